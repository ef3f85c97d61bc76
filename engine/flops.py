"""Model FLOPs and parameters the way users compare them: Megatron-LM's count of a training iteration
(`num_floating_point_operations` in megatron/training/training.py) and a parameter count from the config.

Model FLOPs count the math a step needs (forward and backward, no recomputation, full causal attention
matrix as Megatron counts it); hardware FLOPs (the sum over the operators the GPUs run, recomputation
and optimizer included) come from the operator registry. MFU divides model FLOPs by the datasheet peak.
"""

from __future__ import annotations

from typing import Any

_DIMS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")


def _dims(model: dict[str, Any]) -> tuple[int, ...] | None:
    """(hidden, layers, heads, KV heads, head dim, FFN, vocabulary) of a parsed model spec, or None."""
    try:
        return tuple(int(model[k]) for k in _DIMS)
    except (KeyError, TypeError, ValueError):
        return None


def megatron_model_flops(model: dict[str, Any], global_batch: int, seq_len: int) -> float | None:
    """Megatron-LM's formula for a GPT with GQA and a (gated) MLP, per iteration of `global_batch` sequences."""
    dims = _dims(model)
    if dims is None:
        return None
    h, layers, heads, groups, head_dim, ffn, vocab = dims
    gated = 1.5 if model.get("family") == "llama" else 1.0  # SwiGLU: three matrices instead of two
    q_ratio = head_dim * heads / h
    return (12.0 * global_batch * seq_len * layers * h * h
            * ((1 + groups / heads + seq_len / h) * q_ratio + (ffn / h) * gated + vocab / (2 * layers * h)))


def parameter_count(model: dict[str, Any]) -> int | None:
    """Parameters of the whole model (every TP rank and stage together), from its config."""
    dims = _dims(model)
    if dims is None:
        return None
    h, layers, heads, kv, hd, ffn, vocab = dims
    gpt2 = model.get("family") == "gpt2"
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if model.get("qkv_bias"):
        attn += heads * hd + 2 * kv * hd
    if model.get("o_bias"):
        attn += h
    mlp = (2 if gpt2 else 3) * h * ffn + ((ffn + h) if model.get("mlp_bias") else 0)
    norms = (4 if gpt2 else 2) * h  # GPT-2's LayerNorms have biases
    embed = vocab * h + (int(model.get("max_position_embeddings", 0)) * h if gpt2 else 0)
    head = 0 if model.get("tie_word_embeddings") else vocab * h
    final_norm = (2 if gpt2 else 1) * h
    return embed + layers * (attn + mlp + norms) + final_norm + head
