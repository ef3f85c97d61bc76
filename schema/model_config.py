"""Model descriptions the engine accepts: a HuggingFace config.json, parsed without torch.

Every supported family is one entry of `FAMILIES` (the spec registry): its architectures and
model_type spellings, how its config reads into a `ModelSpec` (attention: GQA, qk-norm, sliding
windows and their per-layer alternation; MLP: gated, fused, or a routed mixture of experts with
shared experts), and which graph builder runs it: our own op-for-op copies for Llama and GPT-2
(`native`), transformers' own modules for the others (`hf`). The training graph is what
transformers 5.17 runs with SDPA (DeepSeek's multi-head latent attention included). Anything else is refused
with a clear message; a user can still `tp-query trace` their module.
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from .messages import TpQueryError, first_line


class ConfigError(TpQueryError):
    """A model file that cannot be used; the message is one line for the user."""


class ArchFamily(StrEnum):
    LLAMA = "llama"  # Llama, Mistral and Qwen2 without sliding windows: the native builder
    GPT2 = "gpt2"
    MISTRAL = "mistral"  # with its sliding window in force
    QWEN2 = "qwen2"  # with sliding-window layers in force
    QWEN3 = "qwen3"
    GEMMA2 = "gemma2"
    GEMMA3 = "gemma3"
    PHI3 = "phi3"
    GPT_NEOX = "gpt_neox"
    MIXTRAL = "mixtral"
    QWEN2_MOE = "qwen2_moe"
    QWEN3_MOE = "qwen3_moe"
    # any other decoder-only causal LM of transformers, built from its own module as the config gives it; tensor
    # parallelism where the divided config's parameters come out as a Megatron split (checked at trace time),
    # sequence parallelism refused
    TRANSFORMERS = "transformers"


# Model types known only to transformers (ArchFamily.TRANSFORMERS) with held-out runs of their own on the H200
# (collector/validate.py GENERIC_CASES and BF16_ONLY_CASES; tests/test_trace_generic.py keeps the two in step)
VALIDATED_MODEL_TYPES = frozenset({"olmo2", "granite", "gemma", "gpt_oss", "starcoder2", "smollm3", "glm4_moe", "dots1",
                                   "olmoe", "deepseek_v2", "deepseek_v3", "llama4_text", "glm4", "exaone4",
                                   "seed_oss", "apertus", "arcee", "ernie4_5", "cohere2", "falcon", "olmo3", "phi",
                                   "stablelm", "ministral3", "granitemoe", "exaone_moe", "helium", "phimoe",
                                   "gemma4_text", "afmoe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
                                   "olmo_hybrid"})


class Builder(StrEnum):
    NATIVE = "native"  # engine/trace/models.py: our op-for-op copies (shardable in every way)
    HF = "hf"  # engine/trace/hf_models.py: transformers' own modules, sharded through their config


ARCHITECTURES: dict[str, tuple[ArchFamily, str]] = {
    "LlamaForCausalLM": (ArchFamily.LLAMA, "llama"),
    "MistralForCausalLM": (ArchFamily.LLAMA, "mistral"),
    "Qwen2ForCausalLM": (ArchFamily.LLAMA, "qwen2"),
    "GPT2LMHeadModel": (ArchFamily.GPT2, "gpt2"),
    "Qwen3ForCausalLM": (ArchFamily.QWEN3, "qwen3"),
    "Gemma2ForCausalLM": (ArchFamily.GEMMA2, "gemma2"),
    "Gemma3ForCausalLM": (ArchFamily.GEMMA3, "gemma3_text"),
    "Gemma3ForConditionalGeneration": (ArchFamily.GEMMA3, "gemma3"),
    "Phi3ForCausalLM": (ArchFamily.PHI3, "phi3"),
    "GPTNeoXForCausalLM": (ArchFamily.GPT_NEOX, "gpt_neox"),
    "MixtralForCausalLM": (ArchFamily.MIXTRAL, "mixtral"),
    "Qwen2MoeForCausalLM": (ArchFamily.QWEN2_MOE, "qwen2_moe"),
    "Qwen3MoeForCausalLM": (ArchFamily.QWEN3_MOE, "qwen3_moe"),
}
MODEL_TYPES: dict[str, tuple[ArchFamily, str]] = {v[1]: v for v in ARCHITECTURES.values()}
# Known and refused, with the reason (the generic message names what is supported).
REFUSED: dict[str, str] = {}

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
LINEAR_ATTENTION = "linear_attention"  # the gated delta rule where transformers runs its torch fallback
# layer kinds under their legacy names, as transformers 5.17's configs rename them (configuration_utils.py
# _LEGACY_LAYER_TYPE_REMAP: Hub checkpoints that list "mamba" / "attention" load as the current kinds)
LEGACY_LAYER_TYPES = {"conv": LINEAR_ATTENTION, "mamba": LINEAR_ATTENTION, "attention": "full_attention"}


def layer_kinds_of(n: int, layer_types: Any, mlp_layer_types: Any, rope_layers: Any) -> list[str]:
    """What each layer's operators depend on: its attention type, its MLP kind, and RoPE or none (a spec's fields,
    or the same fields of a graph's model dict; empty sequences: every layer alike)."""
    return [_layer_kind(i, layer_types, mlp_layer_types, rope_layers) for i in range(n)]


def _layer_kind(i: int, layer_types: Any, mlp_layer_types: Any, rope_layers: Any) -> str:
    k = layer_types[i] if layer_types else FULL
    if mlp_layer_types:
        k += f"|mlp={mlp_layer_types[i]}"
    if rope_layers and not rope_layers[i]:
        k += "|nope"
    return str(k)


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts a training graph depends on (all sizes are the full, unsharded model)."""

    name: str
    family: ArchFamily
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_type: str = "default"
    sliding_window: int | None = None
    attention_dropout: float = 0.0
    resid_dropout: float = 0.0
    embd_dropout: float = 0.0
    pad_token_id: int | None = None
    builder: Builder = Builder.NATIVE
    # attention type of every layer (FULL / SLIDING); empty: all full
    layer_types: tuple[str, ...] = ()
    qk_norm: bool = False
    gated_mlp: bool = True
    # mixture of experts: routed experts per layer, chosen per token, each expert's FFN, shared experts' FFN
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # the config transformers builds the module from (builder HF), canonical JSON
    hf_config: str = ""
    # layers that differ along the depth in more than attention type (model types known only to transformers):
    # each layer's MLP kind in transformers' spelling ("dense" / "sparse"), and whether it applies rotary
    # embeddings (SmolLM3's NoPE layers); empty: every layer alike
    mlp_layer_types: tuple[str, ...] = ()
    rope_layers: tuple[bool, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        d["family"] = ArchFamily(d["family"])
        d["builder"] = Builder(d.get("builder", Builder.NATIVE))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["mlp_layer_types"] = tuple(d.get("mlp_layer_types", ()))
        d["rope_layers"] = tuple(bool(x) for x in d.get("rope_layers", ()))
        return ModelSpec(**d)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def split_refusal(self, tp: int, sequence_parallel: bool) -> str:
        """Why this model cannot run under tensor parallelism `tp` (with SP), or "" when it can."""
        if tp <= 1:
            return ""
        # what no TP degree can run first: the divisibility of one degree would only send the user to another
        if LINEAR_ATTENTION in self.layer_types:
            return (f"TP>1 with {self.model_type}'s linear-attention layers is not modelled (how their heads, "
                    "convolution and recurrent state split over ranks is not traced; DP, ZeRO/FSDP and PP are fine)")
        if self.family == ArchFamily.GPT_NEOX:
            return ("TP>1 is not modelled for GPT-NeoX (its attention derives the head size from hidden_size / "
                    "heads, so a per-rank module cannot be built from a divided config)")
        for what, n in (("attention heads", self.num_heads), ("KV heads", self.num_kv_heads),
                        ("FFN size", self.intermediate_size), ("vocab size", self.vocab_size),
                        ("expert FFN size", self.moe_intermediate_size),
                        ("shared expert FFN size", self.shared_expert_intermediate_size)):
            if n and n % tp:
                hint = " (pad vocab_size to a multiple of TP, as Megatron-LM does)" if what == "vocab size" else ""
                return f"TP={tp} does not divide the {what} ({n}){hint}"
        if self.family == ArchFamily.TRANSFORMERS and sequence_parallel:
            return (f"sequence parallelism is modelled for the listed families only: where {self.model_type}'s "
                    f"layers leave the sequence whole is not known (TP without SP, DP, ZeRO/FSDP and PP are fine)")
        if sequence_parallel and self.builder == Builder.HF and self.layer_types:
            return f"sequence parallelism with {self.family}'s sliding-window layers is not modelled"
        return ""

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else FULL

    def layer_kind(self, i: int) -> str:
        return _layer_kind(i, self.layer_types, self.mlp_layer_types, self.rope_layers)

    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(layer_kinds_of(self.num_layers, self.layer_types, self.mlp_layer_types, self.rope_layers))

    def cut(self, indices: tuple[int, ...] | range) -> ModelSpec:
        """The model of the given layers of this one, in order (a trace's cut)."""
        idx = tuple(indices)

        def pick(xs: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(xs[i] for i in idx) if xs else ()

        return replace(self, num_layers=len(idx), layer_types=pick(self.layer_types),
                       mlp_layer_types=pick(self.mlp_layer_types), rope_layers=pick(self.rope_layers))

    def with_layers(self, n: int) -> ModelSpec:
        return self.cut(range(n))

    def traced_layer_indices(self) -> tuple[int, ...]:
        """The layers a trace runs: a leading layer, then the first layer of each kind in order of first
        appearance (each later traced layer is the template of its kind)."""
        first: dict[str, int] = {}
        for i, k in enumerate(self.layer_kinds()):
            first.setdefault(k, i)
        return (0, *first.values())

    def traced_layer_types(self) -> tuple[str, ...]:
        return tuple(self.layer_type(i) for i in self.traced_layer_indices())

    def layer_type_fractions(self) -> dict[str, float]:
        n = self.num_layers
        out: dict[str, float] = {}
        for i in range(n):
            out[self.layer_type(i)] = out.get(self.layer_type(i), 0.0) + 1.0 / n
        return out

    def param_count(self) -> int:
        """Parameters of the full model (tied embeddings counted once)."""
        return parameter_count(self.to_dict()) or 0


def _need(cfg: dict[str, Any], *keys: str, default: Any = ...) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    if default is ...:
        raise ConfigError(f"config is missing {' / '.join(keys)}")
    return default


# Upper bounds of what any real model has (with ample room): a bigger value is a typo or hostile input,
# and would make the tracer allocate or loop without end.
DIM_LIMITS: dict[str, int] = {
    "hidden_size": 1 << 17, "n_embd": 1 << 17, "num_attention_heads": 4096, "n_head": 4096,
    "num_key_value_heads": 4096, "head_dim": 4096, "num_hidden_layers": 1024, "n_layer": 1024,
    "vocab_size": 1 << 23, "intermediate_size": 1 << 20, "n_inner": 1 << 20,
    "max_position_embeddings": 1 << 24, "n_positions": 1 << 24, "sliding_window": 1 << 24,
}
MAX_CONFIG_BYTES = 16 << 20  # a config.json is kilobytes; graph files from `tp-query trace` a few MB
MAX_GRAPH_BYTES = 512 << 20  # after decompression


def _pos_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    limit = DIM_LIMITS.get(name)
    if limit is not None and v > limit:
        raise ConfigError(f"{name} {v} is beyond any real model (at most {limit})")
    return v


def _nonneg_float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0 or v != v or v == float("inf"):
        raise ConfigError(f"{name} must be a finite non-negative number, got {v!r}")
    return float(v)


def _bool(name: str, v: Any, default: bool) -> bool:
    """JSON booleans only: the string "false" is not false."""
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{name} must be true or false, got {v!r}")
    return v


# transformers 5.17's rotary types (modeling_rope_utils.ROPE_INIT_FUNCTIONS and "default"; a test holds them equal)
ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "longrope", "proportional", "yarn")


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE parameters transformers reads: rope_scaling, when given, replaces rope_parameters."""
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg.get(key), dict):
            raise ConfigError(f"{key} must be an object or null, got {cfg.get(key)!r}"[:160])
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or None


def rope_scaling_factor(cfg: dict[str, Any]) -> float | None:
    """The config's RoPE scaling factor (rope_scaling.factor, as transformers reads it), or None."""
    f = (_rope_params(cfg) or {}).get("factor")
    return float(f) if isinstance(f, int | float) and not isinstance(f, bool) else None


def _rope(cfg: dict[str, Any]) -> tuple[float, str]:
    """RoPE's base and type as transformers reads them."""
    params = _rope_params(cfg)
    if params is None:
        return _nonneg_float("rope_theta", cfg.get("rope_theta", 10000.0)), "default"
    if "factor" in params:
        f = params["factor"]
        if isinstance(f, bool) or not isinstance(f, int | float) or not math.isfinite(f) or f <= 0:
            raise ConfigError(f"rope_scaling.factor must be a positive number, got {f!r}"[:160])
    rtype = str(params.get("rope_type", params.get("type", "default")))
    if rtype not in ROPE_TYPES:
        raise ConfigError(f"rope_type {rtype[:40]!r} is not a type transformers knows ({', '.join(ROPE_TYPES)})")
    return _nonneg_float("rope_theta", params.get("rope_theta", cfg.get("rope_theta", 10000.0))), rtype


def _factor_below_one(cfg: dict[str, Any]) -> bool:
    f = (_rope_params(cfg) or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return isinstance(f, int | float) and not isinstance(f, bool) and f < 1


# Which bias keys each model type's transformers 5.17 modules read (modeling_<type>.py: attention_bias on the q, k, v
# and o projections, mlp_bias on the MLP); the others fix their biases (Qwen2 on q, k and v only; GPT-NeoX's MLP
# always; Mistral, Mixtral and Phi-3 none). A model type known only to transformers is counted from its graph.
_ATTENTION_BIAS_TYPES = frozenset({"llama", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "gpt_neox"})
_MLP_BIAS_TYPES = frozenset({"llama"})


def _biases(cfg: dict[str, Any], model_type: str, family: ArchFamily) -> tuple[bool, bool, bool]:
    """(q/k/v, output projection, MLP) biases as the model type's module builds them (a model type known only to
    transformers: as its keys say; its own module decides, and its graph is counted)."""
    if model_type == "qwen2":
        return True, False, False
    if model_type == "qwen2_moe":
        return _bool("qkv_bias", cfg.get("qkv_bias"), True), False, False
    generic, neox = family == ArchFamily.TRANSFORMERS, family == ArchFamily.GPT_NEOX
    attn = _bool("attention_bias", cfg.get("attention_bias"), neox) if (
        generic or model_type in _ATTENTION_BIAS_TYPES) else False
    mlp = _bool("mlp_bias", cfg.get("mlp_bias"), False) if (generic or model_type in _MLP_BIAS_TYPES) else neox
    return attn, attn, mlp


def unread_bias_keys(cfg: dict[str, Any], model_type: str, family: ArchFamily) -> list[str]:
    """Bias keys a config states, that its model type's module does not read, with a value other than what the
    module builds (config_notes names them)."""
    if family == ArchFamily.TRANSFORMERS:
        return []
    qkv, o, mlp = _biases(cfg, model_type, family)
    asked = {"attention_bias": ((qkv, o), _ATTENTION_BIAS_TYPES), "mlp_bias": ((mlp,), _MLP_BIAS_TYPES),
             "qkv_bias": ((qkv,), frozenset({"qwen2_moe"}))}
    return [k for k, (built, types) in asked.items()
            if isinstance(cfg.get(k), bool) and model_type not in types and any(b != cfg[k] for b in built)]


def _padding_idx(pad: Any, vocab: int, family: ArchFamily) -> int | None:
    """Embedding's padding_idx as nn.Embedding takes it (a negative one counts from the end); one outside the
    vocabulary is refused, as transformers cannot build the embedding."""
    if not isinstance(pad, int) or isinstance(pad, bool):
        return None
    if not -vocab <= pad < vocab:
        if family == ArchFamily.TRANSFORMERS:
            return None  # its own module decides (and the trace says so)
        raise ConfigError(f"pad_token_id {pad} lies outside the {vocab}-word vocabulary: transformers cannot build "
                          "its embedding (Padding_idx must be within num_embeddings)")
    return pad % vocab


def identify(cfg: dict[str, Any]) -> tuple[ArchFamily, str]:
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ConfigError("architectures must be a list of strings")
    if archs is not None and len(set(archs)) > 1:  # transformers builds the first; the file names several models
        raise ConfigError(f"architectures names {len(set(archs))} models ({', '.join(archs[:3])}): keep the one "
                          "to predict")
    mt = cfg.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise ConfigError(f"model_type must be a string, got {mt!r}"[:160])
    for key in [*(archs or []), mt if isinstance(mt, str) else ""]:
        if key in REFUSED:
            raise ConfigError(f"{key}: {REFUSED[key]}; for such models use `tp-query trace`")
    for a in archs or []:
        if a in ARCHITECTURES:
            fam, own = ARCHITECTURES[a]
            if isinstance(mt, str) and mt and mt != own:
                # AutoModelForCausalLM builds by model_type and never reads `architectures`: a file that names two
                # different models (even of one family here: Mistral's window, Qwen2's biases) is refused, not read
                # as the one the user may not get
                raise ConfigError(f"architectures names {a} (model_type {own!r}) but model_type is {mt!r} "
                                  f"(transformers' AutoModelForCausalLM builds by model_type): correct one of them")
            return fam, own
    if isinstance(mt, str) and mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    what = ", ".join(archs) if archs else (mt if isinstance(mt, str) else "nothing")
    if isinstance(mt, str) and mt and all(a.endswith("ForCausalLM") for a in archs or []):
        # a decoder-only model transformers knows by its model_type (checked when it is built); a config
        # without `architectures` (as a config class's to_dict() writes it) is taken by its model_type
        return ArchFamily.TRANSFORMERS, mt
    supported = ", ".join([*ARCHITECTURES, *WRAPPER_ARCHITECTURES])
    raise ConfigError(f"unsupported architecture ({what}); supported: {supported}, or any other decoder-only "
                      "*ForCausalLM of transformers with its model_type; for other models use `tp-query trace`")


def _parse_gpt2(cfg: dict[str, Any], name: str, family: ArchFamily, model_type: str) -> ModelSpec:
    cfg, _ = with_class_defaults(cfg, model_type)
    h = _pos_int("n_embd", _need(cfg, "n_embd", "hidden_size"))
    heads = _pos_int("n_head", _need(cfg, "n_head", "num_attention_heads"))
    if h % heads:
        raise ConfigError(f"n_embd {h} is not divisible by n_head {heads}")
    inner = cfg.get("n_inner")
    act = _need(cfg, "activation_function", default="gelu_new")
    if act not in GPT2_ACTS:
        raise ConfigError(f"activation_function {str(act)[:40]!r} is not modelled for GPT-2 (modelled: "
                          f"{', '.join(GPT2_ACTS)})")
    if cfg.get("add_cross_attention"):
        raise ConfigError("add_cross_attention true gives every GPT-2 block an encoder cross-attention (parameters, "
                          "gradients and optimizer state that a decoder-only step leaves unused) and is not "
                          "modelled: drop it or set it to false")
    return ModelSpec(
        name=name, family=family, model_type=model_type,
        vocab_size=_pos_int("vocab_size", _need(cfg, "vocab_size")),
        hidden_size=h,
        num_layers=_pos_int("n_layer", _need(cfg, "n_layer", "num_hidden_layers")),
        num_heads=heads, num_kv_heads=heads, head_dim=h // heads,
        intermediate_size=_pos_int("n_inner", inner) if inner is not None else 4 * h,
        hidden_act=str(act),
        norm_eps=_nonneg_float("layer_norm_epsilon", _need(cfg, "layer_norm_epsilon", default=1e-5)),
        qkv_bias=True, o_bias=True, mlp_bias=True,
        tie_word_embeddings=_bool("tie_word_embeddings", cfg.get("tie_word_embeddings"), True),
        max_position_embeddings=_pos_int("n_positions", _need(cfg, "n_positions", "max_position_embeddings",
                                                              default=1024)),
        attention_dropout=_nonneg_float("attn_pdrop", cfg.get("attn_pdrop", 0.1)),
        resid_dropout=_nonneg_float("resid_pdrop", cfg.get("resid_pdrop", 0.1)),
        embd_dropout=_nonneg_float("embd_pdrop", cfg.get("embd_pdrop", 0.1)),
        gated_mlp=False,
    )


# Where a family differs from Llama: the config key(s) of the activation, its default, and tied embeddings by default
_ACT_KEYS = {ArchFamily.GEMMA2: ("hidden_activation", "hidden_act"), ArchFamily.GEMMA3: ("hidden_activation", "hidden_act")}
_ACT_DEFAULT = {ArchFamily.GEMMA2: "gelu_pytorch_tanh", ArchFamily.GEMMA3: "gelu_pytorch_tanh",
                ArchFamily.GPT_NEOX: "gelu"}
_TIED_DEFAULT = {ArchFamily.GEMMA2: True, ArchFamily.GEMMA3: True}
_ACTS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu", "gelu_new", "gelu_fast")
# what the native builder's copies apply (engine/trace/models.py keys its activations by these; a test holds them
# equal): another activation of the native families is refused, not a KeyError at trace time
NATIVE_LLAMA_ACTS = ("silu", "swish", "relu", "gelu", "gelu_pytorch_tanh", "gelu_new")
GPT2_ACTS = ("gelu_new", "gelu", "relu", "gelu_pytorch_tanh")


def _transformers_layer_types(cfg: dict[str, Any], model_type: str, n: int) -> tuple[str, ...] | None:
    """The layer kinds transformers' own config class derives for a model type known only to it, when the config
    states a window but no list (None where transformers is not installed or derives none). Only such configs pay
    for importing transformers here; every other reading needs no import."""
    try:
        from transformers import (
            AutoConfig,  # the [trace] extra: a transformers-only type is traced with it anyway
        )
    except ImportError:
        return None
    keep = {k: v for k, v in cfg.items() if k not in _HF_DROP and k != "model_type"}
    try:
        own = getattr(AutoConfig.for_model(model_type, **{**keep, "num_hidden_layers": n}), "layer_types", None)
    except Exception:  # its own refusal comes from the trace, with the reason
        return None
    if not (isinstance(own, list | tuple) and len(own) >= n and all(isinstance(x, str) and x for x in own[:n])):
        return None
    return tuple(own[:n])


def _class_window(cfg: dict[str, Any], model_type: str, n: int) -> int | None:
    """A transformers-only type's window when the config states neither a window nor layer_types: its class's default
    window where its class derives sliding layers from it (GPT-OSS every other layer, OLMo-3 and Cohere-2 three in
    four), else none (the list transformers derives is the one `_layer_types` then reads)."""
    w = hf_class_defaults()["model_types"].get(model_type, {}).get("sliding_window")
    if not (isinstance(w, int) and not isinstance(w, bool) and w > 0):
        return None
    derived = _transformers_layer_types({**cfg, "sliding_window": w}, model_type, n)
    return w if derived and SLIDING in derived else None


def _every_interval_full(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    """Qwen3-Next's and Qwen3.5's config classes: every `full_attention_interval`-th layer (default 4) full attention,
    the others linear."""
    every = cfg.get("full_attention_interval", 4)
    if isinstance(every, float) and every.is_integer():  # (2.0: the class takes it, and derives the same layers)
        every = int(every)
    every = _pos_int("full_attention_interval", every)
    return tuple(LINEAR_ATTENTION if (i + 1) % every else FULL for i in range(n))


def _olmo_hybrid_layers(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    """OLMo-Hybrid's config class: every fourth layer full attention, the last one where none is."""
    lt = [FULL if i % 4 == 3 else LINEAR_ATTENTION for i in range(n)]
    if FULL not in lt and lt:
        lt[-1] = FULL
    return tuple(lt)


# The model types whose config class derives linear-attention layers when the config lists none (transformers
# 5.17's configuration files; the trace checks the reading against the class itself)
LINEAR_PATTERNS: dict[str, Callable[[dict[str, Any], int], tuple[str, ...]]] = {
    "qwen3_next": _every_interval_full, "qwen3_5_text": _every_interval_full,
    "qwen3_5_moe_text": _every_interval_full, "olmo_hybrid": _olmo_hybrid_layers,
}


class WindowRule(StrEnum):
    """How a model type's transformers 5.17 modules decide which layers attend within the window (read from their
    modeling files): never (Llama and GPT-NeoX read no window key), every layer while a window is set (Mistral,
    Mixtral, Phi-3, Qwen3-MoE: a layer_types list is not read), or the config's layer_types (given, or derived by
    the config class: Qwen2, Qwen3, Qwen2-MoE, Gemma 2 and 3)."""
    NEVER = "never"
    EVERY = "every"
    LISTED = "listed"


WINDOW_RULES: dict[str, WindowRule] = {
    "llama": WindowRule.NEVER, "gpt_neox": WindowRule.NEVER,
    "mistral": WindowRule.EVERY, "mixtral": WindowRule.EVERY, "phi3": WindowRule.EVERY, "qwen3_moe": WindowRule.EVERY,
    "qwen2": WindowRule.LISTED, "qwen3": WindowRule.LISTED, "qwen2_moe": WindowRule.LISTED,
    "gemma2": WindowRule.LISTED, "gemma3_text": WindowRule.LISTED,
}


def _layer_types(cfg: dict[str, Any], family: ArchFamily, model_type: str, n: int, window: int | None
                 ) -> tuple[str, ...]:
    """Which layers attend within the sliding window, as transformers 5.17's configs and modules decide."""
    generic = family == ArchFamily.TRANSFORMERS
    rule = WINDOW_RULES.get(model_type)
    given = cfg.get("layer_types") if generic or rule == WindowRule.LISTED else None
    if given is not None:
        ok = (lambda x: isinstance(x, str) and bool(x)) if generic else (lambda x: x in (FULL, SLIDING))
        # exactly one per layer: transformers' validate_layer_type refuses any other length (a list left long
        # when num_hidden_layers was cut is the user's to cut too)
        if not (isinstance(given, list) and len(given) == n and all(ok(x) for x in given)):
            raise ConfigError(f"layer_types must list {n} of {FULL!r} / {SLIDING!r}, one per layer" +
                              (" (or the model type's own layer kinds)" if generic else "") +
                              (f", got {len(given)}" if isinstance(given, list) else ""))
        lt = tuple(str(LEGACY_LAYER_TYPES.get(x, x) if generic else x) for x in given[:n])
        if not generic and window is None and SLIDING in lt:
            raise ConfigError(f"{model_type}: layer_types lists sliding layers but no window is in force "
                              "(sliding_window null, or use_sliding_window false): give the window, or list full "
                              "layers only")
    elif generic and window is not None:
        # which layers a window applies to is the model type's own rule in transformers (Cohere2's every 4th layer
        # full, from its class's sliding_window_pattern); the trace checks the reading against it
        lt = _transformers_layer_types(cfg, model_type, n) or (SLIDING,) * n
    elif generic and model_type in LINEAR_PATTERNS and not isinstance(cfg.get("layer_types"), list):
        lt = LINEAR_PATTERNS[model_type](cfg, n)
    elif window is None:
        lt = (FULL,) * n
    elif family == ArchFamily.GEMMA2:
        lt = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    elif family == ArchFamily.GEMMA3:
        pattern = _pos_int("sliding_window_pattern", cfg.get("sliding_window_pattern", 6))
        lt = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
    elif model_type in ("qwen2", "qwen3"):
        first = _max_window_layers(cfg, n)
        lt = tuple(SLIDING if i >= first else FULL for i in range(n))
    elif model_type == "qwen2_moe":  # its config class: odd-numbered layers below max_window_layers
        last = _max_window_layers(cfg, n)
        lt = tuple(SLIDING if (i + 1) % 2 and i < last else FULL for i in range(n))
    else:  # Mistral, Mixtral, Phi-3, Qwen3-MoE: every layer
        lt = (SLIDING,) * n
    return () if all(x == FULL for x in lt) else lt


def _max_window_layers(cfg: dict[str, Any], n: int) -> int:
    first = cfg.get("max_window_layers", n)
    return first if isinstance(first, int) and not isinstance(first, bool) else n


def _parse_decoder(cfg: dict[str, Any], name: str, family: ArchFamily, model_type: str) -> ModelSpec:
    if model_type == "gemma3" and isinstance(cfg.get("text_config"), dict):  # the multimodal wrapper
        cfg, model_type = _unwrapped(cfg)[0], "gemma3_text"
    raw = cfg  # what transformers is handed: it applies its defaults itself
    cfg, _ = with_class_defaults(cfg, model_type, family)
    h = _pos_int("hidden_size", _need(cfg, "hidden_size"))
    heads = _pos_int("num_attention_heads", _need(cfg, "num_attention_heads"))
    if model_type == "gpt_neox":  # one fused [h, 3h] projection of hidden / heads-sized heads, whatever else is said
        cfg = {k: v for k, v in cfg.items() if k not in ("num_key_value_heads", "head_dim")}
    kv = _pos_int("num_key_value_heads", _need(cfg, "num_key_value_heads", default=heads))
    if heads % kv:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if h % heads and family != ArchFamily.TRANSFORMERS:
            raise ConfigError(f"hidden_size {h} is not divisible by num_attention_heads {heads}")
        # (a model type known only to transformers sizes its heads itself, multi-head latent attention by its
        # qk/v head sizes: the spec's nominal head size is never handed to transformers)
        head_dim = max(1, h // heads)
    theta, rtype = _rope(cfg)
    n_layers = _pos_int("num_hidden_layers", _need(cfg, "num_hidden_layers"))
    _uniform_heads_per_layer(cfg, n_layers)
    act = str(_need(cfg, *_ACT_KEYS.get(family, ("hidden_act", "hidden_activation")),
                    default=_ACT_DEFAULT.get(family, "silu")))
    if act not in _ACTS and family != ArchFamily.TRANSFORMERS:  # transformers' own module applies its own
        raise ConfigError(f"hidden_act {act!r} is not supported for {model_type}")
    mlp_kinds: tuple[str, ...] = ()
    rope_layers: tuple[bool, ...] = ()
    if family == ArchFamily.TRANSFORMERS:
        mlp_kinds, rope_layers = depth_kinds(cfg, _pos_int("num_hidden_layers", _need(cfg, "num_hidden_layers")))
    pad = cfg.get("pad_token_id")
    vocab = _pos_int("vocab_size", _need(cfg, "vocab_size"))
    sw = cfg.get("sliding_window")
    if family == ArchFamily.TRANSFORMERS and "sliding_window" not in cfg and not isinstance(cfg.get("layer_types"), list):
        sw = _class_window(cfg, model_type, n_layers)
    # use_sliding_window is a field of some config classes only (Qwen2/3 and their MoE and VL text models, SmolLM3):
    # those drop the window unless it is true; every other class never reads the key (Mistral's window applies)
    reads, class_use_sw = _use_sliding_window_field(model_type)
    use_sw = cfg.get("use_sliding_window", class_use_sw) if reads else True
    if WINDOW_RULES.get(model_type) == WindowRule.NEVER:
        sw = None  # transformers' Llama and GPT-NeoX attend to every token whatever the config says (config_notes)
    window = _pos_int("sliding_window", sw) if (sw is not None and use_sw is not False) else None
    if window is None and family in (ArchFamily.GEMMA2, ArchFamily.GEMMA3) and not isinstance(cfg.get("layer_types"), list):
        raise ConfigError(f"{model_type}: sliding_window is null, but its layers alternate sliding and full attention "
                          "(transformers cannot build it so): give the window size, or layer_types")
    layer_types = _layer_types(cfg, family, model_type, n_layers, window)
    per_layer_overrides_by_type(cfg, layer_types or (FULL,) * n_layers)  # refused here, rewritten for each cut
    if cfg.get("num_kv_shared_layers"):  # Gemma-3n/4: the last layers reuse earlier layers' keys and values
        raise ConfigError(f"num_kv_shared_layers {cfg['num_kv_shared_layers']}: layers that reuse another layer's keys "
                          "and values (no K/V projections of their own) are not modelled")
    if family == ArchFamily.TRANSFORMERS and "layer_types" not in cfg:
        chunk = with_depth_defaults(cfg).get("attention_chunk_size")
        if chunk:  # Llama-4: its RoPE layers attend within chunks (a mask), its NoPE layers to everything
            layer_types = tuple(CHUNKED if (not rope_layers or rope_layers[i]) else FULL for i in range(n_layers))
    neox = family == ArchFamily.GPT_NEOX
    qkv_bias, o_bias, mlp_bias = _biases(cfg, model_type, family)
    experts = 0
    top_k = moe_ffn = shared_ffn = 0
    if family == ArchFamily.MIXTRAL:
        experts = _pos_int("num_local_experts", _need(cfg, "num_local_experts", default=8))
    elif family in (ArchFamily.QWEN2_MOE, ArchFamily.QWEN3_MOE):
        experts = _pos_int("num_experts", _need(cfg, "num_experts"))
        moe_ffn = _pos_int("moe_intermediate_size", _need(cfg, "moe_intermediate_size"))
        if family == ArchFamily.QWEN2_MOE:
            shared_ffn = _pos_int("shared_expert_intermediate_size", _need(cfg, "shared_expert_intermediate_size"))
        # transformers' rule (Qwen2/3-MoE decoder layer): layer i is dense when it is in mlp_only_layers or
        # (i + 1) % decoder_sparse_step != 0; entries beyond the model name no layer and change nothing
        only = set(_int_list("mlp_only_layers", cfg.get("mlp_only_layers") or [], 0))
        given_step = cfg.get("decoder_sparse_step")  # (0 would be transformers' ZeroDivisionError: refused)
        step = 1 if given_step is None else _pos_int("decoder_sparse_step", given_step)
        dense = [i for i in range(n_layers) if i in only or (i + 1) % step]
        if dense:
            raise ConfigError(f"dense layers between MoE layers are not modelled for this family: mlp_only_layers / "
                              f"decoder_sparse_step {step} make {len(dense)} of the {n_layers} layers dense (first: "
                              f"layer {dense[0]}); every layer must be an MoE layer")
    if experts:
        top_k = _pos_int("num_experts_per_tok", _need(cfg, "num_experts_per_tok"))
        if top_k > experts:
            raise ConfigError(f"num_experts_per_tok {top_k} exceeds the {experts} experts")
    inter = cfg.get("intermediate_size")
    ffn = _pos_int("intermediate_size", inter) if inter is not None else (moe_ffn if experts else None)
    if ffn is None and family == ArchFamily.TRANSFORMERS:
        ffn = 0  # the module's own sizes decide; parameters are counted from the traced graph
    if ffn is None:
        raise ConfigError("config is missing intermediate_size")
    native = family == ArchFamily.LLAMA and window is None
    if native and rtype in ("dynamic", "longrope"):
        raise ConfigError(f"rope_type {rtype!r} recomputes its frequencies from each batch's positions (a max over "
                          "them and a host sync every forward in transformers), which the native builder does not "
                          "model; the types modelled for this family: default, linear, llama3, yarn")
    if rtype == "dynamic":
        raise ConfigError("rope_type 'dynamic' recomputes its frequencies whenever a batch's positions outgrow its "
                          "cache (host synchronisations whose outcome depends on earlier batches): not modelled")
    # (Phi-3's and GPT-NeoX's modules rotate the first partial_rotary_factor of each head, and every RoPE type's
    # frequencies have that size: modeling_phi3.py apply_rotary_pos_emb, modeling_rope_utils)
    if family not in (ArchFamily.TRANSFORMERS, ArchFamily.PHI3, ArchFamily.GPT_NEOX) and rtype != "default" \
            and _factor_below_one(cfg):
        raise ConfigError(f"partial_rotary_factor below 1 with rope_type {rtype!r}: transformers' {model_type} cannot "
                          "build it (its frequencies have the full head size); drop one of them")
    if native and act not in NATIVE_LLAMA_ACTS:
        raise ConfigError(f"hidden_act {act!r} is not modelled for {model_type} (modelled: "
                          f"{', '.join(NATIVE_LLAMA_ACTS)})")
    if family == ArchFamily.LLAMA and window is not None:
        family = ArchFamily.MISTRAL if model_type == "mistral" else ArchFamily.QWEN2
    # a model type known only to transformers keeps its own layer_types rule unless the config lists them (the
    # trace checks the parser's reading against it)
    given_types = layer_types if family != ArchFamily.TRANSFORMERS or "layer_types" in cfg else ()
    hf_raw = raw
    if "head_dim" in raw and raw["head_dim"] is None and model_type in NULL_HEAD_DIM_TYPES:
        # the model's head size, stated: otherwise a TP rank's module sizes its heads from its divided head count
        hf_raw = {**raw, "head_dim": head_dim}
    hf_cfg = "" if native else json.dumps(_hf_config(hf_raw, model_type, given_types), sort_keys=True)
    return ModelSpec(
        name=name, family=family, model_type=model_type,
        vocab_size=vocab, hidden_size=h, num_layers=n_layers,
        num_heads=heads, num_kv_heads=kv, head_dim=_pos_int("head_dim", head_dim),
        intermediate_size=ffn,
        hidden_act=act,
        norm_eps=_nonneg_float("rms_norm_eps", _need(cfg, "rms_norm_eps", "layer_norm_eps", default=1e-6)),
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
        tie_word_embeddings=_bool("tie_word_embeddings", cfg.get("tie_word_embeddings"),
                                  _TIED_DEFAULT.get(family, False)),
        max_position_embeddings=_pos_int("max_position_embeddings",
                                         _need(cfg, "max_position_embeddings", default=4096)),
        rope_theta=theta, rope_type=rtype,
        sliding_window=window if layer_types else None,
        attention_dropout=_nonneg_float("attention_dropout", cfg.get("attention_dropout", 0.0)),
        pad_token_id=_padding_idx(pad, vocab, family),
        builder=Builder.NATIVE if native else Builder.HF,
        layer_types=layer_types,
        qk_norm=family in (ArchFamily.QWEN3, ArchFamily.GEMMA3, ArchFamily.QWEN3_MOE),
        gated_mlp=not neox,
        num_experts=experts, experts_per_token=top_k,
        moe_intermediate_size=(ffn if family == ArchFamily.MIXTRAL else moe_ffn) if experts else 0,
        shared_expert_intermediate_size=shared_ffn,
        hf_config=hf_cfg,
        mlp_layer_types=mlp_kinds, rope_layers=rope_layers,
    )


# Config keys by which transformers' model types mix layers along the depth in ways not modelled here (recurrent
# blocks, interleaved MoE steps and ranges): a traced cut of the first layers would stand for layers it does not
# contain. The MLP and RoPE rules `depth_kinds` reads are modelled.
_MIXED_DEPTH_KEYS = ("moe_layer_freq", "hybrid_override_pattern",
                     "layers_block_type", "attn_layer_indices", "full_attn_idxs")
# Keys `depth_kinds` reads: a trace of a cut writes them for the layers it keeps (engine/trace/hf_models.py)
MLP_DEPTH_KEYS = ("mlp_layer_types", "first_k_dense_replace", "num_dense_layers", "mlp_only_layers", "decoder_sparse_step", "moe_layers",
                  "interleave_moe_layer_step", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")
ROPE_DEPTH_KEYS = ("no_rope_layers", "no_rope_layer_interval")



# What a prediction with gated-delta-rule layers says of them (the capture adds it to the graph's warnings)
GATED_DELTA_NOTE = ("linear-attention layers (the gated delta rule) are priced as transformers' torch fallback runs "
                    "them, chunk by chunk (flash-linear-attention and causal-conv1d not installed, as on the measured "
                    "machines); with those packages their fused kernels run instead, which is not modelled; measured "
                    "over four such models (Qwen3-Next, Qwen3.5 dense and MoE, OLMo-Hybrid), the step came within "
                    "9.8% on an H200 (13 runs, -26% to +9%: under autocast the MoE and OLMo-Hybrid steps are "
                    "under-predicted) and within 3.0% on an H100 (20 runs, -4% to +7%: there the forward's module "
                    "Python is charged once per layer, its operators at their own tight-loop cost, which the H200's one "
                    "host probe is too noisy to give): the host time of the fallback's loops is their step's largest "
                    "uncertainty")


def _int_list(name: str, v: Any, n: int) -> list[int]:
    if not (isinstance(v, list) and len(v) >= n and all(isinstance(x, int) for x in v)):
        raise ConfigError(f"{name} must list at least {n} integers (one per layer), got {str(v)[:60]}")
    return [int(x) for x in v]


# transformers 5.17's config-class defaults of the keys `depth_kinds` reads, for the model types whose default makes
# layers differ (a config.json saved by transformers states them; a hand-written one may not). The trace checks
# the reading against transformers' own config object and refuses a difference.
DEPTH_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4_moe": {"first_k_dense_replace": 1}, "glm4v_moe": {"first_k_dense_replace": 1},
    "exaone_moe": {"first_k_dense_replace": 1}, "deepseek_v3": {"first_k_dense_replace": 3},
    "llama4_text": {"no_rope_layer_interval": 4, "interleave_moe_layer_step": 1, "attention_chunk_size": 8192},
    "smollm3": {"no_rope_layer_interval": 4}, "afmoe": {"num_dense_layers": 1},
    "ernie4_5_moe": {"moe_layer_start_index": 1, "moe_layer_end_index": -1, "moe_layer_interval": 1},
    "axk1": {"first_k_dense_replace": 1},
    # classes that derive mlp_layer_types as ["dense"] + ["sparse"] * (layers - 1) when it is left out
    "glm4_moe_lite": {"first_k_dense_replace": 1}, "hy_v3": {"first_k_dense_replace": 1},
    "mimo_v2_flash": {"first_k_dense_replace": 1},
}


def with_depth_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config with its model type's defaults for the depth keys it leaves out (or leaves empty)."""
    d = DEPTH_DEFAULTS.get(str(cfg.get("model_type")), {})
    return {**cfg, **{k: v for k, v in d.items() if cfg.get(k) in (None, [])}}


def _uniform_heads_per_layer(cfg: dict[str, Any], n_layers: int) -> None:
    """Laguna's `num_attention_heads_per_layer` (its class writes one entry per layer even when all are alike; each
    layer's attention takes its own): one head count for every layer is modelled (a trace's cut keeps that many
    entries, and TP divides them), layers that differ in their head counts are not."""
    v = cfg.get("num_attention_heads_per_layer")
    if v is None:
        return
    if not (isinstance(v, list) and len(v) == n_layers
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)):
        raise ConfigError(f"num_attention_heads_per_layer must list one positive integer per layer ({n_layers}), "
                          f"got {str(v)[:60]}")
    if len(set(v)) > 1:
        raise ConfigError(f"num_attention_heads_per_layer: layers with different head counts ({sorted(set(v))}) are "
                          "not modelled; for this model use `tp-query trace`")


def _refuse_mixed_depth(cfg: dict[str, Any]) -> None:
    for k in _MIXED_DEPTH_KEYS:
        v = cfg.get(k)
        trivial = v is None or v == [] or v == 0 or (k == "moe_layer_freq" and v == 1)
        if not trivial:
            raise ConfigError(f"{k}: layers that differ along the depth this way are not modelled; for this model use "
                              f"`tp-query trace`")


def depth_kinds(cfg: dict[str, Any], n: int) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """Each layer's MLP kind ("dense" / "sparse", or the config's own `mlp_layer_types` words) and whether it
    applies RoPE, by the rules transformers 5.17's model types read: `mlp_layer_types`; `first_k_dense_replace`
    (DeepSeek-style: the first k layers dense) and `num_dense_layers` (AFMoE, LFM2-MoE: the same); Qwen-MoE's `mlp_only_layers` / `decoder_sparse_step`; SmolLM3's and
    Llama-4's `no_rope_layers` (1: RoPE) / `no_rope_layer_interval`; Llama-4's `moe_layers` /
    `interleave_moe_layer_step`. Empty where every layer is alike; a key this does not model is refused."""
    cfg = with_depth_defaults(cfg)
    _refuse_mixed_depth(cfg)
    mlp: list[str] = []
    given = cfg.get("mlp_layer_types")
    if given is not None:
        if not (isinstance(given, list) and len(given) == n and all(isinstance(x, str) and x for x in given)):
            raise ConfigError(f"mlp_layer_types must list {n} MLP kinds, one per layer (transformers refuses any "
                              "other length)" + (f", got {len(given)}" if isinstance(given, list) else ""))
        mlp = list(given[:n])
    elif cfg.get("first_k_dense_replace") or cfg.get("num_dense_layers"):
        # (AFMoE's and LFM2-MoE's num_dense_layers: the same rule, the first k layers dense)
        key = "first_k_dense_replace" if cfg.get("first_k_dense_replace") else "num_dense_layers"
        k = cfg[key]
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"{key} must be a non-negative integer, got {k!r}")
        mlp = ["dense" if i < k else "sparse" for i in range(n)]
    elif cfg.get("moe_layers") is not None or cfg.get("interleave_moe_layer_step", 1) not in (1, None):
        step = _pos_int("interleave_moe_layer_step", cfg.get("interleave_moe_layer_step") or 1)
        given_moe = cfg.get("moe_layers")
        moe = set(_int_list("moe_layers", given_moe, 0)) if given_moe is not None else set(range(step - 1, n, step))
        mlp = ["sparse" if i in moe else "dense" for i in range(n)]
    elif cfg.get("moe_layer_start_index") is not None:
        # ERNIE-4.5-MoE: layer i is sparse when (i + 1) % interval == 0 and start <= i <= end (-1: the last layer)
        start = cfg["moe_layer_start_index"]
        end = cfg.get("moe_layer_end_index", -1)
        every = _pos_int("moe_layer_interval", cfg.get("moe_layer_interval") or 1)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)) or start < 0 or end < -1:
            raise ConfigError(f"moe_layer_start_index / moe_layer_end_index must be layer indices, got {start!r} / "
                              f"{end!r}")
        last = n - 1 if end == -1 else end
        mlp = ["sparse" if (i + 1) % every == 0 and start <= i <= last else "dense" for i in range(n)]
    elif cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) not in (1, None):
        only = set(_int_list("mlp_only_layers", cfg.get("mlp_only_layers") or [], 0))
        step = _pos_int("decoder_sparse_step", cfg.get("decoder_sparse_step") or 1)
        mlp = ["dense" if i in only or (i + 1) % step else "sparse" for i in range(n)]
    rope: list[bool] = []
    if cfg.get("no_rope_layers"):
        rope = [bool(x) for x in _int_list("no_rope_layers", cfg["no_rope_layers"], n)[:n]]
    elif cfg.get("no_rope_layer_interval"):
        every = _pos_int("no_rope_layer_interval", cfg["no_rope_layer_interval"])
        rope = [(i + 1) % every != 0 for i in range(n)]
    return (tuple(mlp) if len(set(mlp)) > 1 else (), tuple(rope) if not all(rope) else ())


# Keys never passed to transformers' config (they describe weights or serving, not the training graph).
_HF_DROP = ("architectures", "torch_dtype", "dtype", "transformers_version", "auto_map", "quantization_config",
            "_name_or_path", "text_config", "vision_config")


def per_layer_overrides_by_type(cfg: dict[str, Any], layer_types: Sequence[str]) -> dict[str, dict[str, Any]]:
    """transformers' per-layer config overrides (`per_layer_config`: Gemma-4's head size and KV heads of its full
    attention layers) as one override per attention type, or a refusal where they are not: a trace's cut keeps
    one layer of each kind, and its config must give each kept layer the overrides of the layers it stands for."""
    plc = cfg.get("per_layer_config")
    if not plc:
        return {}
    n = len(layer_types)
    if not isinstance(plc, dict) or not all(isinstance(v, dict) for v in plc.values()):
        raise ConfigError("per_layer_config must map layer indices to objects of overrides")
    by_type: dict[str, dict[str, Any]] = {}
    counted: Counter[str] = Counter()
    for k, ov in plc.items():
        try:
            i = int(k)
        except (TypeError, ValueError):
            raise ConfigError(f"per_layer_config key {str(k)[:20]!r} is not a layer index") from None
        if not 0 <= i < n:
            raise ConfigError(f"per_layer_config names layer {i} of a model of {n} layers")
        t = layer_types[i]
        if by_type.setdefault(t, ov) != ov:
            raise ConfigError(f"per_layer_config gives {t} layers different overrides: layers that differ along "
                              "the depth this way are not modelled")
        counted[t] += 1
    of_type = Counter(layer_types)
    for t, c in counted.items():
        if c != of_type[t]:
            raise ConfigError(f"per_layer_config overrides {c} of the {of_type[t]} {t} layers: "
                              "layers that differ along the depth this way are not modelled")
    return by_type


# Model types whose transformers modules size a null head_dim as hidden_size / num_attention_heads, as a missing one
# (configuration_llama.py and configuration_mistral.py fill it in; modeling_mixtral.py reads `head_dim or hidden /
# heads`); transformers' own to_dict() writes the null for Mistral and Mixtral. Other types keep the null they are
# given (most of their modules cannot be built with it). tests/test_class_defaults.py builds each one's attention.
NULL_HEAD_DIM_TYPES = frozenset({"llama", "mistral", "mixtral"})


def _hf_config(cfg: dict[str, Any], model_type: str, layer_types: tuple[str, ...]) -> dict[str, Any]:
    out = {k: v for k, v in cfg.items() if k not in _HF_DROP}
    out["model_type"] = model_type
    out["use_cache"] = False
    if layer_types:
        out["layer_types"] = list(layer_types)
    return out


# The keys the parser reads whose absence transformers fills with its config class's default (the table is
# schema/hf_config_defaults.json, written from transformers by tools/hf_config_defaults.py).
DEFAULTED_KEYS: tuple[str, ...] = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size",
    "intermediate_size", "hidden_act", "hidden_activation", "rms_norm_eps", "layer_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
    "sliding_window_pattern", "max_window_layers", "attention_dropout", "num_local_experts", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step",
    "rope_theta", "pad_token_id", "n_embd", "n_head", "n_layer", "n_positions", "n_inner", "activation_function",
    "layer_norm_epsilon", "resid_pdrop", "embd_pdrop", "attn_pdrop",
)
# defaults that set a size or an attention pattern: a prediction names them (the rest are numerics and flags)
_SIZE_KEYS = frozenset({
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size",
    "intermediate_size", "sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "n_embd", "n_head", "n_layer", "n_inner"})

_WINDOW_KEYS = frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "sliding_window_pattern"})


@functools.cache
def hf_class_defaults() -> dict[str, Any]:
    """The shipped table of transformers' config-class defaults (format, transformers version, per model type),
    read once per process (callers read it, never change it)."""
    return _class_defaults_table()


@functools.lru_cache(maxsize=1)
def _class_defaults_table() -> dict[str, Any]:
    path = Path(__file__).with_name("hf_config_defaults.json")
    table = json.loads(path.read_text())
    if table.get("format") != "tp-query-hf-config-defaults/2":
        raise ConfigError(f"{path.name}: unknown format {table.get('format')!r}")
    return dict(table)


def _use_sliding_window_field(model_type: str) -> tuple[bool, Any]:
    """Whether the model type's transformers config class has a use_sliding_window field, and its default."""
    d = hf_class_defaults()["model_types"].get(model_type, {})
    return "use_sliding_window" in d, d.get("use_sliding_window")


def with_class_defaults(cfg: dict[str, Any], model_type: str, family: ArchFamily | None = None
                        ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config with its model type's class defaults for the keys it leaves out (a key given as null keeps null,
    as transformers passes None on), and the defaults taken. A model type known only to transformers keeps its
    own rule for which layers slide (the trace checks the spec's reading against transformers' config object)."""
    table = hf_class_defaults()
    aliases = table.get("aliases", {}).get(model_type, {})
    if aliases:  # a key under either of its names (attribute_map: transformers 5 saves Qwen3-MoE's num_experts as
        cfg = dict(cfg)  # num_local_experts), so a default never replaces a value given under the other name
        for alias, canon in aliases.items():
            if alias in cfg and canon in cfg and cfg[alias] != cfg[canon]:
                # which one transformers keeps depends on its class's field order (GPT-2 keeps the alias, Qwen3-MoE
                # the field): a file stating two values is refused, not read one way
                def shown(v: Any) -> str:  # (one line: a newline in a value is shown escaped)
                    return str(v)[:40].encode("unicode_escape").decode()

                raise ConfigError(f"{canon} {shown(cfg[canon])} and {alias} {shown(cfg[alias])} name the same "
                                  f"setting of {model_type} with different values: keep one")
        _mirror_aliases(cfg, aliases)
    d = table["model_types"].get(model_type, {})
    own = family == ArchFamily.TRANSFORMERS
    taken = {k: v for k, v in d.items() if k not in cfg and not (own and k in _WINDOW_KEYS)}
    if not taken:
        return cfg, {}
    merged = {**cfg, **taken}
    _mirror_aliases(merged, aliases)  # a default under one name is the setting under the other too (CodeGen's
    return merged, taken  # class field n_embd answers hidden_size)


def with_own_class_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """A transformers config (its `model_type` in it) with its class's defaults under what it states, window keys
    included: what transformers' own config object reads."""
    return with_class_defaults(hf, str(hf.get("model_type")))[0]


def _mirror_aliases(cfg: dict[str, Any], aliases: dict[str, str]) -> None:
    """A setting stated under one of its two names, written under the other too (in place)."""
    for alias, canon in aliases.items():
        if alias in cfg and canon not in cfg:
            cfg[canon] = cfg[alias]
        elif canon in cfg and alias not in cfg:
            cfg[alias] = cfg[canon]


def _unwrapped(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The language model's config of a multimodal wrapper the parser reads (Llama-4, Gemma-3/4, Mistral-3), and what was left
    out ("" for a plain config)."""
    mt = cfg.get("model_type")
    if mt == "llama4" and isinstance(cfg.get("text_config"), dict):
        # Llama-4 as published is its multimodal wrapper: its language model trains as Llama4ForCausalLM
        return {**cfg["text_config"], "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"]}, "llama4"
    if mt in _TIED_WRAPPERS and isinstance(cfg.get("text_config"), dict):
        # Gemma3ForConditionalGeneration and Mistral3ForConditionalGeneration tie their LM head by the wrapper's own
        # tie_word_embeddings (class default true), not text_config's: a text_config stating otherwise is refused
        text = cfg["text_config"]
        tied = cfg.get("tie_word_embeddings", True)
        if "tie_word_embeddings" in text and text["tie_word_embeddings"] != tied:
            raise ConfigError(f"{mt}: text_config.tie_word_embeddings {json.dumps(text['tie_word_embeddings'])} "
                              f"but the wrapper's tie_word_embeddings, which {_TIED_WRAPPERS[mt][1]} follows, "
                              f"is {json.dumps(tied)}{'' if 'tie_word_embeddings' in cfg else ' (its class default)'}: "
                              "make them agree")
        inner = _TIED_WRAPPERS[mt][0] or str(text.get("model_type") or "mistral")
        out = {k: v for k, v in text.items() if k != "architectures"}
        return {**out, "model_type": inner, "tie_word_embeddings": tied}, mt
    return cfg, ""


# multimodal wrappers read as their language model: the text model type ("" for text_config's own) and the class
WRAPPER_ARCHITECTURES = ("Llama4ForConditionalGeneration", "Mistral3ForConditionalGeneration",
                         "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration")
_TIED_WRAPPERS = {"gemma3": ("gemma3_text", "Gemma3ForConditionalGeneration"),
                  "gemma4": ("gemma4_text", "Gemma4ForConditionalGeneration"),
                  "gemma4_unified": ("gemma4_unified_text", "Gemma4UnifiedForConditionalGeneration"),
                  "mistral3": ("", "Mistral3ForConditionalGeneration")}


def config_notes(cfg: Any) -> list[str]:
    """What a prediction from this config assumes beyond what the file states: class defaults that set sizes, a
    vision tower left out, settings that do not change what runs. Empty for a graph file or a config the parser
    refuses (its refusal says why)."""
    if not isinstance(cfg, dict) or str(cfg.get("format", "")).startswith("tp-query-graph"):
        return []
    try:
        text, wrapper = _unwrapped(cfg)
        family, model_type = identify(text)
    except ConfigError:
        return []
    notes = []
    if wrapper:
        notes.append(f"{wrapper}: the language model alone (text_config) is predicted; the vision tower and its "
                     "image tokens are not modelled")
    try:
        _, taken = with_class_defaults(text, model_type, family)
    except ConfigError:
        return notes
    sizes = {k: v for k, v in taken.items() if k in _SIZE_KEYS}
    if _use_sliding_window_field(model_type)[0] and {**taken, **text}.get("use_sliding_window") is False:
        sizes.pop("sliding_window", None)  # a window the model does not use (Qwen2/3's default) sets no size
    if sizes:
        ver = hf_class_defaults().get("transformers", "?")
        notes.append(f"{model_type}: not in the config, taken from transformers {ver}'s class defaults as "
                     "transformers builds it: " + ", ".join(f"{k}={v}" for k, v in sorted(sizes.items())))
    q = text.get("quantization_config", cfg.get("quantization_config"))
    if isinstance(q, dict):
        qm = q.get("quant_method", "?")
        notes.append(f"quantization_config ({qm}) describes how the checkpoint is stored; training is predicted in the "
                     "chosen precision setting with unquantized weights (quantized or adapter training is not "
                     "modelled)")
    if model_type == "llama4_text":
        notes.append("llama4_text: transformers' Llama4TextMoe runs every routed expert on every token (inputs "
                     "repeated per expert, scaled by the router's scores, one batched GEMM): the time, memory and "
                     "hardware FLOPs are that dense run's, not top-k routing's")
    unread = unread_bias_keys(text, model_type, family)
    if unread:
        notes.append(f"{model_type}: transformers' {model_type} does not read {', '.join(unread)} (its projections' "
                     "biases are fixed): predicted with the biases it builds")
    if model_type == "gpt_neox" and any(k in text for k in ("num_key_value_heads", "head_dim")):
        notes.append("gpt_neox: transformers' GPT-NeoX does not read num_key_value_heads or head_dim (one fused "
                     "projection, hidden_size / num_attention_heads per head): predicted as it runs")
    mtp = text.get("num_nextn_predict_layers")
    if isinstance(mtp, int) and not isinstance(mtp, bool) and mtp > 0:
        notes.append(f"num_nextn_predict_layers {mtp}: the multi-token-prediction layers are not built by "
                     f"transformers' {model_type} and are not predicted (nor counted in the parameters)")
    rule = WINDOW_RULES.get(model_type)
    if rule == WindowRule.NEVER and (text.get("sliding_window") is not None or text.get("layer_types") is not None):
        notes.append(f"{model_type}: transformers' {model_type} attends to every token and reads neither "
                     "sliding_window nor layer_types: full attention is predicted, as it runs")
    elif rule == WindowRule.EVERY and text.get("layer_types") is not None:
        notes.append(f"{model_type}: transformers' {model_type} does not read layer_types: every layer attends "
                     "within sliding_window when one is set, and is predicted so")
    cap = text.get("attn_logit_softcapping")
    if cap is not None and family != ArchFamily.GPT2:
        notes.append(f"attn_logit_softcapping {cap}: SDPA attention, which transformers builds by default, does not "
                     "apply it, and it is predicted as run so (attn_implementation='eager' applies it, with eager "
                     "attention's kernels and memory)")
    return notes


def parse_config(cfg: Any, name: str = "model") -> ModelSpec:
    if not isinstance(cfg, dict):
        raise ConfigError("a model config must be a JSON object")
    if cfg.get("model_type") in ("llama4", "mistral3", "gemma4", "gemma4_unified"):
        cfg, _ = _unwrapped(cfg)
    elif isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg and cfg.get("model_type") != "gemma3":
        _refuse_wrapper(cfg, name)
    family, model_type = identify(cfg)
    _check_unmodelled_keys(cfg, family)
    if family == ArchFamily.GPT2:
        return _parse_gpt2(cfg, name, family, model_type)
    return _parse_decoder(cfg, name, family, model_type)


def _refuse_wrapper(cfg: dict[str, Any], name: str) -> None:
    """A multimodal wrapper the parser does not read (Qwen3.5, Gemma-3n, ...): refused with its language model's own
    reason, or with how to predict that model alone; its LM head's tying and what the wrapper adds are its own, so
    the text config is not taken silently."""
    text = cfg["text_config"]
    mt, inner = cfg.get("model_type") or "this wrapper", text.get("model_type")
    if not isinstance(inner, str) or not inner:
        raise ConfigError(f"{mt}: a multimodal wrapper whose text_config names no model_type; give the language "
                          "model's own config")
    try:
        parse_config(text, name)
    except ConfigError as e:
        raise ConfigError(f"{mt}: its language model ({inner}): {e}") from None
    raise ConfigError(f"{mt} is a multimodal wrapper the parser does not read: to predict its language model alone, "
                      f"give its text_config (model_type {inner!r}) as the config")


def _check_unmodelled_keys(cfg: dict[str, Any], family: ArchFamily) -> None:
    """Keys transformers honours that change what runs, refused where the prediction would not honour them."""
    inner = cfg.get("text_config")
    text: dict[str, Any] = inner if isinstance(inner, dict) else {}
    _refuse_mixed_depth(cfg)  # (before sizes: Nemotron-H's depth is its block list's length, no num_hidden_layers)
    for d in (cfg, text):
        for key in ("attn_implementation", "_attn_implementation"):
            impl = d.get(key)
            if impl not in (None, "sdpa"):
                raise ConfigError(f"{key} {impl!r} is not modelled: transformers' SDPA attention is what is "
                                  "predicted (eager attention keeps every score matrix; flash and flex attention are "
                                  "other kernels); drop the key or set it to \"sdpa\""[:300])
    if family != ArchFamily.TRANSFORMERS and any(d.get("output_router_logits") is True for d in (cfg, text)):
        # the listed MoE families are traced through the base model, whose router logits make no loss
        raise ConfigError("output_router_logits true (transformers' load-balancing loss on the router logits) is not "
                          "modelled for this family: predictions train the language-model loss alone; set it to "
                          "false (Megatron-Core's own aux loss is modelled with --framework megatron)")


def family_label(model: dict[str, Any]) -> str:
    """How reports name a parsed spec's family: a model type known only to transformers by its model_type."""
    if model.get("family") == ArchFamily.TRANSFORMERS.value:
        return str(model.get("model_type"))
    return str(model.get("family"))


def parameter_count(model: dict[str, Any]) -> int | None:
    """Parameters of the whole model (every TP rank and stage together) from a parsed spec's fields (None for a
    model type known only to transformers: its graph counts them, engine.flops.graph_parameter_count)."""
    if model.get("family") == ArchFamily.TRANSFORMERS.value:
        return None
    try:
        h, layers, heads, kv, hd, ffn, vocab = (int(model[k]) for k in (
            "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size"))
    except (KeyError, TypeError, ValueError):
        return None
    gpt2 = model.get("family") == "gpt2"
    layer_norm = gpt2 or model.get("family") == "gpt_neox"
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if model.get("qkv_bias"):
        attn += heads * hd + 2 * kv * hd
    if model.get("o_bias"):
        attn += h
    if model.get("qk_norm"):
        attn += 2 * hd
    gated = 3 if model.get("gated_mlp", not gpt2) else 2
    experts = int(model.get("num_experts") or 0)
    if experts:
        moe_ffn, shared = int(model["moe_intermediate_size"]), int(model.get("shared_expert_intermediate_size") or 0)
        mlp = experts * gated * h * moe_ffn + h * experts + (gated * h * shared + h if shared else 0)
    else:
        mlp = gated * h * ffn + (((gated - 1) * ffn + h) if model.get("mlp_bias") else 0)  # gate and up, down
    family = model.get("family")
    n_norms = 4 if family in ("gemma2", "gemma3") else 2
    norms = n_norms * h * (2 if layer_norm else 1)  # LayerNorms have biases
    embed = vocab * h + (int(model.get("max_position_embeddings", 0)) * h if gpt2 else 0)
    head = 0 if model.get("tie_word_embeddings") else vocab * h
    final_norm = (2 if layer_norm else 1) * h
    return embed + layers * (attn + mlp + norms) + final_norm + head


# Keys transformers' own to_dict() writes Infinity into, and which no prediction reads (Mamba-2 and the hybrid models
# built on it clamp their time step to [0, inf)): kept, so such a config gets its real refusal (its layer kinds)
NON_FINITE_KEYS = frozenset({"time_step_limit"})


def _non_finite_paths(obj: Any, path: str = "") -> list[str]:
    if isinstance(obj, float) and not math.isfinite(obj):
        return [path]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _non_finite_paths(v, f"{path}.{k}" if path else str(k))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _non_finite_paths(v, f"{path}[{i}]")]
    return []


def _json_constants(text: str, **kw: Any) -> Any:
    """JSON with NaN/Infinity refused except under NON_FINITE_KEYS (at any depth: a wrapper's text_config too); the
    tree is walked only when the text holds such a constant."""
    seen: list[str] = []

    def constant(name: str) -> float:
        seen.append(name)
        return float(name)

    obj = json.loads(text, parse_constant=constant, **kw)
    for p in _non_finite_paths(obj) if seen else []:
        key = p.split(".")[-1].split("[")[0]
        if key not in NON_FINITE_KEYS:
            raise ConfigError(f"{p}: NaN and Infinity are not JSON numbers (refused)")
    return obj


def load_model_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON model file (a HF config or a tp-query graph); errors are one line."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if p.exists() and not p.is_file() and not p.is_char_device():
        # a FIFO or a socket would block the read until someone writes to it
        raise ConfigError(f"{path}: not a regular file")
    try:
        with p.open("rb") as f:  # bounded: /dev/zero or a huge file is refused, not read
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB, not a model file")
        if raw[:2] == b"\x1f\x8b":  # a gzipped graph from `tp-query trace -o graph.json.gz`
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            raw = d.decompress(raw, MAX_GRAPH_BYTES + 1)
            if len(raw) > MAX_GRAPH_BYTES or d.unconsumed_tail:
                raise ConfigError(f"{path}: decompresses beyond {MAX_GRAPH_BYTES >> 20} MiB, not a graph file")
        text = raw.decode()
    except FileNotFoundError:
        raise ConfigError(f"model file not found: {path}") from None
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:
        raise ConfigError(f"cannot read model file {path}: {first_line(e)}"
                          ) from None
    try:
        obj = _json_constants(text)
        if isinstance(obj, dict) and not str(obj.get("format", "")).startswith("tp-query-graph"):
            _json_constants(text, object_pairs_hook=_unique_keys)  # a config: keys once
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: malformed JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:  # the C parser's own depth guard
        raise ConfigError(f"{path}: JSON nested too deeply") from None
    except ValueError as e:  # a key given twice, or an integer of thousands of digits
        why = "an integer of thousands of digits, no model's" if "digits" in str(e) else first_line(e)
        raise ConfigError(f"{path}: {why}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return obj


def is_numpy_scalar(v: Any) -> bool:
    """A numpy number (np.int64(4), a 0-d array's item type): callers pass them where a JSON number is meant."""
    return type(v).__module__ == "numpy" and hasattr(v, "item") and not getattr(v, "shape", ())


def plain_model(obj: dict[str, Any], where: str = "the model dict") -> dict[str, Any]:
    """A caller's config (or graph) dict as a JSON file of it would read: numpy scalars as the numbers they hold,
    keys as JSON text, and what a file cannot hold (NaN, an integer of thousands of digits, a cycle, objects,
    nesting past the parser's depth, two keys of one text) refused in one line. The copy is the caller's no more."""
    def plain(o: Any) -> Any:
        if is_numpy_scalar(o):
            return o.item()
        raise TypeError(f"a {type(o).__name__} is no JSON value")

    try:
        text = json.dumps(obj, default=plain)  # NaN and Infinity as the file reader takes them (NON_FINITE_KEYS)
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    except (TypeError, ValueError) as e:
        why = "an integer of thousands of digits, no model's" if "digits" in str(e) else first_line(e)
        raise ConfigError(f"{where}: {why}") from None
    if len(text) > MAX_GRAPH_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_GRAPH_BYTES >> 20} MiB as JSON, not a model")
    try:
        hook = None if str(obj.get("format", "")).startswith("tp-query-graph") else _unique_keys
        out = _json_constants(text, object_pairs_hook=hook)
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    except ValueError as e:
        raise ConfigError(f"{where}: {first_line(e)}") from None
    assert isinstance(out, dict)
    return out


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys appear once: a config that sets one twice has no single meaning (json keeps the
    last silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} is given twice")
        out[k] = v
    return out
