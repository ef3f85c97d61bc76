"""Layers that differ along the depth in more than attention type, for model types known only to transformers:
dense layers before sparse (mixture-of-experts) ones (GLM-4.5, DeepSeek-style `first_k_dense_replace`, EXAONE's
`mlp_layer_types`, Qwen-MoE's `mlp_only_layers`) and layers without RoPE (SmolLM3's `no_rope_layers`). A trace runs
a leading layer and one layer of each kind; the engine composes the model's layers from those templates, each
layer's parameters from its own kind's."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from tp_query.schema.model_config import ConfigError, depth_kinds, parse_config

_SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 256}
GLM = {**_SMALL, "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "num_hidden_layers": 6,
       "first_k_dense_replace": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
       "n_shared_experts": 1, "partial_rotary_factor": 0.5, "attention_bias": True, "pad_token_id": 0}
SMOL = {**_SMALL, "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "num_hidden_layers": 8,
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(8)], "no_rope_layer_interval": 4,
        "use_sliding_window": False, "pad_token_id": 0}


def test_depth_rules_read_each_layers_kind() -> None:
    assert depth_kinds({"first_k_dense_replace": 2}, 4) == (("dense", "dense", "sparse", "sparse"), ())
    assert depth_kinds({"first_k_dense_replace": 5}, 4) == ((), ())  # every layer of the cut dense: alike
    assert depth_kinds({"mlp_layer_types": ["dense", "sparse", "sparse"]}, 3) == (("dense", "sparse", "sparse"), ())
    # mlp_layer_types outranks first_k_dense_replace (as EXAONE-MoE's config says)
    assert depth_kinds({"mlp_layer_types": ["sparse"] * 3, "first_k_dense_replace": 1}, 3) == ((), ())
    assert depth_kinds({"mlp_only_layers": [1], "decoder_sparse_step": 1}, 3) == (("sparse", "dense", "sparse"), ())
    assert depth_kinds({"decoder_sparse_step": 2}, 4) == (("dense", "sparse", "dense", "sparse"), ())
    assert depth_kinds({"no_rope_layer_interval": 4}, 8) == ((), (True, True, True, False) * 2)
    assert depth_kinds({"no_rope_layers": [1, 0, 1], "no_rope_layer_interval": 4}, 3) == ((), (True, False, True))
    assert depth_kinds({"no_rope_layers": [1, 1]}, 2) == ((), ())
    # Llama-4: MoE every step-th layer, or the listed ones
    assert depth_kinds({"interleave_moe_layer_step": 2}, 4) == (("dense", "sparse", "dense", "sparse"), ())
    assert depth_kinds({"moe_layers": [0, 3], "interleave_moe_layer_step": 2}, 4) == (
        ("sparse", "dense", "dense", "sparse"), ())
    # a model type's own default for a key its config leaves out or empty (Llama-4 lists no_rope_layers as [])
    assert depth_kinds({"model_type": "llama4_text", "no_rope_layers": []}, 4) == ((), (True, True, True, False))
    assert depth_kinds({"model_type": "glm4_moe"}, 3) == (("dense", "sparse", "sparse"), ())
    # ERNIE-4.5-MoE: sparse where (i + 1) % interval == 0 and start <= i <= end (-1: the last layer)
    assert depth_kinds({"moe_layer_start_index": 1}, 4) == (("dense", "sparse", "sparse", "sparse"), ())
    for bad in ({"moe_layer_freq": 2}, {"layers_block_type": ["mamba", "attention"]},
                {"hybrid_override_pattern": "M*M*"}):
        with pytest.raises(ConfigError, match="not modelled"):
            depth_kinds(bad, 4)
    with pytest.raises(ConfigError, match="one per layer"):
        depth_kinds({"no_rope_layers": [1, 0]}, 4)
    with pytest.raises(ConfigError, match="non-negative"):
        depth_kinds({"first_k_dense_replace": -1}, 4)


def test_a_spec_traces_one_layer_of_each_kind() -> None:
    spec = parse_config(GLM)
    assert spec.layer_kinds() == ("full_attention|mlp=dense",) * 2 + ("full_attention|mlp=sparse",) * 4
    assert spec.traced_layer_indices() == (0, 0, 2)
    cut = spec.cut(spec.traced_layer_indices())
    assert cut.mlp_layer_types == ("dense", "dense", "sparse") and cut.num_layers == 3
    smol = parse_config(SMOL)
    assert smol.traced_layer_indices() == (0, 0, 3)
    assert smol.cut((0, 0, 3)).rope_layers == (True, True, False)
    # a cut of the first layers that are all alike has no kinds left
    assert parse_config({**GLM, "num_hidden_layers": 2}).mlp_layer_types == ()


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _layer_ops(g, layers: list[int]) -> Counter:  # type: ignore[no-untyped-def]
    from tp_query.engine.graph import Section

    return Counter((o.op, o.sig, o.phase.value) for o in g.ops if o.section == Section.LAYER and o.layer in layers)


@pytest.mark.parametrize("cfg", [GLM, SMOL], ids=["glm4_moe", "smollm3"])
def test_templates_stand_for_every_layer_of_their_kind(cfg: dict) -> None:
    """The cut's templates, each counted for the layers of its kind, give the whole model's layer operators, its
    parameters and, with PP, each stage's own parameters."""
    from tp_query.engine.compose import Composer
    from tp_query.engine.flops import graph_parameter_count
    from tp_query.engine.graph import layer_template_of
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.engine.trace.hf_models import hf_config_for
    from tp_query.engine.trace.models import Shard
    from tp_query.schema.precision import Setting

    spec = parse_config(cfg)
    n = spec.num_layers
    cut = trace_config(TraceRequest(spec, Setting.BF16, 1, 32))
    assert cut.meta.traced_layers == 3 and cut.meta.extra["traced_layer_kinds"] == list(spec.cut((0, 0, 3 if
                                                                                                 cfg is SMOL else 2)).layer_kinds())
    whole = trace_config(TraceRequest(spec, Setting.BF16, 1, 32, traced_layers=n))
    assert whole.meta.traced_layers == n
    template = layer_template_of(cut.meta)
    composed: Counter = Counter()
    for i in range(1, n):  # layer 0 is each trace's leading layer (the model's first)
        composed.update(_layer_ops(cut, [template[i]]))
    assert composed == _layer_ops(whole, list(range(1, n)))
    real = transformers.AutoModelForCausalLM.from_config(hf_config_for(spec, Shard()))
    n_real = sum(p.numel() for p in real.parameters())
    assert graph_parameter_count(cut) == n_real
    comp = Composer(cut, allow_tf32=False)
    stages = comp.stages(ParallelConfig(pp=2, global_batch=2))
    # a tied embedding (SmolLM3's class default) is held again by the last stage, as Megatron and pipelining keep it
    copy = spec.vocab_size * spec.hidden_size if spec.tie_word_embeddings else 0
    assert sum(s.param_numel for s in stages) == n_real + copy
    own = {name: p.numel() for name, p in real.named_parameters()}
    for s in stages:  # stage 0 holds the dense layers (GLM), each layer its own kind's parameters
        for p in s.params:
            if p.section.value == "layer":
                assert own["model." + p.name] == p.numel, p.name


def test_a_model_types_default_rule_is_read_and_a_contradicting_one_refused() -> None:
    """GLM-4.5's config class makes the first layer dense by default: a config that leaves first_k_dense_replace out
    still traces its first layer dense. A config whose list says otherwise than the rule its model type reads is
    refused when the module comes out unlike the list, instead of pricing the wrong layers."""
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.schema.precision import Setting

    bare = {k: v for k, v in GLM.items() if k != "first_k_dense_replace"}
    spec = parse_config(bare)
    assert spec.mlp_layer_types == ("dense",) + ("sparse",) * 5
    trace_config(TraceRequest(spec, Setting.BF16, 1, 32))
    wrong = {**GLM, "mlp_layer_types": ["sparse", "dense"] + ["sparse"] * 4}  # glm4_moe reads first_k_dense_replace
    with pytest.raises(ConfigError, match="traced cut"):
        trace_config(TraceRequest(parse_config(wrong), Setting.BF16, 1, 32))


DSV3 = {**_SMALL, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "n_shared_experts": 1, "kv_lora_rank": 64, "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "head_dim": 16, "n_group": 1, "topk_group": 1, "pad_token_id": 0}


@pytest.mark.parametrize("setting", ["bf16", "tf32"])
def test_latent_attention_runs_with_its_own_value_head(setting: str) -> None:
    """DeepSeek-V3's multi-head latent attention: SDPA with query/key heads of 48 and value heads of 32 (cuDNN in
    half precision, efficient attention in fp32, as an H200 picks); the value head is part of the attention's
    category, and its work counts both heads."""
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.schema.ops import Family, describe
    from tp_query.schema.precision import Setting
    from tp_query.schema.signature import OpCall

    spec = parse_config(DSV3)
    assert spec.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    g = trace_config(TraceRequest(spec, Setting(setting), 1, 32))
    want = "cudnn" if setting == "bf16" else "efficient"
    attn = [o for o in g.ops if "scaled_dot_product" in o.op]
    assert attn and all(want in o.op for o in attn)
    for o in attn:
        info = describe(OpCall.from_json_str(o.op, o.sig), setting == "tf32")
        assert info.family == Family.ATTENTION and info.features["layout"] == "dv32"
        assert info.features["head_dim"] == 48
        if o.phase.value == "fwd":  # causal: half of 2 x heads x s^2 x (48 + 32)
            heads = info.features["heads"]
            assert info.flops == pytest.approx(0.5 * 2 * heads * 32 * 32 * (48 + 32))


LLAMA4 = {**_SMALL, "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "num_hidden_layers": 4,
          "intermediate_size_mlp": 256, "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
          "attention_chunk_size": 16, "no_rope_layers": [], "pad_token_id": 0}


def test_llama4_layers_by_kind() -> None:
    """Llama-4: RoPE layers attend within chunks, every fourth layer has no RoPE and attends to everything, MoE in
    every other layer (Maverick's pattern); its published multimodal config reads as its language model."""
    spec = parse_config(LLAMA4)
    assert spec.layer_types == ("chunked_attention",) * 3 + ("full_attention",)
    assert spec.mlp_layer_types == ("dense", "sparse", "dense", "sparse")
    assert spec.rope_layers == (True, True, True, False)
    assert spec.traced_layer_indices() == (0, 0, 1, 3)
    wrapped = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
               "text_config": {k: v for k, v in LLAMA4.items() if k not in ("architectures", "model_type")}}
    assert parse_config(wrapped).layer_kinds() == spec.layer_kinds()
    from tp_query.engine.graph import layer_template_of
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.schema.precision import Setting

    g = trace_config(TraceRequest(spec, Setting.BF16, 1, 32))
    assert g.meta.extra["traced_layer_kinds"] == [spec.layer_kind(i) for i in (0, 0, 1, 3)]
    assert layer_template_of(g.meta) == [1, 2, 1, 3]


def test_a_pipeline_stage_weighs_its_own_layer_kinds() -> None:
    """Under PP each stage's layer section counts its own layers' kinds: GLM's 6 layers (2 dense) in 2 stages give
    stage 1 three sparse layers, whose weighted operators equal the whole trace's layers 3-5 exactly."""
    from tp_query.engine.compose import Composer
    from tp_query.engine.graph import Phase, Section
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.schema.precision import Setting

    spec = parse_config(GLM)
    cut = trace_config(TraceRequest(spec, Setting.BF16, 1, 32))
    whole = trace_config(TraceRequest(spec, Setting.BF16, 1, 32, traced_layers=spec.num_layers))
    comp = Composer(cut, allow_tf32=False)
    s0, s1 = comp.stages(ParallelConfig(pp=2, global_batch=2))
    assert s0.layer_mix == ((1, 2), (2, 1)) and s1.layer_mix == ((2, 3),)
    for phase in (Phase.FWD, Phase.BWD):
        w = comp.part_weights(phase, Section.LAYER, s1.layer_mix)
        assert w is not None
        got: Counter = Counter()
        for it, wt in zip(comp.part(phase, Section.LAYER), w, strict=True):
            if wt:
                got[(it.call.op, it.call.to_json_str())] += round(wt * s1.layers)
        want = Counter((o.op, o.sig) for o in whole.ops if o.section == Section.LAYER and o.layer in (3, 4, 5)
                       and o.phase == phase)
        assert got == want
    # without PP the model-wide mix
    (only,) = comp.stages(ParallelConfig())
    assert only.layer_mix is None


def test_a_stage_without_some_layer_kind_lists_only_its_own_operators(cpu_db: Path) -> None:
    """The per-operator table of a PP stage that holds no dense layer (GLM, stage 1 of 2): every row has a finite
    per-call latency and a positive count (a kind whose share of the stage is 0 is left out, not divided by 0)."""
    import math

    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.predict import Engine, PredictRequest
    from tp_query.schema.precision import Setting

    req = PredictRequest(model=GLM, model_name="glm", gpu="cpu", setting=Setting.BF16,
                         parallel=ParallelConfig(pp=2, global_batch=4), seq_len=32)
    p = Engine("cpu", str(cpu_db)).predict(req, with_ops=True)
    assert p.ops and all(math.isfinite(r.latency_us) and math.isfinite(r.total_ms) and r.count > 0 for r in p.ops)


def test_llama4_experts_are_looked_up_with_the_routers_zero_rows() -> None:
    """transformers' Llama-4 runs every token through every expert as one batched GEMM, the router's zero weights
    in 3 of 4 rows here: its forward GEMMs and both weight gradients are keyed with the routed operands, the down
    projection's input gradient (the full output gradient) and every other model's GEMMs with random ones."""
    from tp_query.engine.compose import Composer
    from tp_query.engine.graph import Phase
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.schema.precision import Setting

    g = trace_config(TraceRequest(parse_config(LLAMA4), Setting.BF16, 1, 32))
    comp = Composer(g, allow_tf32=False)
    per_phase: dict[Phase, list[str]] = {}
    for (phase, _), items in comp.sections.items():
        per_phase.setdefault(phase, []).extend(it.key.partition("|")[2] for it in items
                                               if it.call.op == "aten.bmm.default" and it.call.args[0].shape[0] == 4)
    assert per_phase[Phase.FWD] == ["routed-a1"] * 4  # gate-up and down, two MoE layers
    assert per_phase[Phase.BWD] == ["routed-a2", "", "routed-a2b1", "routed-a1"] * 2
    dense = Composer(trace_config(TraceRequest(parse_config(GLM), Setting.BF16, 1, 32)), allow_tf32=False)
    assert not any("|routed" in it.key for items in dense.sections.values() for it in items)


def test_llama4s_routing_is_said_dense(cpu_db: Path) -> None:
    """The prediction says what it priced: Llama-4's experts each run on every token (no top-k grouped GEMMs);
    another transformers MoE is priced as balanced top-k routing."""
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.predict import Engine, PredictRequest
    from tp_query.schema.precision import Setting

    eng = Engine("cpu", str(cpu_db))
    for model, want in ((LLAMA4, "dense: each of 4 experts runs on every token"),
                        (GLM, "balanced: each of")):
        req = PredictRequest(model=model, model_name="m", gpu="cpu", setting=Setting.BF16, parallel=ParallelConfig(),
                             seq_len=32)
        assert eng.predict(req).config["model_graph"]["moe_routing"].startswith(want)


def test_per_layer_lists_have_one_entry_per_layer() -> None:
    """A layer_types or mlp_layer_types list left long when num_hidden_layers was cut is refused, as transformers'
    validate_layer_type refuses it, never read as its first layers."""
    from tp_query.schema.model_config import ConfigError

    qwen = {**_SMALL, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 2,
            "sliding_window": 16, "use_sliding_window": True}
    assert parse_config({**qwen, "layer_types": ["full_attention", "sliding_attention"]}).layer_types
    with pytest.raises(ConfigError, match="one per layer, got 3"):
        parse_config({**qwen, "layer_types": ["full_attention", "sliding_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="one per layer"):
        parse_config({**GLM, "mlp_layer_types": ["dense"] * 2 + ["sparse"] * 5})


GEMMA4 = {**_SMALL, "model_type": "gemma4_text", "num_hidden_layers": 6, "head_dim": 32, "sliding_window": 64,
          "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "vocab_size_per_layer_input": 512,
          "hidden_size_per_layer_input": 16, "per_layer_config": {"5": {"head_dim": 64}}}


def test_per_layer_overrides_are_read_by_attention_type() -> None:
    """transformers' per_layer_config (Gemma-4: the full-attention layers' own head size) is one override per
    attention type; overrides that differ within a type, or cover part of it, are refused in one line."""
    from tp_query.schema.model_config import per_layer_overrides_by_type

    types = GEMMA4["layer_types"]
    assert per_layer_overrides_by_type(GEMMA4, types) == {"full_attention": {"head_dim": 64}}
    assert per_layer_overrides_by_type({**GEMMA4, "per_layer_config": None}, types) == {}
    for plc, why in (({"0": {"head_dim": 64}}, "overrides 1 of the 5 sliding_attention"),
                     ({"0": {"head_dim": 64}, **{str(i): {"head_dim": 32} for i in range(1, 5)}}, "different"),
                     ({"9": {"head_dim": 64}}, "names layer 9"), ({"x": {}}, "not a layer index")):
        with pytest.raises(ConfigError, match=why):
            parse_config({**GEMMA4, "per_layer_config": plc})
    with pytest.raises(ConfigError, match="reuse another layer's keys"):  # Gemma-4 E2B/E4B's KV sharing
        parse_config({**GEMMA4, "num_kv_shared_layers": 2})
    # the multimodal wrapper is read as its language model
    wrapped = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
               "text_config": {k: v for k, v in GEMMA4.items() if k != "model_type"}}
    spec = parse_config(wrapped)
    assert spec.model_type == "gemma4_text" and spec.layer_types == tuple(GEMMA4["layer_types"])
    unified = {**wrapped, "model_type": "gemma4_unified", "architectures": ["Gemma4UnifiedForConditionalGeneration"]}
    assert parse_config(unified).model_type == "gemma4_unified_text"
    assert not parse_config({**wrapped, "tie_word_embeddings": False}).tie_word_embeddings  # the wrapper's flag


def test_gemma4s_cut_keeps_each_layers_overrides_and_its_per_layer_embeddings() -> None:
    """A trace's cut (a leading layer, a sliding one, the full one) gives each kept layer its type's overrides;
    composed, it has the whole model's parameters, per-layer input embeddings (one slice per layer) included."""
    from tp_query.engine.flops import graph_parameter_count
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.engine.trace.hf_models import hf_config_for
    from tp_query.engine.trace.models import Shard
    from tp_query.schema.precision import Setting

    spec = parse_config(GEMMA4)
    assert spec.traced_layer_indices() == (0, 0, 5)
    cut_cfg = hf_config_for(spec.cut((0, 0, 5)), Shard())
    assert [cut_cfg.per_layer_config[i].head_dim for i in range(3)] == [32, 32, 64]
    # under TP each layer's own KV heads divide too (given per layer, or as the class derives them)
    kv = {**GEMMA4, "per_layer_config": {"5": {"head_dim": 64, "num_key_value_heads": 2}}}
    tp2 = hf_config_for(parse_config(kv).cut((0, 0, 5)), Shard(tp=2))
    assert tp2.per_layer_config[2].num_key_value_heads == 1 and tp2.per_layer_config[0].num_key_value_heads == 1
    derived = {**GEMMA4, "per_layer_config": None, "global_head_dim": 64, "num_global_key_value_heads": 2,
               "attention_k_eq_v": True}
    tp2 = hf_config_for(parse_config(derived).cut((0, 0, 5)), Shard(tp=2))
    assert (tp2.per_layer_config[2].head_dim, tp2.per_layer_config[2].num_key_value_heads) == (64, 1)
    real = transformers.AutoModelForCausalLM.from_config(hf_config_for(spec, Shard()))
    cut = trace_config(TraceRequest(spec, Setting.BF16, 1, 32))
    assert graph_parameter_count(cut) == sum(p.numel() for p in real.parameters())


AFMOE = {**_SMALL, "model_type": "afmoe", "num_hidden_layers": 8, "num_dense_layers": 2, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 64, "num_shared_experts": 1, "sliding_window": 64,
         "global_attn_every_n_layers": 4, "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2}


def test_afmoes_leading_dense_layers_are_their_own_kind() -> None:
    """AFMoE (Arcee Trinity) keeps its first num_dense_layers dense (class default 1): a cut of a dense and an MoE
    layer of each attention type has the whole model's parameters (the cut's kinds had differed before)."""
    from tp_query.engine.flops import graph_parameter_count
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.engine.trace.hf_models import hf_config_for
    from tp_query.engine.trace.models import Shard
    from tp_query.schema.precision import Setting

    spec = parse_config(AFMOE)
    assert spec.mlp_layer_types == ("dense",) * 2 + ("sparse",) * 6
    assert parse_config({k: v for k, v in AFMOE.items() if k != "num_dense_layers"}).mlp_layer_types == (
        "dense",) + ("sparse",) * 7
    real = transformers.AutoModelForCausalLM.from_config(hf_config_for(spec, Shard()))
    cut = trace_config(TraceRequest(spec, Setting.BF16, 1, 32))
    assert cut.meta.traced_layers < spec.num_layers
    assert graph_parameter_count(cut) == sum(p.numel() for p in real.parameters())


def test_a_layer_list_transformers_rewrites_is_refused() -> None:
    """Gemma-4's config class makes its last layer full attention whatever layer_types says: a list ending in a
    sliding layer would be predicted as read and built otherwise, so it is refused."""
    from tp_query.engine.trace.hf_models import check_layer_kinds

    check_layer_kinds(parse_config(GEMMA4))
    sliding = {**GEMMA4, "layer_types": ["sliding_attention"] * 6, "per_layer_config": None}
    with pytest.raises(ConfigError, match="not as layer_types reads"):
        check_layer_kinds(parse_config(sliding))


def test_a_wrapper_the_parser_does_not_read_is_refused_for_its_language_models_reason() -> None:
    """A multimodal wrapper (Qwen3.5, Gemma-3n) was refused as "config is missing hidden_size": it now gives its
    language model's own refusal, or says to predict that model from its text_config."""
    inner = {k: v for k, v in GEMMA4.items() if k != "model_type"}
    with pytest.raises(ConfigError, match=r"gemma3n: its language model \(gemma3n_text\): num_kv_shared_layers"):
        parse_config({"model_type": "gemma3n", "text_config": {**inner, "model_type": "gemma3n_text",
                                                                "num_kv_shared_layers": 2}})
    with pytest.raises(ConfigError, match=r"give its text_config \(model_type .qwen3_5_text.\) as the config"):
        parse_config({"model_type": "qwen3_5", "text_config": {**_SMALL, "model_type": "qwen3_5_text",
                                                                "num_hidden_layers": 2}})
    with pytest.raises(ConfigError, match="names no model_type"):
        parse_config({"model_type": "qwen3_5", "text_config": dict(_SMALL)})


def test_infinity_is_read_only_where_transformers_writes_it(tmp_path: Path) -> None:
    """Mamba-2's hybrids (Granite-4.0-H, Falcon-H1, Bamba) as transformers saves them carry time_step_limit
    [0.0, Infinity]: they were refused for it, before their layer kinds were read. Infinity is read under that key
    only; anywhere else NaN and Infinity are refused, naming the key."""
    from tp_query.schema.model_config import load_model_file, plain_model

    ok = tmp_path / "hybrid.json"
    ok.write_text(json.dumps({**GLM, "time_step_limit": [0.0, 1.0]}).replace("1.0]", "Infinity]"))
    assert load_model_file(ok)["time_step_limit"] == [0.0, float("inf")]
    assert plain_model({**GLM, "time_step_limit": [0.0, float("inf")]})["time_step_limit"][1] == float("inf")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**GLM, "text_config": {"rope_theta": 1.0}}).replace("1.0}", "NaN}"))
    with pytest.raises(ConfigError, match=r"text_config\.rope_theta: NaN and Infinity are not JSON numbers"):
        load_model_file(bad)
    with pytest.raises(ConfigError, match="rope_theta: NaN and Infinity"):
        plain_model({**GLM, "rope_theta": float("inf")})
    # Nemotron-H states its depth only as its block list: refused for the list, not for a missing layer count
    nemotron = {k: v for k, v in {**_SMALL, "model_type": "nemotron_h"}.items()}
    with pytest.raises(ConfigError, match="layers_block_type: layers that differ along the depth"):
        parse_config({**nemotron, "layers_block_type": ["mamba", "moe", "attention", "mlp"]})


ERNIE_MOE = {**_SMALL, "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe",
             "num_hidden_layers": 4, "moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 64,
             "moe_num_shared_experts": 1, "moe_layer_start_index": 1, "moe_layer_end_index": 3,
             "moe_layer_interval": 1, "use_bias": False, "pad_token_id": 0}


@pytest.mark.parametrize("setting", ["bf16", "amp_bf16"])
def test_optimizer_lists_of_dtype_groups_and_frozen_parameters_cover_every_layer(setting: str) -> None:
    """ERNIE-4.5-MoE keeps its routers in fp32 beside bf16 weights and its routing bias frozen: torch.optim's
    foreach step runs on each dtype group of the trainable parameters, lists shorter than the traced parameters.
    Rebuilt from the cut (one sparse template), every list holds every layer's parameters, as the whole model's
    own trace does (they had kept the cut's layers: the H100's ERNIE runs were 13-23% under-predicted)."""
    from tp_query.engine.compose import Composer
    from tp_query.engine.graph import Phase
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.schema.precision import Setting
    from tp_query.schema.signature import OpCall, TensorSpec

    spec = parse_config(ERNIE_MOE)
    cut = trace_config(TraceRequest(spec, Setting(setting), 1, 32))
    whole = trace_config(TraceRequest(spec, Setting(setting), 1, 32, traced_layers=spec.num_layers))
    assert len(cut.params) < len(whole.params)

    def lists(calls: list[OpCall]) -> Counter:
        return Counter((c.op, tuple((len(a), sum(t.numel for t in a if isinstance(t, TensorSpec)))
                                    for a in c.args if isinstance(a, list)))
                       for c in calls if any(isinstance(a, list) for a in c.args))

    truth = lists([OpCall.from_json_str(o.op, o.sig) for o in whole.ops if o.phase == Phase.OPT])
    # shorter lists than the parameters: a dtype group (bf16) and the group of the fp32 routers
    assert {n for key in truth for n, _ in key[1]} - {len(whole.params)}
    stage, = Composer(cut, allow_tf32=False).stages(ParallelConfig())
    assert lists([it.call for it in stage.opt]) == truth
    # ZeRO shards every list of the group to 1/DP of each tensor, the count of tensors unchanged
    sharded, = Composer(cut, allow_tf32=False).stages(ParallelConfig(dp=4, zero=2, global_batch=4))
    assert {k[0]: [n for n, _ in k[1]] for k in lists([it.call for it in sharded.opt])} == \
        {k[0]: [n for n, _ in k[1]] for k in truth}


QWEN3_NEXT = {**_SMALL, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 4,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
              "linear_conv_kernel_dim": 4, "pad_token_id": 0}


def test_gated_delta_rule_layers_trace_as_transformers_torch_fallback(cpu_db: Path) -> None:
    """Qwen3-Next's linear-attention layers (the gated delta rule) run transformers' torch fallback where
    flash-linear-attention is not installed: a trace follows it chunk by chunk (more chunks, more operators), the
    prediction says what it priced, TP is refused in one line, and Mamba's recurrent layers stay refused."""
    import importlib.util

    from tp_query.engine.graph import Section
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.predict import Engine, PredictError, PredictRequest
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.schema.model_config import GATED_DELTA_NOTE
    from tp_query.schema.precision import Setting

    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed: transformers runs its kernels, which are not modelled")
    spec = parse_config(QWEN3_NEXT)
    assert spec.layer_types[0] == "linear_attention"

    def linear_ops(seq: int) -> int:
        g = trace_config(TraceRequest(spec, Setting.BF16, 1, seq))
        return sum(o.section == Section.LAYER and o.layer == 1 for o in g.ops)  # the linear layer's template

    assert linear_ops(256) > linear_ops(128)  # 64-token chunks: the fallback loops over them
    eng = Engine("cpu", str(cpu_db))
    p = eng.predict(PredictRequest(model=QWEN3_NEXT, model_name="qwen3-next", gpu="cpu", setting=Setting.BF16,
                                   parallel=ParallelConfig(), seq_len=128))
    assert p.iteration_ms > 0 and GATED_DELTA_NOTE in p.warnings
    with pytest.raises(PredictError, match="linear-attention"):
        eng.predict(PredictRequest(model=QWEN3_NEXT, model_name="qwen3-next", gpu="cpu", setting=Setting.BF16,
                                   parallel=ParallelConfig(tp=2), seq_len=128))
    jamba = {**_SMALL, "architectures": ["JambaForCausalLM"], "model_type": "jamba", "num_hidden_layers": 2,
             "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
             "num_experts": 2, "pad_token_id": 0}
    with pytest.raises((PredictError, ConfigError), match="not modelled"):
        eng.predict(PredictRequest(model=jamba, model_name="jamba", gpu="cpu", setting=Setting.BF16,
                                   parallel=ParallelConfig(), seq_len=128))


def test_linear_attention_configs_read_as_transformers_reads_them(cpu_db: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """An audit's findings: legacy layer names ("mamba", "attention") are the kinds transformers renames them to (the
    same prediction as the current names); a float interval of integral value is taken as the class takes it; TP's
    refusal names the linear layers at any degree (not a head count that sends the user to another degree); an
    invalid kind's refusal keeps what was given; and an installed fast-path package is named, not traced."""
    import importlib.util

    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.predict import Engine, PredictError, PredictRequest
    from tp_query.engine.trace import hf_models
    from tp_query.schema.precision import Setting

    if importlib.util.find_spec("fla") is not None or importlib.util.find_spec("causal_conv1d") is not None:
        pytest.skip("a gated-delta fast-path package is installed here: these models are refused for it")
    eng = Engine("cpu", str(cpu_db))

    def predict(cfg: dict[str, object], tp: int = 1) -> float:
        return eng.predict(PredictRequest(model=cfg, model_name="q", gpu="cpu", setting=Setting.BF16,
                                          parallel=ParallelConfig(tp=tp), seq_len=128)).iteration_ms

    base = predict(QWEN3_NEXT)
    assert predict({**QWEN3_NEXT, "layer_types": ["mamba"] * 3 + ["attention"]}) == base
    derived = {k: v for k, v in QWEN3_NEXT.items() if k != "layer_types"}
    assert predict({**derived, "full_attention_interval": 4.0}) == predict(derived) == base
    with pytest.raises(ConfigError, match="positive integer"):
        parse_config({**derived, "full_attention_interval": 2.5})
    for tp in (2, 3):
        with pytest.raises(PredictError, match="linear-attention"):
            predict(QWEN3_NEXT, tp)
    with pytest.raises((PredictError, ConfigError), match=r"but got \[.*'foo'\]"):
        predict({**QWEN3_NEXT, "layer_types": ["linear_attention"] * 3 + ["foo"]})
    monkeypatch.setattr(hf_models, "gated_delta_kernels_installed", lambda: ["causal_conv1d"])
    hf_models.gated_delta_fallback.cache_clear()
    try:
        with pytest.raises((PredictError, ConfigError), match="causal_conv1d is installed here"):
            predict({**QWEN3_NEXT, "num_hidden_layers": 8, "layer_types": ["linear_attention"] * 7 + ["full_attention"]})
    finally:
        hf_models.gated_delta_fallback.cache_clear()


def test_fsdp2_refuses_a_model_whose_trainable_parameters_mix_dtypes(cpu_db: Path) -> None:
    """fully_shard raises on a unit whose trainable parameters have different dtypes ("FSDP expects uniform original
    parameter dtype"): ERNIE-4.5-MoE in pure bf16 keeps fp32 routers, so FSDP2 is refused in one line; under autocast
    every parameter is fp32 and FSDP2 runs, as DDP runs either way (its buckets are per dtype)."""
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.predict import Engine, PredictError, PredictRequest
    from tp_query.schema.precision import Setting

    eng = Engine("cpu", str(cpu_db))

    def predict(setting: Setting, zero: int) -> float:
        return eng.predict(PredictRequest(model=ERNIE_MOE, model_name="ernie", gpu="cpu", setting=setting,
                                          parallel=ParallelConfig(dp=2, zero=zero, global_batch=2),
                                          seq_len=64)).iteration_ms

    for zero in (2, 3):
        with pytest.raises(PredictError, match=r"FSDP2.*bf16 and fp32"):
            predict(Setting.BF16, zero)
    assert predict(Setting.BF16, 0) > 0 and predict(Setting.AMP_BF16, 3) > 0
