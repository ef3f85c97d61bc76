"""Engine speed and memory targets, measured (not asserted): prints the figures of one run.

Targets (issue 3): cached prediction < 50 ms in-process; cold `tp-query predict` process < 1.5 s;
first prediction of an 8B-class config (graph not cached) < 5 s; engine peak memory < 1 GB for a
70B-class model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LLAMA8B = ROOT / "examples" / "llama3.1-8b.json"
LLAMA70B = ROOT / "examples" / "llama3.1-70b.json"


def run(args: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    return time.perf_counter() - t0, r


def child_peak_rss_mb(code: str, env: dict[str, str]) -> float:
    r = subprocess.run([sys.executable, "-c", code + "\nimport resource;print(resource.getrusage(resource.RUSAGE_SELF)"
                        ".ru_maxrss)"], capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(r.stderr)
    return int(r.stdout.strip().splitlines()[-1]) / 1024


def main() -> None:
    cache = tempfile.mkdtemp(prefix="tpq-bench-")
    env = {**os.environ, "TP_QUERY_CACHE": cache, "PYTHONWARNINGS": "ignore"}
    cli = [sys.executable, "-m", "tp_query.engine.cli", "predict", str(LLAMA8B), "--dp", "2", "--tp", "4", "--json"]
    t_first, r = run(cli, env)
    assert r.returncode == 0, r.stderr
    t_cold, r = run(cli, env)
    assert r.returncode == 0, r.stderr
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.predict import Engine, PredictRequest
    from tp_query.schema.precision import Setting

    os.environ["TP_QUERY_CACHE"] = cache
    eng = Engine("h200")
    req = PredictRequest(model=json.loads(LLAMA8B.read_text()), model_name="llama3.1-8b", gpu="h200",
                         setting=Setting.AMP_BF16, parallel=ParallelConfig(dp=2, tp=4))
    eng.predict(req)
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        eng.predict(req)
    t_cached = (time.perf_counter() - t0) / n
    code = (f"import os; os.environ['TP_QUERY_CACHE']={cache!r}\n"
            "import json; from tp_query.engine.predict import predict, PredictRequest\n"
            "from tp_query.schema.precision import Setting\n"
            "from tp_query.engine.parallel import ParallelConfig\n"
            f"p = predict(PredictRequest(model=json.load(open({str(LLAMA70B)!r})), model_name='70b', gpu='h200', "
            "setting=Setting.AMP_BF16, parallel=ParallelConfig(dp=1, tp=8, pp=4, global_batch=32)))")
    rss70 = child_peak_rss_mb(code, env)
    from tp_query.engine.search import SearchSpace, search

    cfg70 = json.loads(LLAMA70B.read_text())
    space = SearchSpace(64, 512, 4096)
    first = search(eng, cfg70, space)  # traces each graph once, fills the lookups
    again = search(eng, cfg70, space)
    rows = [
        ("first prediction, 8B config, graph not cached (process)", f"{t_first:.2f} s", "< 5 s"),
        ("cold `tp-query predict` process, graph cached", f"{t_cold:.2f} s", "< 1.5 s"),
        ("cached prediction in-process (DP2 TP4)", f"{1000 * t_cached:.1f} ms", "< 50 ms"),
        ("engine peak RSS, 70B TP8 PP4 (trace + predict)", f"{rss70:.0f} MB", "< 1024 MB"),
        (f"search 70B on 64 GPUs: {first.evaluated} configs, first pass (graphs traced, excluded)",
         f"{first.evaluated / first.eval_seconds:,.0f}/s", ">= 1000/s"),
        ("search again with the same engine (graphs and lookups shared)",
         f"{again.evaluated / again.eval_seconds:,.0f}/s", ">= 1000/s"),
    ]
    w = max(len(a) for a, _, _ in rows)
    for a, b, c in rows:
        print(f"{a:<{w}}  {b:>10}  target {c}")


if __name__ == "__main__":
    main()
