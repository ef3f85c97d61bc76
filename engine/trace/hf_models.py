"""Training graphs of the families transformers builds for us (builder HF in the spec registry):
Mistral and Qwen2 with sliding windows, Qwen3, Gemma-2/3, Phi-3, GPT-NeoX, Mixtral, Qwen2-MoE,
Qwen3-MoE. The module is transformers' own (5.17, SDPA attention, its default grouped-GEMM experts),
so a trace dispatches what a user's HF training step dispatches, masks, rotary tables and routing
included. Only the parts a split changes are ours:

- tensor parallelism shards through the config (heads, KV heads, FFN, expert FFN, vocabulary divided
  by TP, head_dim kept), with Megatron's communication points recorded by hooks where each attention
  and MLP block enters and leaves the TP region (sequence parallel: all-gather / reduce-scatter);
- the embedding is vocab-parallel under TP and the loss is the LM head plus, under TP, the loss as
  PyTorch's `loss_parallel` computes it, as in the native builder;
- a traced model holds one layer of each attention type (`ModelSpec.traced_layer_types`).

tests/test_trace_families.py checks the TP=1 graphs against transformers' own CausalLM.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from typing import Any, cast

import torch
from torch import nn
from tp_query.schema.messages import first_line
from tp_query.schema.model_config import (
    LEGACY_LAYER_TYPES,
    LINEAR_ATTENTION,
    ROPE_DEPTH_KEYS,
    ArchFamily,
    Builder,
    ConfigError,
    ModelSpec,
    depth_kinds,
    per_layer_overrides_by_type,
    with_depth_defaults,
)

from .models import (
    Shard,
    TPRegion,
    _is_fake,
    _ReduceFromTP,
    _ScatterSP,
    causal_lm_loss,
    emit_sync,
    packed_sequence_check,
)

# Config keys a TP split divides (transformers builds the per-rank module from the divided config).
_TP_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
            "shared_expert_intermediate_size", "intermediate_size_mlp", "vocab_size",
            "num_global_key_value_heads")  # (Gemma-4's full layers' KV heads, from which its class derives theirs)
# Families whose attention derives head_dim from hidden_size / heads (a divided config cannot keep it).
_NO_TP = {ArchFamily.GPT_NEOX: "GPT-NeoX derives its head size from hidden_size / heads"}


class UnsupportedSplit(ValueError):
    pass


_ATTN_NAMES = ("self_attn", "attention", "self_attention", "attn")


def _child(layer: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    return next((cast(nn.Module, getattr(layer, n)) for n in names if isinstance(getattr(layer, n, None), nn.Module)),
                None)


def _attn_or_none(layer: nn.Module) -> nn.Module | None:
    return _child(layer, _ATTN_NAMES)


_MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe")


def _mlp_attr(layer: nn.Module) -> nn.Module:
    mlp = _child(layer, _MLP_NAMES)
    if mlp is None:
        raise ConfigError(f"{type(layer).__name__} has no MLP module ({' / '.join(_MLP_NAMES)}) where decoder "
                          f"layers keep it; for this model use `tp-query trace`")
    return mlp


def _holds_experts(mod: nn.Module) -> bool:
    """A block (or layer) of routed experts: transformers names routed and shared experts so."""
    return any("expert" in n for n, _ in mod.named_parameters())


def _base_and_layers(hf: Any, mt: str) -> tuple[Any, Any]:
    """transformers' decoder stack of a CausalLM and its layer list."""
    base = hf.base_model
    if base is hf and isinstance(getattr(hf, "model", None), nn.Module):  # a prefix naming no submodule (Llama-4)
        base = hf.model
    return base, _find(base, ("layers", "h", "blocks"), "decoder layer list", mt)


def _attn_attr(layer: nn.Module) -> nn.Module:
    attn = _attn_or_none(layer)
    if attn is not None:
        return attn
    raise ConfigError(f"{type(layer).__name__} has no attention module ({' / '.join(_ATTN_NAMES)}) where decoder "
                      f"layers keep it; for this model use `tp-query trace`")


MODELLED_TRANSFORMERS = "5.17.0"  # the version whose modules the validation measured


def _transformers() -> Any:
    """transformers itself, or a one-line refusal saying how to get the version these graphs model."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"this family is traced through transformers' own modules: pip install "
                          f"'transformers=={MODELLED_TRANSFORMERS}' (or tp-query[trace])") from None
    # its advice about a config (class choice, token ids) is not about the step being predicted, and a
    # refusal is one line (its logging configures itself on import, so this comes after it)
    transformers.logging.set_verbosity_error()
    return transformers


def quiet_imports() -> None:
    """transformers imports torchao when it is installed; a CPU build of torchao logs a warning per CUDA
    extension it cannot load, and torch a deprecation per enum torchao registers. Not the user's concern."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _patch_packed_check() -> None:
    """transformers skips `find_packed_sequence_indices`' host check under fake tensors and then builds a
    dense mask; a real CUDA run performs the check (one sync) and uses is_causal. Record the real run."""
    import transformers.masking_utils as mu

    if getattr(mu.find_packed_sequence_indices, "_tp_query", False):
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> None:
        packed_sequence_check(position_ids, position_ids.shape[0])
        return None

    find_packed_sequence_indices._tp_query = True  # type: ignore[attr-defined]
    mu.find_packed_sequence_indices = find_packed_sequence_indices


def _patch_longrope(hf: nn.Module) -> None:
    """transformers' longrope (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) chooses its short or long factors every
    forward from `torch.max(position_ids) + 1 > original_max_position_embeddings`, a host synchronisation that a fake
    run cannot decide. A training step's positions are 0 .. seq - 1, so the choice is the sequence length's; the max,
    the comparison and the synchronisation are recorded as a real run performs them (modeling_rope_utils's
    dynamic_rope_update, whose undecorated forward runs after)."""
    for mod in hf.modules():
        kinds = getattr(mod, "rope_type", None)
        if kinds is None or "longrope" not in (set(kinds.values()) if isinstance(kinds, dict) else {kinds}):
            continue
        # the class's forward: torch.no_grad() around dynamic_rope_update's wrapper around the RoPE forward
        outer: list[Any] = []
        layer: Any = type(mod).forward
        while layer is not None and not any(getattr(c.cell_contents, "__name__", "") == "longrope_frequency_update"
                                            for c in (layer.__closure__ or ())):
            outer.append(layer)
            layer = getattr(layer, "__wrapped__", None)
        if layer is None or not all(_is_no_grad_decorator(f) for f in outer):
            continue  # another layout: left as transformers runs it (the trace then says what it met)
        rope_forward = layer.__wrapped__
        if type(mod).__name__ == "PhimoeRotaryEmbedding":  # its own forward branches on the positions again
            if _phimoe_source_changed(rope_forward):
                continue  # (left as transformers runs it: the trace then refuses)
            rope_forward = _phimoe_rope_forward
        mod.forward = functools.partial(_longrope_forward, mod, rope_forward, bool(outer))


# transformers 5.17's PhimoeRotaryEmbedding.forward, which `_phimoe_rope_forward` mirrors line for line
_PHIMOE_ROPE_LINES = (
    "seq_len = torch.max(position_ids) + 1",
    'if self.config.rope_parameters["rope_type"] != "default" and seq_len:',
    'self.config.rope_parameters["long_mscale"]',
    'if seq_len > self.config.rope_parameters["original_max_position_embeddings"]',
    'else self.config.rope_parameters["short_mscale"]',
    "inv_freq, attention_scaling = self.rope_init_fn(self.config)",
    "mscale = attention_scaling if mscale is None else mscale",
    "inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(dtype=torch.float, device=x.device)",
    "position_ids_expanded = position_ids[:, None, :].float()",
    "with maybe_autocast(device_type=device_type, enabled=False):  # Force float32",
    "freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)",
    "emb = torch.cat((freqs, freqs), dim=-1)",
    "cos = emb.cos() * mscale",
    "sin = emb.sin() * mscale",
    "return cos.to(x.dtype), sin.to(x.dtype)",
)


def _phimoe_source_changed(fn: Any) -> bool:
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return True
    return not all(line in src for line in _PHIMOE_ROPE_LINES)


def _phimoe_rope_forward(mod: Any, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """Phi-3.5-MoE's rotary forward with its two value-dependent branches (`and seq_len`, the long or short mscale)
    decided by the step's positions under fake tensors and recorded as the host synchronisations they are."""
    from transformers.models.phimoe.modeling_phimoe import maybe_autocast

    params = mod.config.rope_parameters
    mscale = None
    seq_len = torch.max(position_ids) + 1
    if params["rope_type"] != "default" and _host_bool(seq_len, True):
        longer = _host_bool(seq_len > params["original_max_position_embeddings"],
                            int(position_ids.shape[-1]) > params["original_max_position_embeddings"])
        mscale = params["long_mscale"] if longer else params["short_mscale"]
    inv_freq, attention_scaling = mod.rope_init_fn(mod.config)
    mscale = attention_scaling if mscale is None else mscale
    inv_freq_expanded = (
        inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(dtype=torch.float, device=x.device)
    )
    position_ids_expanded = position_ids[:, None, :].float()
    device_type = x.device.type if isinstance(x.device.type, str) and x.device.type != "mps" else "cpu"
    with maybe_autocast(device_type=device_type, enabled=False):
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * mscale
        sin = emb.sin() * mscale
    return cos.to(x.dtype), sin.to(x.dtype)


def _host_bool(t: torch.Tensor, known: bool) -> bool:
    """`bool(t)` as a real run takes it; under fake tensors a recorded synchronisation and the value the step's
    positions give (`known`)."""
    if _is_fake(t):
        emit_sync(t)
        return known
    return bool(t)


def _is_no_grad_decorator(f: Any) -> bool:
    """Whether a function is torch.no_grad()'s decorating wrapper (its closure holds the context's factory)."""
    return any(isinstance(getattr(c.cell_contents, "__self__", None), torch.no_grad) for c in (f.__closure__ or ()))


def _longrope_forward(mod: Any, rope_forward: Any, no_grad: bool, x: torch.Tensor, position_ids: torch.Tensor,
                      layer_type: str | None = None) -> Any:
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        rope_type = mod.rope_type if layer_type is None else mod.rope_type[layer_type]
        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        if "dynamic" in rope_type:  # (refused when the config is parsed: its cache depends on every batch's positions)
            raise ConfigError("rope_type 'dynamic' recomputes its frequencies from each batch's positions: not modelled")
        if rope_type == "longrope":
            _longrope_update(mod, position_ids, x.device, layer_type)
        return rope_forward(mod, x, position_ids, **kwargs)


def _longrope_update(mod: Any, position_ids: torch.Tensor, device: torch.device, layer_type: str | None) -> None:
    """transformers 5.17's longrope_frequency_update, its branch decided by the step's positions under fake tensors
    (the `hasattr` test names the cached long frequencies as transformers does)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    seq_len = torch.max(position_ids) + 1
    if layer_type is None:
        rope_type, original_inv_freq, prefix = mod.rope_type, mod.original_inv_freq, ""
        original_max = mod.config.rope_parameters["original_max_position_embeddings"]
    else:
        rope_type, prefix = mod.rope_type[layer_type], f"{layer_type}_"
        original_inv_freq = getattr(mod, f"{layer_type}_original_inv_freq")
        original_max = mod.config.rope_parameters[layer_type]["original_max_position_embeddings"]
    if _host_bool(seq_len > original_max, int(position_ids.shape[-1]) > original_max):
        if not hasattr(mod, f"{layer_type}_long_inv_freq"):
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](mod.config, device, seq_len=original_max + 1,
                                                              layer_type=layer_type)
        mod.register_buffer(f"{prefix}inv_freq", long_inv_freq, persistent=False)
        setattr(mod, f"{prefix}long_inv_freq", long_inv_freq)
    else:
        original_inv_freq = original_inv_freq.to(device)
        mod.register_buffer(f"{prefix}inv_freq", original_inv_freq, persistent=False)
        setattr(mod, f"{prefix}original_inv_freq", original_inv_freq)


_CPU_BRANCH = 'histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()'


def _patch_grouped_mm_cuda_path() -> None:
    """transformers' grouped-GEMM experts histogram the expert ids as floats on the CPU and as int32 on
    CUDA; a CPU trace must record the CUDA branch (the function's own code, with that one test fixed)."""
    import inspect
    import textwrap

    import transformers.integrations.moe as moe

    fn = moe.ALL_EXPERTS_FUNCTIONS._global_mapping.get("grouped_mm")
    if fn is None or getattr(fn, "_tp_query", False):
        return
    src = textwrap.dedent(inspect.getsource(fn))
    if _CPU_BRANCH not in src:
        raise RuntimeError("transformers' grouped_mm experts changed: the CUDA-branch patch no longer applies")
    ns: dict[str, Any] = {}
    exec(compile(src.replace(_CPU_BRANCH, "histc_input = expert_ids_g.int()"), inspect.getfile(fn), "exec"),
         moe.__dict__, ns)
    cuda_fn = ns[fn.__name__]
    cuda_fn._tp_query = True
    moe.ALL_EXPERTS_FUNCTIONS._global_mapping["grouped_mm"] = cuda_fn


def hf_config_for(spec: ModelSpec, shard: Shard) -> Any:
    """transformers' config of the module one rank runs (layers as `spec.num_layers` / layer_types)."""
    quiet_imports()
    cfg = json.loads(spec.hf_config)
    _cut_per_layer_config(cfg, spec)
    cfg["num_hidden_layers"] = spec.num_layers
    if spec.layer_types:
        cfg["layer_types"] = list(spec.layer_types)
    elif isinstance(cfg.get("layer_types"), list):  # every layer full (as transformers >= 4.53 saves the list)
        cfg["layer_types"] = ["full_attention"] * spec.num_layers
    _write_depth_kinds(cfg, spec)
    if cfg.get("num_attention_heads_per_layer"):  # (one count for every layer: the parser refused others)
        cfg["num_attention_heads_per_layer"] = [cfg["num_attention_heads_per_layer"][0]] * spec.num_layers
    if "head_dim" not in cfg and spec.family not in (ArchFamily.GPT_NEOX, ArchFamily.TRANSFORMERS):
        cfg["head_dim"] = spec.head_dim
    if shard.tp > 1:
        if spec.family in _NO_TP:
            raise UnsupportedSplit(f"TP>1 is not modelled for {spec.family}: {_NO_TP[spec.family]}")
        whole = _config_object(dict(cfg))  # the whole model as transformers builds it, class defaults included
        if spec.family == ArchFamily.TRANSFORMERS and "head_dim" not in cfg:
            # the head size the whole model has, kept when the heads are divided (a model type that derives it
            # from hidden_size / heads regardless fails the split check: its attention comes out replicated)
            heads = _global_attr(whole, "num_attention_heads")
            hd = _global_attr(whole, "head_dim") or (whole.hidden_size // heads if heads else None)
            if hd:
                cfg["head_dim"] = int(hd)
        # a size the file leaves to its class is the class default on every rank unless stated: stated here, so it
        # divides (the Hub's Gemma-3 text_config leaves out vocab_size, and on 4B the head counts)
        for k in _TP_KEYS:
            v = _global_attr(whole, k)
            if cfg.get(k) is None and isinstance(v, int) and not isinstance(v, bool) and v > 0:
                cfg[k] = v
        if cfg.get("num_attention_heads_per_layer"):
            heads = cfg["num_attention_heads_per_layer"][0]
            if heads % shard.tp:
                raise UnsupportedSplit(f"num_attention_heads_per_layer {heads} is not divisible by TP={shard.tp}")
            cfg["num_attention_heads_per_layer"] = [heads // shard.tp] * spec.num_layers
        for d in (cfg, *(cfg.get("per_layer_config") or {}).values()):  # a layer's own head counts divide too
            for k in _TP_KEYS:
                if d.get(k):
                    if d[k] % shard.tp:
                        raise UnsupportedSplit(f"{k} {d[k]} is not divisible by TP={shard.tp}")
                    d[k] //= shard.tp
        cfg["pad_token_id"] = None  # a padding row belongs to one vocabulary shard (as the native builder)
    return _config_object(cfg)


@functools.cache
def _takes_mlp_layer_types(model_type: str) -> bool:
    """Whether transformers' config class of a model type takes the per-layer MLP kinds as a list."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return "mlp_layer_types" in inspect.signature(CONFIG_MAPPING[model_type].__init__).parameters
    except Exception:  # a model type transformers does not know: its own refusal comes when it is built
        return False


def _dense_first(kinds: list[str], spec: ModelSpec, key: str) -> int:
    """How many dense layers lead a cut whose kinds are dense then sparse (what `key` can say), or a refusal."""
    k = kinds.count("dense")
    if kinds != ["dense"] * k + ["sparse"] * (len(kinds) - k):
        raise ConfigError(f"{spec.model_type}: dense layers after sparse ones cannot be written as {key}")
    return k


def _write_depth_kinds(cfg: dict[str, Any], spec: ModelSpec) -> None:
    """The config keys that say which layers are dense or sparse and which apply RoPE, rewritten for the layers
    `spec` keeps (a trace's cut holds one layer of each kind), in the spelling the model type reads."""
    n = spec.num_layers
    own = with_depth_defaults(cfg)  # the keys the model type reads, its defaults included
    if spec.mlp_layer_types:
        kinds = list(spec.mlp_layer_types)
        if "mlp_layer_types" in cfg or _takes_mlp_layer_types(str(cfg.get("model_type"))):
            # (a class that derives its own list, GLM-4.7-Flash's glm4_moe_lite, ignores first_k_dense_replace)
            cfg["mlp_layer_types"] = kinds
        elif "moe_layers" in own or "interleave_moe_layer_step" in own:
            cfg["moe_layers"] = [i for i, x in enumerate(kinds) if x == "sparse"]
        elif own.get("moe_layer_start_index") is not None:  # ERNIE-4.5-MoE's range of sparse layers
            k = _dense_first(kinds, spec, "moe_layer_start_index")
            cfg.update(moe_layer_start_index=k, moe_layer_end_index=n - 1, moe_layer_interval=1)
        elif own.get("first_k_dense_replace"):
            cfg["first_k_dense_replace"] = _dense_first(kinds, spec, "first_k_dense_replace")
        elif own.get("num_dense_layers"):
            cfg["num_dense_layers"] = _dense_first(kinds, spec, "num_dense_layers")
        else:
            cfg["mlp_only_layers"] = [i for i, x in enumerate(kinds) if x == "dense"]
            cfg["decoder_sparse_step"] = 1
    elif isinstance(cfg.get("mlp_layer_types"), list) and cfg["mlp_layer_types"]:
        cfg["mlp_layer_types"] = [cfg["mlp_layer_types"][0]] * n  # every layer alike
    if spec.rope_layers:
        cfg["no_rope_layers"] = [int(x) for x in spec.rope_layers]
    elif any(k in own for k in ROPE_DEPTH_KEYS):
        cfg["no_rope_layers"] = [1] * n


def _global_attr(cfg: Any, key: str) -> Any:
    """A config's model-wide value of `key`, or None where it has none: transformers' heterogeneous configs
    (Gemma-4's per-layer head size and KV heads) raise on a model-wide read of a per-layer attribute."""
    try:
        return getattr(cfg, key, None)
    except Exception:  # AmbiguousGlobalPerLayerAttributeError
        return None


def depth_sized_inputs(spec: ModelSpec) -> bool:
    """Whether the model's embedding holds tables sized by its depth (Gemma-3n/4's per-layer input embeddings,
    `hidden_size_per_layer_input`, its class default included): a cut of its layers would shrink them, so it is
    traced whole."""
    if spec.builder != Builder.HF or not spec.hf_config:
        return False
    return bool(getattr(_config_object(json.loads(spec.hf_config)), "hidden_size_per_layer_input", 0) or 0)


def _cut_per_layer_config(cfg: dict[str, Any], spec: ModelSpec) -> None:
    """The whole model's per-layer overrides (one per attention type: the parser refused any other pattern),
    rewritten for the layers `spec` keeps, each its own copy (a TP split divides them in place). Called while `cfg`
    still describes the whole model. A null per_layer_config is dropped: Gemma-4's class derives the list (from
    global_head_dim, num_global_key_value_heads) only where the key is absent."""
    if "per_layer_config" in cfg and cfg["per_layer_config"] is None:
        del cfg["per_layer_config"]
    if not cfg.get("per_layer_config"):
        return
    n = int(cfg.get("num_hidden_layers") or 0)
    types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else ["full_attention"] * n
    by_type = per_layer_overrides_by_type(cfg, types)
    cfg["per_layer_config"] = {i: dict(by_type[t]) for i in range(spec.num_layers)
                               if (t := spec.layer_type(i)) in by_type}


def _config_object(cfg: dict[str, Any]) -> Any:
    """transformers' config object of a config.json dict (its `model_type` included), or a one-line refusal
    carrying the model type's own check."""
    cfg = dict(cfg)
    mt = cfg.pop("model_type")
    try:
        return _transformers().AutoConfig.for_model(mt, **cfg)
    except Exception as e:  # a model type's own config checks, in one line
        # the reason, not only its heading (a validator's message puts the why on the following lines)
        why = " ".join(x.strip() for x in str(e).splitlines() if x.strip()) or type(e).__name__
        if len(why) > 330:  # its end says what was given ("... but got [...]"): kept, the middle cut
            why = why[:150] + " ... " + why[-175:]
        raise ConfigError(f"transformers {_transformers().__version__} cannot build a {mt!r} config: {why}") from None


def attention_implementation(cfg: Any) -> str:
    """SDPA, as transformers picks by default, or eager for a model type whose attention SDPA cannot express
    (GPT-OSS's attention sinks): what `from_config` without an attn_implementation builds on a GPU."""
    cls = _transformers().AutoModelForCausalLM._model_mapping.get(type(cfg), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


@functools.cache
def gated_delta_fallback(model_type: str) -> bool:
    """Whether a model type's linear-attention layers are the gated delta rule (Qwen3-Next, Qwen3.5, OLMo-Hybrid) and
    run transformers' torch fallback here: the module defines `torch_chunk_gated_delta_rule` and the fast path's
    packages are absent, so its layers are plain aten operators a trace follows (chunk by chunk, every chunk a
    fixed count of operators). Other recurrent or linear layers (Mamba's scans, MiniMax's lightning attention) are
    not."""
    import importlib
    import importlib.util

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    try:
        mod = importlib.import_module(f"transformers.models.{model_type_to_module_name(model_type)}.modeling_"
                                      f"{model_type_to_module_name(model_type)}")
    except Exception:  # not a transformers model type with its own modeling module
        return False
    # (transformers picks each function when the module is imported: flash-linear-attention's kernel where `fla`
    # imports, causal-conv1d's where it does; the torch function only where neither is installed)
    return hasattr(mod, "torch_chunk_gated_delta_rule") and not gated_delta_kernels_installed()


def gated_delta_kernels_installed() -> list[str]:
    """The fast-path packages installed here that transformers would trace in place of the torch fallback."""
    import importlib.util

    return [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]


def check_layer_kinds(spec: ModelSpec) -> None:
    """A model type known only to transformers decides itself which layers slide when its config has no
    layer_types: what the spec assumed (every layer, where a window is given) must be what transformers builds."""
    if spec.family != ArchFamily.TRANSFORMERS:
        return
    cfg = json.loads(spec.hf_config)
    _cut_per_layer_config(cfg, spec)  # (by the spec's layer types: the parser's reading, checked below)
    cfg["num_hidden_layers"] = spec.num_layers
    # (a class may edit it; its legacy names it renames, as the parser did)
    given = [LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in cfg["layer_types"]] \
        if isinstance(cfg.get("layer_types"), list) else None
    obj = _config_object(cfg)
    # chunked attention (Llama-4) is SDPA with a mask, as sliding windows are; other kinds (recurrent, linear or
    # hybrid layers), whether the config lists them or transformers derives them, are refused for that reason
    built = getattr(obj, "layer_types", None)
    if given is not None and isinstance(built, list | tuple) and list(built) != given:
        # a class that rewrites the list it is given (Gemma-4 makes its last layer full attention)
        kinds = {k: list(built).count(k) for k in dict.fromkeys(built)}
        raise ConfigError(f"{spec.model_type}: transformers builds its layers as {kinds}, not as layer_types reads "
                          f"(e.g. the last layer full attention): give the layer_types it builds")
    own_types = built if "layer_types" not in cfg else None
    listed = [*spec.layer_types, *(own_types if isinstance(own_types, list | tuple) else ())]
    other = [k for k in dict.fromkeys(map(str, listed))
             if k not in ("full_attention", "sliding_attention", "chunked_attention")
             and not (k == LINEAR_ATTENTION and gated_delta_fallback(spec.model_type))]
    if other == [LINEAR_ATTENTION] and (kernels := gated_delta_kernels_installed()):
        raise ConfigError(f"{spec.model_type}: {' and '.join(kernels)} is installed here, so "
                          "transformers would trace its kernels, which are not profiled; predict where neither fla "
                          "nor causal_conv1d is installed (transformers' torch fallback is what is modelled)")
    if other:
        raise ConfigError(f"{spec.model_type}: layers of kind {', '.join(other)} (recurrent, linear or hybrid "
                          "attention: their kernels and state are not profiled here) are not modelled")
    # which layers are dense or sparse and which apply RoPE, by the model type's own defaults too
    own_dict = obj.to_dict()
    try:
        own_kinds = depth_kinds(own_dict, spec.num_layers)
    except ConfigError as e:
        raise ConfigError(f"{spec.model_type}: {e}") from None
    if own_kinds != (spec.mlp_layer_types, spec.rope_layers):
        def count(xs: tuple[Any, ...]) -> dict[str, int]:
            return {str(k): xs.count(k) for k in dict.fromkeys(xs)}

        raise ConfigError(f"{spec.model_type}: transformers builds its layers' MLPs as "
                          f"{count(own_kinds[0]) or 'all alike'} and RoPE as {count(own_kinds[1]) or 'everywhere'}, "
                          f"not as the config reads; give first_k_dense_replace / mlp_layer_types / no_rope_layers "
                          f"in the config")
    if own_types is None:
        return  # the config says (and the parser read it), or transformers' class derives no list
    assumed = list(spec.layer_types) or ["full_attention"] * spec.num_layers
    if list(own_types)[:spec.num_layers] != assumed:
        kinds = {k: list(own_types).count(k) for k in dict.fromkeys(own_types)}
        raise ConfigError(f"{spec.model_type}: transformers builds its layers as {kinds}, not as the config reads; give "
                          f"layer_types in the config")


def _check_layer_kinds_built(layers: nn.ModuleList, spec: ModelSpec) -> None:
    """The module transformers built from a cut's config holds the layer kinds the spec says: layers of one kind
    alike, of different MLP kinds different, RoPE where the spec has it (where the attention says)."""
    seen: dict[str, tuple[Any, ...]] = {}
    mlps: dict[str, tuple[Any, ...]] = {}
    for i, layer in enumerate(layers):
        shapes = tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())
        rope = getattr(_attn_or_none(layer), "use_rope", None)
        if spec.rope_layers and rope is not None and bool(rope) != spec.rope_layers[i]:
            raise ConfigError(f"{spec.model_type}: layer {i} of the traced cut applies RoPE {bool(rope)}, the config "
                              f"reads {spec.rope_layers[i]}; for this model use `tp-query trace`")
        kind = spec.layer_kind(i)
        if seen.setdefault(kind, shapes) != shapes:
            raise ConfigError(f"{spec.model_type}: layers of one kind ({kind}) differ in the traced cut; for this "
                              f"model use `tp-query trace`")
        if spec.mlp_layer_types:
            mk = spec.mlp_layer_types[i]
            experts = _holds_experts(layer)
            if mk in ("dense", "sparse") and experts != (mk == "sparse"):
                raise ConfigError(f"{spec.model_type}: layer {i} of the traced cut is {'sparse' if experts else 'dense'}"
                                  f", the config reads {mk}; for this model use `tp-query trace`")
            if any(v == shapes for k, v in mlps.items() if k != mk):
                raise ConfigError(f"{spec.model_type}: its {mk} and other MLP layers came out alike in the traced cut; "
                                  f"for this model use `tp-query trace`")
            mlps.setdefault(mk, shapes)


def _check_generic_split(local: nn.Module, spec: ModelSpec, tp: int) -> None:
    """A model type known only to transformers runs under TP when its divided config builds Megatron's split:
    the embedding and LM head divided over the vocabulary; in every attention and dense MLP block each matrix
    divided along one dimension (column- or row-parallel), none whole but row-parallel biases; in a routed-expert
    block the router and gates whole besides; norms between the blocks whole. Anything else (multi-head latent
    attention's whole down-projections, sizes under keys the split does not divide, a head size derived from the
    divided heads) is refused in one line, never priced as if split."""
    from torch._guards import detect_fake_mode

    whole_cfg = hf_config_for(spec, Shard())
    # built as the rank's module is (under the trace's fake mode), or on the meta device: no memory either way
    with contextlib.nullcontext() if detect_fake_mode() is not None else torch.device("meta"):
        whole = _transformers().AutoModelForCausalLM.from_config(
            whole_cfg, attn_implementation=attention_implementation(whole_cfg))
    mt = spec.model_type
    names = {m: prefix for prefix, m in whole.named_modules()}
    full = {n: tuple(p.shape) for n, p in whole.named_parameters()}
    block_of: dict[str, tuple[str, str]] = {}  # parameter -> (its block's module name, block kind)
    for layer in _base_and_layers(whole, mt)[1]:
        for mod, kind in ((_attn_attr(layer), "attention"), (_mlp_attr(layer), "MLP")):
            routed = kind == "MLP" and _holds_experts(mod)
            for n, _ in mod.named_parameters():
                block_of[f"{names[mod]}.{n}"] = (names[mod], "routed-expert" if routed else kind)
    head = names[whole.get_output_embeddings()]  # a column-parallel LM head: its bias (Phi-2) is divided too
    vocab_split = {f"{names[whole.get_input_embeddings()]}.weight", f"{head}.weight", f"{head}.bias"}
    divided: set[str] = set()

    def refuse(what: str) -> UnsupportedSplit:
        return UnsupportedSplit(f"TP={tp}: {mt}'s {what}; its tensor-parallel layout is not modelled (use --tp 1)")

    for n, p in local.named_parameters():
        f, s = full.get(n), tuple(p.shape)
        if f is None or len(f) != len(s):
            raise refuse(f"divided config builds {n} {list(s)}, not a part of the whole model's")
        dims = [d for d in range(len(f)) if f[d] != s[d]]
        split = len(dims) == 1 and f[dims[0]] == s[dims[0]] * tp
        if dims and not split:
            raise refuse(f"{n} is {list(s)} per rank against {list(f)} whole, not one dimension divided by {tp}")
        block, kind = block_of.get(n, ("", ""))
        if n in vocab_split:
            if not split:
                raise refuse(f"{n} is not divided over the vocabulary")
        elif not block:
            if split:
                raise refuse(f"{n}, outside its attention and MLP blocks, comes out divided")
        elif split:
            divided.add(block)
        elif len(s) >= 2 and not n.endswith("bias") and not (kind == "routed-expert"
                                                             and _is_router(n[len(block) + 1:])):
            raise refuse(f"{n} {list(f)} stays whole on every rank inside its {kind} block (not a column or row "
                         f"split)")
    for block, kind in sorted(set(block_of.values())):
        if block not in divided:
            raise refuse(f"{kind} block {block} holds nothing the divided config splits")


def _is_router(name: str) -> bool:
    """A routed block's matrices that stay whole on every rank: its router (`gate` or `router`) and a shared
    expert's gate, outside the experts."""
    return name.split(".")[0] in ("gate", "router", "shared_expert_gate")


def _find(obj: nn.Module, names: tuple[str, ...], what: str, mt: str) -> Any:
    for n in names:
        if hasattr(obj, n):
            return getattr(obj, n)
    raise ConfigError(f"transformers' {mt} module has no {what} ({' / '.join(names)}) where decoder models keep "
                      f"it; for this model use `tp-query trace`")


class _Section(nn.Module):
    """A named holder so that parameter names read embed.* / layers.i.* / head.* like the native builder."""


class HFCausalLM(nn.Module):
    """transformers' CausalLM with the capture's sections: `embed` (token embedding, masks, rotary tables),
    `layers`, `head` (final norm, LM head, loss)."""

    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        quiet_imports()
        AutoModelForCausalLM = _transformers().AutoModelForCausalLM

        _patch_packed_check()
        self.generic = spec.family == ArchFamily.TRANSFORMERS
        if spec.is_moe or self.generic:
            _patch_grouped_mm_cuda_path()
        self.spec, self.shard = spec, shard
        cfg = hf_config_for(spec, shard)
        try:
            hf = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention_implementation(cfg))
        except Exception as e:  # a model type's own construction checks, in one line
            raise ConfigError(f"transformers cannot build {spec.model_type!r} for causal-LM training: "
                              f"{first_line(e)}") from None
        _patch_longrope(hf)
        mt = spec.model_type
        base, layers = _base_and_layers(hf, mt)
        self.embed = _Section()  # registered before the layers: the parameters' order is the model's
        self.embed.embed_tokens = base.get_input_embeddings()
        self.layers = layers
        self.head = _Section()
        self.head.norm = _find(base, ("norm", "final_layer_norm", "final_layernorm", "ln_f"), "final norm", mt)
        self.head.lm_head = hf.get_output_embeddings()
        if not isinstance(self.layers, nn.ModuleList) or not isinstance(self.head.lm_head, nn.Linear):
            raise ConfigError(f"transformers' {mt} module is not a plain decoder (layer list and LM head); for this "
                              f"model use `tp-query trace`")
        if self.generic:
            _check_layer_kinds_built(self.layers, spec)
            if shard.tp > 1:
                _check_generic_split(hf, spec, shard.tp)
        self.hf = hf
        self.base = base
        self.final_softcap = getattr(hf.config, "final_logit_softcapping", None)
        self.region = TPRegion(shard)
        self._hooks: list[Any] = []
        if shard.recompute:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if shard.tp > 1:
            self._install_tp_hooks()

    # -- sections the capture hooks onto --------------------------------------------------------
    def section_modules(self) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
        """(module that opens the embed section, layers, module that opens the head section)."""
        return (cast(nn.Module, self.embed.embed_tokens), cast(nn.ModuleList, self.layers),
                cast(nn.Module, self.head.norm))

    # -- tensor parallelism -----------------------------------------------------------------------
    def _install_tp_hooks(self) -> None:
        region = self.region
        shard = self.shard

        def enter_pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            whole = mod in routed  # DTensor plans a routed-expert block as one unit
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": region.enter(kwargs["hidden_states"], whole)}
                return args, kwargs
            return (region.enter(args[0], whole), *args[1:]), kwargs

        def leave_post(mod: nn.Module, args: Any, out: Any) -> Any:
            if isinstance(out, tuple):
                return (region.leave(out[0]), *out[1:])
            return region.leave(out)

        # a block of routed experts (its parameters named so by transformers); a dense MLP of an MoE model is not
        routed = {mlp for mlp in map(_mlp_attr, self.layers) if _holds_experts(mlp)}
        for layer in self.layers:
            for block in (_attn_attr(layer), _mlp_attr(layer)):
                self._hooks.append(block.register_forward_pre_hook(enter_pre, with_kwargs=True))
                self._hooks.append(block.register_forward_hook(leave_post))
                if block not in routed:
                    region.enter_consumers(block)

        emb = cast(nn.Embedding, self.embed.embed_tokens)
        vocab = emb.num_embeddings
        state: dict[str, torch.Tensor] = {}

        def emb_pre(mod: nn.Module, args: tuple[Any, ...]) -> Any:
            input_ids = args[0]
            input_mask = (input_ids < 0) | (input_ids >= vocab)
            masked_input = input_ids.clone() - 0
            masked_input[input_mask] = 0
            state["mask"] = input_mask
            return (masked_input, *args[1:])

        def emb_post(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            out[state.pop("mask"), :] = 0.0
            if shard.sequence_parallel:
                return _ScatterSP.apply(out, shard.tp)
            return _ReduceFromTP.apply(out)

        self._hooks.append(emb.register_forward_pre_hook(emb_pre))
        self._hooks.append(emb.register_forward_hook(emb_post))

        if self.generic:  # the LM head is column-parallel: its input enters the region (backward all-reduce)
            def head_pre(mod: nn.Module, args: tuple[Any, ...]) -> Any:
                return (region.enter(args[0], whole=True), *args[1:])

            self._hooks.append(cast(nn.Module, self.head.lm_head).register_forward_pre_hook(head_pre))

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.generic and self.shard.tp == 1:  # the model type's own head and loss (its logit scalings
            # included), as a user's step runs
            return cast(torch.Tensor, self.hf(input_ids=input_ids, labels=labels, use_cache=False).loss)
        if self.generic:  # its own logits (scalings and softcaps included), the loss over vocab-sharded logits
            logits = self.hf(input_ids=input_ids, use_cache=False).logits
            return causal_lm_loss(logits, labels, cast(nn.Linear, self.head.lm_head).out_features, self.shard)
        kw: dict[str, Any] = {}
        if self.region.sp:  # the embedding's output holds seq/TP tokens: positions come from the full sequence
            kw["position_ids"] = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden_states = self.base(input_ids=input_ids, use_cache=False, **kw).last_hidden_state
        hidden_states = self.region.enter(hidden_states, whole=True)
        lm_head = cast(nn.Linear, self.head.lm_head)
        logits = lm_head(hidden_states[:, slice(0, None), :])
        if self.final_softcap is not None:
            logits = logits / self.final_softcap
            logits = torch.tanh(logits)
            logits = logits * self.final_softcap
        vocab = lm_head.out_features
        return causal_lm_loss(logits, labels, vocab, self.shard)
