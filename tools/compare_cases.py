"""Predicted against measured for the validation cases whose ids contain any of the given substrings
(one GPU and distributed alike): per case time and peak-memory error, then time and memory MAPE. The
figures of the notes' per-kind and per-family comparisons come from here; `make report` gives all.
Usage: `.venv/bin/python tools/compare_cases.py fp8_ megatron- torch-pp`"""

import os
import sys
from pathlib import Path

from tp_query.engine.predict import Engine
from tp_query.engine.validation import Study, load_rows

ROOT = Path(__file__).resolve().parent.parent
patterns = sys.argv[1:] or [""]
GPU = os.environ.get("GPU", "h200")
rows = [r for r in load_rows(ROOT / "data" / "validation" / ("" if GPU == "h200" else GPU)) if any(p in r["case_id"] for p in patterns)]
eng = Engine(GPU, str(ROOT / "data"))
study = Study(eng, rows, with_baselines=False)
study.finalize(eng.host)
times, mems = [], []
for c in study.cases:
    if c.error or c.measured_ms is None or c.predicted_ms is None:
        print(f"{c.case_id}: {c.status} {c.error[:150]}")
        continue
    e = (c.predicted_ms - c.measured_ms) / c.measured_ms
    m = ((c.predicted_peak_gib or 0) - (c.measured_peak_gib or 0)) / (c.measured_peak_gib or 1)
    times.append(abs(e))
    mems.append(abs(m))
    print(f"{c.case_id:78s} {c.measured_ms:8.1f} {c.predicted_ms:8.1f} {e:+6.1%}  mem {c.measured_peak_gib:6.1f} "
          f"{c.predicted_peak_gib:6.1f} {m:+6.1%}")
if times:
    print(f"time MAPE {sum(times) / len(times):.2%} max {max(times):.1%}   memory MAPE {sum(mems) / len(mems):.2%} "
          f"max {max(mems):.1%}   n={len(times)}")
