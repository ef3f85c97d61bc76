"""The spec registry's families against transformers itself: our sectioned, shardable wrapper of a
family's modules traces, at TP=1, exactly the operators of transformers' own CausalLM training step
(forward with labels, backward, optimizer step), masks, rotary tables, routing and grouped expert GEMMs
included; and the sections the engine composes stages from hold what they should."""

from __future__ import annotations

from collections import Counter

import pytest
from tp_query.engine.trace.capture import TraceRequest, trace_config
from tp_query.schema.model_config import SLIDING, ArchFamily, Builder, ConfigError, parse_config
from tp_query.schema.precision import Setting
from tp_query.schema.signature import OpCall

from .conftest import TINY_FAMILIES, trace_hf_causal_lm

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _hf_graph(cfg: dict, setting: Setting, mb: int, seq: int):  # type: ignore[no-untyped-def]
    from tp_query.engine.trace.hf_models import _patch_packed_check, hf_config_for
    from tp_query.engine.trace.models import Shard

    _patch_packed_check()
    return trace_hf_causal_lm(hf_config_for(parse_config(cfg), Shard()), cfg["vocab_size"], setting, mb, seq)


@pytest.mark.parametrize("name", sorted(TINY_FAMILIES))
@pytest.mark.parametrize("setting", [Setting.AMP_BF16, Setting.BF16])
def test_family_matches_transformers(name: str, setting: Setting) -> None:
    cfg = TINY_FAMILIES[name]
    spec = parse_config(cfg)
    assert spec.builder == Builder.HF
    ours = trace_config(TraceRequest(spec, setting, 2, 64, traced_layers=spec.num_layers))
    theirs = _hf_graph(cfg, setting, 2, 64)
    for phase in ("fwd", "bwd", "opt"):
        a = Counter((o.op, o.sig) for o in ours.ops if o.phase.value == phase)
        b = Counter((o.op, o.sig) for o in theirs.ops if o.phase.value == phase)
        extra, missing = a - b, b - a
        # the packed-sequence check's host read: our trace records the sync the CUDA run performs
        extra.pop(("aten._local_scalar_dense.default", '{"a":[{"T":[],"d":"bool"}]}'), None)
        assert not extra and not missing, (phase, list(extra.items())[:3], list(missing.items())[:3])


def test_sliding_layers_attend_through_a_mask() -> None:
    """A window shorter than the sequence: transformers materialises the sliding mask and SDPA takes the
    masked (cuDNN) path on those layers; global layers keep is_causal with no mask."""
    spec = parse_config(TINY_FAMILIES["gemma2"])
    assert spec.layer_types[:2] == (SLIDING, "full_attention")
    g = trace_config(TraceRequest(spec, Setting.BF16, 1, 64))
    assert g.meta.extra["traced_layer_types"] == [SLIDING, SLIDING, "full_attention"]
    attn = [o for o in g.ops if o.op == "aten._scaled_dot_product_cudnn_attention.default"]
    by_layer = {o.layer: OpCall.from_json_str(o.op, o.sig) for o in attn}
    n_tensors = {li: sum(1 for _ in c.tensors()) for li, c in by_layer.items()}
    assert n_tensors[1] == 4 and by_layer[1].args[3].shape == (1, 1, 64, 64)  # q, k, v and the window mask
    assert n_tensors[2] == 3 and by_layer[2].args[3] is None  # global layer: is_causal, no mask
    # a window at least as long as the sequence needs no mask: every layer is plain causal attention
    long = parse_config({**TINY_FAMILIES["gemma2"], "sliding_window": 4096})
    g2 = trace_config(TraceRequest(long, Setting.BF16, 1, 64))
    sigs = {o.sig for o in g2.ops if o.op == "aten._scaled_dot_product_cudnn_attention.default"}
    assert len(sigs) == 1


def test_moe_records_grouped_gemms_and_tp_shards_experts() -> None:
    spec = parse_config(TINY_FAMILIES["qwen2-moe"])
    assert spec.is_moe and spec.num_experts == 4 and spec.experts_per_token == 2
    g1 = trace_config(TraceRequest(spec, Setting.BF16, 1, 64))
    gm = [o for o in g1.ops if o.op == "aten._grouped_mm.default"]
    assert {o.phase.value for o in gm} == {"fwd", "bwd"}
    g2 = trace_config(TraceRequest(spec, Setting.BF16, 1, 64, tp=2))
    w1 = {p.name: p.shape for p in g1.params}
    w2 = {p.name: p.shape for p in g2.params}
    name = next(n for n in w1 if n.endswith("experts.gate_up_proj"))
    assert w2[name][1] * 2 == w1[name][1]  # each rank holds every expert's half FFN
    comm = Counter(o.op for o in g2.ops if o.op.startswith("comm."))
    assert comm["comm.all_reduce"] > 0


@pytest.mark.parametrize("cfg, msg", [
    ({**TINY_FAMILIES["qwen2-moe"], "mlp_only_layers": [1]}, "mlp_only_layers"),
    ({**TINY_FAMILIES["gemma2"], "layer_types": ["nope"] * 4}, "layer_types"),
])
def test_refusals_say_why(cfg: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        parse_config(cfg)


def test_mlp_only_layers_naming_no_layer_is_the_plain_moe_model() -> None:
    """transformers' Qwen-MoE layer is dense when its index is in mlp_only_layers: an entry beyond the model (or
    negative) names no layer and the model is every-layer MoE, parsed as if the key were absent."""
    base = TINY_FAMILIES["qwen2-moe"]
    n = base["num_hidden_layers"]
    from dataclasses import replace

    plain = parse_config(base)
    for only in ([n], [n + 5, -1], []):
        got = parse_config({**base, "mlp_only_layers": only})
        assert replace(got, hf_config=plain.hf_config) == plain  # (the config text keeps the key as given)
    with pytest.raises(ConfigError, match=f"1 of the {n} layers dense"):
        parse_config({**base, "mlp_only_layers": [n - 1, n]})
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        parse_config({**base, "decoder_sparse_step": 0})


def test_registry_families() -> None:
    fams = {parse_config(c).family for c in TINY_FAMILIES.values()}
    # the native builders' families are tested against transformers elsewhere, model types known only to
    # transformers in tests/test_trace_generic.py
    assert fams == set(ArchFamily) - {ArchFamily.LLAMA, ArchFamily.GPT2, ArchFamily.TRANSFORMERS}


def test_fp8_settings_trace_torchao_float8() -> None:
    """torchao float8 training: every Linear whose dimensions are multiples of 16 runs three scaled fp8
    GEMMs (output, input gradient, weight gradient) with casts and amax around them; the LM head stays
    a bf16 GEMM; parameters stay bf16."""
    pytest.importorskip("torchao")
    from tp_query.schema.ops import describe
    from tp_query.schema.precision import Precision

    from .conftest import TINY_LLAMA

    spec = parse_config({**TINY_LLAMA, "intermediate_size": 384})
    bf16 = trace_config(TraceRequest(spec, Setting.BF16, 1, 64))
    for setting in (Setting.FP8_TENSORWISE, Setting.FP8_ROWWISE):
        g = trace_config(TraceRequest(spec, setting, 1, 64))
        scaled = [o for o in g.ops if o.op == "aten._scaled_mm.default"]
        linears = 7 * g.meta.traced_layers  # q, k, v, o, gate, up, down
        assert len(scaled) == 3 * linears
        info = describe(OpCall.from_json_str(scaled[0].op, scaled[0].sig), False)
        assert info.precision == Precision.FP8 and info.features["layout"].endswith(setting.value.split("_")[1])
        head_mm = [o for o in g.ops if o.op == "aten.mm.default" and o.section.value == "head"]
        assert head_mm  # the LM head is not converted
        assert [p.dtype for p in g.params] == [p.dtype for p in bf16.params]
        assert len(g.ops) > len(bf16.ops)


def test_fp8_leaves_linear_subclasses_with_their_own_forward() -> None:
    """A Linear subclass has a forward of its own (Phi-MoE's router returns the routing as three tensors):
    torchao's Float8Linear would replace it and break the model, so only plain Linear layers are converted."""
    pytest.importorskip("torchao")
    import torch
    from tp_query.engine.trace.fp8 import convert_fp8

    class Router(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
            logits = super().forward(x)
            w, idx = torch.topk(logits, 2)
            return logits, w, idx

    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(64, 64))
    model.add_module("router", Router(64, 32))
    assert convert_fp8(model, "tensorwise") == (1, ["Router"])  # one converted, the subclass said
    assert type(model.proj).__name__ == "Float8Linear"
    assert type(model.router) is Router


def test_fp8_refuses_a_model_of_linear_subclasses_only() -> None:
    """Falcon's projections are all FalconLinear(nn.Linear): left in bf16, the fp8 answer would be bf16's time
    under fp8's name (torchao's own filter converts them), so the trace refuses it."""
    pytest.importorskip("torchao")
    from tp_query.engine.trace.capture import TraceError

    cfg = {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "hidden_size": 64,
           "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 128, "new_decoder_architecture": False,
           "multi_query": True, "parallel_attn": True, "bias": False}
    spec = parse_config(cfg, "falcon-tiny")
    with pytest.raises(TraceError, match="FalconLinear"):
        trace_config(TraceRequest(spec, Setting.FP8_TENSORWISE, 1, 32, traced_layers=1))


def test_fp8_refuses_a_model_torchao_converts_nothing_of() -> None:
    """GPT-2's projections are transformers' Conv1D, not nn.Linear: convert_to_float8_training converts none of
    them, and the fp8 answer was bf16's time to the digit under fp8's name; the trace refuses it."""
    pytest.importorskip("torchao")
    from tp_query.engine.trace.capture import TraceError

    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4, "n_layer": 1,
           "vocab_size": 128, "n_positions": 64}
    spec = parse_config(cfg, "gpt2-tiny")
    with pytest.raises(TraceError, match="Conv1D"):
        trace_config(TraceRequest(spec, Setting.FP8_TENSORWISE, 1, 32, traced_layers=1))
