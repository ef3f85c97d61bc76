"""Where a search's time goes, per pipeline step, as notes sections 31 and 32 quote it: 8B over 64 GPUs, every
precision, one process, each step's wall time summed over its calls (costed graphs read, graph instantiation where
none is kept, composers, stage lists and their optimizer rebuilds, costed stages, schedule evaluation, the planner's
numbers around it).
    .venv/bin/python tools/search_parts.py [CACHE_DIR]          (a warm cache folder: run it twice)"""
import collections
import json
import os
import sys
import tempfile
import time


def main() -> None:
    os.environ["TP_QUERY_CACHE"] = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    from tp_query.engine import compose, costcache, engine, graphcache, prediction, schedule
    from tp_query.engine.predict import Engine
    from tp_query.engine.search import SearchSpace, search
    from tp_query.schema.precision import Setting

    spent: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()

    def timed(owner: object, name: str, label: str) -> None:
        f = getattr(owner, name)

        def wrapper(*a: object, **k: object) -> object:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t
                calls[label] += 1

        setattr(owner, name, wrapper)

    timed(graphcache, "graph_for", "graph (template instantiation)")
    engine.graph_for = graphcache.graph_for  # the engine's own reference
    timed(graphcache, "trace_missing", "graphs to trace (keys)")
    timed(costcache.CostedGraphs, "load", "costed graphs read (hits and misses)")
    timed(compose.Composer, "__init__", "composer (describe each call)")
    timed(compose.Composer, "stages", "stage lists (all)")
    timed(compose.Composer, "optimizer_items", "  of which optimizer rebuilds")
    timed(schedule.StepSchedule, "__init__", "costed stages")
    timed(schedule.StepSchedule, "evaluate", "schedule evaluation")
    timed(prediction.Assembled, "plan_numbers", "prediction (a planner's numbers)")
    timed(prediction.Assembled, "memories", "  of which memory per stage")
    cfg = json.load(open("examples/llama3.1-8b.json"))
    t0 = time.perf_counter()
    r = search(Engine("h200"), cfg, SearchSpace(64, 512, 4096, precisions=tuple(Setting)), jobs=1)
    print(f"{r.evaluated} configurations in {time.perf_counter() - t0:.2f} s (one process)")
    for label, s in spent.most_common():
        print(f"{label:40} {s:6.2f} s  ({calls[label]} calls)")


if __name__ == "__main__":
    main()
