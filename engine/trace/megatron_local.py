"""Megatron-Core's GPTModel with its local layer spec (`get_gpt_layer_local_spec(normalization="RMSNorm")`,
no Transformer Engine, no apex), op for op as megatron-core 0.19 runs it on CUDA: [s, b, h] layout, fused
QKV and gate/up projections, unfused rotary embedding, unfused core attention (baddbmm, masked softmax in
fp32, bmm) with GQA by repeat_interleave, torch RMSNorm, vocab-parallel cross-entropy on fp32 logits.

The blocks keep the module tree of models.CausalLM (embed / layers / head) so the capture attributes every
operator to its section as it does for the HuggingFace families.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tp_query.schema.model_config import ArchFamily, ModelSpec

from .models import CausalLM, Shard, TPRegion, _ReduceFromTP, _ScatterSP, emit_comm


class MegatronRMSNorm(nn.Module):
    """torch.nn.RMSNorm (megatron/core/transformer/torch_norm.py without TE/apex)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """_apply_rotary_pos_emb_bshd: cos/sin of the frequencies at every call, in the activations' dtype."""
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_ = torch.cos(freqs).to(t.dtype)
    sin_ = torch.sin(freqs).to(t.dtype)
    t = (t * cos_) + (_rotate_half(t) * sin_)
    return torch.cat((t, t_pass), dim=-1)


class MegatronAttention(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        tp = shard.tp
        self.hn = spec.head_dim
        self.np = spec.num_heads // tp
        self.ng = spec.num_kv_heads // tp
        h = spec.hidden_size
        self.linear_qkv = nn.Linear(h, (self.np + 2 * self.ng) * self.hn, bias=spec.qkv_bias)
        self.linear_proj = nn.Linear(self.np * self.hn, h, bias=False)
        self.softmax_scale = self.hn ** -0.5

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.np // self.ng > 1:
            k = k.repeat_interleave(self.np // self.ng, dim=2)
            v = v.repeat_interleave(self.np // self.ng, dim=2)
        sq, b, np_, hn = q.shape
        sk = k.shape[0]
        q = q.reshape(sq, b * np_, -1)
        k = k.view(sk, b * np_, -1)
        buf = torch.empty((b * np_, sq, sk), dtype=q.dtype, device=q.device)  # the global memory buffer
        scores = torch.baddbmm(buf, q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2), beta=0.0,
                               alpha=self.softmax_scale).view(b, np_, sq, sk)
        dtype = scores.dtype
        x = scores.float() if dtype in (torch.float16, torch.bfloat16) else scores
        if x is scores:
            x = x.clone()
        x.masked_fill_(mask, -10000.0)  # attention_mask_func, in place on the fp32 copy
        probs = torch.softmax(x, dim=-1)
        if dtype in (torch.float16, torch.bfloat16):
            probs = probs.to(dtype)
        v = v.view(v.size(0), b * np_, -1)
        context = torch.bmm(probs.view(b * np_, sq, -1), v.transpose(0, 1))
        context = context.view(b, np_, sq, hn).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, np_ * hn)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        sq, b, _ = x.shape
        mixed = self.linear_qkv(x).view(sq, b, self.ng, (self.np // self.ng + 2) * self.hn)
        q, k, v = torch.split(mixed, [self.np // self.ng * self.hn, self.hn, self.hn], dim=3)
        q = q.reshape(sq, b, -1, self.hn)
        q = _apply_rotary(q, freqs)
        k = _apply_rotary(k, freqs)
        return self.linear_proj(self.core_attention(q, k, v, mask))


class MegatronMLP(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        inter = spec.intermediate_size // shard.tp
        self.linear_fc1 = nn.Linear(spec.hidden_size, 2 * inter, bias=False)
        self.linear_fc2 = nn.Linear(inter, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, g = torch.chunk(self.linear_fc1(x), 2, dim=-1)
        return self.linear_fc2(F.silu(a) * g)


class MegatronLayer(nn.Module):
    """TransformerLayer: norm, self-attention, bias-dropout-add (no bias, dropout 0: an add), norm, MLP, add."""

    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        self.input_layernorm = MegatronRMSNorm(spec.hidden_size, spec.norm_eps)
        self.self_attention = MegatronAttention(spec, shard)
        self.pre_mlp_layernorm = MegatronRMSNorm(spec.hidden_size, spec.norm_eps)
        self.mlp = MegatronMLP(spec, shard)
        self.region = TPRegion(shard)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        freqs, mask = rope
        h = self.region.leave(self.self_attention(self.region.enter(self.input_layernorm(x)), freqs, mask))
        x = x + h
        h = self.region.leave(self.mlp(self.region.enter(self.pre_mlp_layernorm(x))))
        return x + h


class MegatronEmbed(nn.Module):
    """LanguageModelEmbedding (vocab-parallel, then [b, s, h] -> [s, b, h]) and the rotary frequencies."""

    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        self.spec, self.shard = spec, shard
        self.embed_tokens = nn.Embedding(spec.vocab_size // shard.tp, spec.hidden_size)
        dim = spec.head_dim
        inv = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self.shard.tp > 1:
            vocab = self.embed_tokens.num_embeddings
            input_mask = (input_ids < 0) | (input_ids >= vocab)
            masked = input_ids.clone()
            masked[input_mask] = 0
            out = F.embedding(masked, self.embed_tokens.weight)
            out[input_mask, :] = 0.0
            out = out.transpose(0, 1).contiguous()
            out = _ScatterSP.apply(out, self.shard.tp) if self.shard.sequence_parallel else _ReduceFromTP.apply(out)
        else:
            out = F.embedding(input_ids, self.embed_tokens.weight).transpose(0, 1).contiguous()
        s = input_ids.shape[1]
        inv: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        seq = torch.arange(s, device=out.device, dtype=inv.dtype)
        freqs = torch.outer(seq, inv)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        # the boolean causal mask the GPT dataset hands every layer (True = masked)
        mask = torch.triu(torch.ones((s, s), dtype=torch.bool, device=out.device), diagonal=1)[None, None]
        return out, (emb, mask)


class _MegatronVocabParallelCE(torch.autograd.Function):
    """megatron/core/tensor_parallel/cross_entropy.py (0.19) as it runs: the fp32 copy of the logits is
    made inside, then shifted, exponentiated and normalised in place (one logits-sized fp32 buffer,
    saved as the softmax for backward); the TP all-reduces of the max, the predicted logit and the sum."""

    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        vocab_parallel_logits = vocab_parallel_logits.float()
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        emit_comm("all_reduce", logits_max)
        vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)
        vocab = vocab_parallel_logits.size()[-1]
        target_mask = (target < 0) | (target >= vocab)
        masked_target = target.clone() - 0
        masked_target[target_mask] = 0
        logits_2d = vocab_parallel_logits.view(-1, vocab)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
        predicted_logits_1d = predicted_logits_1d.clone().contiguous()
        predicted_logits = predicted_logits_1d.view_as(target)
        predicted_logits[target_mask] = 0.0
        exp_logits = vocab_parallel_logits
        torch.exp(vocab_parallel_logits, out=exp_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        emit_comm("all_reduce", predicted_logits)
        emit_comm("all_reduce", sum_exp_logits)
        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax
        vocab = softmax.size()[-1]
        grad_2d = grad_input.view(-1, vocab)
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        softmax_update = 1.0 - target_mask.view(-1).float()
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None


class MegatronHead(nn.Module):
    """Final norm, output layer (column-parallel), vocab-parallel cross-entropy on fp32 logits, token mean."""

    def __init__(self, spec: ModelSpec, shard: Shard, tied: nn.Embedding | None) -> None:
        super().__init__()
        self.spec, self.shard = spec, shard
        self.norm = MegatronRMSNorm(spec.hidden_size, spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size // shard.tp, bias=False)
        if tied is not None:
            self.lm_head.weight = tied.weight
        self.region = TPRegion(shard)

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.region.enter(self.norm(hidden_states))
        logits = self.lm_head(x)  # [s, b, v / tp]
        losses = _MegatronVocabParallelCE.apply(logits, labels.transpose(0, 1).contiguous())
        losses = losses.transpose(0, 1).contiguous().float()
        return torch.sum(losses.view(-1)) / losses.numel()


class MegatronGPT(CausalLM):
    """GPTModel(transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"))."""

    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        nn.Module.__init__(self)
        if spec.family != ArchFamily.LLAMA:
            raise ValueError(f"Megatron-Core's local GPT spec is modelled for Llama-family configs, not {spec.family}")
        self.spec = spec
        self.shard = shard
        self.embed = MegatronEmbed(spec, shard)  # type: ignore[assignment]
        self.layers = nn.ModuleList([MegatronLayer(spec, shard) for _ in range(spec.num_layers)])
        self.head = MegatronHead(spec, shard, self.embed.embed_tokens if spec.tie_word_embeddings else None)  # type: ignore[assignment]
