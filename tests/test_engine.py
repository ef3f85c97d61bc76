"""Predictions on a real (CPU-measured) database: composition, schedule, memory, provenance."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tp_query.engine.db import Database, DatabaseError
from tp_query.engine.parallel import ParallelConfig, PlanError
from tp_query.engine.predict import Engine, PredictError, PredictRequest
from tp_query.schema.ops import Operands
from tp_query.schema.precision import Setting

from .conftest import TINY_LLAMA

PARALLEL = set(ParallelConfig.__dataclass_fields__)


def req(**kw: object) -> PredictRequest:
    """A request for the tiny model; split keywords go to its ParallelConfig (validated when built)."""
    base: dict = dict(model=TINY_LLAMA, model_name="tiny", gpu="cpu", setting=Setting.AMP_BF16, seq_len=64)
    par = {k: kw.pop(k) for k in list(kw) if k in PARALLEL}
    base.update(kw)
    return PredictRequest(**base, parallel=ParallelConfig(**par))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def eng(cpu_db: Path) -> Engine:
    return Engine("cpu", str(cpu_db))


def test_breakdown_adds_up_and_sources_are_reported(eng: Engine) -> None:
    p = eng.predict(req(db_root=str(eng.db.root)))
    assert p.iteration_ms == pytest.approx(sum(p.breakdown.values()), rel=1e-9)
    assert p.breakdown["forward_ms"] > 0 and p.breakdown["backward_ms"] > p.breakdown["forward_ms"]
    assert p.breakdown["host_overhead_ms"] >= 0
    assert sum(v for k, v in p.sources.items()) == pytest.approx(1.0)
    assert p.sources["exact"] > 0.3  # the tiny model's exact calls were measured
    # the exposed host time is the host model's share of the step
    assert p.sources.get("host-model", 0.0) == pytest.approx(p.breakdown["host_overhead_ms"] / p.iteration_ms)
    assert p.fits and p.peak_memory_gib > 0


def test_exact_calls_of_the_measured_setting(eng: Engine) -> None:
    p = eng.predict(req(setting=Setting.FP32), with_ops=True)
    mm = [r for r in p.ops if r.op == "aten.mm.default"]
    assert mm and all(r.source == "exact" for r in mm)


def test_tp_traffic_is_every_tp_collective_of_the_step(eng: Engine) -> None:
    """Sequence parallelism all-reduces its norm gradients over TP before the optimizer step: that traffic was
    counted as optimizer time; the breakdown's TP traffic is every TP collective's GPU time."""
    p = eng.predict(req(tp=2, sequence_parallel=True), with_ops=True)
    comm = [r for r in p.ops if r.op.startswith("comm.")]
    assert any(r.phase == "opt" for r in comm)  # the case the test is about
    assert p.breakdown["tp_comm_ms"] == pytest.approx(sum(r.total_ms for r in comm), rel=1e-9)
    assert p.breakdown["optimizer_ms"] == pytest.approx(
        sum(r.total_ms for r in p.ops if r.phase == "opt" and not r.op.startswith("comm.")), rel=1e-9)


def test_parallel_splits(eng: Engine) -> None:
    one = eng.predict(req())
    tp2 = eng.predict(req(tp=2))
    assert tp2.breakdown["tp_comm_ms"] > 0 and one.breakdown["tp_comm_ms"] == 0
    assert tp2.peak_memory_gib < one.peak_memory_gib
    dp2 = eng.predict(req(dp=2))
    assert dp2.breakdown["dp_comm_ms"] > 0
    mdp2 = eng.predict(req(dp=2, setting=Setting.MP_BF16, framework="megatron"))
    z1 = eng.predict(req(dp=2, zero=1, setting=Setting.MP_BF16, framework="megatron"))
    assert z1.memory["optimizer_gib"] == pytest.approx(mdp2.memory["optimizer_gib"] / 2, rel=0.01)
    with pytest.raises(PredictError, match="ZeroRedundancyOptimizer"):  # PyTorch has no ZeRO-1 stack
        eng.predict(req(dp=2, zero=1))
    pp = eng.predict(req(pp=2, global_batch=4))
    assert pp.breakdown["pipeline_bubble_ms"] > 0 and pp.breakdown["pp_comm_ms"] > 0
    assert [s["layers"] for s in pp.stages] == [2, 2]
    ga = eng.predict(req(global_batch=4))
    assert ga.config["micro_batches"] == 4
    assert ga.iteration_ms > 3 * one.iteration_ms - one.breakdown["optimizer_ms"]


def test_precision_changes_time_and_memory(eng: Engine) -> None:
    amp = eng.predict(req(setting=Setting.AMP_BF16))
    bf = eng.predict(req(setting=Setting.BF16))
    assert bf.memory["weights_gib"] == pytest.approx(amp.memory["weights_gib"] / 2, rel=0.01)


@pytest.mark.parametrize("kw, msg", [
    (dict(tp=3), "does not divide"),
    (dict(pp=5, global_batch=5), "larger than the number of layers"),
    (dict(dp=2, global_batch=3), "not a multiple"),
    (dict(zero=4), "ZeRO stage"),
    (dict(optimizer="lamb"), "unknown optimizer"),
    (dict(model={"architectures": ["T5ForConditionalGeneration"]}), "unsupported architecture"),
    (dict(sequence_parallel=True), "needs TP > 1"),
])
def test_impossible_requests(eng: Engine, kw: dict, msg: str) -> None:
    with pytest.raises((PredictError, PlanError), match=msg):  # a bad split cannot even be built
        eng.predict(req(**kw))


def test_unknown_gpu_and_missing_database(cpu_db: Path) -> None:
    with pytest.raises(PredictError, match="unknown GPU"):
        Engine("rtx9090", str(cpu_db))
    with pytest.raises(DatabaseError, match=r"no profile database for GPU 'h100'.*available: cpu"):
        Engine("h100", str(cpu_db))


def test_corrupt_database_file(cpu_db: Path, tmp_path: Path) -> None:
    bad = tmp_path / "db"
    shutil.copytree(cpu_db / "cpu", bad / "cpu")
    (bad / "cpu" / "ops" / "zz.parquet").write_bytes(b"garbage")
    with pytest.raises(DatabaseError, match=r"zz\.parquet: not in the manifest"):
        Database("cpu", bad)
    from tp_query.schema import manifest

    manifest.adopt(bad / "cpu", "cpu")  # even once recorded, an unreadable file is named, never skipped
    with pytest.raises(DatabaseError, match="corrupt Parquet file"):
        Database("cpu", bad)


def test_sql_views(cpu_db: Path) -> None:
    db = Database("cpu", cpu_db)
    rows = db.sql("SELECT precision, count(*) AS n FROM ops_ok GROUP BY precision ORDER BY precision").to_pylist()
    assert {r["precision"] for r in rows} >= {"fp32", "bf16"}
    s = db.sql("SELECT * FROM op_summary LIMIT 3").to_pylist()
    assert s and "median_us" in s[0]


def test_graph_file_as_model(eng: Engine, tmp_path: Path) -> None:
    from tp_query.engine.predict import graph_for

    r = req()
    g = graph_for(r)
    path = tmp_path / "g.json"
    g.save(path)
    p1 = eng.predict(r)
    p2 = eng.predict(req(model=json.loads(path.read_text())))
    assert p2.iteration_ms == pytest.approx(p1.iteration_ms)


def test_framework_and_data_parallel_flavours(eng: Engine) -> None:
    ddp = eng.predict(req(dp=2))
    view = eng.predict(req(dp=2, ddp_bucket_view=True))
    z2 = eng.predict(req(dp=2, zero=2))
    z3 = eng.predict(req(dp=2, zero=3))
    assert view.peak_memory_gib <= ddp.peak_memory_gib
    # with several micro-batches the gradients live through backward too: as views into the buckets they take no
    # memory of their own, so the peak is one fp32 copy of the gradients lower (it was equal)
    ddp4, view4 = eng.predict(req(dp=2, global_batch=8)), eng.predict(req(dp=2, global_batch=8, ddp_bucket_view=True))
    assert ddp4.peak_memory_gib - view4.peak_memory_gib == pytest.approx(ddp4.memory["grads_gib"], rel=1e-6)
    assert z3.peak_memory_gib < z2.peak_memory_gib < ddp.peak_memory_gib  # FSDP2 shards weights either way
    assert z3.breakdown["dp_comm_ms"] >= z2.breakdown["dp_comm_ms"] > 0  # ZeRO-3 gathers again in backward
    assert ddp.config["framework"] == "torch" and ddp.config["calibration"]
    assert ddp.config["framework_data"]["interference"] == "none"  # this database measured no overlap
    mp = eng.predict(req(dp=2, zero=3, setting=Setting.MP_BF16))
    bf = eng.predict(req(dp=2, zero=3, setting=Setting.BF16))
    assert mp.memory["optimizer_gib"] > bf.memory["optimizer_gib"]  # fp32 master weights and moments
    # FSDP2 in fp16 keeps its gradients finite with torch.amp.GradScaler: the step unscales the fp32 gradients
    # with an inf check, reads the flag on the host and updates the scale (mp_fp16 had none of it, and came out
    # faster than mp_bf16); bf16 needs no scaler
    mp16 = eng.predict(req(dp=2, zero=3, setting=Setting.MP_FP16), with_ops=True)
    scaler_ops = {"aten._amp_foreach_non_finite_check_and_unscale_.default", "aten._amp_update_scale_.default"}
    assert scaler_ops <= {r.op for r in mp16.ops if r.phase == "opt"}
    assert not scaler_ops & {r.op for r in eng.predict(req(dp=2, zero=3, setting=Setting.MP_BF16), with_ops=True).ops}
    unscale = next(r for r in mp16.ops if r.op.startswith("aten._amp_foreach_non_finite"))
    assert unscale.precision == "fp32"  # the master copies' gradients, as FSDP2's fp32 reduce-scatter leaves them


def test_megatron_core_is_its_own_graph_and_refuses_what_it_cannot_run(eng: Engine) -> None:
    pytest.importorskip("torch")
    mc = eng.predict(req(setting=Setting.MP_BF16, framework="megatron"), with_ops=True)
    ops = {r.op for r in mc.ops}
    assert "aten.baddbmm.default" in ops and "aten._fused_rms_norm.default" in ops  # unfused core attention
    torch_ops = {r.op for r in eng.predict(req(setting=Setting.BF16), with_ops=True).ops}
    assert "aten.baddbmm.default" not in torch_ops
    dp = eng.predict(req(dp=2, setting=Setting.MP_BF16, framework="megatron"))
    dist = eng.predict(req(dp=2, zero=1, setting=Setting.MP_BF16, framework="megatron"))
    assert dp.breakdown["dp_comm_ms"] > 0 and dist.memory["optimizer_gib"] < dp.memory["optimizer_gib"]
    for kw, msg in ((dict(dp=2, zero=3), "distributed optimizer"), (dict(tp=2, sequence_parallel=True), "sequence"),
                    (dict(pp=2, global_batch=4, pp_schedule="gpipe"), "GPipe")):
        with pytest.raises((PredictError, PlanError), match=msg):
            eng.predict(req(setting=Setting.MP_BF16, framework="megatron", **kw))


def test_megatron_fp16_unscales_and_checks_its_main_grads(eng: Engine) -> None:
    """--fp16's dynamic loss scaling: before the norms, the main grads are unscaled with an inf check whose flag the
    host reads (megatron-core's MixedPrecisionOptimizer); --bf16 has neither."""
    pytest.importorskip("torch")
    ops = {r.op: r for r in eng.predict(req(setting=Setting.MP_FP16, framework="megatron"), with_ops=True).ops}
    unscale = ops["aten._amp_foreach_non_finite_check_and_unscale_.default"]
    assert unscale.phase == "opt" and unscale.count == 1 and unscale.latency_us > 0
    bf16 = {r.op for r in eng.predict(req(setting=Setting.MP_BF16, framework="megatron"), with_ops=True).ops}
    assert "aten._amp_foreach_non_finite_check_and_unscale_.default" not in bf16


def test_megatron_accumulates_micro_batches_in_its_buffer_not_in_grad(eng: Engine) -> None:
    """Megatron-Core's DDP hook adds each micro-batch's gradient into the fp32 main_grad buffer and sets .grad to
    None (in the traced backward), so a step of 4 micro-batches is 4 forward/backward passes and one optimizer
    step, with no AccumulateGrad addition; PyTorch (DDP, one GPU) adds into .grad from the second micro-batch on."""
    pytest.importorskip("torch")
    for fw, setting in (("megatron", Setting.MP_BF16), ("torch", Setting.BF16)):
        one = eng.assemble(req(setting=setting, framework=fw, global_batch=1))
        four = eng.assemble(req(setting=setting, framework=fw, global_batch=4))
        assert [len(r["accum"].items) for r in four.raw] == ([0] if fw == "megatron" else
                                                              [len(four.stages[0].params)])
        _, b1, _, _ = one.evaluate(eng.host)
        _, b4, _, _ = four.evaluate(eng.host)
        assert b4["forward_ms"] == pytest.approx(4 * b1["forward_ms"], rel=1e-9)
        extra_bwd = b4["backward_ms"] - 4 * b1["backward_ms"]
        assert (extra_bwd == pytest.approx(0, abs=1e-9)) if fw == "megatron" else extra_bwd > 0


def test_the_forward_module_python_is_charged_once_per_decoder_layer(eng: Engine) -> None:
    """HostModel.fwd_layer_us: the forward's module Python once per decoder layer, beside its operators' own host
    costs. With enough of it the step is host-bound, and each more microsecond per layer is the model's layers
    (4) more microseconds of forward; the backward and the optimizer are untouched; a 2-stage pipeline charges
    each stage for its own layers."""
    from dataclasses import replace

    a = eng.assemble(req(setting=Setting.BF16))
    base = replace(eng.host, fwd_layer_us=20_000.0)
    t1, b1, _, _ = a.evaluate(base)
    t2, b2, _, _ = a.evaluate(replace(base, fwd_layer_us=30_000.0))
    assert t2 - t1 == pytest.approx(4 * 10_000.0, rel=1e-9)
    assert b2["backward_ms"] == pytest.approx(b1["backward_ms"]) and b2["optimizer_ms"] == b1["optimizer_ms"]
    per_stage = eng.assemble(req(setting=Setting.BF16, pp=2, global_batch=2))
    _, _, s1, _ = per_stage.evaluate(base)
    _, _, s2, _ = per_stage.evaluate(replace(base, fwd_layer_us=30_000.0))
    grew = [y["fwd_us"] + y["bwd_us"] - x["fwd_us"] - x["bwd_us"] for x, y in zip(s1, s2, strict=True)]
    assert grew == [pytest.approx(2 * 10_000.0, rel=1e-9)] * 2


def test_pipelining_holds_a_receive_buffer_per_micro_batch(eng: Engine) -> None:
    """torch.distributed.pipelining allocates, per micro-batch, a buffer for each stage's input (after the first
    stage) and for its output's gradient (before the last), kept all step; each input's gradient stays in the
    buffer's .grad until the next step. Megatron-Core receives into fresh tensors: none. Closed form over the
    tiny model's hidden states (micro-batch x sequence x hidden x the residual stream's bytes)."""
    from tp_query.engine.memory import pipelining_buffers, stage_io_bytes

    h = TINY_LLAMA["hidden_size"]
    for setting, item in ((Setting.BF16, 2), (Setting.TF32, 4)):
        for sched, chunks in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
            a = eng.assemble(req(pp=2, global_batch=4, pp_schedule=sched, setting=setting))
            one = stage_io_bytes(a.g, a.par)
            assert one == 1 * 64 * h * item
            first, last = a.stages
            inputs = (chunks - 1, chunks)  # the stages after the first that each rank holds
            grads = (chunks, chunks - 1)  # and those before the last
            for st, n_in, n_grad in ((first, inputs[0], grads[0]), (last, inputs[1], grads[1])):
                recv, in_grads, saved = pipelining_buffers(a.g, st, a.par, in_flight=1.0)
                assert recv == (n_in + n_grad) * 4 * one and in_grads == n_in * 4 * one
                assert saved == (n_in * one if item == 4 else 0)  # fp32 stream: the norm saves the buffer
            assert a.memories()[1].buffers_bytes >= pipelining_buffers(a.g, last, a.par, 1.0)[0] > 0
    mc = eng.assemble(req(pp=2, global_batch=4, framework="megatron", setting=Setting.MP_BF16))
    assert pipelining_buffers(mc.g, mc.stages[1], mc.par, 1.0) == (0, 0, 0)


def test_pipeline_fill_and_drain_transfers_are_counted_once(eng: Engine) -> None:
    """The schedule's simulation puts each transfer on its critical path: the pipeline's communication and bubble
    together are the simulated span beyond the stages' own work, with no transfer added on top of it."""
    a = eng.assemble(req(pp=2, global_batch=4))
    _, b, per_stage, crit = a.evaluate(eng.host)
    c, m = per_stage[crit], a.par.micro_batches
    own = m * (c["fwd_us"] + c["bwd_us"])
    p2p = eng.comm.estimate("send_recv", a._p2p_bytes(), 2, per_node=a._p2p_per_node()).us
    span = a._pipeline_us(per_stage, m, p2p)
    assert (b["pp_comm_ms"] + b["pipeline_bubble_ms"]) * 1e3 == pytest.approx(max(span - own, 2 * m * p2p), rel=1e-9)


def test_pipeline_schedules(eng: Engine) -> None:
    one = eng.predict(req(pp=2, global_batch=8))
    gpipe = eng.predict(req(pp=2, global_batch=8, pp_schedule="gpipe"))
    inter = eng.predict(req(pp=2, global_batch=8, pp_schedule="interleaved"))
    assert gpipe.peak_memory_gib > one.peak_memory_gib  # every micro-batch's activations in flight
    assert inter.config["pp_schedule"] == "interleaved" and inter.iteration_ms > 0
    with pytest.raises((PredictError, PlanError), match="interleaved"):
        eng.predict(req(pp=3, global_batch=6, pp_schedule="interleaved"))
    # micro-batch counts the real schedules refuse (torch.distributed.pipelining, Megatron-Core's schedules)
    for kw, msg in (({"global_batch": 1}, "Schedule1F1B"),
                    ({"global_batch": 5, "pp_schedule": "interleaved"}, "ScheduleInterleaved1F1B"),
                    ({"global_batch": 3, "pp_schedule": "interleaved", "framework": "megatron",
                      "setting": Setting.MP_BF16}, "multiple of PP=2")):
        with pytest.raises((PredictError, PlanError), match=msg):
            eng.predict(req(pp=2, **kw))
    assert eng.predict(req(pp=2, global_batch=1, pp_schedule="gpipe")).iteration_ms > 0
    # Megatron-Core's 1F1B runs fewer micro-batches than stages, and asserts layers divide evenly over stages
    assert eng.predict(req(pp=2, global_batch=1, framework="megatron", setting=Setting.MP_BF16)).iteration_ms > 0
    with pytest.raises(PredictError, match="do not divide by PP=3"):
        eng.predict(req(pp=3, global_batch=3, framework="megatron", setting=Setting.MP_BF16))


def test_interleaved_chunks_add_up_to_each_ranks_stage(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Interleaved 1F1B moves layers between a rank's chunks, not between ranks: each rank's chunk costs add up
    to its 1F1B stage's (each priced with its own rank's host scaling; the tiny model is host-bound, where
    pricing every chunk from stage 0 over-counted the last rank), so with more micro-batches it is never slower."""
    import tp_query.engine.schedule as sched

    seen: list[tuple[list[float], list[float]]] = []
    real = sched.pipeline_time

    def spy(fwd: list[float], bwd: list[float], pp: int, m: int, s: object, p2p: float) -> float:
        seen.append((list(fwd), list(bwd)))
        return real(fwd, bwd, pp, m, s, p2p)  # type: ignore[arg-type]

    monkeypatch.setattr(sched, "pipeline_time", spy)
    for fw, setting in (("torch", Setting.BF16), ("megatron", Setting.MP_BF16)):
        a = eng.assemble(req(pp=2, global_batch=8, pp_schedule="interleaved", framework=fw, setting=setting))
        _, _, per_stage, _ = a.evaluate(eng.host)
        fwd, bwd = seen[-1]
        assert len(fwd) == 4
        for r in range(2):
            assert sum(fwd[r::2]) + sum(bwd[r::2]) == pytest.approx(per_stage[r]["fwd_us"] + per_stage[r]["bwd_us"],
                                                                   rel=1e-9)
        one = eng.predict(req(pp=2, global_batch=16, framework=fw, setting=setting))
        inter = eng.predict(req(pp=2, global_batch=16, pp_schedule="interleaved", framework=fw, setting=setting))
        assert inter.iteration_ms <= one.iteration_ms


def test_mfu_and_parameters_match_an_independent_count(eng: Engine) -> None:
    """Per-matrix FLOPs of a Llama step (forward 2 x MACs, backward twice that; causal attention counted
    in full as Megatron does) against the prediction's MFU; parameters against a count of the tensors."""
    from tp_query.schema.gpus import gpu_spec
    from tp_query.schema.precision import Precision

    c = TINY_LLAMA
    h, L, nh, kv, ffn, v = (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                            c["num_key_value_heads"], c["intermediate_size"], c["vocab_size"])
    hd = h // nh
    p = eng.predict(req(dp=2, global_batch=4, setting=Setting.BF16))
    tokens, s = 4 * 64, 64
    per_token_layer = 2 * (h * nh * hd + 2 * h * kv * hd + nh * hd * h + 3 * h * ffn) + 2 * 2 * s * nh * hd
    fwd = tokens * (L * per_token_layer + 2 * h * v)
    model_flops = 3 * fwd
    assert p.model_flops == pytest.approx(model_flops, rel=1e-9)
    peak = gpu_spec("cpu").peak_flops[Precision.BF16]
    expect = model_flops / (p.iteration_ms / 1e3) / 2 / peak
    assert p.mfu == pytest.approx(expect, rel=0.01)
    n_params = v * h + L * (h * nh * hd + 2 * h * kv * hd + nh * hd * h + 3 * h * ffn + 2 * h) + h + v * h
    assert p.parameters == n_params
    assert p.hardware_tflops_per_gpu and p.hardware_tflops_per_gpu > 0


def test_mixed_software_versions_are_named(cpu_db: Path, tmp_path: Path) -> None:
    import dataclasses

    import pyarrow.parquet as pq
    from tp_query.collector.store import write_table
    from tp_query.schema import manifest
    from tp_query.schema.tables import OPS_SCHEMA, Provenance

    root = tmp_path / "db"
    shutil.copytree(cpu_db / "cpu", root / "cpu")
    src = sorted((root / "cpu" / "ops").glob("*.parquet"))[0]
    rows = pq.read_table(src).to_pylist()[:3]
    prov = Provenance.from_json(pq.read_metadata(src).metadata[b"tp_query"])
    newer = dataclasses.replace(prov, torch="9.9.9")
    for r in rows:
        r.update(torch="9.9.9", key=r["key"] + "-new")
    write_table(root / "cpu" / "ops" / "zz-newer.parquet", rows, OPS_SCHEMA, newer)
    manifest.adopt(root / "cpu", "cpu")
    p = Engine("cpu", str(root)).predict(req())
    # the primary stack (most rows) answers; the other is named with the way to choose it
    assert any(f"measured under torch {prov.torch}" in w and "also holds torch 9.9.9" in w and "--torch" in w
               for w in p.warnings)


def test_software_stacks_are_never_blended(cpu_db: Path, tmp_path: Path) -> None:
    """Two software stacks in one database: each answers from its own rows (never a median across them),
    the primary one (most rows, then newest) by default, another on request; an unmeasured version is
    refused in one line; a duplicate within one stack is still caught."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from tp_query.schema import manifest
    from tp_query.schema.tables import METADATA_KEY

    root = tmp_path / "db"
    shutil.copytree(cpu_db / "cpu", root / "cpu")
    old = pq.read_table(sorted((root / "cpu" / "ops").glob("*.parquet"))[0]).column("torch")[0].as_py()
    for f in sorted((root / "cpu" / "ops").glob("*.parquet")):
        t = pq.read_table(f)
        for name in ("latency_us", "latency_warm_us"):
            t = t.set_column(t.schema.get_field_index(name), name, pc.multiply(t[name], 2.0))
        t = t.set_column(t.schema.get_field_index("torch"), "torch", pa.array(["99.0.0"] * t.num_rows, pa.string()))
        md = dict(t.schema.metadata or {})
        prov = json.loads(md[METADATA_KEY])
        md[METADATA_KEY] = json.dumps({**prov, "torch": "99.0.0"}).encode()
        pq.write_table(t.replace_schema_metadata(md), f.with_name(f.stem + "-newer.parquet"))
    manifest.adopt(root / "cpu", "cpu")
    r = req(tp=1)
    base = Engine("cpu", str(cpu_db)).predict(r, with_ops=True)
    newer = Engine("cpu", str(root)).predict(r, with_ops=True)  # equal rows: the newest stack answers
    older = Engine("cpu", str(root), torch_version=old.split("+")[0]).predict(
        replace(r, torch_version=old.split("+")[0]), with_ops=True)
    assert older.iteration_ms == pytest.approx(base.iteration_ms, rel=1e-9)
    by_key = {(o.phase, o.op, o.shapes): o for o in newer.ops}
    exact = [(a, by_key[(a.phase, a.op, a.shapes)]) for a in base.ops if a.source == "exact"]
    assert exact and all(b.latency_us == pytest.approx(2 * a.latency_us) for a, b in exact)
    assert any("also holds torch" in w and "--torch" in w for w in newer.warnings)
    with pytest.raises((PredictError, DatabaseError), match=r"no operator measurements under torch 1\.0"):
        Engine("cpu", str(root), torch_version="1.0")
    with pytest.raises(PredictError, match="answers from the torch"):
        Engine("cpu", str(root)).predict(replace(r, torch_version="99.0.0"))
    f = sorted((root / "cpu" / "ops").glob("*-newer.parquet"))[0]
    shutil.copy(f, f.with_name("zz-again.parquet"))
    manifest.adopt(root / "cpu", "cpu")
    with pytest.raises(DatabaseError, match="duplicate measurements"):
        Database("cpu", str(root))


def test_verification_record_skips_only_unchanged_files(cpu_db: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A file hashed before is not hashed again while its size, mtime, ctime and inode stand; one rewritten
    in place (even with its mtime restored) is hashed and refused; the snapshot keeps the stamps of the last
    passed check only."""
    import os

    from tp_query.engine.dbcache import DbSnapshot
    from tp_query.schema import manifest

    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "db" / "cpu"
    shutil.copytree(cpu_db / "cpu", root)
    n, record = manifest.verify_stamped(root, "cpu", {})
    assert len(record) == n
    assert manifest.verify_stamped(root, "cpu", record) == (n, record)  # from the record
    DbSnapshot("cpu", tmp_path / "db")
    from tp_query.engine.dbcache import _read_json

    (seen,) = (tmp_path / "cache" / "db" / "verified").glob("*.json")
    assert _read_json(seen) == record
    f = sorted((root / "ops").glob("*.parquet"))[0]
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: the ctime still moves
    with pytest.raises(manifest.ManifestError, match="checksum mismatch"):
        manifest.verify_stamped(root, "cpu", record)
    with pytest.raises(DatabaseError, match="checksum mismatch"):
        DbSnapshot("cpu", tmp_path / "db")
    assert _read_json(seen) == record  # a failed check leaves the record as it was


def test_host_range_over_machine_instances(cpu_db: Path, tmp_path: Path) -> None:
    """With host costs of two instances, a user's prediction uses the typical host (each cost the median over
    the instances) and states the step's range over the instances; a planner's loop (host_range=False) does
    not pay for those evaluations."""
    import datetime as dt

    from tp_query.collector.store import write_table
    from tp_query.schema import manifest
    from tp_query.schema.tables import FRAMEWORK_SCHEMA, Provenance

    root = tmp_path / "db"
    shutil.copytree(cpu_db / "cpu", root / "cpu")
    prov = Provenance("cpu", "cpu", "", "", "2.13", "")
    rows = [{"framework": "torch", "kind": "plain", "setting": s, "phase": ph, "quantity": "per_op_us",
             "value_us": us * (3.0 if ph == "fwd" else 1.0), "ranks": 2, "samples_json": "{}", "status": "ok",
             "reason": "", "measured_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC), **prov.__dict__, "machine": m,
             "cpu": "test"}
            for m, us in (("mSlow", 400.0), ("mFast", 40.0)) for s in ("bf16", "amp_bf16")
            for ph in ("fwd", "bwd", "opt")]
    (root / "cpu" / "framework").mkdir()
    write_table(root / "cpu" / "framework" / "framework-r2-test-00000.parquet", rows, FRAMEWORK_SCHEMA, prov)
    manifest.adopt(root / "cpu", "cpu")
    eng = Engine("cpu", str(root))
    by_speed = [i["machine"] for i in sorted(eng.framework.instances(), key=lambda i: -i["per_op_us"])]
    assert by_speed == ["mSlow", "mFast"]
    typical = eng.predict(req(), host_range=True)
    line = next(w for w in typical.warnings if w.startswith("host speed:"))
    fast_ms, slow_ms = (float(x) for x in line.split(" ms over the 2 measured")[0].split()[-3::2])
    assert fast_ms < typical.iteration_ms < slow_ms and f"{typical.iteration_ms:.1f} ms is the typical" in line
    # each instance alone gives the ends of the range; the typical host's per-operator cost is their median
    assert eng.framework.on("mFast").per_op_host_us("bf16")["fwd_us"] == 120.0
    assert eng.framework.on(None).per_op_host_us("bf16")["fwd_us"] == 660.0
    for m, ms in (("mFast", fast_ms), ("mSlow", slow_ms)):
        assert f"{eng.assemble(req(), host_machine=m).run().iteration_ms:.1f}" == f"{ms:.1f}"
    assert not any(w.startswith("host speed:") for w in eng.predict(req()).warnings)


def test_installed_versions_read_as_importlib_metadata_reads_them() -> None:
    """The graph cache keys on installed versions read from dist-info folder names (without importing
    importlib.metadata on a warm predict): the same versions importlib.metadata reports, and the caller's
    fallback for a package that is not installed."""
    from importlib.metadata import version

    from tp_query.engine.graphcache import _installed_version

    for pkg in ("numpy", "duckdb", "pyarrow", "tp-query", "typer"):
        assert _installed_version(pkg, "none") == version(pkg)
    assert _installed_version("no-such-package-tpq", "none") == "none"


def test_shipped_snapshot_is_current() -> None:
    """data/h200/snapshot.json.gz holds exactly what DuckDB derives from the shipped database with this code
    (rebuild with `make snapshot` after a campaign): a stale one would only be ignored, this says so."""
    import gzip

    from tp_query.engine import snapshot
    from tp_query.engine.dbcache import SHIPPED_NAME

    root = Path(__file__).resolve().parents[1] / "data"
    assert gzip.decompress((root / "h200" / SHIPPED_NAME).read_bytes()) == \
        gzip.decompress(snapshot.encode(snapshot.derive("h200", root))), \
        "data/h200/snapshot.json.gz is stale: run `make snapshot GPU=h200`"


def test_a_shipped_snapshot_answers_without_duckdb_and_only_for_its_database(cpu_db: Path, tmp_path: Path,
                                                                            tiny_llama_file: Path) -> None:
    """A fresh cache with the database's own snapshot: the same prediction, DuckDB never imported. One whose
    fingerprint is not this database's (another database's, or damaged) is ignored, and DuckDB answers."""
    import gzip
    import subprocess
    import sys

    from tp_query.engine import snapshot
    from tp_query.engine.dbcache import SHIPPED_NAME

    root = tmp_path / "db"
    shutil.copytree(cpu_db / "cpu", root / "cpu")
    code = ("import json, sys; from tp_query.engine.api import predict; "
            f"p = predict(json.load(open({str(tiny_llama_file)!r})), gpu='cpu', db={str(root)!r}, dp=2); "
            "print(json.dumps([p.iteration_ms, p.peak_memory_gib, 'duckdb' in sys.modules]))")

    def run() -> list[Any]:
        env = {**os.environ, "TP_QUERY_CACHE": str(tmp_path / f"cache{len(list(tmp_path.iterdir()))}")}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-800:]
        return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    ms, gib, used_duckdb = run()
    assert used_duckdb  # no snapshot shipped: derived by DuckDB
    snapshot.write("cpu", root)
    assert run() == [ms, gib, False]
    head, _, body = gzip.decompress((root / "cpu" / SHIPPED_NAME).read_bytes()).partition(b"\n")
    obj = json.loads(head)
    obj["fingerprint"] = "0" * 24  # built from other bytes: not this database's
    (root / "cpu" / SHIPPED_NAME).write_bytes(gzip.compress(json.dumps(obj).encode() + b"\n" + body))
    assert run() == [ms, gib, True]
    (root / "cpu" / SHIPPED_NAME).write_bytes(gzip.compress(head + b"\n" + body[:-1] + b" }"))  # edited payload
    assert run() == [ms, gib, True]
    (root / "cpu" / SHIPPED_NAME).write_bytes(b"\x1f\x8b damaged")
    assert run() == [ms, gib, True]


def test_megatron_pp_all_reduces_the_tied_embeddings_gradient(eng: Engine) -> None:
    """Megatron-Core's finalize_model_grads all-reduces the tied word embedding's fp32 main_grad between the first
    and last stage (the last holds a copy): one all-reduce of vocab x hidden x 4 bytes over 2 ranks, exposed;
    untied models, PP=1 and PyTorch's pipelining have none."""
    tied = {**TINY_LLAMA, "tie_word_embeddings": True}
    untied = {**TINY_LLAMA, "tie_word_embeddings": False}
    mp = dict(pp=2, global_batch=4, framework="megatron", setting=Setting.MP_BF16)
    t = eng.predict(req(model=tied, **mp))
    u = eng.predict(req(model=untied, **mp))
    want = eng.comm.estimate("all_reduce", 4.0 * TINY_LLAMA["vocab_size"] * TINY_LLAMA["hidden_size"], 2,
                             per_node=2).us / 1e3
    assert want > 0
    assert t.breakdown["pp_comm_ms"] - u.breakdown["pp_comm_ms"] == pytest.approx(want, rel=1e-6)
    tp = dict(pp=2, global_batch=4, setting=Setting.BF16)
    assert eng.predict(req(model=tied, **tp)).breakdown["pp_comm_ms"] == pytest.approx(
        eng.predict(req(model=untied, **tp)).breakdown["pp_comm_ms"], rel=1e-9)


def test_an_operator_database_alone_says_what_it_leaves_unpriced(tmp_path: Path) -> None:
    """A database of operators alone (what `make collect` writes: no framework/ nor overlap/ tables) cannot price
    DTensor's dispatch, the data-parallel hooks or the interference of collectives: the answer says so (it was
    39% faster than with them, without a word) and --strict refuses it; the shipped database says none of it."""
    from tp_query.schema import manifest

    from .conftest import run_cli

    root = Path(__file__).resolve().parents[1]
    db = tmp_path / "db"
    shutil.copytree(root / "data" / "h200", db / "h200", ignore=shutil.ignore_patterns("framework", "overlap",
                                                                                       "snapshot.json.gz"))
    manifest.adopt(db / "h200", "h200")
    model = str(root / "examples" / "llama3.1-8b.json")
    args = ("predict", model, "--gpu", "h200", "--dp", "2", "--tp", "2")
    r = run_cli(*args, "--db", str(db))
    assert r.returncode == 0, r.stderr
    assert "host costs of DTensor TP dispatch and data-parallel hooks are not measured" in r.stdout
    assert "eager host cost per operator not measured" in r.stdout
    assert "interference is not measured" in r.stdout
    r = run_cli(*args, "--db", str(db), "--strict")
    assert r.returncode == 2 and "--strict: host costs of DTensor TP dispatch" in r.stderr
    shipped = run_cli(*args)
    assert shipped.returncode == 0 and "not measured in this database" not in shipped.stdout


def test_framework_host_costs_are_read_at_their_groups_size(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """DTensor TP's host cost is read at the TP group's size and DDP's at the DP group's, not at the job's GPUs."""
    from tp_query.engine.framework import FrameworkData

    asked: list[tuple[str, int]] = []
    real = FrameworkData.host_extra

    def spy(self: FrameworkData, framework: str, kind: str, setting: str, ranks: int):  # type: ignore[no-untyped-def]
        asked.append((kind, ranks))
        return real(self, framework, kind, setting, ranks)

    monkeypatch.setattr(FrameworkData, "host_extra", spy)
    eng.assemble(req(dp=4, tp=2, global_batch=4))
    assert asked == [("tp", 2), ("ddp", 4)]


@pytest.mark.parametrize("kw", [dict(pp=4, global_batch=8), dict(pp=4, global_batch=8, pp_schedule="gpipe"),
                                dict(pp=2, global_batch=8, pp_schedule="interleaved"), dict(pp=3, global_batch=6),
                                dict(pp=4, global_batch=2, pp_schedule="gpipe"), dict(dp=2, global_batch=4),
                                dict(pp=2, dp=2, global_batch=8, setting=Setting.TF32)])
def test_the_planners_peak_is_every_stages_largest(eng: Engine, kw: dict) -> None:
    """The planner computes one stage per kind (the one with the most micro-batches in flight); its peak is
    the largest of every stage's, part for part, and the stage lists it reads are the same for every asker."""
    a = eng.assemble(req(**kw))
    every = a.memories()
    _, _, mem, fits = a.plan_numbers()
    top = max(every, key=lambda x: x.peak_bytes)
    assert mem == top and fits == all(x.fits for x in every)
    again = eng.assemble(req(**kw))
    assert [s.param_bytes for s in again.stages] == [s.param_bytes for s in a.stages]


def test_peak_parts_total_is_the_sum_of_its_parts() -> None:
    from dataclasses import fields

    from tp_query.engine.memory import PeakParts, PeakPhase

    names = [f.name for f in fields(PeakParts) if f.name != "phase"]
    p = PeakParts(phase=PeakPhase.OPTIMIZER_STEP, **{n: 1 << i for i, n in enumerate(names)})
    assert p.total() == sum(p.parts().values()) == (1 << len(names)) - 1


def test_megatron_clip_cost_is_stated_and_scales_with_the_gradients_scaled(eng: Engine) -> None:
    """A taken clip scales every fp32 main gradient of the rank (a multiply and a copy per tensor): the warning
    prices it from the database, and the distributed optimizer scales its shard only (about half at DP 2)."""
    pytest.importorskip("torch")
    import re

    def clip_ms(**kw: Any) -> float:
        p = eng.predict(req(setting=Setting.MP_BF16, framework="megatron", **kw))
        (w,) = [w for w in p.warnings if "gradient clipping" in w]
        return float(re.search(r"\+([0-9.]+) ms", w).group(1))  # type: ignore[union-attr]

    whole, shard = clip_ms(dp=2), clip_ms(dp=2, zero=1)
    assert whole > 0 and 0.4 * whole <= shard <= 0.75 * whole
    torch_p = eng.predict(req(setting=Setting.BF16))
    assert not any("gradient clipping" in w for w in torch_p.warnings)


def test_pure_fp16_says_when_no_gemm_was_timed_on_nan(eng: Engine) -> None:
    """Pure fp16 with Adam runs its GEMMs on NaN from the second step: a database without NaN-operand points says
    that it prices them on random data; one with them, another setting or a non-Adam optimizer says nothing."""
    pytest.importorskip("torch")

    def said(e: Engine, **kw: Any) -> bool:
        return any("timed on NaN" in w for w in e.predict(req(**kw)).warnings)

    assert not eng.latency.measures_operands(Operands.NAN)  # the synthetic database: random data only
    assert said(eng, setting=Setting.FP16)
    assert not said(eng, setting=Setting.BF16) and not said(eng, setting=Setting.FP16, optimizer="sgd")
    assert Engine("h200").latency.measures_operands(Operands.NAN)  # the shipped one measured the NaN grid
