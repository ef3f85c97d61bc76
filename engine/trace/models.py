"""Training-graph builders for the supported HuggingFace families, written op for op after
transformers 5.17 (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel with
SDPA attention), so that a trace dispatches what a user's HF training step dispatches.

A `Shard` turns the full model into the slice one GPU runs under Megatron-style tensor parallelism:
heads, KV heads, FFN and vocabulary divided by TP, a vocab-parallel embedding, the loss as PyTorch's
`loss_parallel` computes it on vocab-sharded logits, and (with sequence parallelism) norms and
residuals on seq/TP tokens. Communication is not run;
it is recorded as `comm.*` records through `emit_comm`, at the points Megatron-LM communicates.
tests/test_trace_hf.py checks the TP=1 graphs against transformers itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from tp_query.schema.model_config import ArchFamily, Builder, ModelSpec

# Set by the capture while it records: (collective, tensor, group) -> None.
COMM_SINK: list[Callable[[str, torch.Tensor, str], None]] = []


def emit_comm(kind: str, t: torch.Tensor, group: str = "tp") -> None:
    for sink in COMM_SINK:
        sink(kind, t, group)


def emit_sync(t: torch.Tensor) -> None:
    """A host synchronisation (`bool(tensor)` in a real run; a fake run cannot perform it)."""
    for sink in COMM_SINK:
        sink("sync", t, "")


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor"


def packed_sequence_check(position_ids: torch.Tensor, batch_size: int) -> None:
    """transformers' create_causal_mask with no attention mask: find_packed_sequence_indices, whose
    `.all()` test synchronises with the host once per forward."""
    if batch_size != position_ids.shape[0]:
        position_ids = position_ids.expand(batch_size, -1)
    first_dummy_value = position_ids[:, :1] - 1
    position_diff = torch.diff(position_ids, prepend=first_dummy_value, dim=-1)
    packed_sequence_mask = (position_diff != 1).cumsum(-1)
    flag = (packed_sequence_mask[:, -1] == 0).all()
    if _is_fake(flag):
        emit_sync(flag)
    else:
        bool(flag)


@dataclass(frozen=True)
class Shard:
    tp: int = 1
    sequence_parallel: bool = False
    recompute: bool = False
    ep: int = 1  # expert parallelism: each rank holds num_experts / ep routed experts (Megatron-Core)
    moe_imbalance: float = 1.0  # the busiest expert's rows over the mean (1: balanced routing)
    # PyTorch DTensor TP (ColwiseParallel per Linear) rather than Megatron's one region per block
    dtensor: bool = False


# ---------------------------------------------------------------------------------------------
# Megatron-style TP communication points (identity math; the record is what matters)
# ---------------------------------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    """Forward identity, backward all-reduce (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        emit_comm("all_reduce", g)
        return g


class _ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce (output of a row-parallel layer), backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        emit_comm("all_reduce", x)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class _GatherSP(torch.autograd.Function):
    """Sequence parallel: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: int) -> torch.Tensor:
        ctx.tp = tp
        out = x.new_empty((x.shape[0], x.shape[1] * tp, *x.shape[2:]))
        emit_comm("all_gather", out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        emit_comm("reduce_scatter", g)
        return g.new_empty((g.shape[0], g.shape[1] // ctx.tp, *g.shape[2:])), None


class _ScatterSP(torch.autograd.Function):
    """Sequence parallel: reduce-scatter forward (row-parallel output), all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: int) -> torch.Tensor:
        ctx.tp = tp
        emit_comm("reduce_scatter", x)
        return x.new_empty((x.shape[0], x.shape[1] // tp, *x.shape[2:]))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = g.new_empty((g.shape[0], g.shape[1] * ctx.tp, *g.shape[2:]))
        emit_comm("all_gather", out)
        return out, None


class TPRegion:
    """Where a layer enters and leaves the tensor-parallel region."""

    def __init__(self, shard: Shard) -> None:
        self.tp = shard.tp
        self.sp = shard.sequence_parallel and shard.tp > 1
        # DTensor without sequence parallelism: every ColwiseParallel Linear turns the replicated block input
        # into a DTensor of its own, so each one all-reduces its input gradient in backward (5 per Llama
        # layer: q, k, v, gate, up); Megatron's region all-reduces the summed gradient once per block
        self.per_consumer = shard.dtensor and self.tp > 1 and not self.sp

    def enter(self, x: torch.Tensor, whole: bool = False) -> torch.Tensor:
        """`whole`: one all-reduce for the block even under DTensor (a block with one consumer, an LM head,
        or one DTensor plans as a unit)."""
        if self.tp == 1:
            return x
        if self.per_consumer and not whole:
            return x  # the block's consumers enter one by one (enter_consumers)
        return _GatherSP.apply(x, self.tp) if self.sp else _CopyToTP.apply(x)

    def enter_consumers(self, block: nn.Module) -> None:
        """Hooks for DTensor's per-Linear input: each parameterised leaf of `block` that reads the block's own
        input gets its own backward all-reduce. A block whose input no such leaf reads is refused (its
        all-reduce would vanish)."""
        if not self.per_consumer:
            return
        state: dict[str, Any] = {}

        def block_pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            state["x"], state["n"] = kwargs.get("hidden_states", args[0] if args else None), 0

        def block_post(mod: nn.Module, args: Any, out: Any) -> None:
            if not state.get("n"):  # a layout the DTensor model does not know: refused in one line, not guessed
                raise ValueError(f"tensor parallelism under --framework torch: no layer of {type(mod).__name__} "
                                 "reads the block's input, so DTensor's collectives are not modelled for it "
                                 "(use --tp 1, or --framework megatron where the family has it)")

        def leaf_pre(mod: nn.Module, args: tuple[Any, ...]) -> Any:
            if args and args[0] is state.get("x"):
                state["n"] += 1
                return (_CopyToTP.apply(args[0]), *args[1:])
            return None

        block.register_forward_pre_hook(block_pre, with_kwargs=True)
        block.register_forward_hook(block_post)
        for m in block.modules():
            if m is not block and not any(True for _ in m.children()) and any(True for _ in m.parameters(False)):
                m.register_forward_pre_hook(leaf_pre)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return x
        return _ScatterSP.apply(x, self.tp) if self.sp else _ReduceFromTP.apply(x)


# ---------------------------------------------------------------------------------------------
# Llama family (Llama, Mistral, Qwen2)
# ---------------------------------------------------------------------------------------------

class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        dim = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        inv_freq_expanded = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(
            dtype=torch.float, device=x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def sdpa_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, groups: int,
                           dropout: float, scaling: float) -> torch.Tensor:
    """transformers.integrations.sdpa_attention.sdpa_attention_forward for an unpadded batch."""
    sdpa_kwargs: dict[str, Any] = {}
    if groups > 1:
        if not (key.shape[-1] == value.shape[-1] <= 256):
            key = repeat_kv(key, groups)
            value = repeat_kv(value, groups)
        else:
            sdpa_kwargs = {"enable_gqa": True}
    is_causal = query.shape[2] > 1
    attn_output = F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=dropout,
                                                 scale=scaling, is_causal=is_causal, **sdpa_kwargs)
    return attn_output.transpose(1, 2).contiguous()


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        tp = shard.tp
        self.head_dim = spec.head_dim
        self.heads = spec.num_heads // tp
        self.kv_heads = spec.num_kv_heads // tp
        self.num_key_value_groups = self.heads // self.kv_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = spec.attention_dropout
        h = spec.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=spec.o_bias)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output = sdpa_attention_forward(query_states, key_states, value_states, self.num_key_value_groups,
                                             self.attention_dropout if self.training else 0.0, self.scaling)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)




class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        inter = spec.intermediate_size // shard.tp
        h = spec.hidden_size
        self.gate_proj = nn.Linear(h, inter, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(h, inter, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(inter, h, bias=spec.mlp_bias)
        self.act_fn = _ACTS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, shard)
        self.mlp = LlamaMLP(spec, shard)
        self.input_layernorm = LlamaRMSNorm(spec.hidden_size, spec.norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(spec.hidden_size, spec.norm_eps)
        self.region = TPRegion(shard)
        self.region.enter_consumers(self.self_attn)
        self.region.enter_consumers(self.mlp)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.region.leave(self.self_attn(self.region.enter(hidden_states), position_embeddings))
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.region.leave(self.mlp(self.region.enter(hidden_states)))
        return residual + hidden_states


# ---------------------------------------------------------------------------------------------
# GPT-2
# ---------------------------------------------------------------------------------------------

class Conv1D(nn.Module):
    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def new_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# keyed by schema.model_config.NATIVE_LLAMA_ACTS and GPT2_ACTS (tests/test_trace.py holds them equal)
_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu_new": new_gelu,
}
_GPT2_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": new_gelu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GPT2Attention(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.num_heads = spec.num_heads // shard.tp
        self.split_size = self.num_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.c_attn = Conv1D(3 * self.split_size, spec.hidden_size)
        self.c_proj = Conv1D(spec.hidden_size, self.split_size)
        self.attn_dropout = nn.Dropout(spec.attention_dropout)
        self.resid_dropout = nn.Dropout(spec.resid_dropout)
        self.region = TPRegion(shard)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        query_states, key_states, value_states = self.c_attn(self.region.enter(hidden_states, whole=True)).split(
            self.split_size, dim=2)
        shape_kv = (*key_states.shape[:-1], -1, self.head_dim)
        key_states = key_states.view(shape_kv).transpose(1, 2)
        value_states = value_states.view(shape_kv).transpose(1, 2)
        shape_q = (*query_states.shape[:-1], -1, self.head_dim)
        query_states = query_states.view(shape_q).transpose(1, 2)
        attn_output = sdpa_attention_forward(query_states, key_states, value_states, 1,
                                             self.attn_dropout.p if self.training else 0.0, self.scaling)
        attn_output = attn_output.reshape(*attn_output.shape[:-2], -1).contiguous()
        attn_output = self.region.leave(self.c_proj(attn_output))
        return self.resid_dropout(attn_output)


class GPT2MLP(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        inner = spec.intermediate_size // shard.tp
        self.c_fc = Conv1D(inner, spec.hidden_size)
        self.c_proj = Conv1D(spec.hidden_size, inner)
        self.act = _GPT2_ACTS[spec.hidden_act]
        self.dropout = nn.Dropout(spec.resid_dropout)
        self.region = TPRegion(shard)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.c_fc(self.region.enter(hidden_states, whole=True))
        hidden_states = self.act(hidden_states)
        hidden_states = self.region.leave(self.c_proj(hidden_states))
        return self.dropout(hidden_states)


class GPT2Block(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.attn = GPT2Attention(spec, shard)
        self.ln_2 = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.mlp = GPT2MLP(spec, shard)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output = self.attn(hidden_states)
        hidden_states = attn_output + residual
        residual = hidden_states
        hidden_states = self.ln_2(hidden_states)
        feed_forward_hidden_states = self.mlp(hidden_states)
        return residual + feed_forward_hidden_states


# ---------------------------------------------------------------------------------------------
# Embedding and head sections, vocab-parallel under TP
# ---------------------------------------------------------------------------------------------

def _vocab_parallel_embedding(emb: nn.Embedding, input_ids: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Megatron's VocabParallelEmbedding: mask out-of-shard ids, look up, zero, all-reduce."""
    start = 0
    end = emb.num_embeddings
    input_mask = (input_ids < start) | (input_ids >= end)
    masked_input = input_ids.clone() - start
    masked_input[input_mask] = 0
    out = emb(masked_input)
    out[input_mask, :] = 0.0
    if shard.sequence_parallel:
        return _ScatterSP.apply(out, shard.tp)
    return _ReduceFromTP.apply(out)


class _LossParallelCE(torch.autograd.Function):
    """F.cross_entropy on vocab-sharded DTensor logits under `loss_parallel()` as PyTorch runs it
    (torch/distributed/tensor/parallel/loss.py): a sharded log-softmax (amax and sum-exp all-reduced) whose
    fp32 output is saved, a masked gather all-reduced for the NLL; backward builds the one-hot gradient in
    a zeroed fp32 buffer and returns (grad + exp(log_softmax)) * grad_output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = x.to(dtype=torch.float32, memory_format=torch.contiguous_format)
        x_max = torch.amax(x, -1, keepdim=True)
        emit_comm("all_reduce", x_max)
        shifted = x - x_max
        shifted_sumexp = torch.sum(torch.exp(shifted), -1, keepdim=True)
        emit_comm("all_reduce", shifted_sumexp)
        result = shifted - torch.log(shifted_sumexp)
        vocab = result.shape[-1]
        ignore_mask = target != -100
        safe_target = torch.where(ignore_mask, target, 0)
        mask = (safe_target < 0) | (safe_target >= vocab)  # _MaskPartial: ids of other shards
        masked = (safe_target - 0).masked_fill(mask, 0).unsqueeze(-1)
        picked = torch.gather(result, -1, masked).masked_fill(mask.unsqueeze(-1), 0.0)
        emit_comm("all_reduce", picked)
        loss = torch.where(ignore_mask, -picked.squeeze(-1), 0)
        total_weight = ignore_mask.sum().to(result)
        ctx.save_for_backward(result, target, mask, total_weight)
        return loss.sum() / total_weight

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, target, mask, total_weight = ctx.saved_tensors
        grad_output = grad_output / total_weight
        target = target.unsqueeze(-1)
        safe_target = torch.where(target != -100, target, 0).squeeze(-1).flatten()
        masked_safe_target = safe_target.masked_fill(mask.flatten(), 0)
        grad_input = torch.zeros_like(x)
        grad_update = mask.flatten().to(grad_input.dtype) - 1.0
        arange_1d = torch.arange(masked_safe_target.shape[0], device=masked_safe_target.device)
        grad_input.view(-1, x.shape[-1])[arange_1d, masked_safe_target] = grad_update
        grad_output = torch.where(target != -100, grad_output, 0)
        return (grad_input + torch.exp(x)) * grad_output, None


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, shard: Shard) -> torch.Tensor:
    """transformers' ForCausalLMLoss (TP=1), or under TP>1 the same cross-entropy on vocab-sharded DTensor
    logits within `loss_parallel()` (PyTorch's own sharded log-softmax and NLL)."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=-100)
    shift_labels = labels[..., 1:].contiguous()
    if shard.tp > 1:
        return _LossParallelCE.apply(logits.view(-1, vocab_size), shift_labels.view(-1))
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(logits.device)
    return F.cross_entropy(logits, shift_labels, ignore_index=-100, reduction="mean")


class Embed(nn.Module):
    """Everything before the first layer: token (and position) embeddings, rotary tables."""

    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        self.spec = spec
        self.shard = shard
        vocab = spec.vocab_size // shard.tp
        pad = spec.pad_token_id if shard.tp == 1 else None
        self.embed_tokens = nn.Embedding(vocab, spec.hidden_size, pad)
        if spec.family == ArchFamily.GPT2:
            self.wpe = nn.Embedding(spec.max_position_embeddings, spec.hidden_size)
            self.drop = nn.Dropout(spec.embd_dropout)
        else:
            self.rotary_emb = LlamaRotaryEmbedding(spec)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self.spec.family == ArchFamily.GPT2:
            input_shape = input_ids.size()
            input_ids = input_ids.view(-1, input_shape[-1])
        if self.shard.tp > 1:
            inputs_embeds = _vocab_parallel_embedding(self.embed_tokens, input_ids, self.shard)
        else:
            inputs_embeds = self.embed_tokens(input_ids)
        seq = input_ids.shape[1]
        position_ids = torch.arange(seq, device=inputs_embeds.device) + 0
        position_ids = position_ids.unsqueeze(0)
        if self.spec.family == ArchFamily.GPT2:
            position_embeds = self.wpe(position_ids)
            if self.shard.tp > 1 and self.shard.sequence_parallel:
                position_embeds = position_embeds[:, : inputs_embeds.shape[1]]
            hidden_states = inputs_embeds + position_embeds.to(inputs_embeds.device)
            packed_sequence_check(position_ids, input_ids.shape[0])
            return self.drop(hidden_states), None
        packed_sequence_check(position_ids, input_ids.shape[0])
        return inputs_embeds, self.rotary_emb(inputs_embeds, position_ids=position_ids)


class Head(nn.Module):
    """Everything after the last layer: final norm, LM head, loss."""

    def __init__(self, spec: ModelSpec, shard: Shard, tied: nn.Embedding | None) -> None:
        super().__init__()
        self.spec = spec
        self.shard = shard
        if spec.family == ArchFamily.GPT2:
            self.norm: nn.Module = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        else:
            self.norm = LlamaRMSNorm(spec.hidden_size, spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size // shard.tp, bias=False)
        if tied is not None:
            self.lm_head.weight = tied.weight
        self.region = TPRegion(shard)

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden_states = self.norm(hidden_states)
        if self.spec.family == ArchFamily.GPT2:
            hidden_states = hidden_states.view((-1, *hidden_states.shape[1:]))
        hidden_states = self.region.enter(hidden_states, whole=True)
        slice_indices = slice(0, None)
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        return causal_lm_loss(logits, labels, self.spec.vocab_size // self.shard.tp, self.shard)


class CausalLM(nn.Module):
    """embed -> layers -> head, the module tree the capture attributes operators to."""

    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        self.spec = spec
        self.shard = shard
        self.embed = Embed(spec, shard)
        block = GPT2Block if spec.family == ArchFamily.GPT2 else LlamaDecoderLayer
        self.layers = nn.ModuleList([block(spec, shard) for _ in range(spec.num_layers)])
        self.head = Head(spec, shard, self.embed.embed_tokens if spec.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden_states, position_embeddings = self.embed(input_ids)
        for layer in self.layers:
            if self.shard.recompute and self.training:
                hidden_states = checkpoint(layer, hidden_states, position_embeddings, use_reentrant=False)
            else:
                hidden_states = layer(hidden_states, position_embeddings)
        return self.head(hidden_states, labels)


def build_model(spec: ModelSpec, shard: Shard, framework: str = "torch") -> nn.Module:
    """The module one rank runs: HuggingFace's (PyTorch native stacks; our copy or, for the families the
    spec registry marks `hf`, transformers' own) or Megatron-Core's local GPT spec."""
    if framework == "megatron":
        from .megatron_local import MegatronGPT

        return MegatronGPT(spec, shard)
    if spec.builder == Builder.HF:
        from .hf_models import HFCausalLM

        return HFCausalLM(spec, shard)
    return CausalLM(spec, shard)


def section_modules(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """(module whose forward opens the embed section, the decoder layers, module that opens the head)."""
    own = getattr(model, "section_modules", None)
    if own is not None:
        return own()  # type: ignore[no-any-return]
    return model.embed, model.layers, model.head  # type: ignore[return-value]
