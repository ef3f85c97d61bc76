"""The operator registry: every operator kind defined once.

Like torch/utils/flop_counter.py, one table keyed by aten overload name. A kind says which family it
interpolates in, how its features (the key columns used for interpolation) and its FLOP and byte
counts follow from a call's shapes, how the collector must fill its inputs, and which shapes the
generic campaign sweeps. The collector and the engine both read this module; it imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .precision import SETTINGS, DType, Precision, Setting, op_precision
from .signature import OpCall, SameAs, Scalar, TensorSpec, contiguous_strides


class Family(StrEnum):
    """Interpolation families: points of one family share axes and a roofline."""

    GEMM = "gemm"
    ATTENTION = "attention"
    ROWWISE = "rowwise"  # norms, softmax, losses: rows x cols
    EMBEDDING = "embedding"
    FOREACH = "foreach"  # optimizer and GradScaler multi-tensor ops
    ELEMENTWISE = "elementwise"  # pointwise, reductions, copies, casts, cat: bytes moved
    VIEW = "view"  # metadata only: no kernel
    HOST = "host"  # runs on the CPU or only synchronises: no GPU time


class InputRule(StrEnum):
    """How the collector fills a call's inputs (beyond random floats)."""

    RANDOM = "random"
    FROM_FORWARD = "from_forward"  # attention backward: run the forward to get out/logsumexp/rng state
    GROUP_OFFSETS = "group_offsets"  # grouped GEMM: int32 offsets cutting the rows into balanced groups


@dataclass(frozen=True)
class IndexArg:
    """An integer tensor argument whose values must be valid indices: [0, bound)."""

    arg: int
    bound_arg: int  # argument that gives the bound
    bound_dim: int | None = None  # dimension of that tensor argument; None: the argument is an int
    dim_arg: int | None = None  # the call's argument that names that dimension (scatter/gather's `dim`)


@dataclass(frozen=True)
class FamilySpec:
    """How a family interpolates: `exact` features must match, `axes` are blended in log space."""

    family: Family
    axes: tuple[str, ...]
    exact: tuple[str, ...]
    # Blend in log space (power laws: GEMM, attention) or linear space (affine laws: bytes moved).
    log_space: bool = True
    # Categorical features derived from stored ones (applied alike to database rows and queries).
    derive: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def exact_key(self, feats: dict[str, Any]) -> tuple[Any, ...]:
        f = {**feats, **(self.derive(feats) if self.derive else {})}
        return tuple(f.get(x) for x in self.exact)


# The dimensions that are leading dimensions (row strides) of A, B or C in each row-major layout: C[m, n]
# and A[m, k] ("n") or A stored [k, m] ("t"), B[k, n] ("n") or B stored [n, k] ("t").
_LEADING_DIMS = {"nn": ("k", "n"), "nt": ("k", "n"), "tn": ("m", "n"), "tt": ("m", "k", "n")}


def _gemm_alignment(f: dict[str, Any]) -> dict[str, Any]:
    """cuBLAS's fast Hopper kernels need 16-byte aligned leading dimensions: an odd vocabulary
    (GPT-2's 50257) lands on much slower kernels, so alignment is part of the category. Only the leading
    dimensions count (measured on an H200, bf16 4096^3: m = 4097 in "nn"/"nt" or k = 4097 in "tn" runs at
    the aligned time, 179-184 us; any leading dimension at 4095/4097 takes 890-1450 us): a token count
    that is no multiple of 8, as MoE routing gives each expert, keeps the fast kernels."""
    lay = str(f.get("layout") or "").split(":")[0]
    if lay.endswith("/ua"):  # a padded operand's pitch, not its dimensions, is what is misaligned
        return {"aligned": False}
    names = _LEADING_DIMS.get(lay, ("m", "n", "k"))
    return {"aligned": all((f.get(d) or 0) % 8 == 0 for d in names)}


FAMILIES: dict[Family, FamilySpec] = {
    # batch is exact (a measured batch count is its own category) and an axis: where no point has the
    # query's batch, the points of other batches blend by it, as they scale, instead of lending their
    # times unscaled (56-way fp32 attention bmm had been read as a 16-32-way one: 2.5x too fast)
    Family.GEMM: FamilySpec(Family.GEMM, ("batch", "m", "n", "k"), ("layout", "batch", "aligned"),
                            derive=_gemm_alignment),
    # heads is batch x heads: the kernels parallelise over both alike; the GQA ratio only changes K/V reads
    # masked: an additive mask (sliding windows) makes cuDNN compute every tile; rows stored before the
    # feature existed read NULL, i.e. unmasked
    Family.ATTENTION: FamilySpec(Family.ATTENTION, ("heads", "seq_q"), ("head_dim", "causal", "dropout", "seq_k_eq",
                                                                         "masked", "layout"),
                                 derive=lambda f: {"masked": bool(f.get("masked")), "layout": f.get("layout") or ""}),
    # a row whose length is no multiple of 8 elements (gpt-oss's seq + 1 scores with a sink, GPT-2's 50,257-word
    # vocabulary) takes the kernels' unvectorised path: its own category, as a GEMM's misaligned dimension is
    Family.ROWWISE: FamilySpec(Family.ROWWISE, ("rows", "cols"), ("aligned",), log_space=False,
                               derive=lambda f: {"aligned": (f.get("cols") or 0) % 8 == 0}),
    Family.EMBEDDING: FamilySpec(Family.EMBEDDING, ("tokens", "vocab", "dim"), (), log_space=False),
    Family.FOREACH: FamilySpec(Family.FOREACH, ("tensors", "numel"), ("pattern",), log_space=False),
    Family.ELEMENTWISE: FamilySpec(Family.ELEMENTWISE, ("numel",), ("pattern",), log_space=False),
    Family.VIEW: FamilySpec(Family.VIEW, (), ()),
    Family.HOST: FamilySpec(Family.HOST, (), ()),
}

# Every feature column any family uses, with its Parquet type ("int", "float", "str", "bool").
FEATURE_COLUMNS: dict[str, str] = {
    "batch": "int", "m": "int", "n": "int", "k": "int", "layout": "str",
    "heads": "int", "kv_heads_ratio": "int", "seq_q": "int", "seq_k_eq": "bool", "head_dim": "int",
    "causal": "bool", "dropout": "bool", "masked": "bool", "groups": "int",
    "rows": "int", "cols": "int", "tokens": "int", "vocab": "int", "dim": "int",
    "tensors": "int", "numel": "int", "pattern": "str",
}

Features = dict[str, Any]


@dataclass(frozen=True)
class OpKind:
    """One operator kind. `ops` are the aten overloads it covers (str(OpOverload))."""

    name: str
    ops: tuple[str, ...]
    family: Family
    features: Callable[[OpCall], Features]
    flops: Callable[[OpCall, Features], float] = lambda c, f: 0.0
    bytes: Callable[[OpCall, Features], float] = lambda c, f: float(sum(t.nbytes for t in c.device_tensors()))
    tf32_sensitive: bool = False
    index_args: tuple[IndexArg, ...] = ()
    input_rule: InputRule = InputRule.RANDOM
    grid: Callable[[Precision], Iterable[OpCall]] | None = None
    # argument whose dtype is the op's precision (statistics such as logsumexp stay fp32); None: widest
    primary: int | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Registry:
    """Operator kinds keyed by aten overload; a second registration of an overload raises."""

    def __init__(self) -> None:
        self._by_name: dict[str, OpKind] = {}
        self._by_op: dict[str, OpKind] = {}

    def register(self, kind: OpKind) -> OpKind:
        if kind.name in self._by_name:
            raise ValueError(f"operator kind {kind.name!r} registered twice")
        for op in kind.ops:
            if op in self._by_op:
                raise ValueError(f"{op} already registered by kind {self._by_op[op].name!r}")
        self._by_name[kind.name] = kind
        for op in kind.ops:
            self._by_op[op] = kind
        return kind

    def kind(self, name: str) -> OpKind:
        return self._by_name[name]

    def for_op(self, op: str) -> OpKind:
        """The kind covering `op`; unregistered operators fall into the generic elementwise kind."""
        return self._by_op.get(op) or self._by_name["elementwise"]

    def for_call(self, call: OpCall) -> OpKind:
        """The kind of one call. `aten.contiguous` is a view of a contiguous tensor and a copy of any other:
        tensor subclasses (torchao's float8 tensors) call it below autograd, where it reaches the trace
        undecomposed, and on a transposed fp8 weight it is a strided byte copy costing hundreds of us."""
        if call.op == CONTIGUOUS and call.args and isinstance(call.args[0], TensorSpec) and \
                call.args[0].strides is not None:
            return self._by_name["elementwise"]
        return self.for_op(call.op)

    def is_registered(self, op: str) -> bool:
        return op in self._by_op

    def kinds(self) -> list[OpKind]:
        return list(self._by_name.values())


CONTIGUOUS = "aten.contiguous.default"
REGISTRY = Registry()

# Integer tensors that index another argument, for operators with no kind of their own (they fall into
# the generic elementwise kind): filled uniformly over the indexed dimension, as routing and gathers
# index in a real step. Without a bound an index would be 0 or 1, and an accumulating index_put would
# pile every row onto two and serialise (measured 100x slow).
INDEX_ARGS_BY_OP: dict[str, tuple[IndexArg, ...]] = {
    "aten.index.Tensor": (IndexArg(1, 0, 0),),
    "aten.index_put.default": (IndexArg(1, 0, 0),),
    "aten.index_put_.default": (IndexArg(1, 0, 0),),
    "aten._index_put_impl_.default": (IndexArg(1, 0, 0),),
    "aten.index_select.default": (IndexArg(2, 0, 0),),
    "aten.index_add.default": (IndexArg(2, 0, 0),),
    "aten.index_add_.default": (IndexArg(2, 0, 0),),
    # scatter/gather index along their `dim` argument (self's size there bounds the index)
    "aten.scatter.src": (IndexArg(2, 0, -1, dim_arg=1),),
    "aten.scatter_.src": (IndexArg(2, 0, -1, dim_arg=1),),
    "aten.scatter.value": (IndexArg(2, 0, -1, dim_arg=1),),
    "aten.scatter_.value": (IndexArg(2, 0, -1, dim_arg=1),),
    "aten.scatter_add.default": (IndexArg(2, 0, -1, dim_arg=1),),
    "aten.scatter_add_.default": (IndexArg(2, 0, -1, dim_arg=1),),
    "aten.gather.default": (IndexArg(2, 0, -1, dim_arg=1),),
}


def index_args_of(op: str) -> tuple[IndexArg, ...]:
    kind = REGISTRY.for_op(op)
    return kind.index_args or INDEX_ARGS_BY_OP.get(op, ())


# ---------------------------------------------------------------------------------------------
# Helpers over calls
# ---------------------------------------------------------------------------------------------

def float_dtypes(call: OpCall) -> list[DType]:
    """The device tensors' floating dtypes, each once, in argument order."""
    return [d for d in call.device_dtypes() if d.is_float]


def dtypes_key(call: OpCall) -> str:
    """Input dtypes in argument order, deduplicated, plus an explicit target dtype if any ("fp32>bf16")."""
    seen = [str(d) for d in call.device_dtypes()]
    target = call.kwarg("dtype")
    out = ",".join(seen) if seen else "-"
    if isinstance(target, Scalar) and target.tag == "dtype":
        out += ">" + target.value
    return out


def precision_of(call: OpCall, allow_tf32: bool) -> Precision:
    kind = REGISTRY.for_op(call.op)
    dts = float_dtypes(call)
    if kind.primary is not None and kind.primary < len(call.args):
        prim = call.args[kind.primary]
        if isinstance(prim, list) and prim and isinstance(prim[0], TensorSpec):
            prim = prim[0]
        if isinstance(prim, TensorSpec) and prim.dtype.is_float:
            dts = [prim.dtype]
    return op_precision(dts, kind.tf32_sensitive, allow_tf32)


def math_mode(call: OpCall, allow_tf32: bool) -> str:
    """Part of the key: only TF32-sensitive kinds key on the TF32 switch."""
    return "tf32" if (allow_tf32 and REGISTRY.for_op(call.op).tf32_sensitive) else ""


def _is_colmajor(t: TensorSpec) -> bool:
    if len(t.shape) < 2 or t.strides is None:
        return False
    s = t.strides
    return s[-2] == 1 and s[-1] >= max(t.shape[-2], 1)


def _padded_pitch(t: TensorSpec) -> bool:
    """A GEMM operand read as a view whose row pitch is padded to no 16-byte multiple (the probabilities of an
    attention with sinks: rows of seq + 1 scores, the last one dropped), or that starts off a 16-byte boundary:
    cuBLAS falls back to its unaligned kernels (H200, bf16 [64, 4096, 4096] x [64, 4096, 64] at pitch 4097: 1.9x
    the contiguous time). A contiguous or plainly transposed operand keeps its dimensions' alignment (`aligned`)."""
    if t.strides is None or len(t.shape) < 2:
        return False
    s, it = t.strides, t.dtype.itemsize
    if s[-1] == 1:
        pitch, plain = s[-2], t.shape[-1]
    elif s[-2] == 1:
        pitch, plain = s[-1], t.shape[-2]
    else:
        return False
    return (pitch != plain and (pitch * it) % 16 != 0) or (t.offset * it) % 16 != 0


def _layout(a: TensorSpec, b: TensorSpec) -> str:
    lay = ("t" if _is_colmajor(a) else "n") + ("t" if _is_colmajor(b) else "n")
    return lay + "/ua" if _padded_pitch(a) or _padded_pitch(b) else lay


def _gemm_bytes(c: OpCall, f: Features) -> float:
    it = max((t.dtype.itemsize for t in c.device_tensors() if t.dtype.is_float), default=4)
    return float(it * f["batch"] * (f["m"] * f["k"] + f["k"] * f["n"] + f["m"] * f["n"]))


def _gemm_flops(c: OpCall, f: Features) -> float:
    return 2.0 * f["batch"] * f["m"] * f["n"] * f["k"]


def _t(shape: tuple[int, ...], dtype: DType, strides: tuple[int, ...] | None = None) -> TensorSpec:
    if strides is not None and strides == contiguous_strides(shape):
        strides = None
    return TensorSpec(tuple(shape), dtype, strides)


def _transposed(rows: int, cols: int, dtype: DType) -> TensorSpec:
    """A [rows, cols] view of a contiguous [cols, rows] tensor (what .t() gives)."""
    return _t((rows, cols), dtype, (1, rows))


PRECISION_DTYPE = {Precision.FP32: DType.FP32, Precision.TF32: DType.FP32, Precision.FP16: DType.FP16,
                   Precision.BF16: DType.BF16}
FLOAT_PRECISIONS = (Precision.FP32, Precision.TF32, Precision.FP16, Precision.BF16)
HALF_PRECISIONS = (Precision.FP16, Precision.BF16)


# ---------------------------------------------------------------------------------------------
# Grids (the generic campaign). Sizes cover 7B-70B-class models at 1-64-way TP; off-by-one points
# catch tile and wave quantisation.
# ---------------------------------------------------------------------------------------------

GEMM_TOKENS = (1024, 2048, 4096, 8192, 16384)
GEMM_DIMS = (256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 32768, 65536, 131072)
GEMM_OFF_BY_ONE = ((4096, 4095, 4096), (4096, 4097, 4096), (4096, 4096, 4095), (4096, 4096, 4097),
                   (4095, 4096, 4096), (4097, 4096, 4096), (8192, 8191, 8192), (8192, 8193, 8192))
# FLOP caps per point: beyond them utilisation is flat and the roofline hold extrapolates reliably.
GEMM_FLOP_CAP = {Precision.FP32: 0.15e12, Precision.TF32: 1.5e12, Precision.FP16: 3e12, Precision.BF16: 3e12}


def gemm_layout_call(m: int, n: int, k: int, layout: str, dtype: DType) -> OpCall:
    a = _transposed(m, k, dtype) if layout[0] == "t" else _t((m, k), dtype)
    b = _transposed(k, n, dtype) if layout[1] == "t" else _t((k, n), dtype)
    return OpCall("aten.mm.default", (a, b))


def _gemm_grid(p: Precision) -> Iterable[OpCall]:
    dt = PRECISION_DTYPE[p]
    cap = GEMM_FLOP_CAP[p]
    seen: set[tuple[int, int, int, str]] = set()
    # A linear layer y = x W^T with x [T, din]: forward (T, dout, din) "nt", input grad (T, din, dout)
    # "nn", weight grad (dout, din, T) "tn".
    for tok in GEMM_TOKENS:
        for din in GEMM_DIMS:
            for dout in GEMM_DIMS:
                if max(din, dout) / min(din, dout) > 32:
                    continue
                for m, n, k, lay in ((tok, dout, din, "nt"), (tok, din, dout, "nn"), (dout, din, tok, "tn")):
                    if 2.0 * m * n * k > cap or (m, n, k, lay) in seen:
                        continue
                    seen.add((m, n, k, lay))
                    yield gemm_layout_call(m, n, k, lay, dt)
    for m, n, k in GEMM_OFF_BY_ONE:
        for lay in ("nt", "nn", "tn"):
            if 2.0 * m * n * k <= cap and (m, n, k, lay) not in seen:
                seen.add((m, n, k, lay))
                yield gemm_layout_call(m, n, k, lay, dt)


GEMM_UNALIGNED_VOCAB = (8191, 32001, 50257, 100003)
GEMM_UNALIGNED_HIDDEN = (768, 1024, 2048, 4096)


def _gemm_unaligned_grid(p: Precision) -> Iterable[OpCall]:
    """LM heads with vocabularies that are not a multiple of 8 (forward, input grad, weight grad)."""
    dt = PRECISION_DTYPE[p]
    for tok in (1024, 2048, 4096, 8192, 16384):
        for h in GEMM_UNALIGNED_HIDDEN:
            for v in GEMM_UNALIGNED_VOCAB:
                for m, n, k, lay in ((tok, v, h, "nt"), (tok, h, v, "nn"), (v, h, tok, "tn")):
                    if 2.0 * m * n * k <= GEMM_FLOP_CAP[p] * 2:
                        yield gemm_layout_call(m, n, k, lay, dt)


# Experts computed as one batched GEMM over every token (transformers' Llama-4 experts: [E, T, H] x [E, H, 2F]),
# forward, input and weight gradients; added 2026-12-01 after Llama-4 cuts were over-predicted 11-15% by holding the
# attention-shaped points' efficiency (at most 530 TFLOP/s) for GEMMs that run at 850
BMM_EXPERTS = (8, 16)
BMM_EXPERT_TOKENS = (2048, 8192)
BMM_EXPERT_SIZES = ((4096, 4096), (5120, 8192))  # (hidden, expert FFN)
BMM_EXPERT_FLOP_CAP = {Precision.FP32: 2e12, Precision.TF32: 8e12, Precision.FP16: 24e12, Precision.BF16: 24e12}


def _bmm_expert_calls(e: int, t: int, h: int, f: int, dt: DType) -> list[OpCall]:
    f2 = 2 * f
    return [
        OpCall("aten.bmm.default", (_t((e, t, h), dt), _t((e, h, f2), dt))),  # gate-up
        OpCall("aten.bmm.default", (_t((e, t, f), dt), _t((e, f, h), dt))),  # down
        OpCall("aten.bmm.default", (_t((e, t, h), dt), _t((e, h, f), dt, (f * h, 1, h)))),  # down: input grad
        OpCall("aten.bmm.default", (_t((e, f, t), dt, (f * t, 1, f)), _t((e, t, h), dt))),  # down: weight grad
        OpCall("aten.bmm.default", (_t((e, t, f2), dt), _t((e, f2, h), dt, (f2 * h, 1, f2)))),  # gate-up: input grad
        OpCall("aten.bmm.default", (_t((e, h, t), dt, (h * t, 1, h)), _t((e, t, f2), dt))),  # gate-up: weight grad
    ]


def _bmm_expert_grid(p: Precision) -> Iterable[tuple[int, int, int, list[OpCall]]]:
    """(experts, hidden, expert FFN, its six calls) of every expert shape of the grid within the FLOP cap."""
    for e in BMM_EXPERTS:
        for t in BMM_EXPERT_TOKENS:
            for h, f in BMM_EXPERT_SIZES:
                if 2.0 * e * t * h * 2 * f <= BMM_EXPERT_FLOP_CAP[p]:
                    yield e, h, f, _bmm_expert_calls(e, t, h, f, PRECISION_DTYPE[p])


def routed_expert_calls(p: Precision) -> Iterable[tuple[OpCall, Operands]]:
    """The expert-shaped batched GEMMs of the grid (BMM_EXPERTS) with the operands a top-1 router leaves them
    (routed_operands), for the dense experts of DENSE_ROUTED_MODEL_TYPES; the dense one is the grid's own."""
    for e, h, f, calls in _bmm_expert_grid(p):
        for c in calls:
            ops = routed_operands(c.arg_tensor(0), c.arg_tensor(1), e, h, f)
            if ops != Operands.RANDOM:
                yield c, ops


# batch x heads of attention's math path (SDPA's math backend, eager attention): to 256 as the fused kernels' grid,
# for micro-batches of small models and many-head ones (Falcon-7B's 71 heads)
BMM_ATTENTION_BATCHES = (8, 16, 32, 64, 128, 256)


def _bmm_grid(p: Precision) -> Iterable[OpCall]:
    """Batched GEMMs shaped like attention's math path (fp32 with grouped-query heads): scores, P@V and
    their gradients; measured in every precision. Then experts as batched GEMMs (BMM_EXPERTS)."""
    dt = PRECISION_DTYPE[p]
    for _, _, _, calls in _bmm_expert_grid(p):
        yield from calls
    for b in BMM_ATTENTION_BATCHES:
        for s in (512, 1024, 2048, 4096):
            for d in (64, 128):
                for m, n, k in ((s, s, d), (s, d, s), (d, s, s)):
                    for lay in ("nn", "nt", "tn"):
                        if 2.0 * b * m * n * k > GEMM_FLOP_CAP[p]:
                            continue
                        a = _t((b, m, k), dt, (m * k, 1, m)) if lay[0] == "t" else _t((b, m, k), dt)
                        bb = _t((b, k, n), dt, (n * k, 1, k)) if lay[1] == "t" else _t((b, k, n), dt)
                        yield OpCall("aten.bmm.default", (a, bb))


def _baddbmm_grid(p: Precision) -> Iterable[OpCall]:
    """GPT-2's reordered, upcast attention scores (beta=0, alpha=scale) and other batched add-GEMMs."""
    dt = PRECISION_DTYPE[p]
    for b in (16, 64):
        for s in (512, 1024, 2048):
            for d in (64, 128):
                if 2.0 * b * s * s * d > GEMM_FLOP_CAP[p]:
                    continue
                yield OpCall("aten.baddbmm.default", (_t((b, s, s), dt), _t((b, s, d), dt),
                                                      _t((b, d, s), dt, (s * d, 1, d))),
                             (("alpha", 0.125), ("beta", 0)))


# (hidden, FFN) widths of current open models (Qwen2/2.5/3, Llama 2/3, Mistral, Gemma 2/3, Phi-3,
# TinyLlama): their projections' GEMMs at common token counts, whole and split over TP=2, and LM heads of
# common vocabularies. Between the power-of-two grid's widths GEMM efficiency is not log-linear: a
# Qwen2-7B step's projections (3584 x 18944) and LM head (152064, beyond the FLOP cap) were 7-11% slower
# to predict than to run (per-operator H200 profile, data/validation/profiles/).
GEMM_LLM_WIDTHS = ((896, 4864), (1536, 8960), (2048, 5632), (2048, 6144), (2048, 8192), (2304, 9216),
                   (2560, 9728), (2560, 10240), (3072, 8192), (3072, 24576), (3584, 14336), (3584, 18944),
                   (4096, 11008), (4096, 12288), (4096, 14336), (5120, 13824), (5120, 17408), (5120, 27648),
                   (8192, 28672), (8192, 29568))
GEMM_LLM_TOKENS = (2048, 4096, 8192, 16384)
GEMM_LLM_VOCABS = (32000, 128256, 151936, 152064)
GEMM_LLM_PRECISIONS = (Precision.BF16, Precision.FP16, Precision.TF32)


def _gemm_llm_grid(p: Precision) -> Iterable[OpCall]:
    if p not in GEMM_LLM_PRECISIONS:
        return
    dt = PRECISION_DTYPE[p]
    seen: set[tuple[int, int, int, str]] = set()

    def linear(tok: int, din: int, dout: int) -> Iterable[OpCall]:
        for m, n, k, lay in ((tok, dout, din, "nt"), (tok, din, dout, "nn"), (dout, din, tok, "tn")):
            if (m, n, k, lay) not in seen:
                seen.add((m, n, k, lay))
                yield gemm_layout_call(m, n, k, lay, dt)

    for tok in GEMM_LLM_TOKENS:
        for h, f in GEMM_LLM_WIDTHS:
            for tp in (1, 2):
                yield from linear(tok, h, f // tp)  # up / gate
                yield from linear(tok, h, 2 * f // tp)  # fused gate-up (Megatron, Phi-3)
                yield from linear(tok, f // tp, h)  # down
        if p != Precision.TF32 and tok <= 8192:  # LM heads (TF32 ones run 10-50 ms each: held from the grid)
            for h in sorted({h for h, _ in GEMM_LLM_WIDTHS}):
                for v in GEMM_LLM_VOCABS:
                    yield from linear(tok, h, v)


def _mm_grid(p: Precision) -> Iterable[OpCall]:
    yield from _gemm_grid(p)
    yield from _gemm_unaligned_grid(p)
    yield from _gemm_llm_grid(p)


def _mm_features(c: OpCall) -> Features:
    a, b = c.arg_tensor(0), c.arg_tensor(1)
    return {"batch": 1, "m": a.shape[0], "k": a.shape[1], "n": b.shape[1], "layout": _layout(a, b)}


def _addmm_features(c: OpCall) -> Features:
    a, b = c.arg_tensor(1), c.arg_tensor(2)
    return {"batch": 1, "m": a.shape[0], "k": a.shape[1], "n": b.shape[1], "layout": _layout(a, b)}


def _bmm_features(c: OpCall) -> Features:
    a, b = c.arg_tensor(0), c.arg_tensor(1)
    return {"batch": a.shape[0], "m": a.shape[1], "k": a.shape[2], "n": b.shape[2], "layout": _layout(a, b)}


def _baddbmm_features(c: OpCall) -> Features:
    a, b = c.arg_tensor(1), c.arg_tensor(2)
    return {"batch": a.shape[0], "m": a.shape[1], "k": a.shape[2], "n": b.shape[2], "layout": _layout(a, b)}


def _addmm_grid(p: Precision) -> Iterable[OpCall]:
    # Linear layers with bias (GPT-2's Conv1D is "nn", nn.Linear is "nt"); a smaller sweep than mm.
    dt = PRECISION_DTYPE[p]
    for tok in (1024, 4096, 16384):
        for din in (768, 1024, 2048, 4096, 8192):
            for dout in (768, 1024, 2048, 3072, 4096, 8192, 16384):
                for lay in ("nt", "nn"):
                    if 2.0 * tok * din * dout > GEMM_FLOP_CAP[p]:
                        continue
                    mm = gemm_layout_call(tok, dout, din, lay, dt)
                    yield OpCall("aten.addmm.default", (_t((dout,), dt), *mm.args))


REGISTRY.register(OpKind("mm", ("aten.mm.default",), Family.GEMM, _mm_features, _gemm_flops, _gemm_bytes,
                         tf32_sensitive=True, grid=_mm_grid))
def _scaled_mm_features(c: OpCall) -> Features:
    """torch._scaled_mm(a fp8 row-major, b fp8 column-major, scale_a, scale_b): tensorwise scales are
    scalars, rowwise ones a scale per row of a and per column of b (a different kernel)."""
    a, b = c.arg_tensor(0), c.arg_tensor(1)
    scale = c.args[2] if len(c.args) > 2 and isinstance(c.args[2], TensorSpec) else None
    rowwise = scale is not None and scale.numel > 1
    return {"batch": 1, "m": a.shape[0], "k": a.shape[1], "n": b.shape[1],
            "layout": f"{_layout(a, b)}:{'rowwise' if rowwise else 'tensorwise'}"}


def _scaled_mm_bytes(c: OpCall, f: Features) -> float:
    out = c.kwarg("out_dtype")
    out_size = 2 if out is not None else 1
    return float(f["m"] * f["k"] + f["k"] * f["n"] + f["m"] * f["n"] * out_size)


REGISTRY.register(OpKind("scaled_mm", ("aten._scaled_mm.default",), Family.GEMM, _scaled_mm_features, _gemm_flops,
                         _scaled_mm_bytes, primary=0, notes="fp8 GEMM (torchao float8 training)"))
REGISTRY.register(OpKind("addmm", ("aten.addmm.default",), Family.GEMM, _addmm_features, _gemm_flops,
                         _gemm_bytes, tf32_sensitive=True, grid=_addmm_grid))
REGISTRY.register(OpKind("bmm", ("aten.bmm.default",), Family.GEMM, _bmm_features, _gemm_flops, _gemm_bytes,
                         tf32_sensitive=True, grid=_bmm_grid))
REGISTRY.register(OpKind("baddbmm", ("aten.baddbmm.default",), Family.GEMM, _baddbmm_features, _gemm_flops,
                         _gemm_bytes, tf32_sensitive=True, grid=_baddbmm_grid))


# Grouped GEMM (MoE experts: transformers' grouped_mm path): one kernel over `groups` GEMMs whose rows
# (2-D x 3-D, forward and input gradient) or shared dimension (2-D x 2-D -> 3-D, weight gradient) are cut
# at `offs`. Timed with balanced groups (every expert the same share of tokens, the prediction's stated
# routing assumption); features are the totals, as a dense GEMM of the same work.
def _grouped_features(c: OpCall) -> Features:
    a, b = c.arg_tensor(0), c.arg_tensor(1)
    if len(a.shape) == 2 and len(b.shape) == 3:  # (S, K) x (G, K, N) -> (S, N)
        g, m, k, n, layout = b.shape[0], a.shape[0], a.shape[1], b.shape[2], "grouped:2d3d"
    elif len(a.shape) == 2 and len(b.shape) == 2:  # (K, S) x (S, N) -> (G, K, N): weight gradient
        offs = c.arg_tensor(2) if len(c.args) > 2 and isinstance(c.args[2], TensorSpec) else None
        g = offs.shape[0] if offs is not None else 1
        m, k, n, layout = a.shape[0], a.shape[1], b.shape[1], "grouped:2d2d"
    else:
        g, m, k, n, layout = a.shape[0], a.shape[-2], a.shape[-1], b.shape[-1], "grouped:3d"
    return {"batch": g, "groups": g, "m": m, "n": n, "k": k, "layout": layout}


def _grouped_flops(c: OpCall, f: Features) -> float:
    return 2.0 * f["m"] * f["n"] * f["k"] * (f["groups"] if f["layout"] == "grouped:3d" else 1)


def _grouped_bytes(c: OpCall, f: Features) -> float:
    a, b = c.arg_tensor(0), c.arg_tensor(1)
    it = a.dtype.itemsize
    out = f["m"] * f["n"] * (f["groups"] if f["layout"] != "grouped:2d3d" else 1)
    return float(a.nbytes + b.nbytes + out * it)


def grouped_expert_calls(groups: int, rows: int, hidden: int, ffn: int, dt: DType) -> list[OpCall]:
    """The six grouped GEMMs of one routed-expert MLP step as transformers' grouped_mm experts dispatch them
    (`rows` token-expert pairs, gate/up fused into 2 x ffn, weights stored [G, out, in]): forward gate-up and
    down through transposed weight views, then per projection the weight gradient (a transposed activation
    times the output gradient) and the input gradient (the weight itself)."""
    g, s, h, f2 = groups, rows, hidden, 2 * ffn
    offs = TensorSpec((g,), DType.I32)
    return [
        OpCall("aten._grouped_mm.default", (_t((s, h), dt), _t((g, h, f2), dt, (f2 * h, 1, h)), offs)),
        OpCall("aten._grouped_mm.default", (_t((s, ffn), dt), _t((g, ffn, h), dt, (h * ffn, 1, ffn)), offs)),
        OpCall("aten._grouped_mm.default", (_t((h, s), dt, (1, h)), _t((s, ffn), dt), offs)),
        OpCall("aten._grouped_mm.default", (_t((s, h), dt), _t((g, h, ffn), dt), offs)),
        OpCall("aten._grouped_mm.default", (_t((f2, s), dt, (1, f2)), _t((s, h), dt), offs)),
        OpCall("aten._grouped_mm.default", (_t((s, f2), dt), _t((g, f2, h), dt), offs)),
    ]


# The generic grid (added 2026-12-01 after a GLM-4.5-Air cut was over-predicted 15-19% in its fp32-expert
# settings, its grouped GEMMs extrapolated from model-specific points): experts of current MoE models span
# hidden 2048-7168, expert FFN 768-8192, 8-256 experts, a few hundred to a few thousand token pairs per expert
# (64 and 256 experts added in a second call).
GROUPED_GROUPS = (8, 32, 64, 128, 256)
GROUPED_ROWS_PER_GROUP = (128, 1024)
GROUPED_HIDDEN = (2048, 4096, 7168)
GROUPED_FFN = (768, 2048, 8192)
GROUPED_FLOP_CAP = {Precision.FP32: 1e12, Precision.TF32: 1e12, Precision.FP16: 8e12, Precision.BF16: 8e12}


def _grouped_grid(p: Precision) -> Iterable[OpCall]:
    if p not in (Precision.FP32, Precision.TF32, Precision.BF16):  # fp16 runs bf16's kernels
        return
    dt = PRECISION_DTYPE[p]
    for t in GROUPED_ROWS_PER_GROUP:
        for g in GROUPED_GROUPS:
            for h in GROUPED_HIDDEN:
                for f in GROUPED_FFN:
                    if 2.0 * g * t * h * 2 * f > GROUPED_FLOP_CAP[p]:
                        continue
                    yield from grouped_expert_calls(g, g * t, h, f, dt)


REGISTRY.register(OpKind("grouped_mm", ("aten._grouped_mm.default",), Family.GEMM, _grouped_features,
                         _grouped_flops, _grouped_bytes, tf32_sensitive=True, input_rule=InputRule.GROUP_OFFSETS,
                         grid=_grouped_grid, notes="MoE experts; offsets balanced across groups"))


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

ATTN_FWD_ARGS = {  # op -> (dropout arg index, causal arg index)
    "aten._scaled_dot_product_cudnn_attention.default": (5, 6),
    "aten._scaled_dot_product_efficient_attention.default": (5, 6),
    "aten._scaled_dot_product_flash_attention.default": (3, 4),
}
# backward op -> (index of query, dropout index, causal index, forward op)
ATTN_BWD_ARGS = {
    "aten._scaled_dot_product_cudnn_attention_backward.default":
        (1, 13, 14, "aten._scaled_dot_product_cudnn_attention.default"),
    "aten._scaled_dot_product_efficient_attention_backward.default":
        (1, 9, 11, "aten._scaled_dot_product_efficient_attention.default"),
    "aten._scaled_dot_product_flash_attention_backward.default":
        (1, 10, 11, "aten._scaled_dot_product_flash_attention.default"),
}


def _attn_common(q: TensorSpec, k: TensorSpec, v: TensorSpec, dropout: Any, causal: Any) -> Features:
    """head_dim is the query/key head's; a value head of another size (DeepSeek's multi-head latent attention:
    192 and 128) is part of the category as `layout` "dv<size>" (empty where they are equal)."""
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    dv = v.shape[-1] if v.shape else d
    return {"batch": b, "heads": b * h, "kv_heads_ratio": max(h // max(hk, 1), 1), "seq_q": sq,
            "seq_k_eq": sk == sq, "head_dim": d, "causal": bool(causal), "dropout": bool(dropout and dropout > 0),
            "_seq_k": sk, "_v_head_dim": dv, **({"layout": f"dv{dv}"} if dv != d else {})}


# where an attention call carries its additive mask (attn_bias), if any
ATTN_MASK_ARG = {
    "aten._scaled_dot_product_cudnn_attention.default": 3,
    "aten._scaled_dot_product_efficient_attention.default": 3,
    "aten._scaled_dot_product_cudnn_attention_backward.default": 8,
    "aten._scaled_dot_product_efficient_attention_backward.default": 4,
}


def _masked(c: OpCall) -> bool:
    i = ATTN_MASK_ARG.get(c.op)
    return i is not None and i < len(c.args) and isinstance(c.args[i], TensorSpec)


def _attn_fwd_features(c: OpCall) -> Features:
    di, ci = ATTN_FWD_ARGS[c.op]
    return {**_attn_common(c.arg_tensor(0), c.arg_tensor(1), c.arg_tensor(2), _arg(c, di, 0.0), _arg(c, ci, False)),
            "masked": _masked(c)}


def _attn_bwd_features(c: OpCall) -> Features:
    qi, di, ci, _ = ATTN_BWD_ARGS[c.op]
    return {**_attn_common(c.arg_tensor(qi), c.arg_tensor(qi + 1), c.arg_tensor(qi + 2), _arg(c, di, 0.0),
                           _arg(c, ci, False)),
            "masked": _masked(c)}


def _arg(c: OpCall, i: int, default: Any) -> Any:
    return c.args[i] if i < len(c.args) else default


def _attn_flops(mult: float) -> Callable[[OpCall, Features], float]:
    def f(c: OpCall, feat: Features) -> float:
        # scores (query/key head) and P @ V (value head)
        full = 2.0 * feat["heads"] * feat["seq_q"] * feat["_seq_k"] * (feat["head_dim"] + feat["_v_head_dim"])
        return mult * full * (0.5 if feat["causal"] else 1.0)
    return f


ATTN_SEQS = (256, 512, 1024, 2048, 4096, 8192, 16384)
ATTN_HEADS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # batch x heads: small models train micro-batches of 8-32
ATTN_HEAD_DIMS = (64, 128)
MLA_HEAD_DIMS = (192, 128)  # (query/key, value) head sizes of multi-head latent attention
ATTN_FLOP_CAP = {Precision.FP32: 0.4e12, Precision.TF32: 0.4e12, Precision.FP16: 6e12, Precision.BF16: 6e12}


def attn_qkv(b: int, h: int, hk: int, s: int, d: int, dt: DType, dv: int | None = None
             ) -> tuple[TensorSpec, TensorSpec, TensorSpec]:
    """q, k, v as HF passes them: [B, H, S, D] views of [B, S, H, D] projections (values of head size dv)."""
    def proj(heads: int, dim: int) -> TensorSpec:
        return _t((b, heads, s, dim), dt, (s * heads * dim, dim, heads * dim, 1))
    return proj(h, d), proj(hk, d), proj(hk, dv or d)


def attention_fwd_call(op: str, b: int, h: int, hk: int, s: int, d: int, dt: DType, causal: bool,
                       dropout: float = 0.0, scale: float | None = None, dv: int | None = None) -> OpCall:
    q, k, v = attn_qkv(b, h, hk, s, d, dt, dv)
    kw: tuple[tuple[str, Any], ...] = (("scale", scale if scale is not None else d ** -0.5),)
    if op == "aten._scaled_dot_product_cudnn_attention.default":
        return OpCall(op, (q, k, v, None, True, dropout, causal, False), kw)
    if op == "aten._scaled_dot_product_efficient_attention.default":
        return OpCall(op, (q, k, v, None, True, dropout, causal), kw)
    if op == "aten._scaled_dot_product_flash_attention.default":
        return OpCall(op, (q, k, v, dropout, causal, False), kw)
    raise KeyError(op)


def attention_bwd_call(fwd_op: str, b: int, h: int, hk: int, s: int, d: int, dt: DType, causal: bool,
                       dropout: float = 0.0, scale: float | None = None, dv: int | None = None) -> OpCall:
    """A backward call in the collector's canonical form: the collector runs the forward to fill the
    tensors that only a forward can produce (output, logsumexp, rng state)."""
    q, k, v = attn_qkv(b, h, hk, s, d, dt, dv)
    e = dv or d
    go = _t((b, h, s, e), dt, (s * h * e, e, h * e, 1))
    out = go
    lse = _t((b, h, s), DType.FP32)
    sc = scale if scale is not None else d ** -0.5
    seed = TensorSpec((), DType.I64)
    if fwd_op.endswith("cudnn_attention.default"):
        cum = TensorSpec((0,), DType.I32)
        return OpCall("aten._scaled_dot_product_cudnn_attention_backward.default",
                      (go, q, k, v, out, lse, seed, seed, None, cum, cum, s, s, dropout, causal), (("scale", sc),))
    if fwd_op.endswith("efficient_attention.default"):
        return OpCall("aten._scaled_dot_product_efficient_attention_backward.default",
                      (go, q, k, v, None, out, lse, seed, seed, dropout, [True, True, True, False], causal),
                      (("scale", sc),))
    cum = TensorSpec((0,), DType.I32)
    return OpCall("aten._scaled_dot_product_flash_attention_backward.default",
                  (go, q, k, v, out, lse, cum, cum, s, s, dropout, causal, seed, seed), (("scale", sc),))


def _attn_grid(fwd_op: str, backward: bool, precisions: tuple[Precision, ...]) -> Callable[[Precision], Iterable[OpCall]]:
    def grid(p: Precision) -> Iterable[OpCall]:
        if p not in precisions:
            return
        dt = PRECISION_DTYPE[p]
        for d in ATTN_HEAD_DIMS:
            for s in ATTN_SEQS:
                for h in ATTN_HEADS:
                    for ratio in ((1, 4) if fwd_op != _EFF else (1,)):  # efficient attention has no GQA
                        if h % ratio:
                            continue
                        flops = 4.0 * h * s * s * d * 0.5 * (2.5 if backward else 1.0)
                        if flops > ATTN_FLOP_CAP[p]:
                            continue
                        make = attention_bwd_call if backward else attention_fwd_call
                        yield make(fwd_op, 1, h, h // ratio, s, d, dt, True)
                        if d == 64 and ratio == 1:  # GPT-style models train with attention dropout
                            yield make(fwd_op, 1, h, h, s, d, dt, True, 0.1)
        if fwd_op == _FLASH:  # flash needs one head size for query, key and value
            return
        # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight): query/key heads of 192, value 128
        for s in ATTN_SEQS:
            for h in ATTN_HEADS:
                dq, dv = MLA_HEAD_DIMS
                if 2.0 * h * s * s * (dq + dv) * 0.5 * (2.5 if backward else 1.0) > ATTN_FLOP_CAP[p]:
                    continue
                make = attention_bwd_call if backward else attention_fwd_call
                yield make(fwd_op, 1, h, h, s, dq, dt, True, dv=dv)
    return grid


_CUDNN = "aten._scaled_dot_product_cudnn_attention.default"
_EFF = "aten._scaled_dot_product_efficient_attention.default"
_FLASH = "aten._scaled_dot_product_flash_attention.default"
REGISTRY.register(OpKind("attn_cudnn_fwd", (_CUDNN,), Family.ATTENTION, _attn_fwd_features, _attn_flops(1.0),
                         primary=0, grid=_attn_grid(_CUDNN, False, HALF_PRECISIONS)))
REGISTRY.register(OpKind("attn_cudnn_bwd", ("aten._scaled_dot_product_cudnn_attention_backward.default",),
                         Family.ATTENTION, _attn_bwd_features, _attn_flops(2.5), input_rule=InputRule.FROM_FORWARD, primary=1,
                         grid=_attn_grid(_CUDNN, True, HALF_PRECISIONS)))
REGISTRY.register(OpKind("attn_efficient_fwd", (_EFF,), Family.ATTENTION, _attn_fwd_features, _attn_flops(1.0),
                         primary=0, grid=_attn_grid(_EFF, False, (Precision.FP32, *HALF_PRECISIONS))))
REGISTRY.register(OpKind("attn_efficient_bwd", ("aten._scaled_dot_product_efficient_attention_backward.default",),
                         Family.ATTENTION, _attn_bwd_features, _attn_flops(2.5), input_rule=InputRule.FROM_FORWARD, primary=1,
                         grid=_attn_grid(_EFF, True, (Precision.FP32, *HALF_PRECISIONS))))
REGISTRY.register(OpKind("attn_flash_fwd", (_FLASH,), Family.ATTENTION, _attn_fwd_features, _attn_flops(1.0),
                         primary=0, grid=_attn_grid(_FLASH, False, HALF_PRECISIONS)))
REGISTRY.register(OpKind("attn_flash_bwd", ("aten._scaled_dot_product_flash_attention_backward.default",),
                         Family.ATTENTION, _attn_bwd_features, _attn_flops(2.5), input_rule=InputRule.FROM_FORWARD,
                         primary=1, grid=_attn_grid(_FLASH, True, HALF_PRECISIONS)))


# ---------------------------------------------------------------------------------------------
# Row-wise: norms, softmax, losses
# ---------------------------------------------------------------------------------------------

def _rows_cols(t: TensorSpec) -> Features:
    cols = t.shape[-1] if t.shape else 1
    return {"rows": max(t.numel // max(cols, 1), 1), "cols": cols}


def _rowwise_first(c: OpCall) -> Features:
    return _rows_cols(c.arg_tensor(0))


def _rowwise_second(c: OpCall) -> Features:
    return _rows_cols(c.arg_tensor(1))


def _rowwise_flops(per_elem: float) -> Callable[[OpCall, Features], float]:
    return lambda c, f: per_elem * f["rows"] * f["cols"]


def _rowwise_bytes(reads: float, writes: float) -> Callable[[OpCall, Features], float]:
    def b(c: OpCall, f: Features) -> float:
        it = max((t.dtype.itemsize for t in c.device_tensors() if t.dtype.is_float), default=4)
        return (reads + writes) * it * f["rows"] * f["cols"]
    return b


NORM_ROWS = (1024, 4096, 16384, 65536)
NORM_COLS = (512, 1024, 2048, 4096, 8192, 16384)
SOFTMAX_COLS = (4096, 16384, 32000, 65536, 128256, 151936)
# attention scores' rows: one per query of every head, as long as the key sequence (SDPA's math path)
SCORE_COLS = (1024, 2048, 4096, 8192)
ROWWISE_NUMEL_CAP = 2**31


def _rowwise_grid(build: Callable[[int, int, DType], OpCall], cols: tuple[int, ...],
                  precisions: tuple[Precision, ...] = (Precision.FP32, Precision.FP16, Precision.BF16)):
    def grid(p: Precision) -> Iterable[OpCall]:
        if p not in precisions:
            return
        for r in NORM_ROWS:
            for col in cols:
                if r * col <= ROWWISE_NUMEL_CAP:
                    yield build(r, col, PRECISION_DTYPE[p])
    return grid


def _rms_fwd(r: int, col: int, dt: DType) -> OpCall:
    return OpCall("aten._fused_rms_norm.default", (_t((r, col), dt), [col], _t((col,), dt), 1e-5))


def _rms_bwd(r: int, col: int, dt: DType) -> OpCall:
    return OpCall("aten._fused_rms_norm_backward.default",
                  (_t((r, col), dt), _t((r, col), dt), [col], _t((r, 1), DType.FP32), _t((col,), dt), [True, True]))


def _ln_fwd(r: int, col: int, dt: DType) -> OpCall:
    return OpCall("aten.native_layer_norm.default", (_t((r, col), dt), [col], _t((col,), dt), _t((col,), dt), 1e-5))


def _ln_bwd(r: int, col: int, dt: DType) -> OpCall:
    st = DType.FP32 if dt != DType.FP32 else dt
    return OpCall("aten.native_layer_norm_backward.default",
                  (_t((r, col), dt), _t((r, col), dt), [col], _t((r, 1), st), _t((r, 1), st), _t((col,), dt),
                   _t((col,), dt), [True, True, True]))


def _softmax(op: str) -> Callable[[int, int, DType], OpCall]:
    return lambda r, col, dt: OpCall(op, (_t((r, col), dt), -1, False))


def _safe_softmax(r: int, col: int, dt: DType) -> OpCall:
    return OpCall("aten._safe_softmax.default", (_t((r, col), dt), -1))


def _softmax_bwd(op: str) -> Callable[[int, int, DType], OpCall]:
    return lambda r, col, dt: OpCall(op, (_t((r, col), dt), _t((r, col), dt), -1, Scalar("dtype", str(dt))))


def _nll_fwd(r: int, col: int, dt: DType) -> OpCall:
    return OpCall("aten.nll_loss_forward.default", (_t((r, col), dt), _t((r,), DType.I64), None, 1, -100))


def _nll_bwd(r: int, col: int, dt: DType) -> OpCall:
    return OpCall("aten.nll_loss_backward.default",
                  (TensorSpec((), dt), _t((r, col), dt), _t((r,), DType.I64), None, 1, -100, TensorSpec((), dt)))


def _nll_features(c: OpCall) -> Features:
    i = 0 if c.op == "aten.nll_loss_forward.default" else 1
    return _rows_cols(c.arg_tensor(i))


for _name, _ops, _feat, _build, _cols, _fl, _rw in (
    ("rms_norm_fwd", ("aten._fused_rms_norm.default",), _rowwise_first, _rms_fwd, NORM_COLS, 4.0, (1, 1)),
    ("rms_norm_bwd", ("aten._fused_rms_norm_backward.default",), _rowwise_first, _rms_bwd, NORM_COLS, 8.0, (2, 1)),
    ("layer_norm_fwd", ("aten.native_layer_norm.default",), _rowwise_first, _ln_fwd, NORM_COLS, 6.0, (1, 1)),
    ("layer_norm_bwd", ("aten.native_layer_norm_backward.default",), _rowwise_first, _ln_bwd, NORM_COLS, 10.0, (2, 1)),
    ("softmax_fwd", ("aten._softmax.default",), _rowwise_first, _softmax("aten._softmax.default"), SOFTMAX_COLS, 5.0, (1, 1)),
    # SDPA's math path (fp32 scores, eager models): softmax, then rows that are all -inf set to zero (on CUDA the
    # softmax kernel, isneginf, an all-reduction per row and a where); row-wise like softmax, its cost per element
    # follows the row length (an element-count blend of 2,048- and 8,192-long rows priced Falcon's 4,096-long
    # ones 16% low: docs/validation-notes.md section 30)
    ("safe_softmax_fwd", ("aten._safe_softmax.default",), _rowwise_first, _safe_softmax, SCORE_COLS, 5.0, (1, 1)),
    ("log_softmax_fwd", ("aten._log_softmax.default",), _rowwise_first, _softmax("aten._log_softmax.default"),
     SOFTMAX_COLS, 5.0, (1, 1)),
    ("softmax_bwd", ("aten._softmax_backward_data.default",), _rowwise_first,
     _softmax_bwd("aten._softmax_backward_data.default"), SOFTMAX_COLS, 4.0, (2, 1)),
    ("log_softmax_bwd", ("aten._log_softmax_backward_data.default",), _rowwise_first,
     _softmax_bwd("aten._log_softmax_backward_data.default"), SOFTMAX_COLS, 4.0, (2, 1)),
    ("nll_loss_fwd", ("aten.nll_loss_forward.default",), _nll_features, _nll_fwd, SOFTMAX_COLS, 0.0, (0, 0)),
    ("nll_loss_bwd", ("aten.nll_loss_backward.default",), _nll_features, _nll_bwd, SOFTMAX_COLS, 0.0, (0, 1)),
):
    _idx: tuple[IndexArg, ...] = ()
    if _name == "nll_loss_fwd":
        _idx = (IndexArg(1, 0, -1),)
    elif _name == "nll_loss_bwd":
        _idx = (IndexArg(2, 1, -1),)
    _bytes = _rowwise_bytes(*_rw) if _rw != (0, 0) else (lambda c, f: 8.0 * f["rows"])
    REGISTRY.register(OpKind(_name, _ops, Family.ROWWISE, _feat, _rowwise_flops(_fl), _bytes,
                             index_args=_idx, grid=_rowwise_grid(_build, _cols),
                             primary=1 if _name == "nll_loss_bwd" else 0))


# ---------------------------------------------------------------------------------------------
# Embedding
# ---------------------------------------------------------------------------------------------

EMB_TOKENS = (4096, 16384, 65536)
EMB_VOCAB = (32768, 131072)
EMB_DIMS = (1024, 4096, 8192)


def _emb_fwd_features(c: OpCall) -> Features:
    w, idx = c.arg_tensor(0), c.arg_tensor(1)
    return {"tokens": idx.numel, "vocab": w.shape[0], "dim": w.shape[1]}


def _emb_bwd_features(c: OpCall) -> Features:
    g, idx = c.arg_tensor(0), c.arg_tensor(1)
    return {"tokens": idx.numel, "vocab": int(c.args[2]), "dim": g.shape[-1]}


def _emb_bytes(bwd: bool) -> Callable[[OpCall, Features], float]:
    def b(c: OpCall, f: Features) -> float:
        it = max((t.dtype.itemsize for t in c.device_tensors() if t.dtype.is_float), default=4)
        moved = 2.0 * f["tokens"] * f["dim"] * it + 8.0 * f["tokens"]
        return moved + (f["vocab"] * f["dim"] * 4.0 if bwd else 0.0)
    return b


def _emb_grid(bwd: bool):
    def grid(p: Precision) -> Iterable[OpCall]:
        if p == Precision.TF32:
            return
        dt = PRECISION_DTYPE[p]
        for tok in EMB_TOKENS:
            for v in EMB_VOCAB:
                for d in EMB_DIMS:
                    if bwd:
                        yield OpCall("aten.embedding_dense_backward.default",
                                     (_t((1, tok, d), dt), _t((1, tok), DType.I64), v, -1, False))
                    else:
                        yield OpCall("aten.embedding.default", (_t((v, d), dt), _t((1, tok), DType.I64)))
    return grid


REGISTRY.register(OpKind("embedding_fwd", ("aten.embedding.default",), Family.EMBEDDING, _emb_fwd_features,
                         bytes=_emb_bytes(False), index_args=(IndexArg(1, 0, 0),), grid=_emb_grid(False), primary=0))
REGISTRY.register(OpKind("embedding_bwd", ("aten.embedding_dense_backward.default",), Family.EMBEDDING,
                         _emb_bwd_features, bytes=_emb_bytes(True), index_args=(IndexArg(1, 2, None),),
                         grid=_emb_grid(True), primary=0))


# ---------------------------------------------------------------------------------------------
# Multi-tensor (optimizer, GradScaler)
# ---------------------------------------------------------------------------------------------

def _first_list(c: OpCall) -> list[TensorSpec]:
    for a in c.args:
        if isinstance(a, list) and a and isinstance(a[0], TensorSpec):
            return a
    return []


_NUMEL = operator.attrgetter("numel")
_NBYTES = operator.attrgetter("nbytes")


def _foreach_features(c: OpCall) -> Features:
    lst = _first_list(c)
    feats: Features = {"tensors": len(lst), "numel": sum(map(_NUMEL, lst))}
    same = [f"{i}={a.arg}" for i, a in enumerate(c.args) if isinstance(a, SameAs)]
    if same:  # a list read twice is one stream of memory traffic, not two: its own category
        feats["pattern"] = "same:" + ",".join(same)
    return feats


def _foreach_bytes(c: OpCall, f: Features) -> float:
    lists = [a for a in c.args if isinstance(a, list) and a and isinstance(a[0], TensorSpec)]
    sizes = [sum(map(_NBYTES, lst)) for lst in lists]
    per = sum(sizes)
    first_bytes = sizes[0] if lists else 0
    return float(per + first_bytes)  # inputs read, the first list (or its copy) written


FOREACH_TENSORS = (1, 16, 256)
FOREACH_NUMEL = (2**18, 2**22, 2**26, 2**30)
FOREACH_TOTAL_CAP = 2**30 + 2**29  # elements summed over one list


def _lists(n: int, total: int, dt: DType, count: int) -> list[list[TensorSpec]]:
    per = max(total // n, 1)
    return [[_t((per,), dt)] * n for _ in range(count)]


# op -> (number of tensor lists, extra trailing args builder)
def _foreach_call(op: str, n: int, total: int, dt: DType) -> OpCall:
    L = lambda k: _lists(n, total, dt, k)  # noqa: E731
    if op == "aten._foreach_add_.Scalar":
        return OpCall(op, (L(1)[0], 1e-8))
    if op == "aten._foreach_add_.List":
        a, b = L(2)
        return OpCall(op, (a, b), (("alpha", -0.01),))
    if op == "aten._foreach_mul_.Scalar":
        return OpCall(op, (L(1)[0], 0.999))
    if op == "aten._foreach_lerp_.Scalar":
        a, b = L(2)
        return OpCall(op, (a, b, 0.1))
    if op == "aten._foreach_addcmul_.Scalar":
        a, b, c = L(3)
        return OpCall(op, (a, b, c), (("value", 0.001),))
    if op == "aten._foreach_addcmul_.Scalar/same":  # AdamW: exp_avg_sq += (1 - beta2) * grad * grad
        a, b = L(2)
        return OpCall(op.split("/")[0], (a, b, SameAs(1)), (("value", 0.001),))
    if op == "aten._foreach_sqrt.default":
        return OpCall(op, (L(1)[0],))
    if op == "aten._foreach_div_.ScalarList":
        return OpCall(op, (L(1)[0], [1.5] * n))
    if op == "aten._foreach_div_.Scalar":
        return OpCall(op, (L(1)[0], 1.5))
    if op == "aten._foreach_add_.ScalarList":
        return OpCall(op, (L(1)[0], [1e-8] * n))
    if op == "aten._foreach_addcdiv_.ScalarList":
        a, b, c = L(3)
        return OpCall(op, (a, b, c, [-1e-4] * n))
    if op == "aten._foreach_addcdiv_.Scalar":
        a, b, c = L(3)
        return OpCall(op, (a, b, c), (("value", -1e-4),))
    if op == "aten._foreach_mul_.List":
        a, b = L(2)
        return OpCall(op, (a, b))
    if op == "aten._foreach_norm.Scalar":
        return OpCall(op, (L(1)[0], 2))
    if op == "aten._amp_foreach_non_finite_check_and_unscale_.default":
        return OpCall(op, (L(1)[0], _t((1,), DType.FP32), _t((), DType.FP32)))
    if op == "aten._fused_adamw_.default":
        p, g, m, v = L(4)
        steps = [_t((), DType.FP32)] * n
        return OpCall(op, (p, g, m, v, [], steps), (("lr", 1e-4), ("beta1", 0.9), ("beta2", 0.999),
                                                     ("weight_decay", 0.01), ("eps", 1e-8), ("amsgrad", False),
                                                     ("maximize", False)))
    if op == "aten._fused_sgd_.default":
        p, g = L(2)
        return OpCall(op, (p, g, []), (("weight_decay", 0.0), ("momentum", 0.0), ("lr", 0.01),
                                        ("dampening", 0.0), ("nesterov", False), ("maximize", False),
                                        ("is_first_step", False)))
    raise KeyError(op)


FOREACH_OPS = (
    "aten._foreach_add_.Scalar", "aten._foreach_add_.List", "aten._foreach_mul_.Scalar",
    "aten._foreach_lerp_.Scalar", "aten._foreach_addcmul_.Scalar", "aten._foreach_sqrt.default",
    "aten._foreach_div_.ScalarList", "aten._foreach_div_.Scalar", "aten._foreach_add_.ScalarList",
    "aten._foreach_addcdiv_.ScalarList", "aten._foreach_addcdiv_.Scalar", "aten._foreach_mul_.List",
    "aten._foreach_norm.Scalar", "aten._amp_foreach_non_finite_check_and_unscale_.default",
    "aten._fused_adamw_.default", "aten._fused_sgd_.default",
)


def _foreach_grid(op: str):
    def grid(p: Precision) -> Iterable[OpCall]:
        if p == Precision.TF32:
            return
        if op.startswith("aten._amp_foreach") and p != Precision.FP32:
            return
        for n in FOREACH_TENSORS:
            for total in FOREACH_NUMEL:
                if total < n or total > FOREACH_TOTAL_CAP:
                    continue
                yield _foreach_call(op, n, total, PRECISION_DTYPE[p])
                if op == "aten._foreach_addcmul_.Scalar":
                    yield _foreach_call(op + "/same", n, total, PRECISION_DTYPE[p])
    return grid


for _op in FOREACH_OPS:
    REGISTRY.register(OpKind("foreach:" + _op.split(".", 1)[1], (_op,), Family.FOREACH, _foreach_features,
                             lambda c, f: float(f["numel"]), _foreach_bytes, grid=_foreach_grid(_op), primary=0))


# ---------------------------------------------------------------------------------------------
# Elementwise, reductions, copies, casts (one generic kind: cost follows bytes moved)
# ---------------------------------------------------------------------------------------------

def elementwise_pattern(c: OpCall) -> str:
    """How inputs relate to the largest one: c(ontiguous), b(roadcast), s(trided), 0 (0-dim)."""
    ts = c.device_tensors()
    if not ts:
        return "-"
    big = max(t.numel for t in ts)
    marks = []
    for t in ts:
        if t.numel == 1 and not t.shape:
            marks.append("0")
        elif t.numel < big:
            marks.append("b")
        elif t.strides is not None:
            marks.append("s")
        else:
            marks.append("c")
    return "".join(marks)


LIST_INPUT_OPS = {"aten.cat.default", "aten.stack.default"}
INT32_MAX = 2 ** 31 - 1


def _misaligned_view(t: TensorSpec) -> bool:
    """A strided view whose row pitch (last dimension contiguous) or start is no 16-byte multiple."""
    it = t.dtype.itemsize
    if (t.offset * it) % 16:
        return True
    if t.strides is None or len(t.shape) < 2 or t.strides[-1] != 1 or t.shape[-2] == 1:
        return False  # a size-1 dimension's stride means nothing
    pitch = t.strides[-2]
    return pitch != t.shape[-1] and (pitch * it) % 16 != 0


def _chunk_misaligned(shape: list[int] | tuple[int, ...], dim: int, it: int, start: int = 0) -> bool:
    """A block along `dim` of a contiguous tensor whose width or start (in bytes, rows below `dim` included) is no
    16-byte multiple: cat's inputs inside its output, slice_backward's gradient inside its zeros."""
    if not shape:
        return False
    d = dim % len(shape)
    inner = math.prod(max(x, 1) for x in shape[d + 1:])
    return (shape[d] * inner * it) % 16 != 0 or (start * inner * it) % 16 != 0


def elementwise_misaligned(c: OpCall) -> bool:
    """Whether a memory-bound call moves rows that are no 16-byte multiple apart: PyTorch's vectorised copy, cat
    and pointwise kernels then fall back to element-wise loads (H200, bf16: gpt-oss's cat of 4,096 scores and a
    sink, rows of 4,097, runs about 5x the aligned cat). Contiguous tensors of odd sizes stay aligned: a pointwise
    kernel sees them flat."""
    ts = c.device_tensors()
    if any(_misaligned_view(t) for t in ts):
        return True
    if c.op == "aten.cat.default" and c.args and isinstance(c.args[0], list):
        dim = c.args[1] if len(c.args) > 1 and isinstance(c.args[1], int) else 0
        parts = [t for t in c.args[0] if isinstance(t, TensorSpec) and t.numel]
        return len(parts) > 1 and any(_chunk_misaligned(t.shape, dim, t.dtype.itemsize) for t in parts)
    if c.op == "aten.slice_backward.default" and len(c.args) > 3 and ts:
        size, dim, start = c.args[1], c.args[2], c.args[3]
        if isinstance(size, list) and isinstance(dim, int) and isinstance(start, int) and size:
            it = ts[0].dtype.itemsize
            full = _chunk_misaligned(size, dim, it)
            grad = ts[0].shape
            return full or (bool(grad) and _chunk_misaligned(grad, dim, it, start))
    return False

# Operators whose output size is an argument, not an input's: factories (no tensor input at all), new_* (the
# tensor lends only dtype and device) and backward operators that scatter a gradient into zeros of the forward
# input's size (a slice_backward of an empty gradient still writes its whole output). Value: the size argument.
SIZE_ARG_OPS: dict[str, int] = {
    "aten.zeros.default": 0, "aten.ones.default": 0, "aten.full.default": 0, "aten.rand.default": 0,
    "aten.randn.default": 0, "aten.new_zeros.default": 1, "aten.new_ones.default": 1, "aten.new_full.default": 1,
    "aten.slice_backward.default": 1, "aten.select_backward.default": 1, "aten.diagonal_backward.default": 1,
}
ARANGE_OPS = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")


def _int_list(v: Any) -> list[int] | None:
    if isinstance(v, list | tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return [int(x) for x in v]
    return None


# Gathers: they read the rows their index names, not the whole source, and write one element per index position
# (x[idx] of a [4096, 2048] activation by 262,144 indices writes 2.1 GB; the source's size had been the call's
# size, so 4,096 and 262,144 indices were one point, and a loss's target pick ran at "564 TB/s").
GATHER_OPS = ("aten.index.Tensor", "aten.index_select.default", "aten.gather.default")


def _broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    n = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(n):
        dims = {s[len(s) - n + i] for s in shapes if len(s) - n + i >= 0} - {1}
        if len(dims) > 1:
            return None
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def gather_output_shape(c: OpCall) -> tuple[int, ...] | None:
    """The output shape of a gather (GATHER_OPS), as ATen computes it; None where it depends on the data (a
    boolean mask) or the call is malformed."""
    src = c.args[0] if c.args else None
    if not isinstance(src, TensorSpec):
        return None
    if c.op == "aten.index.Tensor":
        idx = c.args[1] if len(c.args) > 1 and isinstance(c.args[1], list | tuple) else None
        if not idx or len(idx) > len(src.shape):
            return None
        pos = [i for i, t in enumerate(idx) if isinstance(t, TensorSpec)]
        if not pos or any(not isinstance(t, TensorSpec) and t is not None for t in idx) or any(
                idx[i].dtype == DType.BOOL or idx[i].dtype == DType.U8 for i in pos):
            return None
        b = _broadcast([idx[i].shape for i in pos])
        if b is None:
            return None
        if pos == list(range(pos[0], pos[-1] + 1)):  # adjacent advanced indices: their broadcast stands in place
            return (*src.shape[:pos[0]], *b, *src.shape[pos[-1] + 1:])
        return (*b, *[d for i, d in enumerate(src.shape) if i not in pos])  # apart: the broadcast first
    if len(c.args) < 3 or not isinstance(c.args[1], int) or not isinstance(c.args[2], TensorSpec):
        return None
    dim, index = c.args[1], c.args[2]
    if not -len(src.shape) <= dim < max(len(src.shape), 1):
        return None
    if c.op == "aten.index_select.default":
        d = dim % len(src.shape) if src.shape else 0
        return (*src.shape[:d], index.numel, *src.shape[d + 1:]) if src.shape else (index.numel,)
    return tuple(index.shape)  # gather: the index's shape


def output_numel(c: OpCall) -> int | None:
    """Elements the call writes where its arguments, not its inputs' sizes, say so; None elsewhere."""
    if c.op in GATHER_OPS:
        shape = gather_output_shape(c)
        return math.prod(shape) if shape is not None else None
    i = SIZE_ARG_OPS.get(c.op)
    if i is not None:
        size = _int_list(c.args[i]) if i < len(c.args) else None
        if size is not None:
            return math.prod(max(d, 0) for d in size)
    if c.op in ARANGE_OPS:
        nums = [a for a in c.args if isinstance(a, int | float) and not isinstance(a, bool)]
        start, end, step = ((0, nums[0], 1) if c.op == ARANGE_OPS[0] else
                            (nums[0], nums[1], nums[2] if len(nums) > 2 else 1)) if nums else (0, 0, 1)
        return max(int(-(-(end - start) // step)), 0) if step else 0
    if c.op == "aten.scalar_tensor.default":
        return 1
    if c.op == "aten.repeat.default" and c.args and isinstance(c.args[0], TensorSpec):
        reps = _int_list(c.args[1]) if len(c.args) > 1 else None
        if reps is not None:
            return c.args[0].numel * math.prod(max(r, 0) for r in reps)
    return None


# In-place updates of a few positions of their first argument (an eager backward's fresh zeros, MoE's
# combine): the kernel reads and writes what the index and source say, whatever the size of the tensor updated.
# Value: the argument whose elements are the positions written (for index_put, the index tensors' broadcast
# times the dimensions they leave unindexed). A boolean mask writes where it is true: not statically known.
SELF_UPDATE_OPS: dict[str, int] = {
    "aten.scatter_.src": 2, "aten.scatter_.value": 2, "aten.scatter_add_.default": 2, "aten.put_.default": 1,
    "aten.index_add_.default": 3, "aten.index_copy_.default": 3,
    "aten.index_put_.default": 1, "aten._index_put_impl_.default": 1,
}


def _update_numel(c: OpCall) -> int | None:
    """Elements an in-place update touches, or None where the call is no such update."""
    i = SELF_UPDATE_OPS.get(c.op)
    if i is None or len(c.args) <= i or not isinstance(c.args[0], TensorSpec) or c.args[0].host:
        return None
    a = c.args[i]
    if isinstance(a, TensorSpec):
        return a.numel
    if isinstance(a, list):  # index_put's indices
        idx = [t for t in a if isinstance(t, TensorSpec)]
        if not idx or len(idx) != len(a) or any(t.dtype == DType.BOOL for t in idx):
            return None
        return max(t.numel for t in idx) * math.prod(c.args[0].shape[len(idx):])
    return None


ACCUMULATING_INDEX_PUT = ("aten.index_put.default", "aten.index_put_.default", "aten._index_put_impl_.default")
CONTENDED_ROWS = 64  # indices per destination row from which an accumulating index_put is a category of its own


def _accumulate_contention(c: OpCall) -> str:
    """An accumulating index_put whose indices pile many rows onto each destination row: its atomic adds to one
    address serialise, so it runs far below the bandwidth of the same bytes spread out (gpt-oss-20B's expert-bias
    gradients, 16,384 routed rows onto 32 experts: 8.9 ms in a profiled bf16 step, where grid points of at most 8
    indices per row priced them at 1.7 ms). "/x<2^k>" for 2^k <= indices per destination row < 2^(k+1), from
    CONTENDED_ROWS on; "" below."""
    if c.op not in ACCUMULATING_INDEX_PUT or len(c.args) < 3:
        return ""
    acc = c.args[3] if len(c.args) > 3 else c.kwarg("accumulate", False)
    dst, idx = c.args[0], c.args[1]
    if acc is not True or not isinstance(dst, TensorSpec) or not dst.shape or not isinstance(idx, list) or \
            len(idx) != 1 or not isinstance(idx[0], TensorSpec) or idx[0].dtype == DType.BOOL:
        return ""
    per_row = idx[0].numel // max(dst.shape[0], 1)
    return f"/x{1 << (per_row.bit_length() - 1)}" if per_row >= CONTENDED_ROWS else ""


def _elementwise_features(c: OpCall) -> Features:
    ts = c.device_tensors()
    upd = _update_numel(c)
    if c.op in LIST_INPUT_OPS:
        numel = sum(t.numel for t in ts)
    elif upd is not None:
        numel = upd
    else:
        numel = max((t.numel for t in ts), default=0)
    out = output_numel(c)
    # read by _elementwise_bytes; describe() keeps them private
    feats: Features = {"_update": upd is not None, "_gather": c.op in GATHER_OPS and out is not None}
    if out is not None:
        # a gather or a new_* factory is its output's size: neither reads its source whole (a new_zeros of
        # [8192, 2048] from a [65536, 2048] template was filed at 134M elements, blended with real 134M fills)
        numel = out if c.op in GATHER_OPS or c.op.startswith("aten.new_") else max(numel, out)
    pattern = elementwise_pattern(c) + ("/ua" if elementwise_misaligned(c) else "") + _accumulate_contention(c)
    if c.op == "aten.cat.default" and numel >= INT32_MAX:
        # an output beyond 32-bit indexing leaves cat's batched kernel for one copy per input (Cat.cu: the
        # parallel path needs canUse32BitIndexMath(out)); measured, gpt-oss's misaligned cat of the scores and
        # the sink runs at 0.67 TB/s up to 0.6 G elements and at 1.78 TB/s from 2.4 G
        pattern += "/i64"
    return {**feats, "numel": numel, "pattern": pattern}


def _elementwise_bytes(c: OpCall, f: Features) -> float:
    ts = c.device_tensors()
    # a factory without a dtype makes torch's default: float32, int64 for an arange of integers
    out_item = max((t.dtype.itemsize for t in ts), default=4)
    if f["_update"]:
        out_item = ts[0].dtype.itemsize
        ts = ts[1:]  # the updated tensor is touched where the index says: counted as the writes
    reads = sum(t.nbytes for t in ts)
    if c.op.startswith("aten.new_") and c.op in SIZE_ARG_OPS:
        reads = 0  # the template lends its dtype and device only
    elif f["_gather"] and ts:
        # the index, and one source element per output element, written in the source's dtype
        out_item = ts[0].dtype.itemsize
        reads = sum(t.nbytes for t in ts[1:]) + f["numel"] * out_item
    if not ts and c.op in ARANGE_OPS and all(isinstance(a, int) for a in c.args):
        out_item = 8
    target = c.kwarg("dtype")
    if isinstance(target, Scalar) and target.tag == "dtype":
        out_item = DType(target.value).itemsize
    return float(reads + f["numel"] * out_item)


ELEMENTWISE_NUMEL = (*tuple(2 ** e for e in range(10, 31, 2)), 3 * 2 ** 20, 3 * 2 ** 24)


def _unary(op: str) -> Callable[[int, DType], OpCall]:
    return lambda n, dt: OpCall(op, (_t((n,), dt),))


def _binary(op: str) -> Callable[[int, DType], OpCall]:
    return lambda n, dt: OpCall(op, (_t((n,), dt), _t((n,), dt)))


def _bcast(op: str) -> Callable[[int, DType], OpCall]:
    return lambda n, dt: OpCall(op, (_t((n // 4096, 4096), dt), _t((4096,), dt)))


def _scalar(op: str, s: Any) -> Callable[[int, DType], OpCall]:
    return lambda n, dt: OpCall(op, (_t((n,), dt), s))


def _cast(dst: DType) -> Callable[[int, DType], OpCall]:
    return lambda n, dt: OpCall("aten._to_copy.default", (_t((n,), dt),), (("dtype", Scalar("dtype", str(dst))),))


def _copy_strided(n: int, dt: DType) -> OpCall:
    rows = max(n // 4096, 1)
    return OpCall("aten.clone.default", (_t((rows, 4096), dt, (1, rows)),), (("memory_format", Scalar("mf", "contiguous_format")),))


def _cat2(n: int, dt: DType) -> OpCall:
    rows = max(n // 128, 1)
    half = _t((rows, 64), dt)
    return OpCall("aten.cat.default", ([half, half], -1))


def _factory(op: str, *extra: Any) -> Callable[[int, DType], OpCall]:
    return lambda n, dt: OpCall(op, ([n], *extra), (("dtype", Scalar("dtype", str(dt))),))


def _slice_backward(n: int, dt: DType) -> OpCall:
    """Half the columns' gradient into zeros of the whole: rotary's rotate_half backward."""
    rows = max(n // 128, 1)
    return OpCall("aten.slice_backward.default", (_t((rows, 64), dt), [rows, 128], 1, 64, 2 ** 63 - 1, 1))


def _reduce_last(op: str) -> Callable[[int, DType], OpCall]:
    return lambda n, dt: OpCall(op, (_t((max(n // 4096, 1), 4096), dt), [-1], True))


ELEMENTWISE_GRID: dict[str, Callable[[int, DType], OpCall]] = {
    "add": _binary("aten.add.Tensor"),
    "add_bcast": _bcast("aten.add.Tensor"),
    "add_": _binary("aten.add_.Tensor"),
    "mul": _binary("aten.mul.Tensor"),
    "mul_bcast": _bcast("aten.mul.Tensor"),
    "mul_scalar": _scalar("aten.mul.Tensor", 0.5),
    "div": _binary("aten.div.Tensor"),
    "neg": _unary("aten.neg.default"),
    "rsqrt": _unary("aten.rsqrt.default"),
    "pow": _scalar("aten.pow.Tensor_Scalar", 2),
    "silu": _unary("aten.silu.default"),
    "silu_backward": _binary("aten.silu_backward.default"),
    "gelu": _unary("aten.gelu.default"),
    "gelu_tanh": lambda n, dt: OpCall("aten.gelu.default", (_t((n,), dt),), (("approximate", "tanh"),)),
    "gelu_backward": _binary("aten.gelu_backward.default"),
    "tanh": _unary("aten.tanh.default"),
    "tanh_backward": _binary("aten.tanh_backward.default"),
    "exp": _unary("aten.exp.default"),
    "clone": _unary("aten.clone.default"),
    "clone_strided": _copy_strided,
    "copy_": _binary("aten.copy_.default"),
    "cat": _cat2,
    "mean_last": _reduce_last("aten.mean.dim"),
    "sum_last": _reduce_last("aten.sum.dim_IntList"),
    "sum_rows": lambda n, dt: OpCall("aten.sum.dim_IntList", (_t((max(n // 4096, 1), 4096), dt), [0], True)),
    "fill_": _scalar("aten.fill_.Scalar", 0.0),
    "zero_": _unary("aten.zero_.default"),
    "dropout": lambda n, dt: OpCall("aten.native_dropout.default", (_t((n,), dt), 0.1, True)),
    "dropout_bwd": lambda n, dt: OpCall("aten.native_dropout_backward.default",
                                        (_t((n,), dt), _t((n,), DType.BOOL), 1.1111)),
    "mul_Scalar": _scalar("aten.mul.Scalar", 0.5),
    "add_Scalar": _scalar("aten.add.Scalar", 1.0),
    "mul_mixed": lambda n, dt: OpCall("aten.mul.Tensor", (_t((n,), dt), _t((n,), DType.FP32))),
    "add_mixed": lambda n, dt: OpCall("aten.add.Tensor", (_t((n,), DType.FP32), _t((n,), dt))),
    "zeros": _factory("aten.zeros.default"),
    "ones": _factory("aten.ones.default"),
    "full": _factory("aten.full.default", 0.0),
    "new_zeros": lambda n, dt: OpCall("aten.new_zeros.default", (_t((1,), dt), [n]), (("dtype", Scalar("dtype", str(dt))),)),
    "slice_backward": _slice_backward,
    "to_fp32": _cast(DType.FP32),
    "to_fp16": _cast(DType.FP16),
    "to_bf16": _cast(DType.BF16),
}


# Calls whose dtype is no float precision's (masks, positions): swept once, with the fp32 grid.
UNTYPED_GRID: dict[str, Callable[[int], OpCall]] = {
    "ones_bool": lambda n: _factory("aten.ones.default")(n, DType.BOOL),
    "arange": lambda n: OpCall("aten.arange.default", (n,)),
}


def _elementwise_grid(p: Precision) -> Iterable[OpCall]:
    if p == Precision.TF32:
        return
    dt = PRECISION_DTYPE[p]
    for name, build in ELEMENTWISE_GRID.items():
        if name.startswith("to_") and name == "to_" + str(dt):
            continue  # a cast to its own dtype is a no-op
        for n in ELEMENTWISE_NUMEL:
            if n >= 4096:
                yield build(n, dt)
    if p == Precision.FP32:
        for untyped in UNTYPED_GRID.values():
            for n in ELEMENTWISE_NUMEL:
                if n >= 4096:
                    yield untyped(n)


REGISTRY.register(OpKind("elementwise", ("aten.add.Tensor",), Family.ELEMENTWISE, _elementwise_features,
                         lambda c, f: float(f["numel"]), _elementwise_bytes, grid=_elementwise_grid,
                         notes="catch-all: any operator without a kind of its own lands here"))


# ---------------------------------------------------------------------------------------------
# Views (no kernel) and host-side operators (no GPU time)
# ---------------------------------------------------------------------------------------------

VIEW_OPS = (
    "aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.transpose.int",
    "aten.permute.default", "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim",
    "aten.squeeze.dims", "aten.squeeze.default", "aten.slice.Tensor", "aten.select.int", "aten.as_strided.default",
    "aten.detach.default", "aten.alias.default", "aten.split.Tensor", "aten.split_with_sizes.default",
    "aten.unbind.int", "aten._reshape_alias.default", "aten.lift_fresh.default", "aten.unflatten.int",
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten.chunk.default", "aten.narrow.default", "aten.view_as.default",
    "aten.reshape.default", "aten._to_copy.nocopy", "aten.set_.source_Storage_storage_offset",
    "aten.resize_.default", "aten.diagonal.default", "aten.expand_as.default", "aten.unfold.default",
    "aten.flatten.using_ints", "aten.contiguous.default", "aten.view_as_complex.default",
    "aten.view_as_real.default",
)
HOST_OPS = ("aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.item.default",
            "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default", "aten.sym_storage_offset.default",
            "aten.equal.default")


def _no_features(c: OpCall) -> Features:
    return {"numel": max((t.numel for t in c.tensors()), default=0)}


REGISTRY.register(OpKind("view", VIEW_OPS, Family.VIEW, _no_features, bytes=lambda c, f: 0.0))
REGISTRY.register(OpKind("host", HOST_OPS, Family.HOST, _no_features, bytes=lambda c, f: 0.0,
                         notes="synchronises with or runs on the host: costed by the host model"))


# ---------------------------------------------------------------------------------------------
# Public helpers
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CallInfo:
    """A call with everything the engine and the collector derive from the registry."""

    kind: str
    family: Family
    precision: Precision
    math_mode: str
    dtypes: str
    features: Features
    flops: float
    bytes: float


class Operands(StrEnum):
    """What a GEMM's inputs hold when it is timed: the collector's random N(0,1) data, NaN, or a router's zero rows
    (below). Pure fp16
    training with Adam puts NaN in every weight after its first step (eps = 1e-8 underflows to 0 in
    fp16: 0/0 updates), and from then on every GEMM runs on NaN, measured 6-9% faster on an H200 than on
    finite data (tools/operand_probe.py). Part of a point's key and of its GEMM category."""

    RANDOM = ""
    NAN = "nan"
    # A top-1 router's token rows (transformers' Llama-4 experts: every token through every expert as one batched
    # GEMM, `hidden.repeat(E, 1) * router_scores` zeroing each token's row in the E - 1 experts it was not routed
    # to): 1 in E rows nonzero, in operand a's rows (a1), a's columns (a2: a transposed activation, the weight
    # gradients) or both a's columns and b's rows (a2b1). Measured 15% faster than random data at 16 experts: the
    # zeros hold the power cap off (tools/zero_rows_probe.py).
    ROUTED_A_ROWS = "routed-a1"
    ROUTED_A_COLS = "routed-a2"
    ROUTED_A_COLS_B_ROWS = "routed-a2b1"


# Model types whose experts run densely over every token with the router's zero weights in the data (above);
# the others dispatch only the routed tokens (index_select, grouped GEMMs).
DENSE_ROUTED_MODEL_TYPES = ("llama4_text",)


def _batch_transposed(t: TensorSpec) -> bool:
    """A batched matrix read transposed (a view of a [E, k, m] tensor as [E, m, k])."""
    return t.strides is not None and len(t.strides) == 3 and t.strides[-2] == 1 and t.shape[-1] > 1


def routed_operands(a: TensorSpec, b: TensorSpec, experts: int, hidden: int, ffn: int) -> Operands:
    """Which operand of one of the dense experts' batched GEMMs a [E, m, k] x b [E, k, n] holds the router's zero
    rows (RANDOM when none does, or when the sizes cannot tell the call apart). Forward: both operands as stored,
    the activations' rows routed; input gradients: b a transposed weight, the gate-up's output gradient routed,
    the down projection's not (the sum over experts hands every expert the full output gradient); weight
    gradients: a a transposed activation, its columns routed, and for the gate-up b's rows too."""
    if len(a.shape) != 3 or len(b.shape) != 3 or a.shape[0] != experts or b.shape[0] != experts or experts < 2 \
            or a.shape[2] != b.shape[1] or hidden == 2 * ffn:
        return Operands.RANDOM
    m, k, n = a.shape[1], a.shape[2], b.shape[2]
    if _batch_transposed(a):  # weight gradients: activation^T @ output gradient
        if (m, n) == (ffn, hidden):
            return Operands.ROUTED_A_COLS  # down: h^T @ dY
        if (m, n) == (hidden, 2 * ffn):
            return Operands.ROUTED_A_COLS_B_ROWS  # gate-up: X^T @ d(gate, up)
        return Operands.RANDOM
    if _batch_transposed(b):  # input gradients: output gradient @ weight^T
        return Operands.ROUTED_A_ROWS if (k, n) == (2 * ffn, hidden) else Operands.RANDOM
    if (k, n) in ((hidden, 2 * ffn), (ffn, hidden)):  # forward: gate-up, down
        return Operands.ROUTED_A_ROWS
    return Operands.RANDOM


def step_operands(setting: str, optimizer: str) -> Operands:
    """The operands a training step's GEMMs see in steady state."""
    st = SETTINGS[Setting(setting)]
    pure_fp16 = (st.param_dtype == DType.FP16 and st.autocast_dtype is None and not st.grad_scaler
                 and not st.master_weights)
    return Operands.NAN if pure_fp16 and optimizer.startswith("adam") else Operands.RANDOM


def with_operands(key: str, info: CallInfo, operands: Operands) -> tuple[str, CallInfo]:
    """A GEMM call's key and features under `operands` (other families do not depend on their data)."""
    if not operands or info.family != Family.GEMM:
        return key, info
    feats = {**info.features, "layout": f"{info.features.get('layout')}:{operands.value}"}
    return f"{key}|{operands.value}", dataclasses.replace(info, features=feats)


def describe(call: OpCall, allow_tf32: bool) -> CallInfo:
    kind = REGISTRY.for_call(call)
    family = kind.family
    if call.on_host_only():
        family = Family.HOST
    feats = kind.features(call)
    return CallInfo(kind.name, family, precision_of(call, allow_tf32), math_mode(call, allow_tf32),
                    dtypes_key(call), {k: v for k, v in feats.items() if not k.startswith("_")},
                    float(kind.flops(call, feats)), float(kind.bytes(call, feats)))


def stored_description(row: dict[str, Any]) -> dict[str, Any]:
    """The description columns of a stored operator row (kind, family, FLOPs, bytes, features) as the registry
    derives them from its signature; the operands of a row measured on other data than random (NaN, a router's
    zero rows) are read from its key."""
    info = describe(OpCall.from_json_str(row["op"], row["signature"]), row["math_mode"] == "tf32")
    suffix = str(row["key"]).rpartition("|")[2] if "|" in str(row["key"]) else ""
    if suffix in {o.value for o in Operands if o != Operands.RANDOM}:
        info = with_operands(row["key"], info, Operands(suffix))[1]
    return {"kind": info.kind, "family": str(info.family), "flops": info.flops, "bytes": info.bytes,
            **{c: info.features.get(c) for c in FEATURE_COLUMNS}}


def description_mismatches(row: dict[str, Any]) -> dict[str, Any]:
    """The description columns of a stored row that disagree with what the registry derives, with the derived
    values: FLOPs and bytes to 1e-9; an attention row stored before `masked` existed reads NULL, i.e. unmasked."""
    out = {}
    for k, v in stored_description(row).items():
        have = row.get(k)
        if k == "masked" and have is None and v is False:
            continue
        if isinstance(v, float) and isinstance(have, float):
            if math.isclose(v, have, rel_tol=1e-9, abs_tol=1e-6):
                continue
        elif v == have:
            continue
        out[k] = v
    return out


def grid_calls(precisions: Iterable[Precision] = FLOAT_PRECISIONS) -> Iterable[tuple[OpKind, Precision, OpCall]]:
    """The generic campaign: every kind's sweep in every precision it applies to."""
    for p in precisions:
        for kind in REGISTRY.kinds():
            if kind.grid is None:
                continue
            for call in kind.grid(p):
                yield kind, p, call
