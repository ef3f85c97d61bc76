"""Composite operators whose decomposition differs between CPU and CUDA, replayed as on CUDA.

Dropout: on CUDA `aten::dropout` runs the fused `native_dropout` (CPU uses bernoulli_ + mul).
SDPA: the backend choice lives in CUDA code (sdp_utils.cpp), so a CPU trace would otherwise record
CPU kernels.
We override the composite at CompositeImplicitAutograd with a Python copy of the sm90 rules of
torch 2.10/2.11 with cuDNN > 9.15 (cuDNN first, then flash, efficient, math) and call the explicit
aten ops, which have meta kernels and autograd formulas. The rules depend on torch, cuDNN and GPU
generation: `POLICY_ID` is stored with every graph, and the GPU probe checks the choice.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

POLICY_ID = "sm90-torch2.11-cudnn9.19"

_LIB: torch.library.Library | None = None
_HALF = (torch.float16, torch.bfloat16)


def choose_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   dropout_p: float, is_causal: bool, enable_gqa: bool) -> str:
    """"cudnn" | "flash" | "efficient" | "math" for 4-D dense inputs on sm90."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "math"
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    L, S = q.shape[2], k.shape[2]
    dq, dv = q.shape[-1], v.shape[-1]
    same_heads = hq == hk == hv
    gqa_ok = enable_gqa and hq % hk == 0 and hq % hv == 0
    last_stride_ok = all(t.stride(-1) == 1 for t in (q, k, v))
    dtype = q.dtype
    if (dtype in _HALF and k.dtype == dtype and v.dtype == dtype and last_stride_ok
            and (same_heads or gqa_ok) and dq <= 256 and dv <= 256 and dq % 8 == 0 and dv % 8 == 0
            and S != 1 and not (dropout_p > 0 and L == 1)
            and (mask is None or (not mask.requires_grad and mask.dim() in (2, 4)))):
        return "cudnn"
    if (dtype in _HALF and mask is None and dq == k.shape[-1] == dv and dq <= 256
            and not (is_causal and L != S) and (same_heads or (enable_gqa and hq % hk == 0 and hk == hv))):
        return "flash"
    align = 4 if dtype == torch.float32 else 8
    if (dtype in (*_HALF, torch.float32) and dq == k.shape[-1] and dq % align == 0 and dv % align == 0
            and same_heads):
        return "efficient"
    return "math"


def _bool_to_additive(mask: torch.Tensor, dtype: torch.dtype, fill: float) -> torch.Tensor:
    return torch.where(mask.logical_not(), fill, 0.0).to(dtype)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    backend = choose_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if backend == "cudnn":
        mask = attn_mask
        if mask is not None and mask.dtype == torch.bool:
            # sdp_utils' convert_boolean_attn_mask_cudnn, as the H200 logs it: where(mask, 0, -65504) in the
            # query's dtype on the (expanded) mask itself
            neg = torch.ops.aten.scalar_tensor.default(-65504.0, dtype=query.dtype)
            zero = torch.ops.aten.scalar_tensor.default(0.0, dtype=query.dtype, layout=torch.strided)
            mask = torch.ops.aten.where.self(mask, zero, neg)
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, mask, need_lse, dropout_p, is_causal, False, scale=scale)
        return out[0]
    if backend == "flash":
        d = query.shape[-1]
        sc = scale if scale is not None else d ** -0.5
        if d % 8:
            pad = 8 - d % 8
            q, k, v = (F.pad(t, (0, pad)) for t in (query, key, value))
        else:
            q, k, v = query, key, value
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=sc)[0]
        return out[..., :d] if d % 8 else out
    if backend == "efficient":
        mask = attn_mask
        if mask is not None:
            if mask.dtype == torch.bool:
                mask = _bool_to_additive(mask, query.dtype, float("-inf"))
            b, h, L, S = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
            mask = mask.expand(b, h, L, S)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, need_lse, dropout_p, is_causal, scale=scale)
        return out[0]
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """aten::dropout as CUDA runs it: the fused kernel whenever 0 < p < 1 in training."""
    if not train or p == 0.0:
        return input
    if p == 1.0:
        return input.mul(torch.zeros_like(input))
    return torch.ops.aten.native_dropout(input, p, train)[0]


def _rms_norm(input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
              eps: float | None = None) -> torch.Tensor:
    """aten::rms_norm as CUDA runs it (layer_norm.cpp): the fused kernel and its backward."""
    if eps is None:
        eps = torch.finfo(input.dtype).eps
    return torch.ops.aten._fused_rms_norm(input, list(normalized_shape), weight, eps)[0]


def _fused_rms_norm_cpu(input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
                        eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A backend kernel for CUDA's fused RMSNorm (output, fp32 rstd): with one, autograd records the op itself
    and its fused backward, as CUDA runs them, instead of the CPU build's decomposition."""
    dims = tuple(range(input.dim() - len(normalized_shape), input.dim()))
    x = input.float()
    rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + (eps if eps is not None else torch.finfo(input.dtype).eps))
    out = (x * rstd).to(input.dtype)
    return (out * weight if weight is not None else out), rstd


def _allow_grouped_mm_any_float() -> None:
    """torch's meta kernel of `_grouped_mm` accepts bf16 only (its CUTLASS path); CUDA's `_grouped_mm`
    runs fp32 and fp16 through its fallback, which transformers' MoE experts reach with fp32 weights
    (AMP, fp32, tf32). Shape the output of those the same way instead of refusing them."""
    import torch._meta_registrations as mr

    orig = mr._meta_grouped_mm_common
    if getattr(orig, "_tp_query", False):
        return

    def common(mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        scale_a = kwargs.get("scale_a", args[0] if args else None)
        if (scale_a is None and mat_a.dtype == mat_b.dtype and mat_a.dtype in (torch.float32, torch.float16)):
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            out_dtype = kwargs.get("out_dtype", args[5] if len(args) > 5 else None)
            return mr._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return orig(mat_a, mat_b, *args, **kwargs)  # type: ignore[no-any-return]

    common._tp_query = True  # type: ignore[attr-defined]
    mr._meta_grouped_mm_common = common


def _histc_meta(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """histc's shape as CUDA computes it, integer inputs included (the CPU build takes floats only; MoE
    routing histograms int32 expert ids on CUDA)."""
    return input.new_empty((bins,), dtype=input.dtype)


def install() -> None:
    """Route SDPA, dropout and RMSNorm through their CUDA choices for this process (once)."""
    global _LIB
    if _LIB is not None:
        return
    _allow_grouped_mm_any_float()
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("scaled_dot_product_attention", _sdpa, "CompositeImplicitAutograd")
        lib.impl("dropout", _dropout, "CompositeImplicitAutograd")
        lib.impl("rms_norm", _rms_norm, "CompositeImplicitAutograd")
        lib.impl("_fused_rms_norm", _fused_rms_norm_cpu, "CPU")
        lib.impl("histc", _histc_meta, "Meta")
    _LIB = lib
