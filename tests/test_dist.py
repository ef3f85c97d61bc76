"""Distributed validation runs on CPUs with gloo (DDP and DTensor tensor parallelism, 2 processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from .conftest import ROOT, TINY_LLAMA

pytest.importorskip("transformers")


@pytest.mark.parametrize("dp, tp, port", [(2, 1, 29631), (1, 2, 29632)])
def test_distributed_iteration_on_cpu(tmp_path: Path, dp: int, tp: int, port: int) -> None:
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "val"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(port), "-m", "tp_query.collector", "dist-validate", "--gpu", "cpu", "--model", str(model),
                        "--dp", str(dp), "--tp", str(tp), "--seq-len", "64", "--precision", "fp32", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [x for f in out.glob("*.parquet") for x in pq.read_table(f).to_pylist()]
    assert len(rows) == 1 and rows[0]["dp"] == dp and rows[0]["tp"] == tp and rows[0]["iteration_ms"] > 0
