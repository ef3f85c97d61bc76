"""Model descriptions the engine accepts: a HuggingFace config.json, parsed without torch.

Supported families (their training graphs are what HuggingFace transformers runs, with SDPA):
- llama: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (and their model_type spellings)
- gpt2:  GPT2LMHeadModel
Anything else is refused with a clear message (a user can still `tp-query trace` their module).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A model file that cannot be used; the message is one line for the user."""


class ArchFamily(StrEnum):
    LLAMA = "llama"
    GPT2 = "gpt2"


ARCHITECTURES: dict[str, tuple[ArchFamily, str]] = {
    "LlamaForCausalLM": (ArchFamily.LLAMA, "llama"),
    "MistralForCausalLM": (ArchFamily.LLAMA, "mistral"),
    "Qwen2ForCausalLM": (ArchFamily.LLAMA, "qwen2"),
    "GPT2LMHeadModel": (ArchFamily.GPT2, "gpt2"),
}
MODEL_TYPES: dict[str, tuple[ArchFamily, str]] = {v[1]: v for v in ARCHITECTURES.values()}


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        d["family"] = ArchFamily(d["family"])
        return ModelSpec(**d)

    def with_layers(self, n: int) -> ModelSpec:
        return replace(self, num_layers=n)

    def param_count(self) -> int:
        """Parameters of the full model (tied embeddings counted once)."""
        h, v = self.hidden_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        if self.family == ArchFamily.GPT2:
            layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * self.intermediate_size + self.intermediate_size) \
                + (self.intermediate_size * h + h) + 4 * h
            extra = self.max_position_embeddings * h + 2 * h
        else:
            layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
            if self.qkv_bias:
                layer += q + 2 * kv
            extra = h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * layer + extra + head


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


def _rope(cfg: dict[str, Any]) -> tuple[float, str]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        return _nonneg_float("rope_theta", theta), str(params.get("rope_type", params.get("type", "default")))
    scaling = cfg.get("rope_scaling")
    rtype = "default"
    if isinstance(scaling, dict):
        rtype = str(scaling.get("rope_type", scaling.get("type", "default")))
    return _nonneg_float("rope_theta", cfg.get("rope_theta", 10000.0)), rtype


def identify(cfg: dict[str, Any]) -> tuple[ArchFamily, str]:
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ConfigError("architectures must be a list of strings")
    for a in archs or []:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    mt = cfg.get("model_type")
    if isinstance(mt, str) and mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    what = ", ".join(archs) if archs else (mt if isinstance(mt, str) else "nothing")
    supported = ", ".join(ARCHITECTURES)
    raise ConfigError(f"unsupported architecture ({what}); supported: {supported}; "
                      "for other models use `tp-query trace`")


def parse_config(cfg: Any, name: str = "model") -> ModelSpec:
    if not isinstance(cfg, dict):
        raise ConfigError("a model config must be a JSON object")
    family, model_type = identify(cfg)
    if family == ArchFamily.GPT2:
        h = _pos_int("n_embd", _need(cfg, "n_embd", "hidden_size"))
        heads = _pos_int("n_head", _need(cfg, "n_head", "num_attention_heads"))
        if h % heads:
            raise ConfigError(f"n_embd {h} is not divisible by n_head {heads}")
        inner = cfg.get("n_inner")
        spec = ModelSpec(
            name=name, family=family, model_type=model_type,
            vocab_size=_pos_int("vocab_size", _need(cfg, "vocab_size")),
            hidden_size=h,
            num_layers=_pos_int("n_layer", _need(cfg, "n_layer", "num_hidden_layers")),
            num_heads=heads, num_kv_heads=heads, head_dim=h // heads,
            intermediate_size=_pos_int("n_inner", inner) if inner is not None else 4 * h,
            hidden_act=str(_need(cfg, "activation_function", default="gelu_new")),
            norm_eps=_nonneg_float("layer_norm_epsilon", _need(cfg, "layer_norm_epsilon", default=1e-5)),
            qkv_bias=True, o_bias=True, mlp_bias=True,
            tie_word_embeddings=_bool("tie_word_embeddings", cfg.get("tie_word_embeddings"), True),
            max_position_embeddings=_pos_int("n_positions", _need(cfg, "n_positions", "max_position_embeddings",
                                                                  default=1024)),
            attention_dropout=_nonneg_float("attn_pdrop", cfg.get("attn_pdrop", 0.1)),
            resid_dropout=_nonneg_float("resid_pdrop", cfg.get("resid_pdrop", 0.1)),
            embd_dropout=_nonneg_float("embd_pdrop", cfg.get("embd_pdrop", 0.1)),
        )
    else:
        h = _pos_int("hidden_size", _need(cfg, "hidden_size"))
        heads = _pos_int("num_attention_heads", _need(cfg, "num_attention_heads"))
        kv = _pos_int("num_key_value_heads", _need(cfg, "num_key_value_heads", default=heads))
        if heads % kv:
            raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if h % heads:
                raise ConfigError(f"hidden_size {h} is not divisible by num_attention_heads {heads}")
            head_dim = h // heads
        theta, rtype = _rope(cfg)
        qwen = model_type == "qwen2"
        sw = cfg.get("sliding_window")
        use_sw = cfg.get("use_sliding_window", model_type == "mistral")
        act = str(_need(cfg, "hidden_act", default="silu"))
        if act not in ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu"):
            raise ConfigError(f"hidden_act {act!r} is not supported for {model_type}")
        pad = cfg.get("pad_token_id")
        spec = ModelSpec(
            name=name, family=family, model_type=model_type,
            vocab_size=_pos_int("vocab_size", _need(cfg, "vocab_size")),
            hidden_size=h,
            num_layers=_pos_int("num_hidden_layers", _need(cfg, "num_hidden_layers")),
            num_heads=heads, num_kv_heads=kv, head_dim=_pos_int("head_dim", head_dim),
            intermediate_size=_pos_int("intermediate_size", _need(cfg, "intermediate_size")),
            hidden_act=act,
            norm_eps=_nonneg_float("rms_norm_eps", _need(cfg, "rms_norm_eps", default=1e-6)),
            qkv_bias=True if qwen else _bool("attention_bias", cfg.get("attention_bias"), False),
            o_bias=False if qwen else _bool("attention_bias", cfg.get("attention_bias"), False),
            mlp_bias=False if qwen else _bool("mlp_bias", cfg.get("mlp_bias"), False),
            tie_word_embeddings=_bool("tie_word_embeddings", cfg.get("tie_word_embeddings"), False),
            max_position_embeddings=_pos_int("max_position_embeddings",
                                             _need(cfg, "max_position_embeddings", default=4096)),
            rope_theta=theta, rope_type=rtype,
            sliding_window=_pos_int("sliding_window", sw) if (sw is not None and use_sw) else None,
            attention_dropout=_nonneg_float("attention_dropout", cfg.get("attention_dropout", 0.0)),
            pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < cfg["vocab_size"]
            else None,
        )
    return spec


def _no_constant(name: str) -> Any:
    raise ConfigError(f"{name} is not a JSON number (NaN and Infinity are refused)")


def load_model_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON model file (a HF config or a tp-query graph); errors are one line."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
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
        raise ConfigError(f"cannot read model file {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                          ) from None
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: malformed JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:  # the C parser's own depth guard
        raise ConfigError(f"{path}: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return obj
