"""Conversion between torch call arguments and the canonical OpCall form (schema/signature.py).

The tracer and the GPU operator log encode with `encode_call`; the collector replays with
`materialize`. One module owns both directions so the two can never drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tp_query.schema.ops import IndexArg, index_args_of
from tp_query.schema.precision import DTYPE_TO_TORCH_NAME, TORCH_NAME_TO_DTYPE, DType
from tp_query.schema.signature import OpCall, SameAs, Scalar, TensorSpec

_TORCH_DTYPES: dict[DType, torch.dtype] = {d: getattr(torch, n.split(".")[1]) for d, n in DTYPE_TO_TORCH_NAME.items()}
_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format,
    "channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d,
}


def dtype_of(t: torch.dtype) -> DType:
    return TORCH_NAME_TO_DTYPE[str(t)]


def torch_dtype(d: DType | str) -> torch.dtype:
    return _TORCH_DTYPES[DType(d)]


def encode_tensor(t: torch.Tensor, host: bool = False) -> TensorSpec:
    shape = tuple(int(x) for x in t.shape)
    strides = None if t.is_contiguous() else tuple(int(x) for x in t.stride())
    return TensorSpec(shape, dtype_of(t.dtype), strides, int(t.storage_offset()), host)


def encode_value(v: Any, is_host: Callable[[torch.Tensor], bool]) -> Any:
    if isinstance(v, torch.Tensor):
        return encode_tensor(v, is_host(v))
    if isinstance(v, list | tuple):
        return [encode_value(x, is_host) for x in v]
    if isinstance(v, torch.dtype):
        return Scalar("dtype", str(dtype_of(v)))
    if isinstance(v, torch.device):
        return Scalar("device", v.type)
    if isinstance(v, torch.layout):
        return Scalar("layout", str(v).split(".")[-1])
    if isinstance(v, torch.memory_format):
        return Scalar("mf", str(v).split(".")[-1])
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        return int(v) if isinstance(v, torch.SymInt) else (float(v) if isinstance(v, torch.SymFloat) else bool(v))
    if isinstance(v, bool | int | float | str) or v is None:
        return v
    if isinstance(v, torch.Generator):
        return None
    return str(v)


def _same_list(args: tuple[Any, ...], i: int) -> SameAs | None:
    """A tensor list that is an earlier argument's tensors, one by one (not merely equal shapes)."""
    a = args[i]
    if not isinstance(a, list | tuple) or not a or not all(isinstance(t, torch.Tensor) for t in a):
        return None
    for j in range(i):
        b = args[j]
        if isinstance(b, list | tuple) and len(b) == len(a) and all(x is y for x, y in zip(a, b, strict=True)):
            return SameAs(j)
    return None


def encode_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                is_host: Callable[[torch.Tensor], bool] = lambda t: t.device.type == "cpu") -> OpCall:
    enc_args = tuple(_same_list(args, i) or encode_value(a, is_host) for i, a in enumerate(args))
    enc_kwargs = tuple(sorted((k, encode_value(v, is_host)) for k, v in kwargs.items()
                              if k not in ("device", "pin_memory")))
    return OpCall(str(func), enc_args, enc_kwargs)


# ---------------------------------------------------------------------------------------------
# Replay: build real inputs from a call
# ---------------------------------------------------------------------------------------------

def resolve_op(name: str) -> Any:
    """torch.ops overload from "aten.mm.default"."""
    ns, base, overload = name.split(".", 2)
    return getattr(getattr(getattr(torch.ops, ns), base), overload)


_GENERATORS: dict[str, torch.Generator] = {}


def _generator(dev: torch.device) -> torch.Generator:
    """Inputs come from a private generator: the default one may be bound to a CUDA graph capture."""
    key = str(dev)
    if key not in _GENERATORS:
        g = torch.Generator(device=dev)
        g.manual_seed(1234)
        _GENERATORS[key] = g
    return _GENERATORS[key]


def _make_tensor(spec: TensorSpec, device: torch.device, high: int | None) -> torch.Tensor:
    dev = torch.device("cpu") if spec.host else device
    dt = torch_dtype(spec.dtype)
    storage_n = max(spec.storage_numel(), 1)
    gen = _generator(dev)
    if spec.dtype.is_float:
        base = torch.randn(storage_n, device=dev, dtype=torch.float32, generator=gen).to(dt)
    elif spec.dtype == DType.BOOL:
        base = torch.rand(storage_n, device=dev, generator=gen) > 0.1
    else:
        base = torch.randint(0, max(high or 2, 1), (storage_n,), device=dev, dtype=dt, generator=gen)
    return base.as_strided(spec.shape, spec.effective_strides(), spec.offset)


def _bound(call: OpCall, ia: IndexArg) -> int:
    src = call.args[ia.bound_arg]
    if ia.bound_dim is None:
        return int(src)
    dim = ia.bound_dim
    if ia.dim_arg is not None and ia.dim_arg < len(call.args) and isinstance(call.args[ia.dim_arg], int):
        dim = int(call.args[ia.dim_arg])  # type: ignore[arg-type]
    return int(src.shape[dim])  # type: ignore[union-attr]


def materialize(call: OpCall, device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Random inputs with the call's shapes, dtypes, strides and offsets; valid indices where needed."""
    bounds = {ia.arg: _bound(call, ia) for ia in index_args_of(call.op)}

    def build(v: Any, high: int | None) -> Any:
        if isinstance(v, TensorSpec):
            return _make_tensor(v, device, high)
        if isinstance(v, list):
            # one storage per distinct spec would alias in-place lists; build each element
            return [build(x, high) for x in v]
        if isinstance(v, Scalar):
            if v.tag == "dtype":
                return torch_dtype(v.value)
            if v.tag == "device":
                return device if v.value != "cpu" else torch.device("cpu")
            if v.tag == "layout":
                return getattr(torch, v.value)
            if v.tag == "mf":
                return _MEMORY_FORMATS[v.value]
            raise ValueError(f"unknown scalar tag {v.tag}")
        return v

    args: tuple[Any, ...] = ()
    for i, a in enumerate(call.args):  # an argument that is an earlier one's tensors gets those very tensors
        args += (args[a.arg] if isinstance(a, SameAs) else build(a, bounds.get(i)),)
    kwargs = {k: build(v, None) for k, v in call.kwargs}
    return args, kwargs
