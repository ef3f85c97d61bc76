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
from tp_query.engine.parallel import MEGATRON_MOE_AUX_LOSS_COEFF
from tp_query.schema.model_config import ArchFamily, ModelSpec

from .models import CausalLM, Shard, TPRegion, _ReduceFromTP, _ScatterSP, emit_comm, emit_sync

# what the local spec builds here: dense Llama- and Qwen3-shaped models (Qwen3's qk-norm is Megatron's
# qk_layernorm), and Mixtral- and Qwen3-MoE-shaped MoE (no shared experts; softmax over the top-k logits,
# which is Qwen3-MoE's normalised top-k)
MEGATRON_FAMILIES = (ArchFamily.LLAMA, ArchFamily.MIXTRAL, ArchFamily.QWEN3, ArchFamily.QWEN3_MOE)


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
        # qk_layernorm: RMSNorm over each head's channels, on the split query and key
        self.q_layernorm = MegatronRMSNorm(self.hn, spec.norm_eps) if spec.qk_norm else None
        self.k_layernorm = MegatronRMSNorm(self.hn, spec.norm_eps) if spec.qk_norm else None

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
        # attention_mask_func, in place: on the fp32 copy under --bf16/--fp16; in fp32 on the view of the
        # baddbmm result itself, whose backward autograd runs through CopySlices (a zero fill and four
        # scores-sized copies per layer, in the profile of Megatron's fp32 step on an H200)
        x.masked_fill_(mask, -10000.0)
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
        if self.q_layernorm is not None and self.k_layernorm is not None:
            q = self.q_layernorm(q)
            k = self.k_layernorm(k)
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


# ---------------------------------------------------------------------------------------------
# Mixture of experts: MoELayer with the local spec (TopKRouter, the all-to-all token dispatcher,
# SequentialMLP experts), megatron-core 0.19.2 without Transformer Engine or fusions
# ---------------------------------------------------------------------------------------------



class _AllToAllEP(torch.autograd.Function):
    """tensor_parallel.mappings._AllToAll over the expert-parallel group: all-to-all(-v) forward into `rows`
    rows, the reverse backward. Priced on the larger of what the rank sends and receives."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: int) -> torch.Tensor:
        x = x.contiguous()
        ctx.rows_in = x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        emit_comm("all_to_all", out if rows > x.shape[0] else x, "ep")
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.contiguous()
        out = g.new_empty((ctx.rows_in, *g.shape[1:]))
        emit_comm("all_to_all", out if ctx.rows_in > g.shape[0] else g, "ep")
        return out, None


class _RouterGating(torch.autograd.Function):
    """moe_utils.RouterGatingLinearFunction without TE: mm in the router dtype (the input's by default)."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inp, weight)
        shape = inp.shape
        out = torch.mm(inp.view(-1, shape[-1]).to(inp.dtype), weight.to(inp.dtype).t())
        return out.view(*shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inp, weight = ctx.saved_tensors
        shape = inp.shape
        inp2 = inp.view(-1, shape[-1])
        grad2 = grad.view(-1, grad.shape[-1])
        grad_input = torch.mm(grad2, weight.to(inp.dtype)).to(inp.dtype)
        grad_weight = torch.mm(grad2.t(), inp2.to(inp.dtype)).to(weight.dtype)
        return grad_input.view(*shape), grad_weight


class _AuxLossScaler(torch.autograd.Function):
    """MoEAuxLossAutoScaler: identity on the probabilities; backward seeds the aux loss's gradient."""

    @staticmethod
    def forward(ctx: Any, probs: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss) * 1.0


def expert_rows(tokens: int, experts: int, topk: int, imbalance: float = 1.0) -> list[int]:
    """Rows each expert receives from `tokens` tokens routed to `topk` experts each: balanced (the
    remainder to the first experts), or with expert 0 at `imbalance` x the mean and the rest even."""
    total = tokens * topk
    hot = min(round(imbalance * total / experts), tokens, total) if imbalance != 1.0 else None
    if hot is None or experts == 1:
        q, r = divmod(total, experts)
        return [q + (1 if i < r else 0) for i in range(experts)]
    q, r = divmod(total - hot, experts - 1)
    return [hot] + [q + (1 if i < r else 0) for i in range(experts - 1)]


class MegatronExpert(nn.Module):
    """One expert of SequentialMLP: MLP(is_expert=True) with the probabilities applied after the GLU."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        f = spec.moe_intermediate_size
        self.linear_fc1 = nn.Linear(spec.hidden_size, 2 * f, bias=False)
        self.linear_fc2 = nn.Linear(f, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        a, g = torch.chunk(self.linear_fc1(x), 2, dim=-1)
        h = F.silu(a) * (g + 0.0)  # glu with glu_linear_offset 0.0
        dtype = h.dtype
        h = (h * probs.unsqueeze(-1)).to(dtype)
        return self.linear_fc2(h)


class SequentialMLP(nn.Module):
    def __init__(self, spec: ModelSpec, local: int) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList([MegatronExpert(spec) for _ in range(local)])


class MegatronMoE(nn.Module):
    """MoELayer: TopKRouter (softmax over the top-k logits, aux loss), MoEAlltoAllTokenDispatcher
    (argsort permutation, all-to-all of tokens and probabilities over EP, chunks sorted by local expert),
    SequentialMLP (one MLP per local expert on its rows), and the way back (un-sort, all-to-all,
    scatter-add). Routing is balanced (every expert receives tokens x top-k / experts rows from each rank)
    or skewed: expert 0, on this rank, receives moe_imbalance x the mean.
    The dispatcher copies the token counts to the host and synchronises once per forward."""

    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        self.E, self.k, self.ep = spec.num_experts, spec.experts_per_token, shard.ep
        self.local = self.E // self.ep
        self.imbalance = shard.moe_imbalance  # this rank hosts the busiest expert: the step waits for it
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.empty(self.E, spec.hidden_size))
        self.experts = SequentialMLP(spec, self.local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        T, E, k = s * b, self.E, self.k
        logits = _RouterGating.apply(x, self.router.weight).view(-1, E)
        scores, top = torch.topk(logits, k=k, dim=1, sorted=True)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
        routing_probs = torch.zeros_like(logits).scatter(1, top, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, top, 1).bool()
        # aux loss (compute_routing_scores_for_aux_loss, switch_load_balancing_loss_func)
        aux_scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        _, aux_top = torch.topk(aux_scores, k=k, dim=1)
        aux_map = torch.zeros_like(logits).int().scatter(1, aux_top, 1).bool()
        tokens_per_expert = aux_map.sum(dim=0)
        aux_loss = torch.sum(aux_scores.sum(dim=0) * tokens_per_expert) * (E * MEGATRON_MOE_AUX_LOSS_COEFF / (k * T * T))
        routing_probs = _AuxLossScaler.apply(routing_probs, aux_loss)
        # dispatcher preprocess: counts, then the device-to-host copy and its synchronisation
        local_counts = routing_map.sum(dim=0).long()
        if self.ep > 1:
            local_counts.reshape(self.ep, self.local).sum(dim=1)
            gathered = local_counts.new_empty((self.ep * E,))
            emit_comm("all_gather", gathered, "ep")
            per_local = gathered.reshape(self.ep, 1, E).transpose(0, 1)[:, :, :self.local].contiguous()
            per_local.sum(dim=2)
            per_local.sum(dim=(0, 1))
        emit_sync(local_counts)
        # permute
        rmap = routing_map.bool().T.contiguous()
        flat_sorted = rmap.reshape(-1).argsort(descending=True, stable=True)[: T * k]
        sorted_indices = flat_sorted % T
        permuted_probs = routing_probs.T.contiguous().reshape(-1)[flat_sorted]
        tokens = x.view(-1, h).index_select(0, sorted_indices)
        # every rank routes alike: from each source rank, local expert e receives rows[e]
        rows = expert_rows(T, E, k, self.imbalance)[: self.local]
        chunks = rows * self.ep  # [source rank][local expert]
        if self.ep > 1:
            tokens = _AllToAllEP.apply(tokens, sum(chunks))
            permuted_probs = _AllToAllEP.apply(permuted_probs, sum(chunks))
        order = [r * self.local + e for e in range(self.local) for r in range(self.ep)]
        if self.local > 1:  # sort_chunks_by_idxs: group the rows of each local expert
            parts_t = torch.split(tokens, chunks, dim=0)
            tokens = torch.cat([parts_t[i] for i in order], dim=0)
            parts_p = torch.split(permuted_probs, chunks, dim=0)
            permuted_probs = torch.cat([parts_p[i] for i in order], dim=0)
        per_expert = [sum(chunks[r * self.local + e] for r in range(self.ep)) for e in range(self.local)]
        outs = []
        for expert, t, p in zip(self.experts.local_experts, torch.split(tokens, per_expert),
                                torch.split(permuted_probs, per_expert), strict=True):
            outs.append(expert(t, p))
        out = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
        if self.local > 1:  # restore the source-rank order
            back = [chunks[i] for i in order]
            inv = [order.index(i) for i in range(len(order))]
            parts = torch.split(out, back, dim=0)
            out = torch.cat([parts[i] for i in inv], dim=0)
        if self.ep > 1:
            out = _AllToAllEP.apply(out, T * k)
        # unpermute: scatter-add back into token order
        restored = torch.zeros((T, h), dtype=out.dtype, device=out.device)
        restored.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, h), out)
        return restored.to(dtype=x.dtype).view(s, b, h)


class MegatronLayer(nn.Module):
    """TransformerLayer: norm, self-attention, bias-dropout-add (no bias, dropout 0: an add), norm, MLP
    (or MoE), add."""

    def __init__(self, spec: ModelSpec, shard: Shard) -> None:
        super().__init__()
        self.input_layernorm = MegatronRMSNorm(spec.hidden_size, spec.norm_eps)
        self.self_attention = MegatronAttention(spec, shard)
        self.pre_mlp_layernorm = MegatronRMSNorm(spec.hidden_size, spec.norm_eps)
        self.mlp: nn.Module = MegatronMoE(spec, shard) if spec.is_moe else MegatronMLP(spec, shard)
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
        if spec.family not in MEGATRON_FAMILIES:
            raise ValueError(f"Megatron-Core's local GPT spec is modelled for Llama-family and Mixtral configs, "
                             f"not {spec.family}")
        self.spec = spec
        self.shard = shard
        self.embed = MegatronEmbed(spec, shard)  # type: ignore[assignment]
        self.layers = nn.ModuleList([MegatronLayer(spec, shard) for _ in range(spec.num_layers)])
        self.head = MegatronHead(spec, shard, self.embed.embed_tokens if spec.tie_word_embeddings else None)  # type: ignore[assignment]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

        hidden_states, position_embeddings = self.embed(input_ids)
        for layer in self.layers:
            if self.shard.recompute and self.training:
                # Megatron's full recompute (tensor_parallel/random.py CheckpointFunction) is reentrant: its
                # backward runs the whole layer again, fc2, its TP all-reduce and the residual add included, where
                # torch's non-reentrant checkpoint stops at the last tensor saved for backward
                with set_checkpoint_early_stop(False):
                    hidden_states = checkpoint(layer, hidden_states, position_embeddings, use_reentrant=False)
            else:
                hidden_states = layer(hidden_states, position_embeddings)
        return self.head(hidden_states, labels)
