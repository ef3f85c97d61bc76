"""The communication campaign on CPUs (gloo, two processes launched by torchrun), and the engine
using measured collectives instead of the alpha-beta model."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
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


def _ring_table(busbw: float, ranks: tuple[int, ...], lat_us: float = 10.0) -> list[dict[str, object]]:
    """Closed-form NCCL rows: each collective at `busbw` bytes/s bus bandwidth plus a fixed latency."""
    from tp_query.schema.gpus import bus_factor

    rows: list[dict[str, object]] = []
    for coll in ("all_reduce", "reduce_scatter", "all_gather", "send_recv"):
        for n in ranks if coll != "send_recv" else (2,):
            for b in (2.0**k for k in range(10, 32, 2)):
                t = lat_us + 1e6 * bus_factor(coll, n) * b / busbw
                # the campaign stores an all-gather's per-rank input; the model looks it up by the gathered size
                rows.append({"status": "ok", "collective": coll, "ranks": n, "latency_us": t,
                             "bytes": b / n if coll == "all_gather" else b})
    return rows


def test_ring_model_scales_measured_tables_and_crosses_nodes_through_its_nics() -> None:
    """A rank count the tables lack is the nearest measured ring scaled by the bus factors (so 8 ranks are never
    faster than 4 for the same bytes); a group over nodes runs at the lesser of the node's measured ring and its
    NICs on a node (k NICs for k ranks per node), one NIC when each node holds one of its ranks."""
    from tp_query.engine.comm import CommModel
    from tp_query.schema.gpus import bus_factor, gpu_spec
    from tp_query.schema.system import SystemSpec

    busbw = 350e9
    nic = 50e9
    sysspec = SystemSpec(name="t", gpu="h200", gpus_per_node=8, nvlink_bytes_per_s=450e9, nvlink_latency_s=8e-6,
                         network_bytes_per_s=nic, network_latency_s=15e-6)
    cm = CommModel(gpu_spec("h200"), _ring_table(busbw, (2, 4)), sysspec)
    big = 2.0**30
    for coll in ("all_reduce", "reduce_scatter", "all_gather"):
        t4 = cm.estimate(coll, big, 4)
        t8 = cm.estimate(coll, big, 8)
        assert t4.source == "comm-measured" and t8.source == "comm-model" and "4-rank" in t8.link
        assert t8.us == pytest.approx(t4.us * bus_factor(coll, 8) / bus_factor(coll, 4), rel=1e-9)
        assert t8.us > t4.us
        # 3 ranks: scaled from the 2-rank table (the largest measured count below it)
        t2 = cm.estimate(coll, big, 2)
        assert cm.estimate(coll, big, 3).us == pytest.approx(t2.us * bus_factor(coll, 3) / bus_factor(coll, 2))
    # DP over 16 GPUs with TP=1: 8 ranks on each node, 8 NICs (400 GB/s) above the node's ring (350 GB/s, less
    # its latency at the largest measured message of the 4-rank table)
    inside = 1.5 * big / (10e-6 + 1.5 * big / busbw)
    assert cm.per_node(16, 1) == 8 and cm.per_node(8, 8) == 1 and cm.per_node(4, 2) == 4 and cm.per_node(16, 2) == 4
    ar16 = cm.estimate("all_reduce", big, 16, cm.per_node(16, 1))
    lat = 2 * 15 * 15e-6 / 4  # 2(n-1) ring steps at the NIC's latency over log2(16) rounds
    assert ar16.link.startswith("network") and ar16.us == pytest.approx(1e6 * (lat + 2 * 15 / 16 * big / inside))
    # TP=8 filling each node, DP=8 across nodes: one NIC per rank
    ar8 = cm.estimate("all_reduce", big, 8, cm.per_node(8, 8))
    assert ar8.us == pytest.approx(1e6 * (2 * 7 * 15e-6 / 3 + 2 * 7 / 8 * big / nic))
    # TP=2: 4 ranks of the DP group per node, 4 NICs = 200 GB/s
    ar4 = cm.estimate("all_reduce", big, 16, cm.per_node(16, 2))
    assert ar4.us == pytest.approx(1e6 * (lat + 2 * 15 / 16 * big / (4 * nic)))
    assert ar16.us < ar4.us < ar8.us * 2
    p2p = cm.estimate("send_recv", big, 2, 1)
    assert p2p.us == pytest.approx(1e6 * (15e-6 + big / nic)) and cm.estimate("send_recv", big, 2).source == \
        "comm-measured"


def test_data_parallel_communication_is_in_the_sources(cpu_db: Path) -> None:
    """The exposed DP all-reduce is priced outside the operator lists, and the answer says where it came from:
    over 16 ranks (no table) the ring model's share appears in the sources and the warning names it."""
    eng = Engine("cpu", str(cpu_db))
    p = eng.predict(PredictRequest(model=TINY_LLAMA, model_name="tiny", gpu="cpu", setting=Setting.BF16,
                                   parallel=ParallelConfig(dp=16, global_batch=16), seq_len=64))
    assert p.breakdown["dp_comm_ms"] > 0
    share = p.breakdown["dp_comm_ms"] / sum(p.breakdown.values())
    assert p.sources.get("comm-model", 0) >= 0.5 * share
    assert any("ring model" in w and "across nodes" in w for w in p.warnings)


def test_pipeline_transfers_cross_nodes_once_the_job_spans_them(cpu_db: Path) -> None:
    """Stages hold consecutive blocks of TP x DP ranks: PP=4 x DP=2 fills one 8-GPU node (transfers over
    NVLink), PP=4 x DP=4 spans two and a stage boundary lies between them (priced over one NIC)."""
    eng = Engine("cpu", str(cpu_db))

    def per_transfer(dp: int) -> float:
        par = ParallelConfig(dp=dp, pp=4, global_batch=4 * dp)  # 4 micro-batches each
        p = eng.predict(PredictRequest(model=TINY_LLAMA, model_name="tiny", gpu="cpu", setting=Setting.BF16,
                                       parallel=par, seq_len=64))
        return p.breakdown["pp_comm_ms"] / (2 * 4)  # each micro-batch there and back (fill and drain: the bubble)

    inside, across = per_transfer(2), per_transfer(4)
    nbytes = 64.0 * int(TINY_LLAMA["hidden_size"]) * 2  # one micro-batch's bf16 activations
    assert inside == pytest.approx(eng.comm.estimate("send_recv", nbytes, 2).us / 1e3)
    nic_bw, nic_lat = eng.comm.network
    assert across == pytest.approx((nic_lat + nbytes / nic_bw) * 1e3) and across > inside
