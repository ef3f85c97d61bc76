"""Build a graph template from real traces: a base point, each free dimension halved and doubled (or doubled
twice), and three checking points that span the box the template will answer in (a small, a large and a mixed
one). Every number of the graph is fitted as c * prod(x^e) + d from the one-at-a-time traces, or as a sum of the
monomials found that way (memory totals), and every form is checked on every trace; a number that fits no
form, or a trace whose operators differ in structure, refuses the template (the caller traces instead)."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

from tp_query.schema.model_config import ModelSpec

from ..graph import Graph
from ..template import (
    DIMS,
    Form,
    GraphTemplate,
    TemplateError,
    eval_form,
    exact_int,
    numbers_of,
    spec_at,
    structure_key,
)

BASE = {"mb": 4, "seq": 2048, "hidden": 2048, "kl": 2, "g": 4, "hd": 128, "fl": 2048, "vl": 16000, "tp": 2}
# the checking points span the box a template answers in
CHECKS = (
    {"mb": 2, "seq": 128, "hidden": 128, "kl": 2, "g": 1, "hd": 32, "fl": 128, "vl": 256, "tp": 2},
    {"mb": 64, "seq": 131072, "hidden": 16384, "kl": 8, "g": 8, "hd": 256, "fl": 65536, "vl": 262144, "tp": 8},
    {"mb": 3, "seq": 1536, "hidden": 5120, "kl": 3, "g": 6, "hd": 96, "fl": 7168, "vl": 50304, "tp": 4},
)
EXPONENTS = (1, 0, 2, -1)
MAX_TERMS = 24


def build_points(ones: tuple[str, ...]) -> list[dict[str, int]]:
    """The base, each free dimension at two other values, then the checking points; dimensions in `ones` stay 1."""
    base = {k: (1 if k in ones else v) for k, v in BASE.items()}
    pts = [base]
    for k in DIMS:
        if k in ones:
            continue
        v = base[k]
        for x in ((v // 2, v * 2) if v // 2 > 1 and v % 2 == 0 else (v * 2, v * 4)):
            pts.append({**base, k: x})
    for c in CHECKS:
        p = {k: (1 if k in ones else v) for k, v in c.items()}
        for k in DIMS:  # a checking point lies in the template's own class: a size-1 dimension is another class
            if k not in ones and p[k] == 1:
                p[k] = 2  # (one query head per KV head is multi-head attention: fp32 SDPA dispatches it apart)
        pts.append(p)
    return pts


def _fit_one_at_a_time(points: list[dict[str, int]], ys: list[int], free: list[str]) -> Form | None:
    """c * prod(x^e) + d from the base (point 0) and each free dimension's two other values."""
    exps: dict[str, int] = {}
    d_seen: set[Fraction] = set()
    for j, k in enumerate(free):
        i1, i2 = 1 + 2 * j, 2 + 2 * j
        ts = [points[0][k], points[i1][k], points[i2][k]]
        vs = [Fraction(ys[0]), Fraction(ys[i1]), Fraction(ys[i2])]
        found: tuple[int, Fraction | None] | None = None
        for e in EXPONENTS:
            if e == 0:
                if vs[0] == vs[1] == vs[2]:
                    found = (0, None)
                    break
                continue
            p = [Fraction(t) ** e for t in ts]
            a = (vs[1] - vs[0]) / (p[1] - p[0])
            d = vs[0] - a * p[0]
            if a != 0 and a * p[2] + d == vs[2]:
                found = (e, d)
                break
        if found is None:
            return None
        exps[k] = found[0]
        if found[0]:
            d_seen.add(found[1])  # type: ignore[arg-type]
    if len(d_seen) > 1:
        return None
    d = d_seen.pop() if d_seen else Fraction(ys[0])
    mono = Fraction(1)
    for k in DIMS:
        mono *= Fraction(points[0][k]) ** exps.get(k, 0)
    c = (Fraction(ys[0]) - d) / mono
    return ("m", exact_int(c), exact_int(d), tuple(exps.get(k, 0) for k in DIMS))


def _fit_sum(points: list[dict[str, int]], ys: list[int], basis: list[tuple[int, ...]], tol: int) -> Form | None:
    """A sum of monomials from `basis` that reproduces ys within `tol` (greedy selection, rational coefficients)."""
    import numpy as np

    cols = np.array([[float(eval_form(("m", Fraction(1), Fraction(0), e), p, {}) or 0) for e in basis]
                     for p in points])
    y = np.array([float(v) for v in ys])
    scale = np.abs(cols).max(axis=0)
    scale[scale == 0] = 1.0
    a = cols / scale
    chosen: list[int] = []
    resid = y.copy()
    for _ in range(min(MAX_TERMS, len(points) - 1)):
        norms = np.linalg.norm(a, axis=0)
        norms[norms == 0] = 1.0
        score = np.abs(a.T @ resid) / norms
        score[chosen] = -1
        chosen.append(int(score.argmax()))
        coef, *_ = np.linalg.lstsq(a[:, chosen], y, rcond=None)
        resid = y - a[:, chosen] @ coef
        form = ("l", tuple((exact_int(Fraction(float(c) / scale[i]).limit_denominator(4096)), basis[i])
                           for c, i in zip(coef, chosen, strict=True) if abs(c) > 1e-12))
        if all(abs(int(eval_form(form, p, {}) or 0) - v) <= tol for p, v in zip(points, ys, strict=True)):
            return form
    return None


def _fit_float(points: list[dict[str, int]], ys: list[float]) -> Form | None:
    if all(v == ys[0] for v in ys):
        return ("f", ys[0])
    for k in DIMS:
        for pw in (-0.5, -1.0, 0.5, 1.0, -0.25):
            c = ys[0] / float(points[0][k]) ** pw
            for cc in (c, round(c, 12)):
                f = ("p", cc, k, pw)
                if all(eval_form(f, p, {}) == v for p, v in zip(points, ys, strict=True)):
                    return f
    return None


def build_template(spec: ModelSpec, fields: dict[str, Any], ones: tuple[str, ...], trace_version: int | str,
                   trace: Callable[[ModelSpec, dict[str, int]], Graph]) -> GraphTemplate:
    """Trace the build points with `trace(spec_at_point, dims)` and fit every number of the graph."""
    from . import capture

    points = build_points(ones)
    free = [k for k in DIMS if k not in ones]
    skel0: dict[str, Any] | None = None
    table: list[list[int | float]] = []
    roles: list[str] = []
    torch_version = ""
    for p in points:
        capture.RECORD_ALLOC_PARTS = True
        try:
            g = trace(spec_at(spec, p), p)
        finally:
            capture.RECORD_ALLOC_PARTS = False
        skel, nums, roles = numbers_of(g)
        if skel0 is None:
            skel0, torch_version = skel, g.meta.torch_version
        elif skel != skel0 or len(nums) != len(table[0]):
            raise TemplateError(f"the graph's operators change with the dimensions (at {p})")
        table.append(nums)
    assert skel0 is not None
    forms: list[Form | None] = []
    todo: list[int] = []
    for i, role in enumerate(roles):
        ys = [row[i] for row in table]
        if any(isinstance(v, float) for v in ys):
            f = _fit_float(points, [float(v) for v in ys])
            if f is None:
                raise TemplateError(f"a float of the graph ({role}) follows no form of the dimensions: {ys[:4]}")
            forms.append(f)
            continue
        f = _fit_one_at_a_time(points, [int(v) for v in ys], free)
        if f is not None:
            if all(eval_form(f, p, {}) == v for p, v in zip(points, ys, strict=True)):
                forms.append(f)
                continue
        forms.append(None)
        todo.append(i)
    basis = sorted({f[3] for f in forms if f is not None and f[0] == "m"} | {tuple(0 for _ in DIMS)})
    for i in todo:
        ints = [int(row[i]) for row in table]
        f = _fit_sum(points, ints, basis, 0)
        if f is None:
            raise TemplateError(f"a number of the graph ({roles[i]}) is no polynomial of the dimensions: {ints[:6]}")
        forms[i] = f
    box = {k: (min(p[k] for p in points), max(p[k] for p in points)) for k in DIMS}
    return GraphTemplate.of_forms(key=structure_key(spec, fields, ones, trace_version), ones=ones, box=box, skeleton=skel0,
                         forms=tuple(f for f in forms if f is not None), traces=len(points),
                         torch_version=torch_version)


def classes(tp_gt1: bool, mha: bool = False) -> list[tuple[str, ...]]:
    """The size-1 classes a planner meets: micro-batch 1, one KV head per rank (under TP), TP 1; for a model of
    one query head per KV head (multi-head attention: `mha`), all of them with g = 1."""
    out = [("tp",), ("mb", "tp")] if not tp_gt1 else [(), ("mb",), ("kl",), ("mb", "kl")]
    return [tuple(k for k in DIMS if k in c or (k == "g" and mha)) for c in out]


def build_shipped(spec: ModelSpec, settings: list[str], out_dir: str, optimizer: str = "adamw",
                  log: Callable[[str], None] = print) -> int:
    """Every structural type of `spec` a search meets (precisions x SP x recompute x size-1 classes) into
    out_dir; a type already there is kept (a rerun builds only what is missing). The number built."""
    from pathlib import Path

    from tp_query.schema.precision import Setting

    from ..graphcache import trace_version
    from ..parallel import ParallelConfig
    from ..request import setting_refusal
    from ..template import structure_key
    from .capture import TraceRequest, trace_config

    built = 0
    for setting in settings:
        # a setting predicted at TP=1 only (torchao float8) has no TP classes (asked under FSDP2, where every
        # setting's data parallelism is modelled: fp32 master weights on PyTorch are FSDP2's)
        tp_refused = bool(setting_refusal(Setting(setting), ParallelConfig(dp=2, tp=2, zero=3)))
        for tp_gt1 in (False,) if tp_refused else (False, True):
            for sp in ((False, True) if tp_gt1 else (False,)):
                for rc in (False, True):
                    for ones in classes(tp_gt1, spec.num_heads == spec.num_kv_heads):
                        fields = {"setting": setting, "sp": sp, "rc": rc, "opt": optimizer, "fw": "torch"}
                        version = trace_version(setting, "torch")
                        key = structure_key(spec, fields, ones, version)
                        path = Path(out_dir) / f"{key}.json.gz"
                        if path.exists():
                            continue

                        def tr(s: ModelSpec, d: dict[str, int], setting: str = setting, sp: bool = sp,
                               rc: bool = rc) -> Graph:
                            return trace_config(TraceRequest(s, Setting(setting), d["mb"], d["seq"], d["tp"],
                                                             sp and d["tp"] > 1, rc, optimizer))
                        try:
                            t = build_template(spec, fields, ones, version, tr)
                        except ValueError as e:  # TemplateError, or the trace refuses the type
                            log(f"{setting} sp={sp} rc={rc} ones={ones}: not templated ({e})")
                            continue
                        t.save(path)
                        built += 1
                        log(f"{setting} sp={sp} rc={rc} ones={ones}: {key} ({len(t.forms)} numbers, {t.traces} traces)")
    return built


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    from tp_query.schema.model_config import parse_config

    ap = argparse.ArgumentParser(description="build the graph templates of a model's structural types")
    ap.add_argument("model", help="a HF config.json")
    ap.add_argument("--precisions", default="amp_bf16,bf16")
    ap.add_argument("--out", default="data/templates")
    a = ap.parse_args(argv)
    with open(a.model) as f:
        spec = parse_config(json.load(f), "model")
    n = build_shipped(spec, a.precisions.split(","), a.out)
    from pathlib import Path

    from ..template import write_index

    print(f"built {n} templates into {a.out}; index of {write_index(Path(a.out))}")


if __name__ == "__main__":
    main()
