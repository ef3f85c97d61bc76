"""Operator latency from the database: exact hit, bracket-and-blend, roofline hold, structured miss.

The fixed fallback order of NVIDIA aiconfigurator's interpolation:
1. exact: the call's key was measured;
2. interpolated: the query lies inside its category's grid (same operator, precision, dtypes and the
   family's exact features); log-latency is blended multilinearly in the log of the family's axes
   (for GEMMs this equals blending utilisation against the roofline); where grid corners are missing
   the roofline efficiency of the nearest points is blended instead;
3. extrapolated: outside the grid (or only a relaxed category has points), the efficiency of the
   nearest point is held against the roofline;
4. miss: nothing comparable measured; the roofline with the family's median efficiency (or 50%).
Every estimate carries its source; the prediction reports the share of time from each.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from tp_query.schema.gpus import GpuSpec
from tp_query.schema.ops import FAMILIES, FEATURE_COLUMNS, CallInfo, Family, FamilySpec

FLOOR_US = 2.0  # no kernel runs faster than this; keeps the roofline meaningful for tiny ops


class Source(StrEnum):
    EXACT = "exact"
    INTERPOLATED = "interpolated"
    EXTRAPOLATED = "extrapolated"
    MISS = "miss"
    NO_KERNEL = "no-kernel"  # views, host-side ops: no GPU time by construction
    COMM_MEASURED = "comm-measured"
    COMM_MODEL = "comm-model"


@dataclass(frozen=True)
class Estimate:
    cold_us: float  # L2 flushed
    warm_us: float  # back to back
    source: Source
    points: int = 0

    def blend(self, beta: float) -> float:
        """GPU time in a training step: between warm (beta 0) and cold (beta 1)."""
        return self.warm_us + beta * (self.cold_us - self.warm_us)


def roofline_us(flops: float, nbytes: float, precision: Any, gpu: GpuSpec) -> float:
    peak = gpu.peak_flops.get(precision, min(gpu.peak_flops.values()))
    return max(flops / peak * 1e6, nbytes / gpu.hbm_bytes_per_s * 1e6, FLOOR_US)


@dataclass(frozen=True)
class Point:
    """One measured row of a category."""

    axes: tuple[float, ...]
    cold_us: float
    warm_us: float
    roofline_us: float

    @property
    def eff_cold(self) -> float:
        return self.roofline_us / self.cold_us

    @property
    def eff_warm(self) -> float:
        return self.roofline_us / self.warm_us


def _logs(v: Iterable[float]) -> tuple[float, ...]:
    return tuple(math.log(max(x, 1e-9)) for x in v)


class Category:
    """The points of one category, indexed for interpolation (in log or linear space)."""

    def __init__(self, points: list[Point], log_space: bool = True) -> None:
        self.log_space = log_space
        by: dict[tuple[float, ...], list[Point]] = defaultdict(list)
        for p in points:
            by[p.axes].append(p)
        self.grid: dict[tuple[float, ...], Point] = {}
        for ax, ps in by.items():
            self.grid[ax] = Point(ax, statistics.median(p.cold_us for p in ps),
                                  statistics.median(p.warm_us for p in ps), ps[0].roofline_us)
        self.points = list(self.grid.values())
        d = len(points[0].axes) if points else 0
        self.values = [sorted({p.axes[i] for p in self.points}) for i in range(d)]
        self._log_axes = {p.axes: _logs(p.axes) for p in self.points}

    def inside(self, q: tuple[float, ...]) -> bool:
        return all(vals[0] <= x <= vals[-1] for x, vals in zip(q, self.values, strict=True))

    def multilinear(self, q: tuple[float, ...]) -> tuple[float, float] | None:
        brackets = []
        for x, vals in zip(q, self.values, strict=True):
            lo = max((v for v in vals if v <= x), default=None)
            hi = min((v for v in vals if v >= x), default=None)
            if lo is None or hi is None:
                return None
            if hi == lo:
                w = 0.0
            elif self.log_space:
                w = (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
            else:
                w = (x - lo) / (hi - lo)
            brackets.append(((lo, 1.0 - w), (hi, w)) if hi != lo else ((lo, 1.0),))
        cold = warm = 0.0
        total = 0.0
        corners: list[tuple[tuple[float, ...], float]] = [((), 1.0)]
        for br in brackets:
            corners = [((*c, v), wt * w) for c, wt in corners for v, w in br]
        f = math.log if self.log_space else (lambda v: v)
        for c, wt in corners:
            p = self.grid.get(c)
            if p is None:
                return None
            if wt == 0.0:
                continue
            cold += wt * f(p.cold_us)
            warm += wt * f(p.warm_us)
            total += wt
        if self.log_space:
            return math.exp(cold / total), math.exp(warm / total)
        return cold / total, warm / total

    def nearest(self, q: tuple[float, ...], k: int) -> list[tuple[float, Point]]:
        lq = _logs(q)
        ds = []
        for p in self.points:
            la = self._log_axes[p.axes]
            ds.append((math.sqrt(sum((a - b) ** 2 for a, b in zip(la, lq, strict=True))), p))
        ds.sort(key=lambda t: t[0])
        return ds[:k]

    def estimate(self, q: tuple[float, ...], roof_q: float) -> tuple[float, float, Source, int]:
        if self.inside(q):
            ml = self.multilinear(q)
            if ml is not None:
                return ml[0], ml[1], Source.INTERPOLATED, 2 ** len(q)
            near = self.nearest(q, 4)
            if near and near[0][0] == 0.0:
                p = near[0][1]
                return p.cold_us, p.warm_us, Source.INTERPOLATED, 1
            ws = [1.0 / (d * d) for d, _ in near]
            ec = sum(w * p.eff_cold for w, (_, p) in zip(ws, near, strict=True)) / sum(ws)
            ew = sum(w * p.eff_warm for w, (_, p) in zip(ws, near, strict=True)) / sum(ws)
            return roof_q / ec, roof_q / ew, Source.INTERPOLATED, len(near)
        (_, p), = self.nearest(q, 1)
        return roof_q / p.eff_cold, roof_q / p.eff_warm, Source.EXTRAPOLATED, 1


class PointSource(Protocol):
    def exact(self, keys: list[str]) -> dict[str, tuple[float, float | None]]: ...

    def family_points(self, family: str, categories: list[tuple[str, str, str, str]], columns: list[str]) -> Any: ...

    def op_family_points(self, family: str, ops: list[tuple[str, str]], columns: list[str]) -> Any: ...


@dataclass(frozen=True)
class Query:
    key: str
    op: str
    info: CallInfo


def _exact_features(spec: FamilySpec, feats: dict[str, Any]) -> tuple[Any, ...]:
    return spec.exact_key(feats)


def _axes(spec: FamilySpec, feats: dict[str, Any]) -> tuple[float, ...]:
    return tuple(float(max(feats.get(a) or 1, 1)) for a in spec.axes)


class LatencyModel:
    """Estimates for many calls at once: one exact query, then one query per family."""

    def __init__(self, db: PointSource, gpu: GpuSpec) -> None:
        self.db = db
        self.gpu = gpu
        self._cache: dict[str, Estimate] = {}

    def estimate(self, queries: list[Query]) -> dict[str, Estimate]:
        todo = {q.key: q for q in queries if q.key not in self._cache}
        if todo:
            self._cache.update(self._resolve(list(todo.values())))
        return {q.key: self._cache[q.key] for q in queries}

    def _resolve(self, queries: list[Query]) -> dict[str, Estimate]:
        out: dict[str, Estimate] = {}
        rest: list[Query] = []
        for q in queries:
            if q.info.family in (Family.VIEW, Family.HOST):
                out[q.key] = Estimate(0.0, 0.0, Source.NO_KERNEL)
            else:
                rest.append(q)
        hits = self.db.exact([q.key for q in rest])
        missing: dict[Family, list[Query]] = defaultdict(list)
        for q in rest:
            if q.key in hits:
                c, w = hits[q.key]
                out[q.key] = Estimate(c, w if w is not None else c, Source.EXACT, 1)
            else:
                missing[q.info.family].append(q)
        for fam, qs in missing.items():
            out.update(self._family(fam, qs))
        return out

    def _family(self, fam: Family, qs: list[Query]) -> dict[str, Estimate]:
        spec = FAMILIES[fam]
        stored = [c for c in ("m", "n", "k", *spec.exact) if c in FEATURE_COLUMNS]
        cols = ["op", "precision", "math_mode", "dtypes", "flops", "bytes", "latency_us", "latency_warm_us",
                *spec.axes, *stored]
        cats = sorted({(q.op, str(q.info.precision), q.info.math_mode, q.info.dtypes) for q in qs})
        table = self.db.family_points(str(fam), cats, list(dict.fromkeys(cols)))
        rows = table.to_pylist() if hasattr(table, "to_pylist") else list(table)
        strict: dict[tuple[Any, ...], list[Point]] = defaultdict(list)
        loose: dict[tuple[Any, ...], list[Point]] = defaultdict(list)
        for r in rows:
            base = (r["op"], r["precision"], r["math_mode"], r["dtypes"])
            pt = Point(_axes(spec, r), float(r["latency_us"]), float(r["latency_warm_us"] or r["latency_us"]),
                       roofline_us(r["flops"], r["bytes"], _prec(r["precision"]), self.gpu))
            strict[base + _exact_features(spec, r)].append(pt)
            loose[base].append(pt)
        cache: dict[tuple[Any, ...], Category] = {}
        out: dict[str, Estimate] = {}
        unresolved: list[Query] = []
        for q in qs:
            base = (q.op, str(q.info.precision), q.info.math_mode, q.info.dtypes)
            sk = base + _exact_features(spec, q.info.features)
            roof = roofline_us(q.info.flops, q.info.bytes, q.info.precision, self.gpu)
            ax = _axes(spec, q.info.features)
            if sk in strict:
                cat = cache.setdefault(sk, Category(strict[sk], spec.log_space))
                c, w, src, n = cat.estimate(ax, roof)
                out[q.key] = Estimate(c, w, src, n)
            elif base in loose:
                cat = cache.setdefault(base, Category(loose[base], spec.log_space))
                c, w, _, n = cat.estimate(ax, roof)
                out[q.key] = Estimate(c, w, Source.EXTRAPOLATED, n)
            else:
                unresolved.append(q)
        if unresolved:
            out.update(self._relaxed(fam, spec, unresolved))
        return out

    def _relaxed(self, fam: Family, spec: FamilySpec, qs: list[Query]) -> dict[str, Estimate]:
        """Same operator and precision in any dtype mix, else the family's median efficiency."""
        cols = ["op", "precision", "flops", "bytes", "latency_us", "latency_warm_us", *spec.axes]
        pairs = sorted({(q.op, str(q.info.precision)) for q in qs})
        rows = self.db.op_family_points(str(fam), pairs, list(dict.fromkeys(cols)))
        rows = rows.to_pylist() if hasattr(rows, "to_pylist") else list(rows)
        by: dict[tuple[str, str], list[Point]] = defaultdict(list)
        for r in rows:
            by[(r["op"], r["precision"])].append(
                Point(_axes(spec, r), float(r["latency_us"]), float(r["latency_warm_us"] or r["latency_us"]),
                      roofline_us(r["flops"], r["bytes"], _prec(r["precision"]), self.gpu)))
        fam_eff = [p.eff_cold for ps in by.values() for p in ps]
        default_eff = statistics.median(fam_eff) if fam_eff else 0.5
        out: dict[str, Estimate] = {}
        for q in qs:
            roof = roofline_us(q.info.flops, q.info.bytes, q.info.precision, self.gpu)
            pts = by.get((q.op, str(q.info.precision)))
            if pts:
                c, w, _, n = Category(pts, spec.log_space).estimate(_axes(spec, q.info.features), roof)
                out[q.key] = Estimate(c, w, Source.EXTRAPOLATED, n)
            else:
                out[q.key] = Estimate(roof / default_eff, roof / default_eff, Source.MISS, 0)
        return out


def _prec(s: str) -> Any:
    from tp_query.schema.precision import Precision

    return Precision(s)
