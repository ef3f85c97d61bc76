"""Decoder-only model types the spec registry does not list, known only to transformers (ArchFamily.TRANSFORMERS):
built from transformers' own module as their config gives it, traced op for op as transformers' own CausalLM step
runs; what cannot be told from the config (tensor parallelism, layers that differ along the depth by rules not
modelled, recurrent layer kinds) is refused in one line (tests/test_depth_kinds.py: the rules that are)."""

from __future__ import annotations

from collections import Counter

import pytest
from tp_query.engine.trace.capture import TraceRequest, trace_config
from tp_query.schema.model_config import ArchFamily, Builder, ConfigError, parse_config
from tp_query.schema.precision import Setting

from .conftest import ROOT, trace_hf_causal_lm

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

_SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256}
GENERIC: dict[str, dict] = {
    "olmo2": {**_SMALL, "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "pad_token_id": 1},
    "granite": {**_SMALL, "architectures": ["GraniteForCausalLM"], "model_type": "granite", "embedding_multiplier": 12.0,
                "logits_scaling": 16.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
                "pad_token_id": 0},
    "gemma": {**_SMALL, "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "head_dim": 32, "pad_token_id": 0},
    "starcoder2": {**_SMALL, "architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "sliding_window": 16,
                   "use_bias": True, "bos_token_id": 0, "eos_token_id": 0},
}


@pytest.mark.parametrize("name", sorted(GENERIC))
def test_model_type_traces_as_transformers_runs_it(name: str) -> None:
    cfg = GENERIC[name]
    spec = parse_config(cfg)
    assert spec.family == ArchFamily.TRANSFORMERS and spec.builder == Builder.HF and spec.model_type == name
    ours = trace_config(TraceRequest(spec, Setting.BF16, 2, 32, traced_layers=spec.num_layers))
    from tp_query.engine.trace.hf_models import _patch_packed_check, hf_config_for
    from tp_query.engine.trace.models import Shard

    _patch_packed_check()
    theirs = trace_hf_causal_lm(hf_config_for(spec, Shard()), cfg["vocab_size"], Setting.BF16, 2, 32)
    for phase in ("fwd", "bwd", "opt"):
        a = Counter((o.op, o.sig) for o in ours.ops if o.phase.value == phase)
        b = Counter((o.op, o.sig) for o in theirs.ops if o.phase.value == phase)  # type: ignore[attr-defined]
        extra, missing = a - b, b - a
        extra.pop(("aten._local_scalar_dense.default", '{"a":[{"T":[],"d":"bool"}]}'), None)  # packed check's read
        assert not extra and not missing, (phase, list(extra.items())[:3], list(missing.items())[:3])


def test_parameters_are_counted_from_the_graph() -> None:
    """No formula knows a model type's blocks: the parameters come from the traced layers, scaled to the depth."""
    from tp_query.engine.flops import graph_parameter_count
    from tp_query.engine.trace.hf_models import hf_config_for
    from tp_query.engine.trace.models import Shard
    from tp_query.schema.model_config import parameter_count

    cfg = {**GENERIC["olmo2"], "num_hidden_layers": 6}
    spec = parse_config(cfg)
    assert parameter_count(spec.to_dict()) is None
    g = trace_config(TraceRequest(spec, Setting.BF16, 1, 32))
    assert g.meta.traced_layers == 2
    real = transformers.AutoModelForCausalLM.from_config(hf_config_for(spec, Shard()))
    assert graph_parameter_count(g) == sum(p.numel() for p in real.parameters())


def test_parameters_under_tp_are_the_whole_models(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Under TP a rank's graph holds shards: the answer's parameter count is the whole model's, as at TP=1."""
    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path))
    from tp_query.engine import api

    cfg = {**GENERIC["olmo2"], "num_hidden_layers": 4}
    one, two = (api.predict(cfg, gpu="h200", tp=tp, precision="bf16", seq_len=64) for tp in (1, 2))
    assert one.parameters and two.parameters == one.parameters


def test_a_config_without_architectures_is_taken_by_its_model_type() -> None:
    """A config as a config class's to_dict() writes it has no `architectures`: its model_type names the module, and
    the same model type with a non-causal-LM architecture is still refused; transformers' own advice about the config
    does not reach the user (a refusal is one line)."""
    import logging

    bare = {k: v for k, v in GENERIC["gemma"].items() if k != "architectures"}
    spec = parse_config(bare)
    assert spec.family == ArchFamily.TRANSFORMERS and spec.model_type == "gemma"
    with pytest.raises(ConfigError, match="unsupported architecture"):
        parse_config({**bare, "architectures": ["GemmaModel"]})
    from tp_query.engine.trace.hf_models import _config_object

    _config_object({**bare, "bos_token_id": 10**6})  # out of the vocabulary: transformers warns about it
    assert logging.getLogger("transformers").getEffectiveLevel() >= logging.ERROR


def test_what_the_config_cannot_tell_is_refused() -> None:
    spec = parse_config(GENERIC["olmo2"])
    assert "sequence parallelism" in spec.split_refusal(2, True) and spec.split_refusal(2, False) == ""
    with pytest.raises(ConfigError, match="not modelled"):  # MoE layers interleaved by a rule not modelled
        parse_config({**GENERIC["olmo2"], "moe_layer_freq": 2})
    # a dense-before-sparse rule the model type does not have: its layers come out alike, and that is said
    with pytest.raises(ConfigError, match="traced cut"):
        trace_config(TraceRequest(parse_config({**GENERIC["olmo2"], "first_k_dense_replace": 1}), Setting.BF16, 1, 32))
    with pytest.raises(ConfigError, match="unsupported architecture"):  # not a causal LM head
        parse_config({**GENERIC["olmo2"], "architectures": ["Olmo2Model"]})
    with pytest.raises(ConfigError, match="cannot build"):  # a model type transformers does not know
        trace_config(TraceRequest(parse_config({**GENERIC["olmo2"], "model_type": "no_such_model"}), Setting.BF16, 1, 32))
    with pytest.raises(ConfigError, match="linear_attention"):  # recurrent layer kinds
        trace_config(TraceRequest(parse_config({**GENERIC["olmo2"], "layer_types": ["linear_attention", "full_attention"]}),
                                  Setting.BF16, 1, 32))


def test_a_window_rule_of_the_model_type_is_read_as_transformers_builds_it() -> None:
    """Cohere-2 alternates sliding and global layers by its own rule when the config lists no layer_types: the parser
    reads transformers' own layer kinds (it assumed every layer slides, and the trace refused the difference), and
    the trace of the config without the list is the trace of the config with it."""
    base = {**_SMALL, "architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "sliding_window": 16,
            "num_hidden_layers": 4, "pad_token_id": 0}
    own = transformers.AutoConfig.for_model(**{k: v for k, v in base.items() if k != "architectures"})
    if getattr(own, "layer_types", None) is None or len(set(own.layer_types)) < 2:
        pytest.skip("this transformers' cohere2 config lists no alternating layer kinds")
    plain = parse_config(base)
    assert plain.layer_types == tuple(own.layer_types)
    listed = parse_config({**base, "layer_types": list(own.layer_types)})  # saying it explicitly is the same
    g, h = (trace_config(TraceRequest(s, Setting.BF16, 1, 32)) for s in (plain, listed))
    assert set(g.meta.extra["traced_layer_types"]) == set(h.meta.extra["traced_layer_types"]) == set(own.layer_types)
    assert [(o.op, o.sig) for o in g.ops] == [(o.op, o.sig) for o in h.ops]


def test_a_model_type_without_sdpa_is_built_eager() -> None:
    from tp_query.engine.trace.hf_models import attention_implementation

    oss = transformers.AutoConfig.for_model("gpt_oss", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=32, num_hidden_layers=2, vocab_size=512)
    assert attention_implementation(oss) == "eager"
    assert attention_implementation(transformers.AutoConfig.for_model("olmo2")) == "sdpa"


def test_expert_options_are_refused_for_a_model_type_known_only_to_transformers() -> None:
    spec = parse_config(GENERIC["olmo2"])
    with pytest.raises(ValueError, match="moe-imbalance"):
        trace_config(TraceRequest(spec, Setting.BF16, 1, 32, moe_imbalance=1.5))
    with pytest.raises(ValueError, match="expert parallelism"):
        trace_config(TraceRequest(spec, Setting.MP_BF16, 1, 32, ep=2, framework="megatron"))


def test_a_module_the_trace_cannot_follow_is_refused_in_one_line() -> None:
    """JetMoE's experts read routing counts on the host (data-dependent), which fake tensors cannot give: refused
    in one line naming why, not a traceback."""
    cfg = {**_SMALL, "architectures": ["JetMoeForCausalLM"], "model_type": "jetmoe", "num_local_experts": 4,
           "num_experts_per_tok": 2, "kv_channels": 32}
    with pytest.raises(ConfigError, match="depends on tensor values") as e:
        trace_config(TraceRequest(parse_config(cfg), Setting.BF16, 1, 32))
    assert "\n" not in str(e.value)


def test_the_validated_model_types_are_those_with_held_out_runs() -> None:
    """A prediction says whether its model type has held-out runs: the list the engine reads is the case table's
    types with measured runs (a case defined before it ran, Gemma-4's, is not a validated type yet)."""
    from tp_query.collector.validate import BF16_ONLY_CASES, GENERIC_CASES, default_type_cases
    from tp_query.engine.validation import load_rows
    from tp_query.schema.model_config import VALIDATED_MODEL_TYPES

    measured = {r["model"] for r in load_rows(ROOT / "data" / "validation", "h200") if r["status"] == "ok"}
    cased = {parse_config(cfg).model_type for name, (cfg, layers, *_) in [*GENERIC_CASES.items(),
                                                                        *BF16_ONLY_CASES.items()]
             if f"{name}-L{layers}" in measured}
    cased |= {parse_config(c.config).model_type for c in default_type_cases() if c.model in measured}
    assert cased == set(VALIDATED_MODEL_TYPES)


def _ops(g, phase: str) -> Counter:
    return Counter((o.op, o.sig) for o in g.ops if o.phase.value == phase)


def _shapes(g) -> dict:
    return {p.name: p.shape for p in g.params}


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_through_the_generic_path_is_the_listed_familys(tp: int) -> None:
    """A model type known only to transformers is split under TP from its divided config, with the collectives
    DTensor's Megatron plan issues. Taken through that path, a listed family (Qwen3, built by transformers in
    both) gives the very operators, shapes and collectives of its own builder, forward, backward and step."""
    from dataclasses import replace

    from .conftest import TINY_FAMILIES

    listed = parse_config({**TINY_FAMILIES["qwen3"], "num_key_value_heads": 4})
    generic = replace(listed, family=ArchFamily.TRANSFORMERS)
    a = trace_config(TraceRequest(listed, Setting.BF16, 1, 64, tp=tp))
    b = trace_config(TraceRequest(generic, Setting.BF16, 1, 64, tp=tp))
    for phase in ("fwd", "bwd", "opt"):
        ours, theirs = _ops(b, phase), _ops(a, phase)
        assert ours == theirs, (phase, list((ours - theirs).items())[:3], list((theirs - ours).items())[:3])
    assert _shapes(a) == _shapes(b)


def test_generic_tp_divides_heads_ffn_and_vocabulary() -> None:
    cfg = GENERIC["gemma"]
    spec = parse_config(cfg)
    g1 = trace_config(TraceRequest(spec, Setting.BF16, 1, 32))
    g2 = trace_config(TraceRequest(spec, Setting.BF16, 1, 32, tp=2))
    w1, w2 = _shapes(g1), _shapes(g2)
    assert w1.keys() == w2.keys()
    for n in w1:
        leaf = n.split(".")[-2]
        if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens"):
            assert w2[n][0] * 2 == w1[n][0] and w2[n][1:] == w1[n][1:], n  # column-parallel (and vocab rows)
        elif leaf in ("o_proj", "down_proj"):
            assert w2[n][1] * 2 == w1[n][1] and w2[n][0] == w1[n][0], n  # row-parallel
        else:
            assert w2[n] == w1[n], n  # norms replicated
    comm = Counter(o.op for o in g2.ops if o.op.startswith("comm."))
    assert set(comm) == {"comm.all_reduce"} and comm["comm.all_reduce"] > 0
    assert not any(o.op.startswith("comm.") for o in g1.ops)


def test_generic_tp_that_is_not_a_megatron_split_is_refused_in_one_line() -> None:
    from tp_query.engine.trace.hf_models import UnsupportedSplit

    from .test_depth_kinds import DSV3

    # multi-head latent attention: its down-projections stay whole inside the attention block
    with pytest.raises(UnsupportedSplit, match=r"(q_a_proj|kv_a_proj_with_mqa).*stays whole.*not modelled") as e:
        trace_config(TraceRequest(parse_config(DSV3), Setting.BF16, 1, 32, tp=2))
    assert "\n" not in str(e.value)
    # OLMoE normalises queries over all heads together: the divided module cannot run, and says so
    olmoe = {**_SMALL, "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "num_experts": 4,
             "num_experts_per_tok": 2, "pad_token_id": 1}
    with pytest.raises(UnsupportedSplit, match="divided config"):
        trace_config(TraceRequest(parse_config(olmoe), Setting.BF16, 1, 32, tp=2))


def test_generic_tp_divides_a_column_parallel_heads_bias() -> None:
    """Phi-2's LM head has a bias: column-parallel, it is divided with the vocabulary (not refused as a stray split)."""
    phi = {**_SMALL, "num_key_value_heads": 4, "architectures": ["PhiForCausalLM"], "model_type": "phi"}
    spec = parse_config(phi)
    g1 = trace_config(TraceRequest(spec, Setting.BF16, 1, 32))
    g2 = trace_config(TraceRequest(spec, Setting.BF16, 1, 32, tp=2))
    w1, w2 = _shapes(g1), _shapes(g2)
    bias = next(n for n in w1 if n.endswith("lm_head.bias"))
    assert w2[bias][0] * 2 == w1[bias][0]


def test_latent_attention_with_its_own_mlp_list_traces() -> None:
    """GLM-4.7-Flash's glm4_moe_lite: heads that do not divide the hidden size (its attention is latent, sized by
    qk/v head sizes) and a config class that derives its MLP kinds as a list, ignoring first_k_dense_replace: the
    cut's kinds are written as that list (both were refused)."""
    cfg = {"model_type": "glm4_moe_lite", "architectures": ["Glm4MoeLiteForCausalLM"], "hidden_size": 120,
           "num_attention_heads": 7, "num_key_value_heads": 7, "intermediate_size": 256, "moe_intermediate_size": 64,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
           "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
           "num_hidden_layers": 4, "vocab_size": 512, "n_group": 1, "topk_group": 1}
    spec = parse_config(cfg)
    assert spec.mlp_layer_types[:2] == ("dense", "sparse")
    g = trace_config(TraceRequest(spec, Setting.BF16, 1, 32))
    kinds = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"}).mlp_layer_types
    assert set(kinds) == {"dense", "sparse"} and g.ops


def test_a_one_layer_windowed_model_and_a_step_pytorch_refuses(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A model of one layer whose layers have kinds traces its one layer (it was an IndexError); a step PyTorch itself
    refuses (bf16 grouped GEMMs need 16-byte strides: 60 expert columns are 120 bytes) is one PredictError, not a
    RuntimeError."""
    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path))
    from tp_query.engine import api
    from tp_query.schema.messages import TpQueryError

    from .conftest import TINY_FAMILIES

    one = api.predict({**TINY_FAMILIES["gemma3"], "num_hidden_layers": 1}, gpu="h200", precision="bf16", seq_len=64)
    assert one.iteration_ms > 0
    moe = {**TINY_FAMILIES["qwen3-moe"], "moe_intermediate_size": 60}
    with pytest.raises(TpQueryError, match="PyTorch refuses this model's training step"):
        api.predict(moe, gpu="h200", precision="bf16", seq_len=64)
