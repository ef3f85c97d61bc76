"""CUDA autocast on a CPU: CPU autocast with its policy replaced by CUDA's.

Meta tensors carry no autocast key and fake CUDA tensors need a real accelerator, so the tracer runs
fake CPU tensors under `torch.autocast("cpu")` and replaces the CPU policy with the CUDA one
(schema/autocast_policy.json, derived from ATen's autocast_mode.h): a Python kernel on the
AutocastCPU key for every op in CUDA's lists, and a fallthrough for ops only CPU autocasts.
Installing is process-wide and idempotent; the tracer process is the only place it happens.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from importlib import resources
from typing import Any

import torch

_LIB: torch.library.Library | None = None
_CACHE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_AUTOCAST_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def load_policy() -> dict[str, Any]:
    text = resources.files("tp_query.schema").joinpath("autocast_policy.json").read_text()
    return json.loads(text)


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast_one(t: Any, to: torch.dtype, lower: torch.dtype) -> Any:
    if isinstance(t, list | tuple) and t and all(isinstance(x, torch.Tensor) for x in t):
        return type(t)(_cast_one(x, to, lower) for x in t)
    if not _eligible(t) or t.dtype == to:
        return t
    cacheable = (to == lower and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                 and not t._is_view())
    if cacheable:
        hit = _CACHE.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
    out = t.to(to)
    if cacheable:
        _CACHE[id(t)] = (t, out)
    return out


def _cast_args(args: tuple[Any, ...], kwargs: dict[str, Any], to: torch.dtype,
               lower: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # ATen evaluates cached_cast(...) over the arguments last-to-first (GCC's order): keep it, it
    # fixes the order of the _to_copy ops in the log.
    new_kwargs = {k: _cast_one(v, to, lower) for k, v in reversed(list(kwargs.items()))}
    new_args = [_cast_one(a, to, lower) for a in reversed(args)]
    return tuple(reversed(new_args)), dict(reversed(list(new_kwargs.items())))


def _redispatch(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEY):
        return op(*args, **kwargs)


def _lower() -> torch.dtype:
    return torch.get_autocast_dtype("cpu")


def _make_kernel(policy: str, op: Any) -> Any:
    dtype_arg = None
    if policy == "fp32_set_opt_dtype":
        names = [a.name for a in op._schema.arguments]
        dtype_arg = "dtype" if "dtype" in names else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        lower = _lower()
        if policy == "lower_precision":
            args, kwargs = _cast_args(args, kwargs, lower, lower)
        elif policy == "fp32":
            args, kwargs = _cast_args(args, kwargs, torch.float32, lower)
        elif policy == "promote":
            to = lower
            for a in list(args) + list(kwargs.values()):
                items = a if isinstance(a, list | tuple) else [a]
                for t in items:
                    if _eligible(t) and t.dtype == torch.float32:
                        to = torch.float32
            args, kwargs = _cast_args(args, kwargs, to, lower)
        elif policy == "fp32_set_opt_dtype":
            if args and _eligible(args[0]) and dtype_arg is not None:
                schema_args = op._schema.arguments
                pos = [a.name for a in schema_args].index(dtype_arg)
                if len(args) > pos:
                    if args[pos] is None:
                        args = (*args[:pos], torch.float32, *args[pos + 1:])
                elif kwargs.get(dtype_arg) is None:
                    kwargs = {**kwargs, dtype_arg: torch.float32}
        elif policy == "banned":
            raise RuntimeError(f"{op} is unsafe to autocast on CUDA (torch bans it)")
        return _redispatch(op, args, kwargs)

    return kernel


def _resolve(name: str) -> Any | None:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    try:
        return getattr(packet, overload or "default")
    except AttributeError:
        return None


def install() -> None:
    """Replace CPU autocast's policy by CUDA's for this process (once)."""
    global _LIB
    if _LIB is not None:
        return
    policy = load_policy()
    cuda = policy["AutocastCUDA"]
    warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
    warnings.filterwarnings("ignore", message="Warning only once for all operators.*")
    lib = torch.library.Library("aten", "IMPL")
    covered: set[str] = set()
    for kind in ("lower_precision", "fp32", "fp32_set_opt_dtype", "promote", "banned"):
        for name in cuda.get(kind, []):
            op = _resolve(name)
            if op is None:
                continue
            lib.impl(name, _make_kernel(kind, op), "AutocastCPU")
            covered.add(name)
    for names in policy["AutocastCPU"].values():
        for name in names:
            if name in covered or _resolve(name) is None:
                continue
            lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
            covered.add(name)
    _LIB = lib


def clear_cache() -> None:
    _CACHE.clear()


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype | None) -> Iterator[None]:
    """torch.autocast("cuda", dtype) as the tracer sees it; a no-op for dtype None."""
    if dtype is None:
        yield
        return
    install()
    try:
        with torch.autocast("cpu", dtype=dtype):
            yield
    finally:
        clear_cache()
