"""Behaviour added with the spec registry, MoE, FP8 and the distributed memory findings: the losses as
the stacks compute them (checked numerically against F.cross_entropy), mean layers of mixed attention
types, index inputs the collector makes, the grouped GEMM kind, the memory terms the allocator traces
showed, and what every prediction says about its graph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tp_query.engine.graph import GraphMeta, layer_templates
from tp_query.engine.parallel import ParallelConfig
from tp_query.engine.predict import Engine, PredictError, PredictRequest
from tp_query.schema.model_config import FULL, SLIDING, parse_config
from tp_query.schema.ops import REGISTRY, describe, index_args_of
from tp_query.schema.precision import Setting
from tp_query.schema.signature import OpCall

from .conftest import TINY_FAMILIES, TINY_LLAMA, run_cli

torch = pytest.importorskip("torch")


# -- losses as the stacks run them ------------------------------------------------------------------

@pytest.mark.parametrize("which", ["loss_parallel", "megatron"])
def test_sharded_losses_equal_cross_entropy_on_one_shard(which: str) -> None:
    """With the whole vocabulary on one rank (no communication needed), PyTorch's loss_parallel math and
    Megatron's in-place vocab-parallel cross-entropy give F.cross_entropy's loss and gradient."""
    import torch.nn.functional as F
    from tp_query.engine.trace.megatron_local import _MegatronVocabParallelCE
    from tp_query.engine.trace.models import _LossParallelCE

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=g)
    target = torch.randint(0, 50, (12,), generator=g)
    a = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(a, target)
    ref.backward()
    b = logits.clone().requires_grad_(True)
    if which == "loss_parallel":
        loss = _LossParallelCE.apply(b, target)
    else:
        loss = _MegatronVocabParallelCE.apply(b, target).mean()
    loss.backward()
    assert torch.allclose(loss, ref, atol=1e-6) and torch.allclose(b.grad, a.grad, atol=1e-6)


# -- layer types --------------------------------------------------------------------------------------

def test_mean_layer_weights_follow_the_layer_types() -> None:
    types = [SLIDING] * 5 + [FULL]
    meta = GraphMeta(source="config", model={"layer_types": types * 2}, setting="bf16", micro_batch=1, seq_len=64,
                     tp=1, sequence_parallel=False, recompute=False, optimizer="adamw", traced_layers=3,
                     torch_version="x", sdpa_policy="x", extra={"traced_layer_types": [SLIDING, SLIDING, FULL]})
    assert layer_templates(meta) == {1: pytest.approx(5 / 6), 2: pytest.approx(1 / 6)}
    uniform = GraphMeta(**{**meta.__dict__, "model": {"layer_types": []}})
    assert layer_templates(uniform) == {}


def test_gemma3_pattern_and_traced_types() -> None:
    spec = parse_config({**TINY_FAMILIES["gemma3"], "num_hidden_layers": 12})
    assert spec.layer_types == tuple([SLIDING] * 5 + [FULL]) * 2
    assert spec.traced_layer_types() == (SLIDING, SLIDING, FULL)
    assert spec.layer_type_fractions() == {SLIDING: pytest.approx(10 / 12), FULL: pytest.approx(2 / 12)}
    # a window at least the sequence long is the model's own business: the spec keeps the layer types
    assert parse_config({**TINY_FAMILIES["mistral-sw"], "sliding_window": None}).builder.value == "native"


# -- collector inputs and the grouped GEMM kind -------------------------------------------------------

def test_index_operators_get_valid_uniform_indices() -> None:
    from tp_query.engine.trace.torchargs import materialize

    sig = '{"a":[{"T":[64,8],"d":"fp32"},[{"T":[4096],"d":"i64"}],{"T":[4096,8],"d":"fp32"},true]}'
    call = OpCall.from_json_str("aten.index_put.default", sig)
    assert index_args_of(call.op)
    args, _ = materialize(call, torch.device("cpu"))
    idx = args[1][0]
    assert int(idx.min()) >= 0 and int(idx.max()) < 64
    assert len(torch.unique(idx)) > 32  # spread over the rows, not piled on two


@pytest.mark.parametrize("op,sig,bound", [
    # Megatron's unpermute: an expanded index into the token rows along dim 0 (the hidden size is larger)
    ("aten.scatter_add_.default", '{"a":[{"T":[512,1024],"d":"bf16"},0,{"T":[1024,1024],"d":"i64","s":[1,0]},'
                                  '{"T":[1024,1024],"d":"bf16"}]}', 512),
    ("aten.gather.default", '{"a":[{"T":[512,1024],"d":"bf16"},0,{"T":[1024,1024],"d":"i64","s":[1,0]}]}', 512),
    # the router's routing map: top-k expert ids along dim 1
    ("aten.scatter.value", '{"a":[{"T":[2048,8],"d":"i32"},1,{"T":[2048,2],"d":"i64"},1]}', 8),
])
def test_scatter_gather_indices_bounded_along_their_dim(op: str, sig: str, bound: int) -> None:
    from tp_query.engine.trace.torchargs import materialize

    args, _ = materialize(OpCall.from_json_str(op, sig), torch.device("cpu"))
    idx = args[2]
    assert int(idx.min()) >= 0 and int(idx.max()) < bound
    assert int(idx.max()) >= bound // 2  # spread over the valid range


def test_grouped_gemm_features_and_balanced_offsets() -> None:
    from tp_query.collector.replay import balanced_offsets

    fwd = OpCall.from_json_str("aten._grouped_mm.default",
                               '{"a":[{"T":[256,64],"d":"bf16"},{"T":[4,64,32],"d":"bf16"},{"T":[4],"d":"i32"}]}')
    info = describe(fwd, False)
    assert info.kind == "grouped_mm" and info.features["layout"] == "grouped:2d3d"
    assert info.flops == 2 * 256 * 64 * 32
    wgrad = OpCall.from_json_str("aten._grouped_mm.default",
                                 '{"a":[{"T":[64,256],"d":"bf16"},{"T":[256,32],"d":"bf16"},{"T":[4],"d":"i32"}]}')
    assert describe(wgrad, False).flops == 2 * 64 * 32 * 256 and REGISTRY.is_registered(wgrad.op)
    assert balanced_offsets(10, 4, torch.device("cpu")).tolist() == [2, 5, 7, 10]


# -- memory terms the allocator traces showed ----------------------------------------------------------

@pytest.fixture(scope="module")
def eng(cpu_db: Path) -> Engine:
    return Engine("cpu", str(cpu_db))


def _req(setting: Setting = Setting.AMP_BF16, **par: object) -> PredictRequest:
    return PredictRequest(model=TINY_LLAMA, model_name="tiny", gpu="cpu", setting=setting, seq_len=64,
                          parallel=ParallelConfig(**par))  # type: ignore[arg-type]


def test_megatron_gradient_buffer_is_live_all_step(eng: Engine) -> None:
    """Megatron-Core's main-grad buffer exists from the DDP wrap on: at the start of backward of a single
    micro-batch it is live, so the peak is at least weights + optimizer + fp32 gradients."""
    p = eng.predict(_req(Setting.MP_BF16, framework="megatron"))
    m = p.memory
    assert p.peak_memory_gib >= m["weights_gib"] + m["optimizer_gib"] + m["grads_gib"] + m["activations_gib"] - 1e-6


def test_gpipe_keeps_each_micro_batch_loss_activations(eng: Engine) -> None:
    """Under GPipe the last stage's extra memory grows with the micro-batches in flight (their loss
    activations), under 1F1B it does not."""
    def last_stage(sched: str, m: int) -> float:
        p = eng.predict(_req(pp=2, micro_batch=1, global_batch=m, pp_schedule=sched))
        return float(p.stages[-1]["peak_memory_gib"])

    g4, g8 = last_stage("gpipe", 4), last_stage("gpipe", 8)
    o4, o8 = last_stage("1f1b", 4), last_stage("1f1b", 8)
    assert g8 - g4 > 0 and (g8 - g4) > (o8 - o4)


@pytest.mark.parametrize("setting,par", [
    (Setting.AMP_BF16, {}), (Setting.AMP_BF16, {"global_batch": 4}), (Setting.AMP_BF16, {"dp": 2}),
    (Setting.AMP_BF16, {"dp": 2, "global_batch": 8, "ddp_bucket_view": True}), (Setting.BF16, {"dp": 2, "zero": 2}),
    (Setting.AMP_BF16, {"dp": 2, "zero": 3}), (Setting.MP_BF16, {"dp": 2, "zero": 3, "global_batch": 8}),
    (Setting.BF16, {"pp": 2, "global_batch": 8}), (Setting.AMP_BF16, {"pp": 2, "global_batch": 8, "pp_schedule": "gpipe"}),
    (Setting.BF16, {"tp": 2}), (Setting.MP_BF16, {"framework": "megatron", "dp": 2}),
])
def test_memory_at_the_peak_sums_to_it(eng: Engine, setting: Setting, par: dict[str, object]) -> None:
    """The memory lines say what is live at the peak (they sum to it, and name the phase), apart from each kind's
    largest over the step, which no part at the peak exceeds."""
    p = eng.predict(_req(setting, **par))
    m = p.memory
    kinds = ("weights", "grads", "optimizer", "activations", "gathered", "transient", "buffers")
    assert sum(m[f"at_peak_{k}_gib"] for k in kinds) == pytest.approx(p.peak_memory_gib, rel=1e-12)
    assert all(m[f"at_peak_{k}_gib"] <= m[f"{k}_gib"] + 1e-12 for k in kinds)
    assert p.peak_at in {"start of backward", "optimizer step", "pipeline output merge", "layer backward"}
    assert all(s["peak_at"] for s in p.stages)


def test_one_micro_batch_peaks_before_any_gradient(eng: Engine) -> None:
    """PyTorch frees gradients at zero_grad: a one-micro-batch step peaks either at the start of backward with no
    gradient yet, or at the optimizer step with every gradient and no activations kept; several micro-batches run
    backward beside the earlier ones' gradients."""
    one = eng.predict(_req(Setting.AMP_BF16))
    if one.peak_at == "start of backward":
        assert one.memory["at_peak_grads_gib"] == 0 and one.memory["at_peak_activations_gib"] > 0
    else:
        assert one.peak_at == "optimizer step" and one.memory["at_peak_activations_gib"] == 0
    assert one.memory["grads_gib"] > 0
    four = eng.predict(_req(Setting.AMP_BF16, global_batch=4))
    assert four.peak_at == "start of backward" and four.memory["at_peak_grads_gib"] == four.memory["grads_gib"]


def test_predict_table_memory_line_sums_to_the_peak() -> None:
    """The table's first memory line is the peak's own composition: its numbers add up to the peak printed."""
    import re

    cfg = Path(__file__).resolve().parents[1] / "examples" / "llama3.1-8b.json"
    r = run_cli("predict", str(cfg), "--gpu", "h200", "--dp", "2", "--tp", "2")
    assert r.returncode == 0, r.stderr
    peak = float(re.search(r"peak memory\s+([0-9.]+) GiB", r.stdout).group(1))  # type: ignore[union-attr]
    line = re.search(r"  at the (start of backward|optimizer step): (.*)", r.stdout)
    assert line is not None and "largest over the step: " in r.stdout
    parts = [float(x) for x in re.findall(r"[a-z]+ ([0-9.]+)", line.group(2))]
    assert len(parts) == 6 and peak > 50 and sum(parts) == pytest.approx(peak, abs=0.005 * len(parts) + 0.005)


# -- what a prediction says about its graph -------------------------------------------------------------

def test_moe_prediction_states_its_routing(tmp_path: Path) -> None:
    cfg = tmp_path / "moe.json"
    cfg.write_text(json.dumps(TINY_FAMILIES["qwen2-moe"]))
    r = run_cli("predict", str(cfg), "--gpu", "h200", "--seq-len", "64", "--precision", "bf16", "--json")
    assert r.returncode == 0, r.stderr
    mg = json.loads(r.stdout)["config"]["model_graph"]
    assert mg["family"] == "qwen2_moe" and "balanced" in mg["moe_routing"]
    r = run_cli("predict", str(cfg), "--gpu", "h200", "--seq-len", "64", "--precision", "bf16", "--tp", "3")
    assert r.returncode == 2 and "does not divide" in r.stderr


def test_sliding_window_model_graph_counts_layer_types(tmp_path: Path) -> None:
    cfg = tmp_path / "gemma.json"
    cfg.write_text(json.dumps(TINY_FAMILIES["gemma2"]))
    r = run_cli("predict", str(cfg), "--gpu", "h200", "--seq-len", "64", "--json")
    assert r.returncode == 0, r.stderr
    mg = json.loads(r.stdout)["config"]["model_graph"]
    assert mg["layer_types"] == {SLIDING: 2, FULL: 2} and mg["sliding_window"] == 16


def test_pure_fp16_with_adam_times_its_gemms_on_nan() -> None:
    """Pure fp16 with Adam runs on NaN after its first step (eps underflows): its GEMMs, and only its
    GEMMs, are looked up among NaN-operand measurements; loss scaling, master weights or SGD keep data finite."""
    from tp_query.engine.compose import make_item
    from tp_query.engine.graph import Phase
    from tp_query.schema.ops import Operands, step_operands

    assert step_operands("fp16", "adamw") == Operands.NAN and step_operands("fp16", "adamw_fused") == Operands.NAN
    for setting, opt in (("fp16", "sgd"), ("amp_fp16", "adamw"), ("mp_fp16", "adamw"), ("bf16", "adamw")):
        assert step_operands(setting, opt) == Operands.RANDOM
    mm = '{"a":[{"T":[64,32],"d":"fp16"},{"T":[32,16],"d":"fp16"}]}'
    plain = make_item("aten.mm.default", mm, Phase.FWD, False)
    nan = make_item("aten.mm.default", mm, Phase.FWD, False, operands=Operands.NAN)
    assert nan.key == plain.key + "|nan" and nan.info.features["layout"].endswith(":nan")
    add = '{"a":[{"T":[64,32],"d":"fp16"},{"T":[64,32],"d":"fp16"}]}'
    assert make_item("aten.add.Tensor", add, Phase.FWD, False, operands=Operands.NAN).key == \
        make_item("aten.add.Tensor", add, Phase.FWD, False).key


def test_database_snapshot_answers_without_duckdb_and_never_stale(cpu_db: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A second engine on the same database reads its snapshot (no DuckDB connection) and predicts the
    same; a changed file is caught by the manifest check before any snapshot is read."""
    import shutil

    from tp_query.engine.dbcache import DatabaseError

    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "db"
    shutil.copytree(cpu_db / "cpu", root / "cpu")
    first = Engine("cpu", str(root)).predict(_req(dp=2))
    eng2 = Engine("cpu", str(root))
    second = eng2.predict(_req(dp=2))
    assert eng2.db._db is None  # answered from the snapshot
    assert second.iteration_ms == first.iteration_ms and second.peak_memory_gib == first.peak_memory_gib
    victim = sorted((root / "cpu" / "ops").glob("*.parquet"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(DatabaseError, match="checksum mismatch"):
        Engine("cpu", str(root))


def test_lookup_memo_reused_and_damage_recomputed(cpu_db: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Estimates are memoised beside the database snapshot: a later engine answers the same request from
    the memo (no family points built) with the same numbers; a damaged entry is recomputed, not used (one written
    under a valid seal: the file's seal catches damage from outside)."""
    import shutil

    from tp_query.engine.dbcache import _read_json, _write_json

    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "db"
    shutil.copytree(cpu_db / "cpu", root / "cpu")
    e1 = Engine("cpu", str(root))
    first = e1.predict(_req(dp=2))
    e1.latency.flush_memo()
    (memo,) = (tmp_path / "cache" / "db").glob("*/memo-estimates-*.json")
    shutil.rmtree(tmp_path / "cache" / "costed")  # the graph's kept arrays would answer without any lookup
    e2 = Engine("cpu", str(root))
    assert e2.predict(_req(dp=2)).iteration_ms == first.iteration_ms
    assert not e2.latency._families  # every estimate came from the memo
    entries = _read_json(memo)
    key = next(k for k, v in entries.items() if v[2] in ("exact", "interpolated"))
    entries[key] = ["not a number"]
    _write_json(memo, entries)
    shutil.rmtree(tmp_path / "cache" / "costed")
    e3 = Engine("cpu", str(root))
    assert key not in e3.latency._cache  # dropped on load
    assert e3.predict(_req(dp=2)).iteration_ms == first.iteration_ms
    # two processes' memos merge: each flush keeps what the other wrote meanwhile
    shutil.rmtree(tmp_path / "cache" / "costed")
    memo.unlink()
    a, b = Engine("cpu", str(root)), Engine("cpu", str(root))
    a.predict(_req(dp=2))
    b.predict(_req(Setting.BF16, dp=2))
    a.latency.flush_memo()
    b.latency.flush_memo()
    merged = _read_json(memo)
    assert set(a.latency._memo) <= set(merged) and set(b.latency._memo) <= set(merged)
    assert len(merged) > len(a.latency._memo)


def test_pipelining_merges_retained_outputs_at_the_end_of_the_step(eng: Engine) -> None:
    """torch.distributed.pipelining keeps every micro-batch's logits on the last stage and concatenates them
    when schedule.step() ends: a copy priced from the database (torch only: Megatron frees outputs per
    micro-batch), and a memory peak of both copies beside every gradient."""
    from tp_query.engine.memory import logits_bytes

    p = eng.predict(_req(Setting.BF16, pp=2, global_batch=8))
    assert p.breakdown["pp_output_merge_ms"] > 0
    mega = eng.predict(_req(Setting("mp_bf16"), pp=2, global_batch=8, framework="megatron"))
    assert "pp_output_merge_ms" not in mega.breakdown
    with pytest.raises(PredictError, match="Megatron-Core trains with"):  # no torch autocast, no pure bf16
        eng.predict(_req(Setting.BF16, pp=2, global_batch=8, framework="megatron"))
    asm = eng.assemble(_req(Setting.BF16, pp=2, global_batch=8))
    last = asm.stages[-1]
    from tp_query.engine.memory import stage_memory

    m = stage_memory(asm.g, last, asm.par, "adamw", eng.gpu)
    two_copies = 2 * 8 * logits_bytes(asm.g, asm.par)
    assert m.peak_bytes >= m.weights_bytes + m.optimizer_bytes + m.grads_bytes + two_copies


def test_dtensor_tp_step_keeps_its_logits(eng: Engine) -> None:
    """PyTorch's loss_parallel step keeps `pred` (the vocab-sharded logits) referenced through backward and
    the optimizer step: one micro-batch's logits more in a torch TP step's activations, not in Megatron's and
    not at TP=1."""
    from tp_query.engine.framework import tp_step_keeps_logits
    from tp_query.engine.memory import logits_bytes, stage_memory

    assert tp_step_keeps_logits("torch", 2, 1)
    assert not tp_step_keeps_logits("megatron", 2, 1) and not tp_step_keeps_logits("torch", 1, 1)
    assert not tp_step_keeps_logits("torch", 2, 2)  # pipelining keeps its outputs by its own rule

    asm = eng.assemble(_req(Setting.BF16, tp=2))
    (st,) = asm.stages
    mp = asm.g.memory
    m = stage_memory(asm.g, st, asm.par, "adamw", eng.gpu)
    kept = st.layers * mp.layer_act_bytes + mp.embed_act_bytes
    assert logits_bytes(asm.g, asm.par) > 0
    assert m.activations_bytes == kept + logits_bytes(asm.g, asm.par)
    asm1 = eng.assemble(_req(Setting.BF16))
    (st1,) = asm1.stages
    m1 = stage_memory(asm1.g, st1, asm1.par, "adamw", eng.gpu)
    assert m1.activations_bytes == st1.layers * asm1.g.memory.layer_act_bytes + asm1.g.memory.embed_act_bytes


def test_megatron_scales_its_gradient_buffer_before_reducing(eng: Engine) -> None:
    """Megatron-Core's DDP multiplies its fp32 gradient buffer by 1/DP before the all-reduce (one in-place
    multiply over the whole buffer); none at DP=1, and PyTorch DDP's own bucket work is not added to it."""
    from tp_query.schema.precision import DType

    def scaling(**par: object) -> list[tuple[tuple[int, ...], DType, object]]:
        asm = eng.assemble(_req(Setting.MP_BF16, framework="megatron", **par))
        return [(it.call.args[0].shape, it.call.args[0].dtype, it.call.args[1]) for st in asm.stages
                for it in st.ddp if it.call.op == "aten.mul_.Tensor"]

    asm = eng.assemble(_req(Setting.MP_BF16, framework="megatron", dp=4))
    (st,) = asm.stages
    assert scaling(dp=4) == [((st.param_numel,), DType.FP32, 0.25)]
    assert all(it.call.op == "aten.mul_.Tensor" for it in st.ddp)
    assert scaling(dp=1) == []
    p2 = eng.predict(_req(Setting.MP_BF16, framework="megatron", dp=2))
    p1 = eng.predict(_req(Setting.MP_BF16, framework="megatron"))
    assert p2.breakdown["backward_ms"] > p1.breakdown["backward_ms"]


def test_models_differing_only_in_their_dense_first_layers_share_no_stage_lists(cpu_db: Path) -> None:
    """Two DeepSeek-V3 cuts whose traced parameters are equal but whose dense-first count differs name other
    parameters per model layer: one engine predicting both gives each its own answer (the second took the first's
    parameter list and crashed with a KeyError)."""
    base = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "vocab_size": 256,
            "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
            "max_position_embeddings": 256}

    def req(first_dense: int) -> PredictRequest:
        return PredictRequest(model={**base, "first_k_dense_replace": first_dense}, model_name="ds", gpu="cpu",
                              setting=Setting.BF16, seq_len=64, parallel=ParallelConfig())

    shared = Engine("cpu", str(cpu_db))
    both = [shared.predict(req(1)), shared.predict(req(3))]
    alone = [Engine("cpu", str(cpu_db)).predict(req(k)) for k in (1, 3)]
    assert [p.iteration_ms for p in both] == [p.iteration_ms for p in alone]
    assert both[0].parameters != both[1].parameters


def test_moe_types_known_only_to_transformers_state_their_routing(tmp_path: Path) -> None:
    """An MoE model type known only to transformers (OLMoE) says its routing is balanced, as every MoE prediction
    does (its expert count comes from the class defaults when the file leaves it out); gpt-oss without a
    `sliding_window` key shows the window its class gives (128), not None."""
    olmoe = tmp_path / "olmoe.json"
    olmoe.write_text(json.dumps({"model_type": "olmoe", "num_hidden_layers": 2, "hidden_size": 256,
                                 "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 512}))
    r = run_cli("predict", str(olmoe), "--gpu", "h200", "--seq-len", "128", "--precision", "bf16", "--json")
    assert r.returncode == 0, r.stderr
    mg = json.loads(r.stdout)["config"]["model_graph"]
    assert mg["moe_routing"].startswith("balanced: each of 64 experts receives tokens x 8 / 64 rows")
    assert "not modelled for it" in mg["moe_routing"]
    goss = tmp_path / "goss.json"
    goss.write_text(json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 2, "hidden_size": 256,
                                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
                                "vocab_size": 512, "layer_types": ["sliding_attention", "full_attention"]}))
    r = run_cli("predict", str(goss), "--gpu", "h200", "--seq-len", "128", "--precision", "bf16", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config"]["model_graph"]["sliding_window"] == 128
