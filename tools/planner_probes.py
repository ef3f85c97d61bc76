"""The figures notes section 32 quotes about the planner's parts, each measured here:
    .venv/bin/python tools/planner_probes.py pipeline    1F1B at PP=32 x 512 and PP=4 x 256: the steady-state path
                                                          against the event simulation (time, largest relative difference)
    .venv/bin/python tools/planner_probes.py templates   reading shipped template files (first 60, no compiled cache)
    .venv/bin/python tools/planner_probes.py workers     a parallel 8B search from an empty cache: each group a worker
                                                          ran (candidates, seconds, when) and the pool's shutdown time
    .venv/bin/python tools/planner_probes.py gc [CACHE]  (notes 33) the 8B/64-GPU search in one process with the
                                                          cyclic collector paused (as search does) and running,
                                                          alternately, 3 processes each; CACHE: a warm cache folder"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def pipeline() -> None:
    import numpy as np
    from tp_query.engine.framework import PipeSchedule, _one_f_one_b_periodic, _pipeline_time

    rng = np.random.default_rng(0)
    for pp, m in ((32, 512), (4, 256)):
        f, b = tuple(rng.uniform(1, 100, pp)), tuple(rng.uniform(1, 200, pp))
        t0 = time.perf_counter()
        fast = _one_f_one_b_periodic(f, b, pp, m, 3.0)
        t1 = time.perf_counter()
        slow = _pipeline_time(f, b, pp, m, PipeSchedule.ONE_F_ONE_B, 3.0)
        t2 = time.perf_counter()
        print(f"PP={pp} m={m}: steady state {1e3 * (t1 - t0):.2f} ms, simulation {1e3 * (t2 - t1):.2f} ms, "
              f"relative difference {abs(fast - slow) / slow:.1e}")


def templates() -> None:
    os.environ["TP_QUERY_CACHE"] = tempfile.mkdtemp()  # no compiled copies: every file parsed
    import gzip

    from tp_query.engine import template

    files = sorted(template.shipped_dir().glob("*.json.gz"))[:60]
    t0 = time.perf_counter()
    ts = [template.GraphTemplate.from_json(json.loads(gzip.decompress(p.read_bytes()))) for p in files]
    for t in ts:
        t._plan  # noqa: B018 - built once per template, as instantiation does
    print(f"{len(files)} templates: {1e3 * (time.perf_counter() - t0) / len(files):.1f} ms each (read, parse, plan)")


def workers() -> None:
    os.environ["TP_QUERY_CACHE"] = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp()
    from concurrent.futures import ProcessPoolExecutor

    from tp_query.engine import search as S
    from tp_query.engine.predict import Engine
    from tp_query.schema.precision import Setting

    log: list[str] = []
    t00 = time.perf_counter()
    submit, shutdown = ProcessPoolExecutor.submit, ProcessPoolExecutor.shutdown

    def timed_submit(self: ProcessPoolExecutor, fn: object, *a: object, **k: object) -> object:
        t = time.perf_counter()
        fut = submit(self, fn, *a, **k)  # type: ignore[arg-type]
        n = len(a[0]) if a and isinstance(a[0], list) else 0
        fut.add_done_callback(lambda _f: log.append(f"group of {n}: {time.perf_counter() - t:.2f} s, done at "
                                                    f"{time.perf_counter() - t00:.2f} s"))
        return fut

    def timed_shutdown(self: ProcessPoolExecutor, *a: object, **k: object) -> None:
        t = time.perf_counter()
        shutdown(self, *a, **k)  # type: ignore[arg-type]
        log.append(f"pool shutdown {time.perf_counter() - t:.2f} s")

    ProcessPoolExecutor.submit = timed_submit  # type: ignore[method-assign]
    ProcessPoolExecutor.shutdown = timed_shutdown  # type: ignore[method-assign]
    cfg = json.load(open("examples/llama3.1-8b.json"))
    r = S.search(Engine("h200"), cfg, S.SearchSpace(64, 512, 4096, precisions=tuple(Setting)))
    print(f"{r.evaluated} configurations in {time.perf_counter() - t00:.2f} s")
    print("\n".join(log))


def gc_pause() -> None:
    import subprocess

    cache = sys.argv[2] if len(sys.argv) > 2 else ""
    code = f"""
import contextlib, json, os, sys, tempfile, time
os.environ['TP_QUERY_CACHE'] = {cache!r} or tempfile.mkdtemp()
from tp_query.engine import search as S
from tp_query.engine.predict import Engine
from tp_query.schema.precision import Setting
if sys.argv[1] == 'running':
    S.gc_paused = contextlib.nullcontext
cfg = json.load(open('examples/llama3.1-8b.json'))
t0 = time.perf_counter()
S.search(Engine('h200'), cfg, S.SearchSpace(64, 512, 4096, precisions=tuple(Setting)), jobs=1)
print(time.perf_counter() - t0)
"""
    times: dict[str, list[float]] = {"paused": [], "running": []}
    for _ in range(3):
        for mode in times:
            r = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True)
            times[mode].append(float(r.stdout.strip().splitlines()[-1]))
    for mode, xs in times.items():
        print(f"collector {mode}: min {min(xs):.2f} s, median {sorted(xs)[1]:.2f} s ({', '.join(f'{x:.2f}' for x in xs)})")


if __name__ == "__main__":
    {"pipeline": pipeline, "templates": templates, "workers": workers, "gc": gc_pause}[sys.argv[1]]()
