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


class TemplateError(ValueError):
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


def structure_key(spec: ModelSpec, fields: dict[str, Any], ones: tuple[str, ...], trace_version: int) -> str:
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
    meta fields, and one form per slot, in the order `numbers_of` lists them."""

    key: str
    ones: tuple[str, ...]
    box: dict[str, tuple[int, int]]  # the dimensions the build's traces spanned
    skeleton: dict[str, Any]  # the base graph's JSON with every number replaced by a slot order
    forms: tuple[Form, ...]
    traces: int  # how many traces the forms were fitted and checked on
    torch_version: str

    def covers(self, dims: dict[str, int]) -> bool:
        return _holds(self.ones, self.box, dims)

    def instantiate(self, dims: dict[str, int], model: dict[str, Any]) -> Graph | None:
        """The graph at `dims` (meta.model set to `model`), or None outside the template's domain."""
        if not self.covers(dims):
            return None
        vals = self._plan.evaluate(self.forms, dims)
        if vals is None:
            return None
        return graph_from_numbers(self.skeleton, vals, model, self.key, self.traces, self._formats,
                                  self._plan.float_at)

    @functools.cached_property
    def _plan(self) -> _Plan:
        return _Plan(self.forms)

    @functools.cached_property
    def _formats(self) -> tuple[str, ...]:
        return op_formats(self.skeleton)

    def to_json(self) -> dict[str, Any]:
        return {"format": TEMPLATE_FORMAT, "key": self.key, "ones": list(self.ones),
                "box": {k: list(v) for k, v in self.box.items()}, "skeleton": self.skeleton,
                "forms": _forms_columns(self.forms), "traces": self.traces,
                "torch_version": self.torch_version}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> GraphTemplate:
        if obj.get("format") != TEMPLATE_FORMAT:
            raise ValueError(f"not a {TEMPLATE_FORMAT} file")
        exps: dict[tuple[int, ...], tuple[int, ...]] = {}
        return GraphTemplate(key=obj["key"], ones=tuple(obj["ones"]),
                             box={k: (int(a), int(b)) for k, (a, b) in obj["box"].items()},
                             skeleton=obj["skeleton"],
                             forms=tuple(_form_load(f, exps) for f in obj["forms"]) if isinstance(obj["forms"], list)
                             else _forms_from_columns(obj["forms"]),
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
            if isinstance(body, tuple) and len(body) == 9 and body[0] == _COMPILED_FORMAT:
                return GraphTemplate._from_compiled(body)
        except (OSError, ValueError, EOFError, TypeError, IndexError, KeyError):
            pass
        t = GraphTemplate.from_json(json.loads(gzip.decompress(raw)))
        try:
            compiled.parent.mkdir(parents=True, exist_ok=True)
            tmp = compiled.with_name(f".{compiled.name}.{os.getpid()}.tmp")
            tmp.write_bytes(marshal.dumps(t._compiled()))
            os.replace(tmp, compiled)
        except (OSError, ValueError):
            pass
        return t

    def _compiled(self) -> tuple[Any, ...]:
        """The template as marshal-able builtins: Fractions as (numerator, denominator) with their places listed."""
        forms: list[Any] = []
        fractions: list[tuple[int, int]] = []
        for i, f in enumerate(self.forms):
            if f[0] == "m" and (type(f[1]) is Fraction or type(f[2]) is Fraction):
                fractions.append((i, 0))
                f = (f[0], _frac_out(f[1]), _frac_out(f[2]), f[3])
            elif f[0] == "l" and any(type(c) is Fraction for c, _ in f[1]):
                fractions.append((i, 1))
                f = (f[0], tuple((_frac_out(c), e) for c, e in f[1]))
            forms.append(f)
        return (_COMPILED_FORMAT, self.key, self.ones, tuple((k, a, b) for k, (a, b) in self.box.items()),
                self.skeleton, tuple(forms), tuple(fractions), self.traces, self.torch_version)

    @staticmethod
    def _from_compiled(body: tuple[Any, ...]) -> GraphTemplate:
        _, key, ones, box, skeleton, forms, fractions, traces, torch_version = body
        forms = list(forms)
        for i, kind in fractions:
            f = forms[i]
            forms[i] = (f[0], _frac_in(f[1]), _frac_in(f[2]), f[3]) if kind == 0 else \
                (f[0], tuple((_frac_in(c), e) for c, e in f[1]))
        return GraphTemplate(key=key, ones=tuple(ones), box={k: (a, b) for k, a, b in box}, skeleton=skeleton,
                             forms=tuple(forms), traces=traces, torch_version=torch_version)


_COMPILED_FORMAT = "tp-query-template-compiled/1"


def _frac_out(x: int | Fraction) -> int | tuple[int, int]:
    return (x.numerator, x.denominator) if isinstance(x, Fraction) else x


def _frac_in(x: int | tuple[int, int] | list[int]) -> int | Fraction:
    return exact_int(Fraction(x[0], x[1])) if isinstance(x, tuple | list) else x


class _Plan:
    """A template's integer slots c * prod(x^e) + d evaluated at once (int64 where the value cannot overflow); the
    others (sums of monomials, floats, non-integer or huge monomials) one by one, as `eval_form`."""

    def __init__(self, forms: tuple[Form, ...]) -> None:
        exps: dict[tuple[int, ...], int] = {}
        idx, cs, ds, at = [], [], [], []
        for i, f in enumerate(forms):
            if f[0] == "m" and type(f[1]) is int and type(f[2]) is int and abs(f[1]) < 2**52 and abs(f[2]) < 2**52:
                at.append(i)
                idx.append(exps.setdefault(f[3], len(exps)))
                cs.append(f[1])
                ds.append(f[2])
        self.exps = list(exps)
        self.at = np.array(at, dtype=np.int64)
        self.idx = np.array(idx, dtype=np.int64)
        self.c = np.array(cs, dtype=np.int64)
        self.d = np.array(ds, dtype=np.int64)
        self.bound = np.abs(self.c).astype(np.float64), np.abs(self.d).astype(np.float64)
        fast = set(at)
        # float constants once; every other slot that is not a fast integer one, as eval_form evaluates it
        self.consts = [(i, float(f[1])) for i, f in enumerate(forms) if f[0] == "f"]
        self.rest = [i for i in range(len(forms)) if i not in fast and forms[i][0] != "f"]
        self.float_at = [i for i, f in enumerate(forms) if f[0] in ("f", "p")]  # the slots that hold floats

    def evaluate(self, forms: tuple[Form, ...], dims: dict[str, int]) -> list[int | float] | None:
        cache: dict[tuple[int, ...], int | Fraction] = {}
        monos = [_mono(dims, e, cache) for e in self.exps]
        vals: list[Any] = [0] * len(forms)
        for i, const in self.consts:
            vals[i] = const
        rest = list(self.rest)
        if monos:
            whole = np.array([type(m) is int and m < 2**52 for m in monos])
            m_i = np.array([m if w else 0 for m, w in zip(monos, whole, strict=True)], dtype=np.int64)
            # |c| * mono + |d| below 2^62 (in float64, whose rounding is far below that margin): no int64 overflow
            ok = whole[self.idx] & (self.bound[0] * m_i.astype(np.float64)[self.idx] + self.bound[1] < 2.0**62)
            v = self.c[ok] * m_i[self.idx[ok]] + self.d[ok]
            for i, x in zip(self.at[ok].tolist(), v.tolist(), strict=True):
                vals[i] = x
            rest += self.at[~ok].tolist()
        for i in rest:
            x = eval_form(forms[i], dims, cache)
            if x is None:
                return None
            vals[i] = x
        return vals


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


def graph_from_numbers(skel: dict[str, Any], vals: list[int | float], model: dict[str, Any], key: str,
                       traces: int, formats: tuple[str, ...] | None = None, floats: list[int] | None = None) -> Graph:
    sections, phases = {s.value: s for s in Section}, {p.value: p for p in Phase}
    i = 0
    ops = []
    parts: list[int] = []
    fmts = formats if formats is not None else op_formats(skel)
    texts = _number_texts(vals, floats)
    for (op, chunks, ph, sec, layer, n_parts), fmt in zip(skel["ops"], fmts, strict=True):
        n = len(chunks) - 1
        sig = fmt % tuple(texts[i:i + n])
        i += n
        if n_parts:
            pa = [int(v) for v in vals[i:i + n_parts]]
            parts.extend(pa)
            i += n_parts
            alloc = sum(round_alloc(v) for v in pa)
        else:
            alloc = 0
        ops.append(OpRecord(op, sig, phases[ph], sections[sec], layer, alloc))
    params = []
    for name, rank, dtype, sec, layer in skel["params"]:
        params.append(ParamRecord(name, tuple(int(v) for v in vals[i:i + rank]), dtype, sections[sec], layer))
        i += rank
    n_tr = sum(1 for e in skel["events"] if e[0] == "t")
    transients = [int(v) for v in vals[i:i + n_tr]]
    i += n_tr
    static = sum(round_alloc(int(v)) for v in vals[i:i + skel["static_parts"]]) + int(skel["static_more"])
    i += skel["static_parts"]
    grad_bytes = sum(round_alloc(int(v)) for v in vals[i:i + skel["grad_parts"]])
    i += skel["grad_parts"]
    meta_nums: dict[str, Any] = {k: int(vals[i + j]) for j, k in enumerate(_META_NUMS)}
    mem = replay_memory(skel["events"], parts, transients, static, grad_bytes, meta_nums["traced_layers"],
                        {int(k): float(v) for k, v in skel["mem_templates"]})
    m = dict(skel["meta"])
    m["extra"] = {**m["extra"], "template": key, "template_traces": traces}
    meta = GraphMeta(**m, **meta_nums, model=model)
    return Graph(meta, tuple(ops), tuple(params), mem)


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

