"""Model FLOPs and parameters the way users compare them: Megatron-LM's count of a training iteration
(`num_floating_point_operations` in megatron/training/training.py) and a parameter count from the config.

Model FLOPs count the math a step needs (forward and backward, no recomputation, full causal attention
matrix as Megatron counts it); hardware FLOPs (the sum over the operators the GPUs run, recomputation
and optimizer included) come from the operator registry. MFU divides model FLOPs by the datasheet peak.
"""

from __future__ import annotations

from typing import Any

from tp_query.schema.model_config import parameter_count as _parameter_count

from .graph import Graph, layer_template_of

_DIMS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")


def _dims(model: dict[str, Any]) -> tuple[int, ...] | None:
    """(hidden, layers, heads, KV heads, head dim, FFN, vocabulary) of a parsed model spec, or None."""
    try:
        return tuple(int(model[k]) for k in _DIMS)
    except (KeyError, TypeError, ValueError):
        return None


def megatron_model_flops(model: dict[str, Any], global_batch: int, seq_len: int) -> float | None:
    """Megatron-LM's formula for a GPT with GQA, a (gated) MLP and MoE (routed top-k plus shared experts),
    per iteration of `global_batch` sequences. Sliding windows are counted as full attention, as Megatron
    does."""
    dims = _dims(model)
    if dims is None or model.get("family") == "transformers":  # its blocks are transformers', not Megatron's GPT
        return None
    h, layers, heads, groups, head_dim, ffn, vocab = dims
    gated = 1.5 if model.get("gated_mlp", model.get("family") != "gpt2") else 1.0  # SwiGLU: three matrices
    experts = int(model.get("num_experts") or 0)
    if experts:
        ffn_terms = (int(model["experts_per_token"]) * int(model["moe_intermediate_size"])
                     + int(model.get("shared_expert_intermediate_size") or 0)) / h * gated
    else:
        ffn_terms = (ffn / h) * gated
    q_ratio = head_dim * heads / h
    return (12.0 * global_batch * seq_len * layers * h * h
            * ((1 + groups / heads + seq_len / h) * q_ratio + ffn_terms + vocab / (2 * layers * h)))


def parameter_count(model: dict[str, Any]) -> int | None:
    """Parameters of the whole model (every TP rank and stage together), from its config."""
    return _parameter_count(model)


def graph_parameter_count(graph: Graph) -> int:
    """Parameters of the whole model from a traced graph's parameter records: each model layer counts its kind's
    traced template (engine.graph.layer_template_of)."""
    per_layer: dict[int, int] = {}
    rest = 0
    for p in graph.params:
        if p.section.value == "layer":
            per_layer[p.layer] = per_layer.get(p.layer, 0) + p.numel
        else:
            rest += p.numel
    return rest + sum(per_layer.get(t, 0) for t in layer_template_of(graph.meta))
