"""The canonical form of one aten operator call: what the tracer records, the collector replays and
the engine looks up. A call is the operator's name plus its arguments with tensors reduced to
(shape, dtype, strides, offset, device); its key is a hash of that form plus the math mode.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .precision import DType


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as the kernel sees it. `host` marks CPU-resident tensors on a CUDA run."""

    shape: tuple[int, ...]
    dtype: DType
    strides: tuple[int, ...] | None = None  # None: contiguous
    offset: int = 0
    host: bool = False

    def __hash__(self) -> int:
        """The fields' hash, computed once per spec (a planner looks specs up by the hundred thousand)."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.shape, self.dtype, self.strides, self.offset, self.host))
        return h  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its fields alone: a cached hash is this process's (strings hash per process)."""
        return (TensorSpec, (self.shape, self.dtype, self.strides, self.offset, self.host))

    # computed once per spec (an optimizer step's lists sum them over hundreds of tensors per candidate);
    # stored in the instance's __dict__, outside the fields that equality, hashing and JSON read
    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @functools.cached_property
    def json_text(self) -> str:
        """The spec's canonical JSON text (an optimizer call's lists repeat a few specs hundreds of times)."""
        return _dumps(self.to_json())

    def effective_strides(self) -> tuple[int, ...]:
        return self.strides if self.strides is not None else contiguous_strides(self.shape)

    def storage_numel(self) -> int:
        """Elements the backing storage must hold for this view."""
        if self.numel == 0:
            return self.offset
        st = self.effective_strides()
        return self.offset + 1 + sum((d - 1) * s for d, s in zip(self.shape, st, strict=True))

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this spec (shared, read-only: a planner encodes the same specs thousands of
        times when it rebuilds optimizer steps)."""
        out = _SPEC_JSON.get(self)
        if out is None:
            out = {"T": list(self.shape), "d": str(self.dtype)}
            if self.strides is not None:
                out["s"] = list(self.strides)
            if self.offset:
                out["o"] = self.offset
            if self.host:
                out["h"] = 1
            if len(_SPEC_JSON) < 1 << 18:
                _SPEC_JSON[self] = out
        return out

    @staticmethod
    def from_json(obj: dict[str, Any]) -> TensorSpec:
        shape = tuple(int(x) for x in obj["T"])
        strides = tuple(int(x) for x in obj["s"]) if "s" in obj else None
        if strides is not None and strides == contiguous_strides(shape):
            strides = None
        return TensorSpec(shape, _DTYPES[obj["d"]], strides, int(obj.get("o", 0)), bool(obj.get("h", 0)))


_SPEC_JSON: dict[TensorSpec, dict[str, Any]] = {}
_DTYPES: dict[str, DType] = {d.value: d for d in DType}


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Scalar:
    """A typed non-tensor argument that JSON cannot carry by itself (dtype, device, layout, ...)."""

    tag: str  # "dtype" | "device" | "layout" | "mf" | "float"
    value: str

    def to_json(self) -> dict[str, Any]:
        return {self.tag: self.value}


@dataclass(frozen=True)
class SameAs:
    """A list argument made of the very tensors of an earlier positional argument (AdamW's
    `_foreach_addcmul_(exp_avg_sqs, grads, grads)`): the kernel reads them once from memory, not twice."""

    arg: int

    def to_json(self) -> dict[str, Any]:
        return {"same": self.arg}


ArgValue = Any  # TensorSpec | Scalar | SameAs | int | float | bool | str | None | list[ArgValue]


def _encode(v: ArgValue) -> Any:
    if isinstance(v, TensorSpec | Scalar | SameAs):
        return v.to_json()
    if isinstance(v, list | tuple):
        return [_encode(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}
    return v


def _dumps(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def _encode_str(v: ArgValue) -> str:
    """_dumps(_encode(v)), built from each tensor spec's own cached text (an optimizer call holds hundreds of
    specs, most of them alike: a planner encodes such calls for every new sharding)."""
    if type(v) is TensorSpec:
        return v.json_text
    if isinstance(v, list | tuple):
        kinds = set(map(type, v))
        if kinds == {TensorSpec}:  # a list of specs: each one's text, joined in C
            return "[" + ",".join(map(_JSON_TEXT, v)) + "]"
        if kinds and kinds <= {float, int} and all(map(math.isfinite, v)):  # plain numbers: JSON's own text
            return _dumps(v)
        return "[" + ",".join([x.json_text if type(x) is TensorSpec else _encode_str(x) for x in v]) + "]"
    if v is None or isinstance(v, int | float | str):  # scalars recur in every rebuilt call: text once each
        # the type apart (True is 1) and the sign of zero apart (-0.0 == 0.0, but not as text)
        k = (type(v), v, math.copysign(1.0, v) if isinstance(v, float) else 0.0)
        out = _SCALAR_STR.get(k)
        if out is None:
            out = _dumps(_encode(v))
            if len(_SCALAR_STR) < 1 << 16 and v == v:  # NaN never finds itself
                _SCALAR_STR[k] = out
        return out
    return _dumps(_encode(v))


_SCALAR_STR: dict[tuple[type, Any, float], str] = {}
_JSON_TEXT = operator.attrgetter("json_text")


def _decode(v: Any) -> ArgValue:
    if isinstance(v, dict):
        if "T" in v:
            return TensorSpec.from_json(v)
        ((tag, value),) = v.items()
        if tag == "same":
            return SameAs(int(value))
        if tag == "float":
            return float(value)
        return Scalar(tag, value)
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


@dataclass(frozen=True)
class OpCall:
    """One operator invocation: `op` is torch's overload name, e.g. "aten.mm.default"."""

    op: str
    args: tuple[ArgValue, ...]
    kwargs: tuple[tuple[str, ArgValue], ...] = ()
    _json: str = field(default="", compare=False, repr=False)
    _tensors: tuple[TensorSpec, ...] | None = field(default=None, compare=False, repr=False)
    _dtypes: tuple[DType, ...] | None = field(default=None, compare=False, repr=False)

    def to_json_str(self) -> str:
        if self._json:
            return self._json
        s = '{"a":' + _encode_str(list(self.args))
        if self.kwargs:
            s += ',"k":{' + ",".join([_dumps(k) + ":" + _encode_str(v) for k, v in sorted(self.kwargs)]) + "}"
        s += "}"
        object.__setattr__(self, "_json", s)
        return s

    @staticmethod
    def from_json_str(op: str, s: str) -> OpCall:
        body = json.loads(s)
        args = tuple(_decode(x) for x in body["a"])
        kwargs = tuple(sorted((k, _decode(v)) for k, v in body.get("k", {}).items()))
        return OpCall(op, args, kwargs, s)

    def kwarg(self, name: str, default: ArgValue = None) -> ArgValue:
        for k, v in self.kwargs:
            if k == name:
                return v
        return default

    def tensors(self) -> Iterator[TensorSpec]:
        """Every tensor argument, lists flattened, in argument order (found once per call: optimizer
        calls carry hundreds)."""
        if self._tensors is None:
            found: list[TensorSpec] = []
            for v in list(self.args) + [v for _, v in self.kwargs]:
                _collect_tensors(v, found)
            object.__setattr__(self, "_tensors", tuple(found))
        return iter(self._tensors)  # type: ignore[arg-type]

    def device_tensors(self) -> list[TensorSpec]:
        return [t for t in self.tensors() if not t.host]

    def device_dtypes(self) -> tuple[DType, ...]:
        """The device tensors' dtypes, each once, in the order first seen (found once per call, from its distinct
        spec objects: an optimizer call's lists hold hundreds of tensors and a few specs)."""
        if self._dtypes is None:
            self.tensors()
            ts = self._tensors or ()
            distinct = dict(zip(map(id, ts), ts, strict=True)).values()  # (same object, same dtype)
            object.__setattr__(self, "_dtypes", tuple(dict.fromkeys(t.dtype for t in distinct if not t.host)))
        return self._dtypes  # type: ignore[return-value]

    def arg_tensor(self, i: int) -> TensorSpec:
        v = self.args[i]
        if not isinstance(v, TensorSpec):
            raise TypeError(f"{self.op}: argument {i} is not a tensor")
        return v

    def on_host_only(self) -> bool:
        ts = list(self.tensors())
        return bool(ts) and all(t.host for t in ts)


def _collect_tensors(v: ArgValue, out: list[TensorSpec]) -> None:
    """_iter_tensors into a list, a list of specs in one pass (an optimizer call's lists hold hundreds)."""
    if type(v) is TensorSpec:
        out.append(v)
    elif isinstance(v, list | tuple):
        if v and set(map(type, v)) == {TensorSpec}:  # a list of specs (an optimizer's): taken whole
            out.extend(v)
            return
        for x in v:
            if type(x) is TensorSpec:
                out.append(x)
            elif isinstance(x, TensorSpec | list | tuple):
                _collect_tensors(x, out)
    elif isinstance(v, TensorSpec):
        out.append(v)


def _iter_tensors(v: ArgValue) -> Iterator[TensorSpec]:
    if isinstance(v, TensorSpec):
        yield v
    elif isinstance(v, list | tuple):
        for x in v:
            yield from _iter_tensors(x)


def call_key(op: str, sig_json: str, math_mode: str) -> str:
    """Stable 16-hex key of (operator, canonical arguments, math mode such as "tf32")."""
    h = hashlib.blake2b(digest_size=8)
    h.update(op.encode())
    h.update(b"|")
    h.update(sig_json.encode())
    h.update(b"|")
    h.update(math_mode.encode())
    return h.hexdigest()
