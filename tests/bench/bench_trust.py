"""Bad input is refused within 5 s in bounded memory (issue: trust). Whole processes, five runs each,
minimum and median; exits 1 when a median misses the target."""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verdict import verdict

ROOT = Path(__file__).resolve().parents[2]
TARGET_S = 5.0
RUNS = 5


def main() -> int:
    d = Path(tempfile.mkdtemp(prefix="tpq-trust-"))
    llama = json.loads((ROOT / "examples" / "llama3.1-8b.json").read_text())
    (d / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (d / "layers.json").write_text(json.dumps({**llama, "num_hidden_layers": 10**9}))
    with gzip.open(d / "bomb.json.gz", "wb") as f:
        for _ in range(256):
            f.write(b"0" * (1 << 20))
    cases = {
        "/dev/zero": ["predict", "/dev/zero"],
        "/dev/urandom": ["predict", "/dev/urandom"],
        "JSON nested 100,000 deep": ["predict", str(d / "deep.json")],
        "gzip bomb": ["predict", str(d / "bomb.json.gz")],
        "10^9 layers": ["predict", str(d / "layers.json")],
        "micro-batch 10^11": ["predict", str(ROOT / "examples" / "llama3.1-8b.json"), "--micro-batch", str(10**11)],
        "SQL COPY into the database": ["sql", "COPY (SELECT 1) TO 'data/h200/ops/x.parquet'"],
    }
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    failed = 0
    w = max(map(len, cases))
    for name, args in cases.items():
        times = []
        for _ in range(RUNS):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "tp_query.engine.cli", *args], capture_output=True, text=True,
                               env=env, cwd=ROOT, timeout=120)
            times.append(time.perf_counter() - t0)
            if r.returncode != 2 or len(r.stderr.strip().splitlines()) != 1:
                print(f"{name}: rc={r.returncode} stderr={r.stderr[-200:]!r}")
                failed += 1
        ok = statistics.median(times) < TARGET_S
        failed += not ok
        print(verdict(name, times, "s", f"< {TARGET_S:.0f} s", ok, w))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
