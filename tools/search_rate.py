"""A search's rate as the closing note of stop 24 quotes it: 8B over GPUS (default 64) GPUs, every precision (ALL=0: amp_bf16),
global batch GB (512), in one process with the cache folder given (or a fresh one); PROF=1 prints a cProfile.
    .venv/bin/python tools/search_rate.py [CACHE_DIR]"""
import json, os, sys, time, tempfile
def main():
    os.environ['TP_QUERY_CACHE'] = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    t0=time.perf_counter()
    from tp_query.engine.predict import Engine
    from tp_query.engine.search import SearchSpace, search
    from tp_query.schema.precision import Setting
    cfg = json.load(open('examples/llama3.1-8b.json'))
    gpus = int(os.environ.get("GPUS", 64)); gb = int(os.environ.get("GB", 512))
    precs = tuple(Setting) if os.environ.get("ALL", "1") == "1" else (Setting.AMP_BF16,)
    space = SearchSpace(gpus, gb, 4096, precisions=precs)
    eng = Engine('h200')
    t1=time.perf_counter()
    if os.environ.get("PROF"):
        import cProfile, pstats
        pr = cProfile.Profile(); pr.enable()
    r = search(eng, cfg, space)
    t2=time.perf_counter()
    if os.environ.get("PROF"):
        pr.disable(); pstats.Stats(pr).sort_stats(os.environ.get("SORT","cumulative")).print_stats(int(os.environ.get("N","45")))
    print(f"import+engine {t1-t0:.2f}s search {t2-t1:.2f}s evaluated {r.evaluated} ranked {len(r.ranked)} rejected {len(r.rejected)} rate {r.evaluated/(t2-t0):.1f}/s eval {r.eval_seconds:.2f}s")
    print(r.ranked[0].candidate.label(), r.ranked[0].iteration_ms)
if __name__ == "__main__":
    main()
