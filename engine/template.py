"""Graph templates: the traced graph of one structural type with every number a function of the dimensions.

A structural type is a model spec minus its sizes, a precision setting, the trace flags (SP, recompute,
optimizer, framework) and which dimensions are 1 (a size-1 dimension changes strides and so the operators
PyTorch dispatches). Within a type every integer of the graph (shapes, offsets, bytes allocated, memory
profile) is a polynomial in the per-rank dimensions `DIMS`; a template holds those polynomials, fitted
from real traces (engine/trace/template_build.py), and instantiates a graph without importing torch.

A template answers only inside the box of dimensions its traces spanned, and only where every integer it
computes is an integer: elsewhere it returns None and the caller traces. Sizes of allocations are rounded as the
caching allocator rounds them (512 bytes).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import marshal
import math
import os
import re
import sys
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from tp_query.schema.messages import TpQueryError
from tp_query.schema.model_config import ArchFamily, Builder, ModelSpec

from .graph import Graph, GraphMeta, MemoryProfile, OpRecord, ParamRecord, Phase, Section, memory_profile_from

TEMPLATE_FORMAT = "tp-query-template/1"
# per-rank dimensions of a dense native decoder: micro-batch, sequence, hidden, KV heads per rank, query heads per
# KV head, head size, FFN per rank, vocabulary per rank, TP degree
DIMS = ("mb", "seq", "hidden", "kl", "g", "hd", "fl", "vl", "tp")
ALLOC_ROUND = 512  # the caching allocator's block rounding (bytes)
_SIZE_FIELDS = ("name", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size")
# a JSON string (kept as text) or a JSON number (a template slot)
NUMBER_RE = re.compile(r'"(?:[^"\\]|\\.)*"|(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)')


class TemplateError(TpQueryError):
    """A structural type whose graph is not polynomial in its dimensions (the caller traces instead)."""


# The config keys in which transformers reads a spec's sizes (the HF builder traces transformers' module from its
# config.json, not from the spec's fields): a template's traces rewrite them, its key leaves them out.
HF_SIZE_KEYS = {"hidden_size": "hidden_size", "num_attention_heads": "num_heads",
                "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
                "intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
                "num_hidden_layers": "num_layers"}
# Families of the HF builder whose graphs templates reproduce, checked against real traces (tests/test_template.py):
# every size of theirs is one of the keys above, spelled out in the config
HF_TEMPLATE_FAMILIES = (ArchFamily.QWEN3,)


def templatable(spec: ModelSpec, framework: str, ep: int, moe_imbalance: float) -> bool:
    """Dense decoders under torch without per-layer kinds: the native builder's Llama family (Llama, Mistral and
    Qwen2 without sliding windows) and the HF builder's families listed above."""
    if spec.builder == Builder.HF:
        cfg = json.loads(spec.hf_config or "{}")
        windowed = spec.sliding_window or cfg.get("sliding_window") or cfg.get("use_sliding_window") or \
            cfg.get("layer_types")
        if spec.family not in HF_TEMPLATE_FAMILIES or windowed or \
                any(k not in cfg for k in HF_SIZE_KEYS if k != "num_hidden_layers"):
            return False
    elif spec.builder != Builder.NATIVE or spec.family != ArchFamily.LLAMA:
        return False
    return (not spec.is_moe and framework == "torch" and ep == 1 and moe_imbalance == 1.0 and not spec.layer_types
            and not spec.mlp_layer_types and not spec.rope_layers)


def fp8_aligned(spec: ModelSpec, tp: int) -> bool:
    """Whether every Linear an fp8 setting may convert has both dimensions multiples of 16 on a rank
    (schema.precision.fp8_linear_filter): a template holds one answer for every size of its type, so a model with
    an unaligned one (left in bf16 by the filter, as torchao's _scaled_mm needs) is traced instead."""
    q, kv = spec.num_heads * spec.head_dim // tp, spec.num_kv_heads * spec.head_dim // tp
    return all(d % 16 == 0 for d in (spec.hidden_size, q, kv, spec.intermediate_size // tp))


def dims_of(spec: ModelSpec, micro_batch: int, seq_len: int, tp: int) -> dict[str, int] | None:
    """The per-rank dimensions of a request; None when a size does not split evenly (the trace refuses it)."""
    if spec.num_kv_heads % tp or spec.num_heads % spec.num_kv_heads or spec.intermediate_size % tp \
            or spec.vocab_size % tp:
        return None
    return {"mb": micro_batch, "seq": seq_len, "hidden": spec.hidden_size, "kl": spec.num_kv_heads // tp,
            "g": spec.num_heads // spec.num_kv_heads, "hd": spec.head_dim, "fl": spec.intermediate_size // tp,
            "vl": spec.vocab_size // tp, "tp": tp}


def spec_at(spec: ModelSpec, dims: dict[str, int]) -> ModelSpec:
    """The model of these per-rank dimensions (what a build traces)."""
    tp = dims["tp"]
    out = replace(spec, hidden_size=dims["hidden"], num_heads=dims["kl"] * dims["g"] * tp,
                  num_kv_heads=dims["kl"] * tp, head_dim=dims["hd"], intermediate_size=dims["fl"] * tp,
                  vocab_size=dims["vl"] * tp)
    if spec.builder == Builder.HF:  # transformers reads the sizes from the config
        cfg = json.loads(spec.hf_config)
        for key, fieldname in HF_SIZE_KEYS.items():
            if key in cfg:
                cfg[key] = getattr(out, fieldname)
        out = replace(out, hf_config=json.dumps(cfg, sort_keys=True))
    return out


def ones_of(dims: dict[str, int]) -> tuple[str, ...]:
    return tuple(k for k in DIMS if dims[k] == 1)


def _holds(ones: tuple[str, ...], box: dict[str, Any], dims: dict[str, int]) -> bool:
    """Whether a template of these size-1 dimensions and this box answers for `dims`."""
    return ones_of(dims) == ones and all(lo <= dims[k] <= hi for k, (lo, hi) in box.items())


# What a traced step of a templatable family does not read, so a user's own config.json finds the shipped types
# (checked against real traces of configs that differ in all of them: tests/test_template.py). Rotary tables are
# built from rope_theta when the module is made, not in the step, and the native builder has one rotary form
# whatever the config's rope type; under the default rope type transformers reads max_position_embeddings only
# when it builds the module. Token ids of generation, initialisation and serialisation never reach the step, and
# neither do window and dropout settings that are switched off. pad_token_id stays: it is embedding backward's
# padding_idx.
_NATIVE_INERT_FIELDS = ("rope_theta", "rope_type", "max_position_embeddings")
_DEFAULT_ROPE_INERT = ("rope_theta", "max_position_embeddings")  # spec fields and config keys alike
_HF_INERT_KEYS = ("bos_token_id", "eos_token_id", "initializer_range", "transformers_version", "torch_dtype",
                  "dtype")
_HF_INERT_VALUES: dict[str, Any] = {"attention_dropout": 0.0, "rope_scaling": None, "sliding_window": None,
                                    "use_sliding_window": False}


def _switched_off(key: str, value: Any) -> bool:
    """A config value that leaves its feature off (of the same type as the off value: 0 is not 0.0)."""
    off = _HF_INERT_VALUES.get(key, ...)
    return off is not ... and value == off and type(value) is type(off)


def _structural_spec(spec: ModelSpec) -> dict[str, Any]:
    """The spec as its structural type sees it: no sizes, nothing the traced step does not read."""
    s = {k: v for k, v in spec.to_dict().items() if k not in _SIZE_FIELDS}
    if spec.builder == Builder.NATIVE and spec.family == ArchFamily.LLAMA:
        for k in _NATIVE_INERT_FIELDS:
            s.pop(k, None)
    if s.get("hf_config"):
        cfg = json.loads(s["hf_config"])
        default_rope = cfg.get("rope_scaling") is None and spec.rope_type == "default"
        drop = {*HF_SIZE_KEYS, *_HF_INERT_KEYS, *(_DEFAULT_ROPE_INERT if default_rope else ())}
        if not cfg.get("use_sliding_window"):
            drop.add("max_window_layers")
        s["hf_config"] = json.dumps({k: v for k, v in cfg.items() if k not in drop and not _switched_off(k, v)},
                                    sort_keys=True)
        if default_rope:
            for k in _DEFAULT_ROPE_INERT:
                s.pop(k, None)
    return s


def structure_key(spec: ModelSpec, fields: dict[str, Any], ones: tuple[str, ...], trace_version: int | str) -> str:
    """The structural type: the spec without its sizes and what the step does not read, the trace fields without
    micro-batch, sequence and TP, and which dimensions are 1."""
    s = _structural_spec(spec)
    f = {k: v for k, v in fields.items() if k not in ("mb", "seq", "tp")}
    body = json.dumps({"spec": s, "fields": f, "ones": list(ones), "v": trace_version, "tpl": TEMPLATE_FORMAT},
                      sort_keys=True, default=str)
    return hashlib.blake2b(body.encode(), digest_size=10).hexdigest()


def round_alloc(n: int) -> int:
    """As engine/trace/capture.rounded: at least one block, whole blocks."""
    return max(ALLOC_ROUND, -(-n // ALLOC_ROUND) * ALLOC_ROUND) if n > 0 else 0


# A slot's form: ("m", c, d, exps) integer c * prod(x^e) + d; ("l", ((c, exps), ...)) a sum of monomials (memory
# totals, within the allocator's rounding);
# ("f", value) a float constant; ("p", c, var, power) a float c * x^power (power -1/4: sqrt(x ** -0.5), the factor
# PyTorch's math attention multiplies q and k by, computed as it computes it).
Form = tuple[Any, ...]


def _mono(dims: dict[str, int], exps: tuple[int, ...], cache: dict[tuple[int, ...], int | Fraction]) -> int | Fraction:
    v = cache.get(exps)
    if v is None:
        num = den = 1
        for x, e in zip((dims[k] for k in DIMS), exps, strict=True):
            if e > 0:
                num *= x ** e
            elif e < 0:
                den *= x ** -e
        v = cache[exps] = num if den == 1 else Fraction(num, den)
    return v


def exact_int(x: Fraction) -> int | Fraction:
    return x.numerator if x.denominator == 1 else x


def eval_form(f: Form, dims: dict[str, int], cache: dict[tuple[int, ...], int | Fraction]) -> int | float | None:
    """A slot's value at `dims`; None where an integer slot is not an integer there."""
    kind = f[0]
    if kind == "m":
        v = f[1] * _mono(dims, f[3], cache) + f[2]
        if isinstance(v, int):
            return v
        return int(v) if v.denominator == 1 else None
    if kind == "l":
        return round(sum(c * _mono(dims, e, cache) for c, e in f[1]))
    if kind == "f":
        return float(f[1])
    if kind == "p":
        if f[3] == -0.25:  # ATen's math attention scales q and k by sqrt(scale); the model's scale is hd ** -0.5
            return float(f[1]) * math.sqrt(float(dims[f[2]]) ** -0.5)
        return float(f[1]) * float(dims[f[2]]) ** float(f[3])
    raise ValueError(f"unknown template form {kind!r}")


def split_numbers(text: str) -> tuple[list[str], list[int | float]]:
    """A JSON text's number literals (outside strings) and the text around them."""
    chunks: list[str] = []
    nums: list[int | float] = []
    last = 0
    for m in NUMBER_RE.finditer(text):
        if m.group(1) is None:
            continue
        chunks.append(text[last:m.start()])
        lit = m.group(1)
        nums.append(float(lit) if ("." in lit or "e" in lit or "E" in lit) else int(lit))
        last = m.end()
    chunks.append(text[last:])
    return chunks, nums


def _render(chunks: list[str], vals: list[int | float]) -> str:
    """The text with its numbers written as json.dumps writes them (what instantiation writes, one operator)."""
    return _op_format(chunks) % tuple(_number_texts(vals))


def _number_texts(vals: list[int | float], floats: list[int] | None = None) -> list[str]:
    """Numbers as json.dumps writes them: str of an int and of a finite float, NaN and Infinity otherwise.
    floats: where the floats can be (a template's float slots), when known."""
    texts = list(map(str, vals))
    for j in range(len(vals)) if floats is None else floats:
        v = vals[j]
        if type(v) is float and not math.isfinite(v):
            texts[j] = json.dumps(v)
    return texts


def _op_format(chunks: list[str]) -> str:
    """An operator's text as a %-format with one %s per number (rendered at C speed)."""
    return "%s".join(c.replace("%", "%%") for c in chunks)


def op_formats(skel: dict[str, Any]) -> tuple[str, ...]:
    return tuple(_op_format(o[1]) for o in skel["ops"])


@dataclass(frozen=True)
class GraphTemplate:
    """One structural type's graph with number slots: the ops' text around its numbers, the params, memory and
    meta fields, and one form per slot, in the order `numbers_of` lists them, kept in columns as the file stores
    them (instantiation plans its slots from the columns: thousands of per-slot tuples are built only when asked)."""

    key: str
    ones: tuple[str, ...]
    box: dict[str, tuple[int, int]]  # the dimensions the build's traces spanned
    skeleton: dict[str, Any]  # the base graph's JSON with every number replaced by a slot order
    columns: dict[str, Any]  # the forms in columns (`_forms_columns`)
    traces: int  # how many traces the forms were fitted and checked on
    torch_version: str

    @staticmethod
    def of_forms(*, key: str, ones: tuple[str, ...], box: dict[str, tuple[int, int]], skeleton: dict[str, Any],
                 forms: tuple[Form, ...], traces: int, torch_version: str) -> GraphTemplate:
        return GraphTemplate(key=key, ones=ones, box=box, skeleton=skeleton, columns=_forms_columns(forms),
                             traces=traces, torch_version=torch_version)

    @functools.cached_property
    def forms(self) -> tuple[Form, ...]:
        return _forms_from_columns(self.columns)

    def covers(self, dims: dict[str, int]) -> bool:
        return _holds(self.ones, self.box, dims)

    def instantiate(self, dims: dict[str, int], model: dict[str, Any]) -> Graph | None:
        """The graph at `dims` (meta.model set to `model`), or None outside the template's domain."""
        if not self.covers(dims):
            return None
        vals = self._plan.evaluate(dims)
        if vals is None:
            return None
        return graph_from_numbers(self.skeleton, vals, model, self.key, self.traces, self._formats,
                                  self._plan.float_at, self._layout)

    @functools.cached_property
    def _plan(self) -> _Plan:
        return _Plan(self.columns)

    @functools.cached_property
    def _formats(self) -> tuple[str, ...]:
        return op_formats(self.skeleton)

    @functools.cached_property
    def _layout(self) -> _Layout:
        return _Layout(self.skeleton, self._formats)

    def to_json(self) -> dict[str, Any]:
        return {"format": TEMPLATE_FORMAT, "key": self.key, "ones": list(self.ones),
                "box": {k: list(v) for k, v in self.box.items()}, "skeleton": self.skeleton,
                "forms": self.columns, "traces": self.traces, "torch_version": self.torch_version}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> GraphTemplate:
        if obj.get("format") != TEMPLATE_FORMAT:
            raise ValueError(f"not a {TEMPLATE_FORMAT} file")
        exps: dict[tuple[int, ...], tuple[int, ...]] = {}
        if isinstance(obj["forms"], list):  # the first layout: one list per slot
            cols = _forms_columns(tuple(_form_load(f, exps) for f in obj["forms"]))
        else:
            cols = obj["forms"]
            _check_columns(cols)
        return GraphTemplate(key=obj["key"], ones=tuple(obj["ones"]),
                             box={k: (int(a), int(b)) for k, (a, b) in obj["box"].items()},
                             skeleton=obj["skeleton"], columns=cols,
                             traces=int(obj["traces"]), torch_version=obj["torch_version"])

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(gzip.compress(json.dumps(self.to_json(), separators=(",", ":")).encode(), 6))
        os.replace(tmp, path)

    @staticmethod
    def load(path: Path) -> GraphTemplate:
        """A template file, through its compiled copy in the user's cache (marshal: 5-10x faster than parsing the
        JSON; named by the file's hash, so an edited or replaced file is compiled again)."""
        raw = path.read_bytes()
        # marshal's format is the running Python's: a cache shared by two Pythons keeps one copy for each
        py = f"py{sys.version_info[0]}{sys.version_info[1]}"
        compiled = compiled_dir() / f"{path.name.split('.')[0]}-{hashlib.blake2b(raw, digest_size=12).hexdigest()}-{py}.m"
        try:
            body = marshal.loads(compiled.read_bytes())
            if isinstance(body, tuple) and len(body) == 8 and body[0] == _COMPILED_FORMAT:
                _, key, ones, box, skeleton, cols, traces, torch_version = body
                _check_columns(cols)
                return GraphTemplate(key=key, ones=tuple(ones), box={k: (a, b) for k, a, b in box},
                                     skeleton=skeleton, columns=cols, traces=traces, torch_version=torch_version)
        except (OSError, ValueError, EOFError, TypeError, IndexError, KeyError):
            pass
        t = GraphTemplate.from_json(json.loads(gzip.decompress(raw)))
        try:
            compiled.parent.mkdir(parents=True, exist_ok=True)
            tmp = compiled.with_name(f".{compiled.name}.{os.getpid()}.tmp")
            tmp.write_bytes(marshal.dumps((_COMPILED_FORMAT, t.key, t.ones, tuple((k, a, b) for k, (a, b) in
                                                                                  t.box.items()),
                                           t.skeleton, t.columns, t.traces, t.torch_version)))
            os.replace(tmp, compiled)
        except (OSError, ValueError):
            pass
        return t


_COMPILED_FORMAT = "tp-query-template-compiled/2"  # the forms kept in columns


class _Plan:
    """A template's integer slots c * prod(x^e) + d evaluated at once (int64 where the value cannot overflow); the
    others (sums of monomials, floats, non-integer or huge monomials) one by one, as `eval_form`. Planned from the
    columns: a slot's tuple is built only for the slots evaluated one by one."""

    def __init__(self, cols: dict[str, Any]) -> None:
        kind = np.frombuffer(cols["kind"].encode("ascii"), dtype=np.uint8)
        at_of = {k: np.flatnonzero(kind == ord(k)).tolist() for k in "mflp"}
        self.exps = [tuple(e) for e in cols["exps"]]
        self.exp_at = {e: j for j, e in enumerate(self.exps)}
        lim = 2**52
        m_at, m_e = np.array(at_of["m"], dtype=np.int64), np.array(cols["m_e"], dtype=np.int64)
        (cs, c_a, c_odd), (ds, d_a, d_odd) = _int_column(cols["m_c"]), _int_column(cols["m_d"])
        fast_a = (np.abs(c_a) < lim) & (np.abs(d_a) < lim)
        fast_a[c_odd] = False
        fast_a[d_odd] = False
        slow = np.flatnonzero(~fast_a).tolist()
        self.at, self.idx = m_at[fast_a], m_e[fast_a]
        self.c, self.d = c_a[fast_a].astype(np.int64), d_a[fast_a].astype(np.int64)
        self.bound = np.abs(self.c).astype(np.float64), np.abs(self.d).astype(np.float64)
        # float constants once; every other slot that is not a fast integer one, as eval_form evaluates it
        self.consts = [(i, float(v)) for i, v in zip(at_of["f"], cols["f"], strict=True)]
        rest: list[tuple[int, Form]] = [(at_of["m"][j], ("m", cs[j], ds[j], self.exps[cols["m_e"][j]]))
                                        for j in slow]
        rest += [(i, ("p", *v)) for i, v in zip(at_of["p"], cols["p"], strict=True)]
        rest += [(i, ("l", tuple((_coef_from(c), self.exps[e]) for c, e in v)))
                 for i, v in zip(at_of["l"], cols["l"], strict=True)]
        self.rest = sorted(rest, key=lambda x: x[0])
        self.n = len(kind)
        self.float_at = sorted(at_of["f"] + at_of["p"])  # the slots that hold floats

    def evaluate(self, dims: dict[str, int]) -> list[int | float] | None:
        cache: dict[tuple[int, ...], int | Fraction] = {}
        monos = [_mono(dims, e, cache) for e in self.exps]
        vals: list[Any] = [0] * self.n
        for i, const in self.consts:
            vals[i] = const
        rest = self.rest
        if len(self.at):
            whole = np.array([type(m) is int and m < 2**52 for m in monos], dtype=bool)
            m_i = np.array([m if w else 0 for m, w in zip(monos, whole.tolist(), strict=True)], dtype=np.int64)
            # |c| * mono + |d| below 2^62 (in float64, whose rounding is far below that margin): no int64 overflow
            ok = whole[self.idx] & (self.bound[0] * m_i.astype(np.float64)[self.idx] + self.bound[1] < 2.0**62)
            v = self.c[ok] * m_i[self.idx[ok]] + self.d[ok]
            for i, x in zip(self.at[ok].tolist(), v.tolist(), strict=True):
                vals[i] = x
            if not ok.all():  # evaluated one by one, exactly
                bad = ~ok
                rest = rest + [(i, ("m", c, d, self.exps[e])) for i, c, d, e in
                               zip(self.at[bad].tolist(), self.c[bad].tolist(), self.d[bad].tolist(),
                                   self.idx[bad].tolist(), strict=True)]
        for i, f in rest:
            if f[0] == "m":  # c * mono + d with ratios: in integers (eval_form's value, without Fraction objects)
                mono = monos[self.exp_at[f[3]]]
                if type(mono) is int:
                    c, d = f[1], f[2]
                    cn, cd = (c, 1) if type(c) is int else (c.numerator, c.denominator)
                    dn, dd = (d, 1) if type(d) is int else (d.numerator, d.denominator)
                    num, den = cn * mono * dd + dn * cd, cd * dd
                    if num % den:
                        return None
                    vals[i] = num // den
                    continue
            x = eval_form(f, dims, cache)
            if x is None:
                return None
            vals[i] = x
        return vals


def _int_column(xs: list[Any]) -> tuple[list[int | Fraction], np.ndarray, list[int]]:
    """A column of stored coefficients: their values (ratios are stored as text), the int64 array of those that
    fit (0 elsewhere) and where the others are."""
    odd = [j for j, x in enumerate(xs) if type(x) is not int]
    vals: list[int | Fraction] = list(xs)
    z: list[int] = list(xs)
    for j in odd:
        vals[j] = _coef(xs[j])
        z[j] = 0
    try:
        arr = np.array(z, dtype=np.int64).reshape(-1)
    except OverflowError:  # integers beyond int64: those one by one
        big = [j for j, x in enumerate(z) if not -2**63 < x < 2**63]
        for j in big:
            z[j] = 0
        odd += big
        arr = np.array(z, dtype=np.int64).reshape(-1)
    return vals, arr, odd


def _check_columns(cols: dict[str, Any]) -> None:
    """Stored columns that agree with their kinds (a damaged or foreign file is not planned from)."""
    if not isinstance(cols, dict) or cols.get("layout") != "columns" or not isinstance(cols.get("kind"), str):
        raise ValueError("unknown template forms layout")
    kind = cols["kind"]
    if set(kind) - set("mflp"):
        raise ValueError("unknown template form kind")
    if not isinstance(cols.get("exps"), list):
        raise ValueError("template forms without exponent vectors")
    n_exps = len(cols["exps"])
    for k, names in (("m", ("m_c", "m_d", "m_e")), ("f", ("f",)), ("l", ("l",)), ("p", ("p",))):
        for c in names:
            if not isinstance(cols.get(c), list) or len(cols[c]) != kind.count(k):
                raise ValueError("template forms with values missing or left over")
    if any(type(e) is not int or not 0 <= e < n_exps for e in cols["m_e"]):
        raise ValueError("template form with an unknown exponent vector")


def _coef_json(c: int | Fraction) -> int | str:
    return c if type(c) is int else str(c)


def _forms_columns(forms: tuple[Form, ...]) -> dict[str, Any]:
    """The forms by kind, in columns (a template file's bulk: thousands of integer slots): one letter per slot
    for its kind, each kind's values in slot order, and the exponent vectors once each."""
    exps: dict[tuple[int, ...], int] = {}
    cols: dict[str, list[Any]] = {"m_c": [], "m_d": [], "m_e": [], "f": [], "p": [], "l": []}
    for f in forms:
        if f[0] == "m":
            cols["m_c"].append(_coef_json(f[1]))
            cols["m_d"].append(_coef_json(f[2]))
            cols["m_e"].append(exps.setdefault(tuple(f[3]), len(exps)))
        elif f[0] == "l":
            cols["l"].append([[_coef_json(c), exps.setdefault(tuple(e), len(exps))] for c, e in f[1]])
        elif f[0] == "f":
            cols["f"].append(f[1])
        elif f[0] == "p":
            cols["p"].append(list(f[1:]))
        else:
            raise ValueError(f"unknown template form {f[0]!r}")
    return {"layout": "columns", "kind": "".join(f[0] for f in forms), "exps": [list(e) for e in exps], **cols}


def _forms_from_columns(cols: dict[str, Any]) -> tuple[Form, ...]:
    if cols.get("layout") != "columns":
        raise ValueError("unknown template forms layout")
    exps = [tuple(e) for e in cols["exps"]]
    it = {k: iter(cols[k]) for k in ("m_c", "m_d", "m_e", "f", "p", "l")}
    coef = _coef_from

    def one(kind: str) -> Form:
        if kind == "m":
            return ("m", coef(next(it["m_c"])), coef(next(it["m_d"])), exps[next(it["m_e"])])
        if kind == "f":
            return ("f", next(it["f"]))
        if kind == "p":
            return ("p", *next(it["p"]))
        if kind == "l":
            return ("l", tuple((coef(c), exps[e]) for c, e in next(it["l"])))
        raise ValueError(f"unknown template form {kind!r}")

    out = tuple(one(k) for k in cols["kind"])
    if any(next(v, None) is not None for v in it.values()):
        raise ValueError("template forms with values left over")
    return out


def _coef_from(x: int | str) -> int | Fraction:
    return _coef(x) if isinstance(x, str) else x


def _form_json(f: Form) -> list[Any]:
    if f[0] == "m":
        return [f[0], str(f[1]), str(f[2]), list(f[3])]
    if f[0] == "l":
        return [f[0], [[str(c), list(e)] for c, e in f[1]]]
    return list(f)


def _coef(text: str) -> int | Fraction:
    """A stored coefficient: almost all are integers ("4096"); a ratio ("1/2") where the fit needed one."""
    try:
        return int(text)
    except ValueError:
        return exact_int(Fraction(text))


def _form_load(f: list[Any], exps: dict[tuple[int, ...], tuple[int, ...]]) -> Form:
    """`exps`: one tuple per distinct exponent vector (a template repeats a few dozen over its slots)."""
    if f[0] == "m":
        e = tuple(f[3])
        return (f[0], _coef(f[1]), _coef(f[2]), exps.setdefault(e, e))
    if f[0] == "l":
        return (f[0], tuple((_coef(c), exps.setdefault(tuple(x), tuple(x))) for c, x in f[1]))
    return tuple(f)


# -- a graph as skeleton + numbers (the build and instantiation share this one layout) ----------------------------

_META_NUMS = ("micro_batch", "seq_len", "tp", "traced_layers")
_EXTRA_BUILD = ("trace_s", "alloc_parts", "mem_events", "mem_templates", "static_parts", "static_more", "grad_parts")


def numbers_of(g: Graph) -> tuple[dict[str, Any], list[int | float], list[str]]:
    """(skeleton, numbers, the role of each number: "sig", "part", "shape", "mem", "transient" or "meta") of a graph
    traced for a template (capture.RECORD_ALLOC_PARTS): each operator's new storages in raw bytes, and the
    recording's memory events."""
    extra = g.meta.extra or {}
    parts, events = extra.get("alloc_parts"), extra.get("mem_events")
    if parts is None or events is None or len(parts) != len(g.ops):
        raise ValueError("a template is built from traces that record storages and memory events (alloc_parts)")
    nums: list[int | float] = []
    roles: list[str] = []
    ops = []
    for o, pa in zip(g.ops, parts, strict=True):
        chunks, n = split_numbers(o.sig)
        nums.extend(n)
        roles.extend(["sig"] * len(n))
        nums.extend(pa)
        roles.extend(["part"] * len(pa))
        ops.append([o.op, chunks, o.phase.value, o.section.value, o.layer, len(pa)])
    params = []
    for p in g.params:
        nums.extend(p.shape)
        roles.extend(["shape"] * len(p.shape))
        params.append([p.name, len(p.shape), p.dtype, p.section.value, p.layer])
    skel_events = []
    for e in events:
        if e[0] == "t":
            nums.append(int(e[1]))
            roles.append("transient")
            skel_events.append(["t"])
        else:
            skel_events.append(list(e))
    # the static state (weights, optimizer state) and the gradients: each storage in raw bytes
    for k in ("static_parts", "grad_parts"):
        nums.extend(extra[k])
        roles.extend(["part"] * len(extra[k]))
    for k in _META_NUMS:
        nums.append(getattr(g.meta, k))
        roles.append("meta")
    meta = {k: v for k, v in g.meta.__dict__.items() if k not in _META_NUMS and k != "model"}
    meta["extra"] = {k: v for k, v in extra.items() if k not in _EXTRA_BUILD}
    return {"ops": ops, "params": params, "meta": meta, "events": skel_events,
            "mem_templates": extra["mem_templates"], "static_parts": len(extra["static_parts"]),
            "static_more": extra["static_more"], "grad_parts": len(extra["grad_parts"])}, nums, roles


def replay_memory(events: list[list[Any]], parts: list[int], transients: list[int], static: int, grad_bytes: int,
                  n_layers: int, templates: dict[int, float]) -> MemoryProfile:
    """The memory profile of a recording from its events, each allocation rounded as the caching allocator
    rounds it (the same bookkeeping as engine/trace/capture._Capture)."""
    live = peak = 0
    sizes: dict[int, int] = {}
    marks: dict[str, int] = {}
    wpk: dict[str, int] = {}
    windows: set[str] = set()
    ia = it = 0
    for e in events:
        kind = e[0]
        if kind == "a":
            n = round_alloc(parts[ia])
            sizes[ia] = n
            ia += 1
            live += n
            peak = max(peak, live)
            for w in windows:
                wpk[w] = max(wpk.get(w, 0), live)
        elif kind == "f":
            live -= sizes.pop(e[1], 0)
        elif kind == "t":
            top = live + transients[it]
            it += 1
            peak = max(peak, top)
            for w in windows:
                wpk[w] = max(wpk.get(w, 0), top)
        elif kind == "m":
            marks[e[1]] = live
        elif kind == "mo":
            marks[e[1]] = live - sum(sizes.get(j, 0) for j in range(ia - int(e[2]), ia))
        elif kind == "o":
            windows.add(e[1])
            wpk[e[1]] = live
        elif kind == "c":
            windows.discard(e[1])
    return memory_profile_from(marks, wpk, peak, static, grad_bytes, n_layers, templates)


class _Layout:
    """Where each part of a graph sits among a template's numbers (slot ranges per operator, parameter and memory
    field), laid out once per template: instantiation then reads its numbers by range."""

    def __init__(self, skel: dict[str, Any], formats: tuple[str, ...]) -> None:
        sections, phases = {s.value: s for s in Section}, {p.value: p for p in Phase}
        i = 0
        self.ops: list[tuple[str, str, Phase, Section, int, int, int]] = []
        part_at: list[int] = []
        bounds: list[int] = [0]  # per operator, its parts' end among all parts
        for (op, chunks, ph, sec, layer, n_parts), fmt in zip(skel["ops"], formats, strict=True):
            n = len(chunks) - 1
            self.ops.append((op, fmt, phases[ph], sections[sec], layer, i, i + n))
            part_at.extend(range(i + n, i + n + n_parts))
            bounds.append(len(part_at))
            i += n + n_parts
        self.part_at, self.bounds = part_at, np.array(bounds, dtype=np.int64)
        self.params: list[tuple[str, int, int, str, Section, int]] = []
        for name, rank, dtype, sec, layer in skel["params"]:
            self.params.append((name, i, i + rank, dtype, sections[sec], layer))
            i += rank
        spans = []
        for n in (sum(1 for e in skel["events"] if e[0] == "t"), skel["static_parts"], skel["grad_parts"]):
            spans.append((i, i + n))
            i += n
        self.transients, self.static, self.grads = spans
        self.meta_at = i
        self.static_more = int(skel["static_more"])
        self.mem_templates = {int(k): float(v) for k, v in skel["mem_templates"]}


def _rounded(xs: list[int]) -> np.ndarray:
    """Allocation sizes rounded as the caching allocator rounds them (round_alloc over an array)."""
    a = np.array(xs, dtype=np.int64).reshape(-1)
    return np.where(a > 0, np.maximum(ALLOC_ROUND, -(-a // ALLOC_ROUND) * ALLOC_ROUND), 0)


def graph_from_numbers(skel: dict[str, Any], vals: list[int | float], model: dict[str, Any], key: str,
                       traces: int, formats: tuple[str, ...] | None = None, floats: list[int] | None = None,
                       layout: _Layout | None = None) -> Graph:
    lay = layout if layout is not None else _Layout(skel, formats if formats is not None else op_formats(skel))
    texts = _number_texts(vals, floats)
    parts = [int(vals[j]) for j in lay.part_at]
    cum = np.concatenate(([0], np.cumsum(_rounded(parts))))
    allocs = (cum[lay.bounds[1:]] - cum[lay.bounds[:-1]]).tolist()
    ops = tuple([OpRecord(op, fmt % tuple(texts[a:b]), ph, sec, layer, al)
                 for (op, fmt, ph, sec, layer, a, b), al in zip(lay.ops, allocs, strict=True)])
    params = tuple([ParamRecord(name, tuple(int(v) for v in vals[a:b]), dtype, sec, layer)
                    for name, a, b, dtype, sec, layer in lay.params])
    transients = [int(v) for v in vals[lay.transients[0]:lay.transients[1]]]
    static = int(_rounded([int(v) for v in vals[lay.static[0]:lay.static[1]]]).sum()) + lay.static_more
    grad_bytes = int(_rounded([int(v) for v in vals[lay.grads[0]:lay.grads[1]]]).sum())
    meta_nums: dict[str, Any] = {k: int(vals[lay.meta_at + j]) for j, k in enumerate(_META_NUMS)}
    mem = replay_memory(skel["events"], parts, transients, static, grad_bytes, meta_nums["traced_layers"],
                        lay.mem_templates)
    m = dict(skel["meta"])
    m["extra"] = {**m["extra"], "template": key, "template_traces": traces}
    meta = GraphMeta(**m, **meta_nums, model=model)
    return Graph(meta, ops, params, mem)


# -- where templates live ----------------------------------------------------------------------------------------

def shipped_dir() -> Path:
    """Templates built with the project (data/templates, in the wheel as tp_query/data/templates)."""
    return Path(__file__).resolve().parent.parent / "data" / "templates"


def user_dir() -> Path:
    return Path(os.environ.get("TP_QUERY_CACHE", Path.home() / ".cache" / "tp-query")) / "templates"


def compiled_dir() -> Path:
    return Path(os.environ.get("TP_QUERY_CACHE", Path.home() / ".cache" / "tp-query")) / "templates-compiled"


_LOADED: dict[str, GraphTemplate | None] = {}


def find(key: str) -> GraphTemplate | None:
    """The template of a structural type: shipped first, then the user's cache; None when neither holds it
    (a file that does not load is ignored: the caller traces)."""
    if key in _LOADED:
        return _LOADED[key]
    t = None
    for p in _paths(key):
        try:
            t = GraphTemplate.load(p)
            if t.key != key:
                t = None
        except (OSError, ValueError, KeyError, TypeError, EOFError):
            t = None
        if t is not None:
            break
    _LOADED[key] = t
    return t


INDEX_NAME = "index.json"  # beside shipped templates: each type's box and size-1 dimensions


@functools.cache
def _shipped_index() -> dict[str, Any]:
    try:
        obj = json.loads((shipped_dir() / INDEX_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return obj.get("templates", {}) if isinstance(obj, dict) and obj.get("format") == TEMPLATE_FORMAT else {}


def may_cover(key: str, dims: dict[str, int]) -> bool:
    """Whether a structural type's template holds these dimensions, from the shipped index where it lists the type
    (no template is loaded) and from the template itself otherwise. A planner asks this to know which graphs need
    a trace; building a graph loads the template and checks again, so a stale index costs time, never answers."""
    entry = _shipped_index().get(key)
    if entry is not None and (shipped_dir() / f"{key}.json.gz").exists():
        return _holds(tuple(entry["ones"]), entry["box"], dims)
    t = find(key)
    return t is not None and t.covers(dims)


def write_index(directory: Path) -> int:
    """The index of the templates in `directory` (what `may_cover` reads), rebuilt from every file; how many."""
    out: dict[str, Any] = {}
    for p in sorted(directory.glob("*.json.gz")):
        t = GraphTemplate.load(p)
        out[t.key] = {"ones": list(t.ones), "box": {k: list(v) for k, v in sorted(t.box.items())}}
    tmp = directory / f".{INDEX_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"format": TEMPLATE_FORMAT, "templates": out}, sort_keys=True, separators=(",", ":")))
    os.replace(tmp, directory / INDEX_NAME)
    return len(out)


def _paths(key: str) -> list[Path]:
    return [p for p in (shipped_dir() / f"{key}.json.gz", user_dir() / f"{key}.json.gz") if p.exists()]


def file_digest(key: str) -> str | None:
    """The bytes of the files `find` would try for a structural type, hashed (None: there are none): what a
    graph built from the template depends on, without loading it. Read once per file state (path, size and
    modification time: a template built or replaced meanwhile is read again)."""
    state = []
    for p in _paths(key):
        try:
            st = p.stat()
        except OSError:
            continue
        state.append((str(p), st.st_size, st.st_mtime_ns))
    return _digest_of(tuple(state)) if state else None


@functools.lru_cache(maxsize=4096)
def _digest_of(state: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for path, _, _ in state:
        try:
            h.update(Path(path).read_bytes())
        except OSError:
            h.update(path.encode())
    return h.hexdigest()

