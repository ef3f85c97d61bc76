"""The communication campaign on CPUs (gloo, two processes launched by torchrun), and the engine
using measured collectives instead of the alpha-beta model."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from tp_query.engine.parallel import ParallelConfig
from tp_query.engine.predict import Engine, PredictRequest
from tp_query.schema.precision import Setting

from .conftest import ROOT, TINY_LLAMA


def _torchrun(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           "-m", "tp_query.collector", "comm", "--gpu", "cpu", "--tiny",
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_comm_campaign_and_engine(cpu_db: Path, tmp_path: Path) -> None:
    root = tmp_path / "db"
    shutil.copytree(cpu_db / "cpu", root / "cpu")
    out = root / "cpu" / "comm"
    r = _torchrun(out)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [x for f in out.glob("*.parquet") for x in pq.read_table(f).to_pylist()]
    colls = {x["collective"] for x in rows}
    assert colls == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv"}
    assert all(x["status"] == "ok" and x["latency_us"] > 0 and x["ranks"] == 2 for x in rows)
    again = _torchrun(out)  # resumable: nothing left to measure
    assert again.returncode == 0 and "[comm] measured 0 points" in again.stdout
    eng = Engine("cpu", str(root))
    p = eng.predict(PredictRequest(model=TINY_LLAMA, model_name="tiny", gpu="cpu", setting=Setting.AMP_BF16,
                                   parallel=ParallelConfig(tp=2), seq_len=64))
    assert p.sources.get("comm-measured", 0) > 0 and "comm-model" not in p.sources
    assert not any("alpha-beta" in w for w in p.warnings)
