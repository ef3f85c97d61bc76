"""A key a config leaves out means what transformers' config class makes of it (schema/hf_config_defaults.json)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from tp_query.schema.model_config import (
    NULL_HEAD_DIM_TYPES,
    ROPE_TYPES,
    WINDOW_RULES,
    ArchFamily,
    ConfigError,
    WindowRule,
    config_notes,
    hf_class_defaults,
    parse_config,
    unread_bias_keys,
)

ROOT = Path(__file__).resolve().parents[1]

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
SAME_VERSION = transformers.__version__ == hf_class_defaults()["transformers"]


def _tool() -> object:
    spec = importlib.util.spec_from_file_location("hf_config_defaults", ROOT / "tools" / "hf_config_defaults.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not SAME_VERSION, reason="the shipped table was written from another transformers version")
def test_shipped_table_is_transformers_own() -> None:
    assert _tool().table() == hf_class_defaults()  # type: ignore[attr-defined]


# minimal configs: the keys a user's hand-written file might keep, everything else left to the class
MINIMAL = {
    "gemma": {"model_type": "gemma", "hidden_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 1, "intermediate_size": 16384},
    "gemma2": {"model_type": "gemma2", "hidden_size": 3584, "num_hidden_layers": 2, "num_attention_heads": 16,
               "num_key_value_heads": 8, "intermediate_size": 14336},
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 2, "intermediate_size": 10240},
    "mistral": {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 2, "intermediate_size": 14336},
    "qwen3": {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
              "num_key_value_heads": 8, "intermediate_size": 3072},
    "llama": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 16,
              "intermediate_size": 8192},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_hidden_layers": 2},
    "mixtral": {"model_type": "mixtral", "num_hidden_layers": 2},
    "gpt2": {"model_type": "gpt2", "n_layer": 2},
}


@pytest.mark.skipif(not SAME_VERSION, reason="the shipped table was written from another transformers version")
@pytest.mark.parametrize("mt", sorted(MINIMAL))
def test_sizes_are_what_transformers_builds(mt: str) -> None:
    cfg = MINIMAL[mt]
    spec = parse_config(dict(cfg))
    obj = transformers.AutoConfig.for_model(**cfg)
    if mt == "gpt2":
        assert (spec.hidden_size, spec.num_heads, spec.vocab_size) == (obj.n_embd, obj.n_head, obj.vocab_size)
        return
    head_dim = getattr(obj, "head_dim", None) or obj.hidden_size // obj.num_attention_heads
    got = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size,
           spec.tie_word_embeddings)
    want = (obj.hidden_size, obj.num_attention_heads, obj.num_key_value_heads, head_dim, obj.vocab_size,
            obj.tie_word_embeddings)
    assert got == want
    window = getattr(obj, "sliding_window", None) if getattr(obj, "use_sliding_window", True) else None
    assert (spec.sliding_window is not None) == (window is not None and any(
        t == "sliding_attention" for t in getattr(obj, "layer_types", None) or ["sliding_attention"]))


def test_gemma_head_size_is_the_class_default_not_hidden_over_heads() -> None:
    # Gemma-2-9B as a user might write it: no head_dim. transformers builds 256-wide heads (3584 / 16 = 224).
    spec = parse_config(dict(MINIMAL["gemma2"]))
    assert spec.head_dim == 256 and spec.family == ArchFamily.GEMMA2
    # a stated value wins, and null keeps transformers' derivation
    assert parse_config({**MINIMAL["gemma2"], "head_dim": 128}).head_dim == 128
    assert parse_config({**MINIMAL["mistral"], "num_key_value_heads": None}).num_kv_heads == 32
    assert parse_config(dict(MINIMAL["mistral"])).num_kv_heads == 8


def test_hub_gemma3_multimodal_wrapper_reads_its_text_model() -> None:
    # google/gemma-3-4b-it's config.json states six keys of its text_config
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
    spec = parse_config(hub)
    example = parse_config(json.loads((ROOT / "examples" / "gemma3-4b.json").read_text()))
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (
        example.num_heads, example.num_kv_heads, example.head_dim, example.vocab_size) == (8, 4, 256, 262208)
    notes = config_notes(hub)
    assert any("vision tower" in n for n in notes)
    assert any("head_dim=256" in n and "num_attention_heads=8" in n for n in notes)


def test_notes_name_what_a_config_states_but_does_not_change() -> None:
    full = json.loads((ROOT / "examples" / "llama3.1-8b.json").read_text())
    assert config_notes(full) == []
    q = config_notes({**full, "quantization_config": {"quant_method": "fp8"}})
    assert len(q) == 1 and "fp8" in q[0] and "quantization_config" in q[0]
    cap = config_notes({**MINIMAL["gemma2"], "attn_logit_softcapping": 50.0})
    assert any("attn_logit_softcapping 50.0" in n for n in cap)
    assert config_notes({"format": "tp-query-graph/9"}) == [] and config_notes([1]) == []


def test_model_types_known_only_to_transformers_keep_their_file() -> None:
    # such a type's module is built by transformers from the config as given (its own defaults apply there); the
    # spec reads the class's defaults (sizes dimension templates; tied embeddings put a copy on PP's last stage),
    # and the file's keys go to transformers unchanged
    cfg = {"model_type": "starcoder2", "num_hidden_layers": 2}
    spec = parse_config(dict(cfg))
    obj = transformers.AutoConfig.for_model(**cfg)
    assert spec.family == ArchFamily.TRANSFORMERS
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.vocab_size, spec.tie_word_embeddings) == (
        obj.hidden_size, obj.num_attention_heads, obj.num_key_value_heads, obj.vocab_size, obj.tie_word_embeddings)
    hf = json.loads(spec.hf_config)
    assert {k for k in hf if k not in ("use_cache",)} == set(cfg)
    # which layers slide stays transformers' own rule (dots1's class has a window its default layers do not use)
    assert parse_config({"model_type": "dots1", "num_hidden_layers": 2}).sliding_window is None


def test_a_left_out_size_is_the_class_default_and_the_answer_says_so() -> None:
    full = json.loads((ROOT / "examples" / "llama3.1-8b.json").read_text())
    cut = {k: v for k, v in full.items() if k != "hidden_size"}
    assert parse_config(cut).hidden_size == transformers.LlamaConfig().hidden_size
    assert any("hidden_size=4096" in n for n in config_notes(cut))


def test_llama4_notes_say_what_transformers_runs() -> None:
    hub = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
           "text_config": {"model_type": "llama4_text", "hidden_size": 512, "num_hidden_layers": 2,
                           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                           "intermediate_size": 1024, "intermediate_size_mlp": 2048, "num_local_experts": 4,
                           "num_experts_per_tok": 1, "vocab_size": 1000}}
    notes = config_notes(hub)
    assert any("every routed expert on every token" in n for n in notes)
    assert any("vision tower" in n for n in notes)


def test_an_unused_default_window_is_not_named() -> None:
    """Qwen3's class default window (4096) is off (use_sliding_window False): it sets nothing, so the answer does
    not name it; Mistral's default window is applied, so the answer names it."""
    q = json.loads((ROOT / "examples" / "qwen3-8b.json").read_text())
    assert "sliding_window" not in q and parse_config(q).sliding_window is None
    assert not any("sliding_window" in n for n in config_notes(q))
    assert any("sliding_window=4096" in n for n in config_notes({**q, "use_sliding_window": True}))
    m = {k: v for k, v in json.loads((ROOT / "examples" / "llama3.1-8b.json").read_text()).items()
         if k not in ("rope_scaling",)}
    m["model_type"] = "mistral"
    m["architectures"] = ["MistralForCausalLM"]
    assert parse_config(m).sliding_window == transformers.MistralConfig().sliding_window
    assert any(f"sliding_window={transformers.MistralConfig().sliding_window}" in n for n in config_notes(m))


def test_configs_as_transformers_5_saves_them(cpu_db: Path) -> None:
    """transformers >= 4.53 saves every layer's kind (`layer_types`, all full_attention for Qwen3, SmolLM3, dots1)
    and transformers 5 saves Qwen3-MoE's experts as num_local_experts (its attribute_map): such a file is the
    model it was saved from (the list was refused, the experts taken as the class's 128)."""
    from tp_query.engine.api import predict

    tiny = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 128,
            "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "num_hidden_layers": 4, "vocab_size": 512, "max_position_embeddings": 256}
    saved = {**tiny, "layer_types": ["full_attention"] * 4}
    kw = dict(gpu="cpu", db=str(cpu_db), seq_len=64)
    a, b = predict(tiny, **kw), predict(saved, **kw)  # type: ignore[arg-type]
    assert b.iteration_ms == pytest.approx(a.iteration_ms, rel=1e-9) and b.parameters == a.parameters
    moe = {**tiny, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": 64,
           "num_experts_per_tok": 2}
    for key in ("num_experts", "num_local_experts"):
        spec = parse_config({**moe, key: 16})
        assert spec.num_experts == 16
        assert not any("num_experts" in n for n in config_notes({**moe, key: 16}))
    assert transformers.AutoConfig.for_model("qwen3_moe", **{k: v for k, v in moe.items() if k != "model_type"},
                                             num_local_experts=16).num_experts == 16


def test_ernie_moe_layer_range_is_read_as_transformers_builds_it() -> None:
    """ERNIE-4.5-MoE: layer i is sparse when (i + 1) % interval == 0 and start <= i <= end, end -1 the last layer
    (its decoder layer's rule; the class defaults start 1, end -1, interval 1); it was refused."""
    from tp_query.schema.model_config import depth_kinds

    cfg = {"model_type": "ernie4_5_moe"}
    assert depth_kinds(cfg, 4)[0] == ("dense", "sparse", "sparse", "sparse")  # the class defaults
    assert depth_kinds({**cfg, "moe_layer_start_index": 0, "moe_layer_end_index": 4, "moe_layer_interval": 2}, 6)[0] \
        == ("dense", "sparse", "dense", "sparse", "dense", "dense")
    obj = transformers.AutoConfig.for_model("ernie4_5_moe", num_hidden_layers=6, moe_layer_start_index=0,
                                            moe_layer_end_index=4, moe_layer_interval=2)
    want = tuple("sparse" if (i + 1) % obj.moe_layer_interval == 0 and obj.moe_layer_start_index <= i
                 <= obj.moe_layer_end_index else "dense" for i in range(6))
    assert depth_kinds(obj.to_dict(), 6)[0] == want


def test_a_transformers_only_type_slides_by_its_own_rule() -> None:
    """A model type known only to transformers whose config states a window but no layer_types (Command R7B as
    published: cohere2, every 4th layer full by its class) takes transformers' own layer kinds (it was refused:
    the reading assumed every layer slides)."""
    cfg = {"model_type": "cohere2", "architectures": ["Cohere2ForCausalLM"], "hidden_size": 256,
           "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 8,
           "vocab_size": 1000, "sliding_window": 128}
    own = transformers.AutoConfig.for_model(**cfg).layer_types
    assert len(set(own)) == 2  # the test means something: the class mixes full and sliding layers
    assert parse_config(cfg).layer_types == tuple(own)


def _modeling_source(model_type: str) -> str:
    name = model_type.removesuffix("_text")
    return (Path(transformers.__file__).parent / "models" / name / f"modeling_{name}.py").read_text()


@pytest.mark.skipif(not SAME_VERSION, reason="the rules were read from another transformers version")
@pytest.mark.parametrize("mt", sorted(WINDOW_RULES))
def test_window_rule_is_what_the_modeling_file_reads(mt: str) -> None:
    """Per model type, whether transformers' modules read a per-layer list (config.layer_types[i]), one window for
    every layer, or no window at all (a Llama config with a sliding_window key was predicted as Qwen2's windows)."""
    src = _modeling_source(mt)
    own = WindowRule.LISTED if "layer_types[" in src else WindowRule.EVERY if "sliding_window" in src \
        else WindowRule.NEVER
    assert WINDOW_RULES[mt] == own


_SIZES = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
          "vocab_size": 32064, "num_hidden_layers": 6}  # Phi-3's class pads with id 32000
_WINDOWS = [{"sliding_window": 64}, {"sliding_window": 64, "use_sliding_window": True},
            {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 3},
            {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"] * 3}, {},
            # a key only some config classes have: Mistral's, Gemma's and Phi-3's never read it (their window applies)
            {"sliding_window": 64, "use_sliding_window": False}]


@pytest.mark.skipif(not SAME_VERSION, reason="the rules were read from another transformers version")
@pytest.mark.parametrize("mt", ["llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe",
                                "gemma2", "gemma3_text"])
@pytest.mark.parametrize("window", range(len(_WINDOWS)))
def test_sliding_layers_are_those_transformers_runs(mt: str, window: int) -> None:
    cfg = {"model_type": mt, **_SIZES, **_WINDOWS[window]}
    if mt in ("qwen2_moe", "qwen3_moe"):
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256)
    if mt == "mixtral":
        cfg.update(num_local_experts=4, num_experts_per_tok=2)
    obj = transformers.AutoConfig.for_model(**cfg)
    win = getattr(obj, "sliding_window", None)
    rule = WINDOW_RULES[mt]
    if rule == WindowRule.LISTED and not win and "sliding_attention" in cfg.get("layer_types", []):
        # transformers' sliding mask raises without a window ("Could not find a `sliding_window` argument")
        with pytest.raises(ConfigError, match="no window is in force"):
            parse_config(cfg)
        return
    if rule == WindowRule.NEVER or not win:
        want = ("full_attention",) * 6
    elif rule == WindowRule.EVERY:
        want = ("sliding_attention",) * 6
    else:
        want = tuple(obj.layer_types)
    spec = parse_config(cfg)
    assert (spec.layer_types or ("full_attention",) * 6) == want
    assert (spec.sliding_window is not None) == ("sliding_attention" in want)
    if rule == WindowRule.NEVER:  # Llama's own builder, and the answer says the keys are not read
        assert spec.builder.value == "native"
        assert any("reads neither sliding_window nor layer_types" in n for n in config_notes(cfg)) == bool(
            _WINDOWS[window])


def test_a_list_of_sliding_layers_without_a_window_is_refused() -> None:
    cfg = {"model_type": "qwen2", **_SIZES, "layer_types": ["sliding_attention"] * 6}
    with pytest.raises(ConfigError, match="no window is in force"):
        parse_config(cfg)


@pytest.mark.parametrize(("mt", "canon", "alias", "extra"), [
    ("gpt2", "n_embd", "hidden_size", {}), ("gpt2", "n_layer", "num_hidden_layers", {}),
    ("mixtral", "num_local_experts", "num_experts", {}),
    ("qwen3_moe", "num_local_experts", "num_experts", {"moe_intermediate_size": 128}),
])
def test_two_spellings_of_one_setting_must_agree(mt: str, canon: str, alias: str, extra: dict[str, int]) -> None:
    """transformers keeps one of two differing spellings by its class's field order (GPT-2 the alias, Qwen3-MoE the
    field), while the parameter count and Megatron read the other: a file stating both differently is refused."""
    assert hf_class_defaults()["aliases"][mt][alias] == canon
    cfg = {"model_type": mt, **extra, canon: 48, alias: 48}
    parse_config(cfg)  # equal values are one setting
    with pytest.raises(ConfigError, match=f"{canon} 48 and {alias} 24 name the same setting"):
        parse_config({**cfg, alias: 24})


def test_gemma3_wrapper_ties_by_its_own_key() -> None:
    """Gemma3ForConditionalGeneration ties the LM head by the wrapper's tie_word_embeddings (class default true)."""
    text = {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 2, "sliding_window": 1024}
    wrap = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}
    obj = transformers.AutoConfig.for_model(**{**wrap, "tie_word_embeddings": False, "text_config": text})
    assert obj.tie_word_embeddings is False and obj.text_config.tie_word_embeddings is True
    assert parse_config({**wrap, "tie_word_embeddings": False, "text_config": text}).tie_word_embeddings is False
    assert parse_config({**wrap, "text_config": text}).tie_word_embeddings is True
    with pytest.raises(ConfigError, match="make them agree"):
        parse_config({**wrap, "text_config": {**text, "tie_word_embeddings": False}})


def test_gpt2_keys_that_change_the_model_are_honoured_or_refused() -> None:
    with pytest.raises(ConfigError, match="activation_function 'bogus' is not modelled"):
        parse_config({"model_type": "gpt2", "activation_function": "bogus"})
    with pytest.raises(ConfigError, match="add_cross_attention"):
        parse_config({"model_type": "gpt2", "add_cross_attention": True})
    assert parse_config({"model_type": "gpt2", "add_cross_attention": False}).num_layers == 12


_BIAS_SIZES = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
               "vocab_size": 32064, "num_hidden_layers": 2}  # Phi-3's class pads with id 32000


@pytest.mark.skipif(not SAME_VERSION, reason="the rules were read from another transformers version")
@pytest.mark.parametrize("mt", ["llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe",
                                "gemma2", "gemma3_text", "gpt_neox"])
@pytest.mark.parametrize("keys", [{}, {"attention_bias": True}, {"mlp_bias": True},
                                  {"attention_bias": False, "mlp_bias": False}, {"qkv_bias": False},
                                  {"num_key_value_heads": 1, "head_dim": 8}])
def test_parameters_are_those_transformers_builds(mt: str, keys: dict[str, object]) -> None:
    """Bias keys (and GPT-NeoX's head keys) count only where the model type's module reads them: Mistral with
    attention_bias true was priced with biases its module does not build, GPT-NeoX with GQA it does not have."""
    import torch

    cfg = {"model_type": mt, **_BIAS_SIZES, **keys}
    if mt in ("qwen2_moe", "qwen3_moe"):
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    if mt == "mixtral":
        cfg.update(num_local_experts=4, num_experts_per_tok=2)
    if mt in ("gemma2", "gemma3_text"):
        cfg.update(sliding_window=16)
    spec = parse_config(dict(cfg))
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    assert spec.param_count() == sum(p.numel() for p in model.parameters())
    unread = [k for k in ("attention_bias", "mlp_bias", "qkv_bias") if k in keys]
    noted = any("does not read" in n and "biases" in n for n in config_notes(cfg))
    assert noted == (any(k in unread_bias_keys(cfg, mt, spec.family) for k in unread))


def test_rope_types_are_transformers_own() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_TYPES) == {"default", *ROPE_INIT_FUNCTIONS}


@pytest.mark.parametrize(("change", "said"), [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "host sync"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "host sync"),
    ({"rope_scaling": {"rope_type": "bogus"}}, "not a type transformers knows"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "partial_rotary_factor": 0.5}, "cannot build"),
    ({"pad_token_id": 128256}, "outside the 128256-word vocabulary"),
])
def test_native_rope_and_padding_as_transformers_builds_them(change: dict[str, object], said: str) -> None:
    """What transformers' Llama cannot build, or runs with host work the native copy lacks, is refused (each was
    predicted as the default rotary embedding); rope_scaling replaces rope_parameters, and a negative pad counts
    from the end, as nn.Embedding takes it."""
    base = json.loads((ROOT / "examples" / "llama3.1-8b.json").read_text())
    with pytest.raises(ConfigError, match=said):
        parse_config({**base, **change})
    both = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    obj = transformers.AutoConfig.for_model(**{k: v for k, v in both.items() if k != "architectures"})
    assert parse_config(both).rope_type == obj.rope_parameters["rope_type"] == "linear"
    assert parse_config({**base, "pad_token_id": -1}).pad_token_id == base["vocab_size"] - 1


def test_sizes_left_to_the_class_divide_under_tp() -> None:
    """The Hub's Gemma-3 text_config leaves out vocab_size and the head counts: under TP each rank was built with
    the whole vocabulary and every head (Gemma-3-4B at TP=4: 77% more peak memory than the same sizes written
    out). A rank's config now matches the one the fully stated file gives."""
    pytest.importorskip("torch")
    from tp_query.engine.trace.hf_models import hf_config_for
    from tp_query.engine.trace.models import Shard

    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "sliding_window": 1024}}
    stated = json.loads((ROOT / "examples" / "gemma3-4b.json").read_text())
    keys = ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    for tp in (2, 4):
        a, b = (hf_config_for(parse_config(c).with_layers(2), Shard(tp=tp)) for c in (hub, stated))
        assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}
        assert a.vocab_size == 262208 // tp


def test_mistral3_wrapper_reads_its_language_model() -> None:
    """Mistral-Small-3.1 as published is Mistral3ForConditionalGeneration (it was refused as unsupported): its
    language model is predicted, with the wrapper's tie, and counts what transformers builds without the vision
    tower."""
    import torch

    text = {"head_dim": 32, "hidden_size": 256, "intermediate_size": 512, "model_type": "mistral",
            "num_attention_heads": 8, "num_hidden_layers": 2, "num_key_value_heads": 2, "sliding_window": None,
            "vocab_size": 4096}
    hub = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "text_config": text,
           "vision_config": {"model_type": "pixtral", "hidden_size": 64, "intermediate_size": 128,
                             "num_attention_heads": 2, "num_hidden_layers": 1, "head_dim": 32}}
    spec = parse_config(hub)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hub.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.Mistral3ForConditionalGeneration(cfg)
    language = sum(p.numel() for n, p in model.named_parameters() if "vision" not in n and "projector" not in n)
    assert spec.model_type == "mistral" and spec.param_count() == language
    assert any("vision tower" in n for n in config_notes(hub))
    with pytest.raises(ConfigError, match="Mistral3ForConditionalGeneration follows"):
        parse_config({**hub, "text_config": {**text, "tie_word_embeddings": False}})


def test_layers_transformers_derives_are_refused_for_what_they_are() -> None:
    """Qwen3-Next derives its linear-attention layers itself (every fourth full): the parser reads them as its config
    class does, and transformers builds them so. Jamba derives recurrent (Mamba) layers: the refusal says so (it had
    asked for a layer_types list, and a config with one was then refused for the layer kind); multi-token-prediction
    layers are named."""
    from tp_query.engine.trace.hf_models import check_layer_kinds, gated_delta_fallback

    cfg = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 8, "intermediate_size": 512,
           "vocab_size": 1000, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
           "shared_expert_intermediate_size": 64}
    assert parse_config(cfg).layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
    assert parse_config({**cfg, "full_attention_interval": 2}).layer_types == \
        ("linear_attention", "full_attention") * 4
    if gated_delta_fallback("qwen3_next"):
        check_layer_kinds(parse_config(cfg))
    jamba = {"model_type": "jamba", "architectures": ["JambaForCausalLM"], "hidden_size": 256,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 512,
             "vocab_size": 1000, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
             "expert_layer_offset": 1, "num_experts": 2, "pad_token_id": 0}
    with pytest.raises(ConfigError, match="layers of kind"):
        check_layer_kinds(parse_config(jamba))
    notes = config_notes({"model_type": "deepseek_v3", "num_hidden_layers": 4, "num_nextn_predict_layers": 1})
    assert any("multi-token-prediction" in n for n in notes)


_NULL_HEAD_DIM_PROBES = ["llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma2",
                         "gemma3_text"]


def _tiny(mt: str, **extra: object) -> dict:
    cfg = {"model_type": mt, **_SIZES, "num_hidden_layers": 1, **extra}
    if mt in ("qwen2_moe", "qwen3_moe"):
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256)
    if mt == "mixtral":
        cfg.update(num_local_experts=4, num_experts_per_tok=2)
    return cfg


@pytest.mark.skipif(not SAME_VERSION, reason="the list was read from another transformers version")
@pytest.mark.parametrize("mt", _NULL_HEAD_DIM_PROBES)
def test_null_head_dim_types_are_those_transformers_sizes_from_hidden(mt: str) -> None:
    """A null head_dim is stated as hidden / heads exactly for the types whose modules build it so (their own
    to_dict() writes the null for Mistral and Mixtral); the others cannot build it and keep it."""
    import torch

    try:
        obj = transformers.AutoConfig.for_model(**_tiny(mt, head_dim=None))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(obj)
        attn = next(m for n, m in model.named_modules() if n.endswith("self_attn"))
        built = attn.head_dim
    except Exception:  # (a None in the module's arithmetic, or the config class's own validation)
        built = None
    assert (built == _SIZES["hidden_size"] // _SIZES["num_attention_heads"]) == (mt in NULL_HEAD_DIM_TYPES)


@pytest.mark.parametrize("mt", sorted(NULL_HEAD_DIM_TYPES))
def test_null_head_dim_keeps_the_head_size_under_tp(mt: str) -> None:
    """Mixtral's or a windowed Mistral's config with "head_dim": null at TP=2 was traced with each rank's q/o
    projections whole (the head size taken from the divided head count): +16% at TP 4 on a Mixtral slice."""
    from tp_query.engine.trace.hf_models import hf_config_for
    from tp_query.engine.trace.models import Shard

    extra = {"sliding_window": 64} if mt == "mistral" else {}
    with_null, without = parse_config(_tiny(mt, head_dim=None, **extra)), parse_config(_tiny(mt, **extra))
    assert with_null.head_dim == without.head_dim == _SIZES["hidden_size"] // _SIZES["num_attention_heads"]
    if with_null.builder.value == "native":  # Llama without a window: transformers is not handed the config
        return
    rank = hf_config_for(with_null, Shard(tp=2))
    assert rank.num_attention_heads == _SIZES["num_attention_heads"] // 2
    assert rank.head_dim == without.head_dim


def _tiny_longrope(**extra: object) -> dict:
    """A Phi-4-mini-like config at test size: longrope over the rotated 3/4 of each 32-wide head (12 factors)."""
    rot = 12
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 128, "intermediate_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512,
            "pad_token_id": 0, "max_position_embeddings": 256, "original_max_position_embeddings": 32,
            "partial_rotary_factor": 0.75,
            "rope_scaling": {"type": "longrope", "long_factor": [1.0 + i / 8 for i in range(rot)],
                             "short_factor": [1.0 + i / 32 for i in range(rot)]}, **extra}


def _tiny_phimoe_longrope(**extra: object) -> dict:
    """Phi-3.5-MoE's layout at test size: longrope over 32-wide heads (16 factors) with its long and short mscale."""
    return {"architectures": ["PhimoeForCausalLM"], "model_type": "phimoe", "hidden_size": 128,
            "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "vocab_size": 512, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 256,
            "original_max_position_embeddings": 32, "sliding_window": 256,
            "rope_scaling": {"type": "longrope", "long_factor": [1.0 + i / 8 for i in range(16)],
                             "short_factor": [1.0 + i / 32 for i in range(16)], "long_mscale": 1.25,
                             "short_mscale": 1.0}, **extra}


@pytest.mark.parametrize("tiny", [_tiny_longrope, _tiny_phimoe_longrope])
@pytest.mark.parametrize("seq", [16, 48])
def test_longrope_update_is_transformers_own(seq: int, tiny: Any) -> None:
    """The trace's longrope step (its short or long factors chosen by the step's positions; Phi-3.5-MoE's own
    forward choosing its mscale the same way) computes what transformers' own does on real tensors, below and beyond
    original_max_position_embeddings."""
    import torch
    from tp_query.engine.trace.hf_models import _patch_longrope

    def rotary() -> torch.nn.Module:
        torch.manual_seed(0)
        with torch.device("cpu"):
            m = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
                **{k: v for k, v in tiny().items() if k != "architectures"}))
        return next(mod for mod in m.modules() if hasattr(mod, "rope_type"))

    x = torch.randn(1, seq, 128)
    pos = torch.arange(seq)[None]
    own, ours = rotary(), rotary()
    _patch_longrope(ours)
    assert "forward" in vars(ours) and "forward" not in vars(own)
    for _ in range(2):  # (the long factors are cached after the first step)
        want, got = own(x, pos), ours(x, pos)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        assert torch.equal(own.inv_freq, ours.inv_freq)


def test_longrope_is_traced_with_its_host_sync() -> None:
    """Phi-3/Phi-4-mini's longrope was refused: Phi-4-mini for a partial rotary factor its module does slice, and
    every longrope config by the trace (`if max(positions) + 1 > original_max_position_embeddings` cannot be
    decided on fake tensors). It is now traced with the step's max, comparison and host synchronisation."""
    pytest.importorskip("torch")
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.schema.precision import Setting

    def syncs(cfg: dict, seq: int) -> int:
        g = trace_config(TraceRequest(parse_config(cfg), Setting.BF16, 1, seq, 1, False, False, "adamw"))
        embed = [o.op for o in g.ops if o.section.value == "embed" and o.phase.value == "fwd"]
        return embed.count("aten._local_scalar_dense.default")

    # Phi-3: longrope's update (one sync) beside the packed-sequence check; Phi-3.5-MoE: its forward's two more
    for tiny, more in ((_tiny_longrope, 1), (_tiny_phimoe_longrope, 3)):
        plain = {k: v for k, v in tiny().items() if k not in ("rope_scaling", "partial_rotary_factor")}
        assert parse_config(tiny()).rope_type == "longrope"
        for seq in (16, 64):
            assert syncs(tiny(), seq) == syncs(plain, seq) + more
    with pytest.raises(ConfigError, match="dynamic"):
        parse_config({**_tiny_longrope(), "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
                      "partial_rotary_factor": 1.0})


_LAGUNA = {"model_type": "laguna", "architectures": ["LagunaForCausalLM"], "vocab_size": 512, "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "num_experts": 4,
           "num_experts_per_tok": 2, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
           "layer_types": ["full_attention"] * 4}


def test_laguna_heads_per_layer_as_its_class_writes_them() -> None:
    """Laguna's class writes `num_attention_heads_per_layer` (one entry per layer) into every saved config: the
    trace's cut kept the whole model's list, and transformers refused it, so every saved Laguna config was refused.
    One count for every layer is now cut with the layers and divided under TP; different counts are refused."""
    pytest.importorskip("torch")
    from tp_query.engine.trace.hf_models import hf_config_for
    from tp_query.engine.trace.models import Shard

    saved = {**_LAGUNA, "num_attention_heads_per_layer": [4] * 4}
    spec, plain = parse_config(saved), parse_config(_LAGUNA)
    for tp in (1, 2):
        rank = hf_config_for(spec.with_layers(2), Shard(tp=tp))
        assert rank.num_attention_heads_per_layer == [4 // tp] * rank.num_hidden_layers
        assert rank.num_attention_heads_per_layer == hf_config_for(plain.with_layers(2), Shard(tp=tp)).num_attention_heads_per_layer
    with pytest.raises(ConfigError, match="different head counts"):
        parse_config({**_LAGUNA, "num_attention_heads_per_layer": [4, 4, 8, 8]})
    with pytest.raises(ConfigError, match="one positive integer per layer"):
        parse_config({**_LAGUNA, "num_attention_heads_per_layer": [4, 4]})


@pytest.mark.skipif(not SAME_VERSION, reason="the shipped table was written from another transformers version")
def test_a_default_under_an_alias_is_the_setting_under_both_names() -> None:
    """CodeGen's class fields are n_embd and n_head (hidden_size and num_attention_heads are its attribute_map's
    names): a config leaving them to the class was refused as "missing hidden_size", while the one transformers
    saves (which states them) predicted."""
    saved = {k: v for k, v in transformers.AutoConfig.for_model("codegen").to_dict().items() if not k.startswith("_")}
    minimal = {"model_type": "codegen", "architectures": ["CodeGenForCausalLM"], "n_layer": 2}
    a, b = parse_config({**saved, **minimal}), parse_config(minimal)
    assert (a.hidden_size, a.num_heads, a.vocab_size) == (b.hidden_size, b.num_heads, b.vocab_size) == (
        saved["n_embd"], saved["n_head"], saved["vocab_size"])


def test_llama4_routed_experts_read_with_the_class_defaults() -> None:
    """Llama-4's experts run densely over router-zeroed rows (priced with those operands): a config leaving
    num_local_experts or intermediate_size to the class (16 and 8192) was priced with ordinary operands, +1.6%
    on a 2-layer Scout cut against the same model stated in full."""
    from tp_query.engine.compose import dense_routed_experts

    full = {"model_type": "llama4_text", "num_local_experts": 16, "num_experts_per_tok": 1, "intermediate_size": 8192}
    for hf in (full, {"model_type": "llama4_text"}):
        assert dense_routed_experts({"model_type": "llama4_text", "hidden_size": 5120,
                                     "hf_config": json.dumps(hf)}) == (16, 5120, 8192)


@pytest.mark.skipif(not SAME_VERSION, reason="the defaults were read from another transformers version")
@pytest.mark.parametrize("mt", ["axk1", "glm4_moe_lite", "hy_v3", "mimo_v2_flash"])
def test_dense_first_layers_left_to_the_class(mt: str) -> None:
    """Classes that make the first layer dense unless told otherwise (AXK1's first_k_dense_replace default 1; GLM-4.7
    Flash's, HY-V3's and MiMo-V2-Flash's derived mlp_layer_types): a config leaving it out was read as all sparse and
    refused by the trace's check, while the one transformers saves predicted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    obj = transformers.AutoConfig.for_model(mt, num_hidden_layers=4)
    k = getattr(obj, "first_k_dense_replace", None)
    want = tuple(obj.mlp_layer_types) if getattr(obj, "mlp_layer_types", None) else ("dense",) * k + ("sparse",) * (4 - k)
    spec = parse_config({"model_type": mt, "architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt]],
                         "num_hidden_layers": 4})
    assert spec.mlp_layer_types == want


_CLASS_WINDOWED = ["gpt_oss", "cohere2", "cohere2_moe", "exaone4", "exaone_moe", "afmoe", "cwm", "olmo3", "vaultgemma",
                   "gemma4_text", "granite_swa", "granitemoe_swa"]


@pytest.mark.skipif(not SAME_VERSION, reason="the defaults were read from another transformers version")
@pytest.mark.parametrize("mt", _CLASS_WINDOWED)
def test_sliding_layers_left_to_the_class(mt: str) -> None:
    """A transformers-only type whose class slides some layers by default (GPT-OSS every other one, OLMo-3 three in
    four, ...): a config stating neither a window nor layer_types was read as all full and refused by the trace's
    check, while the config transformers saves predicted. Its class's window and derived layers are now read."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    obj = transformers.AutoConfig.for_model(mt, num_hidden_layers=4)
    spec = parse_config({"model_type": mt, "architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt]],
                         "num_hidden_layers": 4})
    assert spec.layer_types == tuple(obj.layer_types)
    assert spec.sliding_window == obj.sliding_window


@pytest.mark.skipif(not SAME_VERSION, reason="the defaults were read from another transformers version")
def test_class_windowed_config_predicts_as_saved() -> None:
    """OLMo-3 left to its class and as transformers saves it (window and layer list stated): the same step."""
    from tp_query.engine.api import predict

    saved = {k: v for k, v in transformers.AutoConfig.for_model("olmo3", num_hidden_layers=2).to_dict().items()
             if not k.startswith("_")}
    base = {"model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "num_hidden_layers": 2}
    a, b = predict({**saved, **base}, seq_len=512), predict(base, seq_len=512)
    assert a.iteration_ms == b.iteration_ms and a.memory == b.memory
