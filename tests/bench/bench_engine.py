"""Engine speed and memory targets as a user pays for them: whole processes, several runs each (minimum and
median), tracing included where a user would wait for it. Exits 1 when a median misses its target.

    python tests/bench/bench_engine.py [--runs 5] [--quick]

--quick searches a smaller space (8B over 8 GPUs, amp_bf16) instead of the issue's 8B over 64 GPUs in
every precision, for a figure in minutes rather than a quarter of an hour.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from verdict import verdict

ROOT = Path(__file__).resolve().parents[2]
LLAMA8B = ROOT / "examples" / "llama3.1-8b.json"
LLAMA70B = ROOT / "examples" / "llama3.1-70b.json"


def timed_process(args: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    dt = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(r.stderr[-500:])
    return dt


def child_value(code: str, env: dict[str, str]) -> float:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(r.stderr[-800:])
    return float(r.stdout.strip().splitlines()[-1])


def runs(fn: Callable[[int], float], n: int) -> list[float]:
    return [fn(i) for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    # Whole processes as a user runs them: Python may keep its bytecode cache (an installed wheel has one;
    # a shell with PYTHONDONTWRITEBYTECODE=1 would recompile every module of every run, ~60 ms here)
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONWARNINGS": "ignore"}
    predict = [sys.executable, "-m", "tp_query.engine.cli", "predict", str(LLAMA8B), "--dp", "2", "--tp", "4",
               "--json"]

    def empty_cache(i: int) -> float:
        env = {**base_env, "TP_QUERY_CACHE": tempfile.mkdtemp(prefix="tpq-bench-empty-")}
        return timed_process(predict, env)

    warm = tempfile.mkdtemp(prefix="tpq-bench-warm-")
    timed_process(predict, {**base_env, "TP_QUERY_CACHE": warm})

    def warm_cache(i: int) -> float:
        return timed_process(predict, {**base_env, "TP_QUERY_CACHE": warm})

    # a new request inside one process (different split each time, graphs warm): ms per request
    in_process = f"""
import json, os, time
os.environ['TP_QUERY_CACHE'] = {warm!r}
from tp_query.engine.parallel import ParallelConfig
from tp_query.engine.predict import Engine, PredictRequest
from tp_query.schema.precision import Setting
cfg = json.load(open({str(LLAMA8B)!r}))
eng = Engine('h200')
def req(dp, z): return PredictRequest(model=cfg, model_name='8b', gpu='h200', setting=Setting.AMP_BF16,
                                      parallel=ParallelConfig(dp=dp, tp=4, zero=z))
eng.predict(req(2, 0))
splits = [(dp, z) for dp in (1, 2, 4, 8, 16) for z in (0, 2, 3) if dp > 1 or z == 0]  # PyTorch: DDP, FSDP2
t0 = time.perf_counter()
for dp, z in splits:
    eng.predict(req(dp, z))
print(1000 * (time.perf_counter() - t0) / len(splits))
"""
    search_code = """
import json, os, time, tempfile
os.environ['TP_QUERY_CACHE'] = {cache}
from tp_query.engine.predict import Engine
from tp_query.engine.search import SearchSpace, search
from tp_query.schema.precision import Setting
cfg = json.load(open({model!r}))
space = SearchSpace({gpus}, {gb}, 4096, precisions={precs})
t0 = time.perf_counter()
r = search(Engine('h200'), cfg, space)
print(r.evaluated / (time.perf_counter() - t0))
"""
    gpus, gb, precs = (8, 64, "(Setting.AMP_BF16,)") if a.quick else (64, 512, "tuple(Setting)")

    def search_empty(i: int) -> float:
        code = search_code.format(cache="tempfile.mkdtemp(prefix='tpq-bench-s-')", model=str(LLAMA8B), gpus=gpus,
                                  gb=gb, precs=precs)
        return child_value(code, base_env)

    warm_search = tempfile.mkdtemp(prefix="tpq-bench-sw-")
    code_warm = search_code.format(cache=repr(warm_search), model=str(LLAMA8B), gpus=gpus, gb=gb, precs=precs)
    child_value(code_warm, base_env)  # fills the graph cache

    def search_warm(i: int) -> float:
        return child_value(code_warm, base_env)

    rss70 = f"""
import json, os, resource
os.environ['TP_QUERY_CACHE'] = {warm!r}
from tp_query.engine.parallel import ParallelConfig
from tp_query.engine.predict import PredictRequest, predict
from tp_query.schema.precision import Setting
predict(PredictRequest(model=json.load(open({str(LLAMA70B)!r})), model_name='70b', gpu='h200',
                       setting=Setting.AMP_BF16, parallel=ParallelConfig(tp=8, pp=4, global_batch=32)))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
    # a database of 100 software stacks (tools/versions_db.py: the shipped operator files once per stack):
    # built once, then every process answers from its own stack's rows
    vdb = tempfile.mkdtemp(prefix="tpq-bench-vdb-")
    subprocess.run([sys.executable, str(ROOT / "tools" / "versions_db.py"), vdb, "100"], check=True,
                   capture_output=True, cwd=ROOT)
    vcache = tempfile.mkdtemp(prefix="tpq-bench-vc-")
    vpredict = [*predict, "--db", vdb]
    t_build = timed_process(vpredict, {**base_env, "TP_QUERY_CACHE": vcache})
    print(f"100-stack database: first build and predict {t_build:.1f} s (once)")

    def versions_warm(i: int) -> float:
        return timed_process(vpredict, {**base_env, "TP_QUERY_CACHE": vcache})

    rows: list[tuple[str, list[float], str, Callable[[float], bool], str]] = [
        ("first predict, empty graph cache (process, s)", runs(empty_cache, a.runs), "< 1 s", lambda m: m < 1.0,
         "s"),
        ("predict, warm caches (process, s)", runs(warm_cache, a.runs), "< 0.3 s", lambda m: m < 0.3, "s"),
        ("a new request inside one process (ms)", runs(lambda i: child_value(in_process, base_env), a.runs),
         "< 5 ms", lambda m: m < 5.0, "ms"),
        (f"search 8B over {gpus} GPUs, empty cache (configs/s)", runs(search_empty, a.runs), ">= 1000/s",
         lambda m: m >= 1000, "/s"),
        (f"search 8B over {gpus} GPUs, warm cache (configs/s)", runs(search_warm, a.runs), ">= 10000/s",
         lambda m: m >= 10000, "/s"),
        ("engine peak RSS, 70B TP8 PP4 (MB)", runs(lambda i: child_value(rss70, base_env), a.runs), "< 1024 MB",
         lambda m: m < 1024, "MB"),
        ("predict, 100-stack database after its first build (process, s)", runs(versions_warm, a.runs), "< 1 s",
         lambda m: m < 1.0, "s"),
    ]
    import shutil

    shutil.rmtree(vdb, ignore_errors=True)  # 300 MB of synthetic copies
    shutil.rmtree(vcache, ignore_errors=True)
    missed = 0
    w = max(len(r[0]) for r in rows)
    for name, xs, target, ok, unit in rows:
        med = statistics.median(xs)
        good = ok(med)
        missed += not good
        print(verdict(name, xs, unit, target, good, w))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
