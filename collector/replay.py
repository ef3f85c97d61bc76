"""Replay one recorded aten call on the device: real inputs from its signature, then a closure the
timer can call. Forward and backward operators alike; attention backward gets its saved tensors
from a real forward (InputRule.FROM_FORWARD)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tp_query.engine.trace.torchargs import materialize, resolve_op
from tp_query.schema.ops import ATTN_BWD_ARGS, REGISTRY, InputRule, Operands
from tp_query.schema.signature import OpCall


def _attention_backward(call: OpCall, device: torch.device) -> Callable[[], Any]:
    args, kwargs = materialize(call, device)
    qi, di, ci, fwd_name = ATTN_BWD_ARGS[call.op]
    grad_out, q, k, v = args[0], args[qi], args[qi + 1], args[qi + 2]
    # trailing defaults are left out of a signature (a masked call has is_causal=False)
    dropout = args[di] if di < len(args) else 0.0
    causal = args[ci] if ci < len(args) else False
    scale = kwargs.get("scale")
    bargs: tuple[Any, ...]
    fwd = resolve_op(fwd_name)
    bwd = resolve_op(call.op)
    if fwd_name.endswith("cudnn_attention.default"):
        mask = args[8]  # the additive mask (sliding windows), or None
        o = fwd(q, k, v, mask, True, dropout, causal, False, scale=scale)
        bargs = (grad_out, q, k, v, o[0], o[1], o[6], o[7], mask, o[2], o[3], o[4], o[5], dropout, causal)
    elif fwd_name.endswith("efficient_attention.default"):
        bias = args[4]  # the additive mask (sliding windows), or None
        o = fwd(q, k, v, bias, True, dropout, causal, scale=scale)
        grad_input_mask = args[10] if len(args) > 10 else [True, True, True, bias is not None]
        bargs = (grad_out, q, k, v, bias, o[0], o[1], o[2], o[3], dropout, grad_input_mask, causal)
    else:
        o = fwd(q, k, v, dropout, causal, False, scale=scale)
        bargs = (grad_out, q, k, v, o[0], o[1], o[2], o[3], o[4], o[5], dropout, causal, o[6], o[7])
    return lambda: bwd(*bargs, scale=scale)


def balanced_offsets(total: int, groups: int, device: torch.device) -> torch.Tensor:
    """Cumulative group ends with every group the same share (the last takes the remainder)."""
    ends = [(i + 1) * total // groups for i in range(groups)]
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _with_balanced_offsets(args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
                           ) -> tuple[list[Any], dict[str, Any]]:
    """A grouped GEMM's offsets cutting its jagged dimension into equal groups."""
    a, b = args[0], args[1]
    offs = kwargs["offs"] if "offs" in kwargs else args[2]
    groups = b.shape[0] if (a.dim() == 2 and b.dim() == 3) else int(offs.shape[0])
    jagged = a.shape[0] if b.dim() == 3 else a.shape[1]
    new = [a, b, balanced_offsets(jagged, groups, device), *args[3:]]
    if "offs" in kwargs:
        kwargs = {**kwargs, "offs": new.pop(2)}
    return new, kwargs


def build(call: OpCall, device: torch.device, operands: Operands = Operands.RANDOM) -> Callable[[], Any]:
    """A zero-argument closure that runs `call` once on `device` with persistent inputs (NaN operands:
    every floating input NaN, after the kind's own input rule)."""
    kind = REGISTRY.for_op(call.op)
    if kind.input_rule == InputRule.FROM_FORWARD:
        return _attention_backward(call, device)
    op = resolve_op(call.op)
    args, kwargs = _inputs(call, device, operands)
    return lambda: op(*args, **kwargs)


def materialized_inputs(call: OpCall, device: torch.device, operands: Operands = Operands.RANDOM) -> list[Any]:
    """The positional inputs `build` runs `call` on (tests read what the operands made of them)."""
    return list(_inputs(call, device, operands)[0])


def _inputs(call: OpCall, device: torch.device, operands: Operands) -> tuple[Any, dict[str, Any]]:
    kind = REGISTRY.for_op(call.op)
    args, kwargs = materialize(call, device)
    if not any(True for _ in call.tensors()) and call.kwarg("device") is None:
        # a factory: the trace does not record its device (the model's own), and without one torch would
        # build it on the host, timing an idle GPU (every factory row before collector 0.2.0)
        kwargs["device"] = device
    if kind.input_rule == InputRule.GROUP_OFFSETS:
        args, kwargs = _with_balanced_offsets(args, kwargs, device)
    if operands == Operands.NAN:
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                a.fill_(float("nan"))
    elif operands in ROUTED_AXES:
        _route(args, ROUTED_AXES[operands], device)
    return args, kwargs


# (operand, axis) pairs holding the tokens of a dense experts' batched GEMM [E, m, k] x [E, k, n]
ROUTED_AXES = {Operands.ROUTED_A_ROWS: ((0, 1),), Operands.ROUTED_A_COLS: ((0, 2),),
               Operands.ROUTED_A_COLS_B_ROWS: ((0, 2), (1, 1))}


def _route(args: list[Any], axes: tuple[tuple[int, int], ...], device: torch.device) -> None:
    """Zero every token's entries outside its one expert, as a top-1 router's weights do (each token's expert
    drawn uniformly; the same draw for both operands of a weight gradient)."""
    a = args[axes[0][0]]
    experts, tokens = a.shape[0], a.shape[axes[0][1]]
    gen = torch.Generator(device=device).manual_seed(0)
    owner = torch.randint(0, experts, (tokens,), device=device, generator=gen)
    keep = torch.zeros(experts, tokens, device=device, dtype=a.dtype)
    keep[owner, torch.arange(tokens, device=device)] = 1
    for i, axis in axes:
        t = args[i]
        t.mul_(keep[:, :, None] if axis == 1 else keep[:, None, :])
