"""Model FLOPs and parameters the way users compare them: Megatron-LM's count of a training iteration
(`num_floating_point_operations` in megatron/training/training.py) and a parameter count from the config.

Model FLOPs count the math a step needs (forward and backward, no recomputation, full causal attention
matrix as Megatron counts it); hardware FLOPs (the sum over the operators the GPUs run, recomputation
and optimizer included) come from the operator registry. MFU divides model FLOPs by the datasheet peak.
"""

from __future__ import annotations

from typing import Any


def megatron_model_flops(model: dict[str, Any], global_batch: int, seq_len: int) -> float | None:
    """Megatron-LM's formula for a GPT with GQA and a (gated) MLP, per iteration of `global_batch` sequences."""
    try:
        h = int(model["hidden_size"])
        layers = int(model["num_layers"])
        heads = int(model["num_heads"])
        groups = int(model["num_kv_heads"])
        head_dim = int(model["head_dim"])
        ffn = int(model["intermediate_size"])
        vocab = int(model["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    gated = 1.5 if model.get("family") == "llama" else 1.0  # SwiGLU: three matrices instead of two
    q_ratio = head_dim * heads / h
    return (12.0 * global_batch * seq_len * layers * h * h
            * ((1 + groups / heads + seq_len / h) * q_ratio + (ffn / h) * gated + vocab / (2 * layers * h)))


def parameter_count(model: dict[str, Any]) -> int | None:
    """Parameters of the whole model (every TP rank and stage together), from its config."""
    try:
        h = int(model["hidden_size"])
        layers = int(model["num_layers"])
        heads = int(model["num_heads"])
        kv = int(model["num_kv_heads"])
        hd = int(model["head_dim"])
        ffn = int(model["intermediate_size"])
        vocab = int(model["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
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
