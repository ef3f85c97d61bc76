"""The captured graph is what CUDA would run: autocast casts, SDPA backends, TP/SP records, memory."""

from __future__ import annotations

from collections import Counter

import pytest
from tp_query.engine.graph import Graph, Phase, Section
from tp_query.engine.trace.capture import TraceError, TraceRequest, trace_config
from tp_query.schema.model_config import parse_config
from tp_query.schema.precision import Setting

from .conftest import TINY_GPT2, TINY_LLAMA

LLAMA = parse_config(TINY_LLAMA, "tiny-llama")
GPT2 = parse_config(TINY_GPT2, "tiny-gpt2")


def ops_of(g: Graph, phase: Phase | None = None) -> Counter[str]:
    return Counter(o.op for o in g.ops if phase is None or o.phase == phase)


@pytest.fixture(scope="module")
def amp() -> Graph:
    return trace_config(TraceRequest(LLAMA, Setting.AMP_BF16, 2, 64))


def test_phases_and_sections(amp: Graph) -> None:
    secs = Counter((o.phase, o.section) for o in amp.ops)
    for key in [(Phase.FWD, Section.EMBED), (Phase.FWD, Section.LAYER), (Phase.FWD, Section.HEAD),
                (Phase.BWD, Section.HEAD), (Phase.BWD, Section.LAYER), (Phase.BWD, Section.EMBED),
                (Phase.OPT, Section.OPTIM)]:
        assert secs[key] > 0, key
    layer = [o for o in amp.ops if o.section == Section.LAYER]
    per_layer = Counter((o.phase, o.layer) for o in layer)
    assert per_layer[(Phase.FWD, 0)] == per_layer[(Phase.FWD, 1)]  # identical layers
    assert per_layer[(Phase.BWD, 0)] == per_layer[(Phase.BWD, 1)]


def test_amp_inserts_casts_and_uses_cudnn_attention(amp: Graph) -> None:
    fwd = ops_of(amp, Phase.FWD)
    assert fwd["aten._scaled_dot_product_cudnn_attention.default"] == 2
    assert ops_of(amp, Phase.BWD)["aten._scaled_dot_product_cudnn_attention_backward.default"] == 2
    casts = [o.sig for o in amp.ops if o.op == "aten._to_copy.default" and o.phase == Phase.FWD]
    assert any('"dtype":{"dtype":"bf16"}' in s for s in casts)
    # weights are cast once per autocast region (cached), activations once per consumer
    layer0 = [o for o in amp.ops if o.phase == Phase.FWD and o.layer == 0 and o.op == "aten._to_copy.default"]
    weight_casts = [o for o in layer0 if '"T":[128,128]' in o.sig or '"T":[64,128]' in o.sig]
    assert len(weight_casts) == 4  # q, k, v, o projections
    # the loss runs in fp32 under autocast (log_softmax via the fp32 policy)
    ls = [o.sig for o in amp.ops if o.op == "aten._log_softmax.default"]
    assert ls and '"d":"fp32"' in ls[0]
    # optimizer: AdamW foreach, step counters on the host
    opt = ops_of(amp, Phase.OPT)
    assert opt["aten._foreach_addcdiv_.ScalarList"] == 1
    assert any('"h":1' in o.sig for o in amp.ops if o.op.startswith("aten._foreach_add_"))


def test_fp32_gqa_falls_back_to_math_attention() -> None:
    g = trace_config(TraceRequest(LLAMA, Setting.FP32, 1, 64))
    names = ops_of(g)
    assert not any("scaled_dot_product" in n and "attention" in n and "math" not in n for n in names)
    assert names["aten._safe_softmax.default"] == 2 and names["aten.bmm.default"] >= 4  # scores materialised
    gm = trace_config(TraceRequest(GPT2, Setting.FP32, 1, 64))  # MHA: memory-efficient kernel
    assert ops_of(gm)["aten._scaled_dot_product_efficient_attention.default"] == 2


def test_grad_scaler_under_amp_fp16() -> None:
    g = trace_config(TraceRequest(LLAMA, Setting.AMP_FP16, 1, 64))
    opt = ops_of(g, Phase.OPT)
    assert opt["aten._amp_foreach_non_finite_check_and_unscale_.default"] == 1
    assert opt["aten._amp_update_scale_.default"] == 1
    device_syncs = [o for o in g.ops if o.phase == Phase.OPT and o.op == "aten._local_scalar_dense.default"
                    and '"h":1' not in o.sig]
    assert len(device_syncs) == 1  # found_inf.item() synchronises; step.item() on host counters does not


def test_tensor_parallel_shards_and_comm_records() -> None:
    g1 = trace_config(TraceRequest(LLAMA, Setting.BF16, 1, 64))
    g2 = trace_config(TraceRequest(LLAMA, Setting.BF16, 1, 64, tp=2))
    n1 = sum(p.numel for p in g1.params)
    n2 = sum(p.numel for p in g2.params)
    assert n2 < 0.6 * n1
    comms = Counter((o.phase, o.op) for o in g2.ops if o.op.startswith("comm.") and o.layer == 1)
    assert comms[(Phase.FWD, "comm.all_reduce")] == 2  # after o_proj and down_proj
    # DTensor's ColwiseParallel: each column-parallel Linear all-reduces its own input gradient (q, k, v, gate,
    # up), as the profiles of real DTensor steps show; Megatron-Core sums them and all-reduces once per block
    assert comms[(Phase.BWD, "comm.all_reduce")] == 5
    rc = trace_config(TraceRequest(LLAMA, Setting.BF16, 1, 64, tp=2, recompute=True))
    # recomputation reruns o_proj's all-reduce; checkpoint stops before the MLP's (its output is not saved)
    assert Counter(o.op for o in rc.ops if o.phase == Phase.BWD and o.layer == 1)["comm.all_reduce"] == 5 + 1
    mc = trace_config(TraceRequest(LLAMA, Setting.MP_BF16, 1, 64, tp=2, framework="megatron"))
    mcomms = Counter((o.phase, o.op) for o in mc.ops if o.op.startswith("comm.") and o.layer == 1)
    assert mcomms[(Phase.FWD, "comm.all_reduce")] == 2 and mcomms[(Phase.BWD, "comm.all_reduce")] == 2
    sp = trace_config(TraceRequest(LLAMA, Setting.BF16, 1, 64, tp=2, sequence_parallel=True))
    kinds = Counter(o.op for o in sp.ops if o.op.startswith("comm.") and o.layer == 1)
    assert kinds["comm.all_gather"] == 4 and kinds["comm.reduce_scatter"] == 4
    with pytest.raises(TraceError, match="does not divide the attention heads"):
        trace_config(TraceRequest(LLAMA, Setting.BF16, 1, 64, tp=3))


def test_recompute_reruns_forward_in_backward_and_saves_memory() -> None:
    base = trace_config(TraceRequest(LLAMA, Setting.BF16, 2, 128))
    rc = trace_config(TraceRequest(LLAMA, Setting.BF16, 2, 128, recompute=True))
    assert ops_of(rc, Phase.BWD)["aten.mm.default"] > ops_of(base, Phase.BWD)["aten.mm.default"]
    assert rc.memory.layer_act_bytes < base.memory.layer_act_bytes / 2


def test_memory_profile_is_consistent(amp: Graph) -> None:
    m = amp.memory
    assert m.layer_act_bytes > 0 and m.grad_bytes > 0
    assert m.traced_peak_bytes >= m.static_bytes + m.fwd_end_bytes
    # weights (fp32) + AdamW's two moments: 12 bytes per parameter under AMP
    n = sum(p.numel for p in amp.params)
    assert abs(m.static_bytes - 12 * n) / (12 * n) < 0.05


def test_graph_file_roundtrip(amp: Graph, tmp_path) -> None:
    p = tmp_path / "g.json.gz"
    amp.save(p)
    again = Graph.load(p)
    assert again.ops == amp.ops and again.params == amp.params and again.memory == amp.memory


@pytest.mark.parametrize("setting,framework,optimizer", [
    (Setting.AMP_FP16, "torch", "adamw"), (Setting.MP_BF16, "torch", "adamw"),
    (Setting.MP_BF16, "megatron", "adamw"), (Setting.TF32, "torch", "adamw_fused"), (Setting.BF16, "torch", "sgd")])
def test_steady_state_without_a_whole_warmup_step(setting: Setting, framework: str, optimizer: str) -> None:
    """The recorded step is the same whether the optimizer and grad-scaler state came from an optimizer step
    over zero gradients (the fast path) or from a whole unrecorded training step."""
    req = TraceRequest(LLAMA, setting, 2, 64, tp=2, optimizer=optimizer, framework=framework)
    fast, full = trace_config(req).to_json(), trace_config(req, full_warmup_step=True).to_json()
    for g in (fast, full):
        g["meta"]["extra"].pop("trace_s")
    assert fast == full


def test_per_parameter_optimizer_calls_cover_every_layer() -> None:
    """Megatron-Core's step computes a gradient norm and copies the main parameter back once per parameter:
    in a graph traced with 2 of 4 layers those calls stand for all 4 layers' parameters (a stage of the full
    model has them all), sharded under its distributed optimizer like the rest of the step; the host reads
    of the optimizer's step counts stay as traced."""
    from tp_query.engine.compose import Composer

    g = trace_config(TraceRequest(LLAMA, Setting.MP_BF16, 1, 64, framework="megatron"))
    assert g.meta.traced_layers == 2 and LLAMA.num_layers == 4
    comp = Composer(g, False)
    params = comp.stage_params(True, True, 4)
    assert len(params) > len(g.params)
    traced_norms = [o for o in g.ops if o.op == "aten.linalg_vector_norm.default"]
    assert len(traced_norms) == len(g.params)
    items = comp.optimizer_items(params, 1)
    norms = [it for it in items if it.call.op == "aten.linalg_vector_norm.default"]
    copies = [it for it in items if it.call.op == "aten.copy_.default"]
    assert len(norms) == len(params) and len(copies) == len(params)
    assert sorted(it.call.args[0].shape for it in norms) == sorted(tuple(p.shape) for p in params)
    sharded = comp.optimizer_items(params, 2)
    assert sum(it.call.args[0].numel for it in sharded if it.call.op == "aten.linalg_vector_norm.default") \
        <= sum(p.numel for p in params) // 2 + len(params)


def test_dtensor_sequence_parallel_reduces_partial_norm_gradients_in_the_optimizer() -> None:
    """Under DTensor SP the norms' weight gradients stay Partial over the TP ranks; each optimizer call that
    reads them all-reduces them first (3 per weight with foreach AdamW: lerp_ and addcmul_ twice, as the kernel
    timelines of real steps count), and a stage of the whole model has them for all its norms."""
    from tp_query.engine.compose import Composer
    from tp_query.engine.graph import sequence_parallel_norm

    def opt_comms(g: Graph) -> int:
        return sum(1 for o in g.ops if o.phase == Phase.OPT and o.op == "comm.all_reduce")

    sp = trace_config(TraceRequest(LLAMA, Setting.BF16, 1, 64, tp=2, sequence_parallel=True))
    norms = [p for p in sp.params if sequence_parallel_norm(p.name, tuple(p.shape))]
    assert len(norms) == 2 * 2 + 1  # two per traced layer and the final norm
    assert opt_comms(sp) == 3 * len(norms)
    fused = trace_config(TraceRequest(LLAMA, Setting.BF16, 1, 64, tp=2, sequence_parallel=True,
                                      optimizer="adamw_fused"))
    assert opt_comms(fused) == len(norms)
    assert opt_comms(trace_config(TraceRequest(LLAMA, Setting.BF16, 1, 64, tp=2))) == 0  # no SP: replicated
    comp = Composer(sp, False)
    params = comp.stage_params(True, True, 4)
    items = comp.optimizer_items(params, 1)
    assert sum(1 for it in items if it.call.op == "comm.all_reduce") == 3 * (2 * 4 + 1)


def test_softmax_backward_holds_the_cuda_kernels_temporary() -> None:
    """CUDA's softmax backward computes grad * output into a temporary before its kernel: the peak during that
    operator is its output plus one more gradient-sized tensor, while the live count after it has the output only."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from tp_query.engine.trace.capture import _Capture, _HostSet, _Recorder, rounded

    with FakeTensorMode():
        grad = torch.empty(2, 4, 64, 64, dtype=torch.float32)
        out = torch.empty(2, 4, 64, 64, dtype=torch.float32)
        cap = _Capture(_HostSet(), {})
        cap.known([grad, out])
        cap.active = True
        cap.open_window("w")
        with _Recorder(cap):
            res = torch.ops.aten._softmax_backward_data.default(grad, out, -1, torch.float32)
            size = rounded(2 * 4 * 64 * 64 * 4)
            assert res.shape == grad.shape
            assert cap.live == size  # the output stays; the temporary does not
            assert cap.window_peak["w"] == cap.peak == 2 * size  # output and temporary at once
            plain = torch.ops.aten.mul.Tensor(grad, out)  # no temporary registered: its output only
            assert cap.live == cap.peak == 2 * size
    del res, plain


def test_megatron_attention_backward_peak_includes_the_softmax_temporary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's unfused attention under --bf16 takes its softmax in fp32; the layer's backward peaks in the softmax
    backward, whose temporary adds one fp32 B x heads x S x S tensor to the transient (as on an H200: +4 GiB during
    the op, +2 after it, for Llama-8B at 4096 tokens)."""
    from tp_query.engine.trace import capture

    def traced() -> Graph:
        return trace_config(TraceRequest(LLAMA, Setting.MP_BF16, 1, 256, framework="megatron"))

    with_tmp = traced().memory.layer_bwd_transient_bytes
    monkeypatch.setattr(capture, "CUDA_IN_OP_TEMPORARIES", {})
    without = traced().memory.layer_bwd_transient_bytes
    assert with_tmp - without == LLAMA.num_heads * 256 * 256 * 4


def test_native_activations_are_those_the_parser_admits() -> None:
    """The parser admits for the native builder exactly the activations its copies apply (a Llama config with
    gelu_fast was a KeyError at trace time), and each traces."""
    from tp_query.engine.trace import models
    from tp_query.schema.model_config import GPT2_ACTS, NATIVE_LLAMA_ACTS

    assert set(models._ACTS) == set(NATIVE_LLAMA_ACTS) and set(models._GPT2_ACTS) == set(GPT2_ACTS)
    for act in NATIVE_LLAMA_ACTS:
        g = trace_config(TraceRequest(parse_config({**TINY_LLAMA, "hidden_act": act}), Setting.FP32, 1, 16))
        assert any(o.phase == Phase.BWD for o in g.ops)
