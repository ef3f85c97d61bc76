"""The distributed campaign on CPUs with gloo: every torch stack (DDP, FSDP2, DTensor TP/SP, pipelining
schedules) runs a real training iteration of a tiny Llama on 2 processes, rows are resumable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from .conftest import ROOT, TINY_LLAMA

pytest.importorskip("transformers")


def _run(model: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           "-m", "tp_query.collector", "dist-validate", "--gpu", "cpu", "--tiny-model",
                           str(model), "--frameworks", "torch", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)


def test_every_torch_stack_on_cpu_and_a_rerun_adds_nothing(tmp_path: Path) -> None:
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "val"
    r = _run(model, out)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [x for f in out.glob("*.parquet") for x in pq.read_table(f).to_pylist()]
    kinds = {x["dist_kind"] for x in rows}
    assert {"ddp", "ddp_bucket_view", "fsdp_z3", "fsdp_z2", "tp", "tp_sp", "pp_1f1b", "pp_gpipe",
            "pp_interleaved"} <= kinds
    assert all(x["status"] == "ok" and x["iteration_ms"] > 0 for x in rows), [x["reason"] for x in rows]
    for x in rows:
        per_rank = json.loads(x["rank_json"])
        assert len(per_rank) == 2 and x["iteration_ms"] == max(p["median_ms"] for p in per_rank)
        assert x["dp"] * x["tp"] * x["pp"] == 2
    # each run names the instance and CPU it ran on: the report prices it with that host's measured costs
    from tp_query.collector.device import cpu_model, machine_id

    assert {x["machine"] for x in rows} == {machine_id()} and {x["cpu"] for x in rows} == {cpu_model()}
    r = _run(model, out)
    assert r.returncode == 0, r.stderr[-3000:]
    again = [x for f in out.glob("*.parquet") for x in pq.read_table(f).to_pylist()]
    assert sorted(x["case_id"] for x in again) == sorted(x["case_id"] for x in rows)


def test_campaign_lists_each_world_size_once_per_configuration() -> None:
    """Every case id is unique and its sizes multiply to the world; on one GPU only Megatron-Core's step is listed
    (every torch kind degenerates to the one-GPU HF campaign's plain step), in its three recipes, with one
    micro-batch and with four accumulated; Megatron's --fp16 recipe is in every world's list."""
    from tp_query.collector.dist_validate import MEGATRON_KINDS, TORCH_KINDS, dist_cases

    for world in (1, 2, 4, 8):
        cases = dist_cases(world)
        ids = [c.case_id for c in cases]
        assert len(ids) == len(set(ids)), world
        assert all(c.dp * c.tp * c.pp == world for c in cases)
        assert all(c.kind in (TORCH_KINDS if c.framework == "torch" else MEGATRON_KINDS) for c in cases)
        assert any(c.framework == "megatron" and c.setting == "mp_fp16" for c in cases), world
    one = dist_cases(1)
    assert {c.kind for c in one} == {"mcore_1gpu"}
    assert {(c.setting, c.micro_batches) for c in one} == {(s, m) for s in ("mp_bf16", "mp_fp16", "tf32")
                                                           for m in (1, 4)}
    assert {c.model for c in one} == {"llama3-8b-L4", "qwen2-7b-L4", "qwen3-8b-L4"}


def test_every_listed_case_can_run_at_its_world_size() -> None:
    """At 4 and 8 GPUs a cut model must take its split: enough layers for every pipeline stage (two chunks per
    rank under interleaved 1F1B), heads and KV heads that divide by TP; the 2-GPU list is the one the measured
    runs came from (no case id of theirs is lost)."""
    import glob

    from tp_query.collector.dist_validate import dist_cases

    for world in (2, 4, 8):
        for c in dist_cases(world):
            layers = int(c.config.get("num_hidden_layers", c.config.get("n_layer", 0)))
            assert layers >= c.pp * (2 if c.kind == "pp_interleaved" else 1), c.case_id
            assert f"-L{layers}" in c.model, c.case_id
            heads = int(c.config["num_attention_heads"])
            assert heads % c.tp == 0 and int(c.config.get("num_key_value_heads", heads)) % c.tp == 0, c.case_id
    listed = {c.case_id for c in dist_cases(2)}
    measured = {x["case_id"] for f in glob.glob(str(ROOT / "data" / "validation" / "validation-dist-*.parquet"))
                for x in pq.read_table(f, columns=["case_id", "dp", "tp", "pp"]).to_pylist()
                if x["dp"] * x["tp"] * x["pp"] == 2}
    assert measured and measured <= listed, sorted(measured - listed)[:5]
