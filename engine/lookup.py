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

import atexit
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Protocol

import numpy as np
from tp_query.schema.gpus import GpuSpec
from tp_query.schema.ops import FAMILIES, FEATURE_COLUMNS, CallInfo, Family, FamilySpec, Operands

FLOOR_US = 2.0  # no kernel runs faster than this; keeps the roofline meaningful for tiny ops
LAUNCH_BOUND_US = 4 * FLOOR_US  # a call whose roofline passes this moves enough bytes for bandwidth to tell
LARGE_ROOFLINE_US = 50.0  # calls of this roofline and more (200 MB moved) show a family's large-call efficiency


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
        self.max_roofline_us = max((p.roofline_us for p in self.points), default=0.0)
        d = len(points[0].axes) if points else 0
        self.values = [sorted({p.axes[i] for p in self.points}) for i in range(d)]
        self._log_axes = {p.axes: _logs(p.axes) for p in self.points}
        self._la: np.ndarray | None = None  # log axes and log efficiencies as arrays, for local fits
        self._le: np.ndarray | None = None

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

    # Scattered points between grid corners (power laws: GEMM, attention): a local linear fit of log efficiency
    # against the log axes over the nearest MLS_K points, tricube-weighted by distance, slopes ridged by MLS_RIDGE,
    # the value held within the neighbours' range. Chosen by leave-one-out over the H200 database's own points (a
    # point removed and estimated from the rest): GEMM 8.0% -> 6.4% MAPE, attention 12.5% -> 10.0%, against the
    # inverse-distance blend of the 4 nearest efficiencies that holds them flat (small GEMMs -5% biased).
    MLS_K: ClassVar[int] = 12
    MLS_RIDGE: ClassVar[float] = 0.01

    def local_linear(self, q: tuple[float, ...]) -> tuple[float, float] | None:
        """(cold, warm) efficiency at q from a local linear fit, or None with too few points."""
        n, d = len(self.points), len(q)
        if n < max(self.MLS_K, d + 2):
            return None
        la, le = self._log_arrays()
        x = la - np.array(_logs(q))
        dist = np.sqrt((x * x).sum(axis=1))
        idx = np.argpartition(dist, self.MLS_K - 1)[:self.MLS_K]
        x, dist, y = x[idx], dist[idx], le[idx]
        w = (1.0 - (dist / (1.0001 * max(float(dist.max()), 1e-9))) ** 3) ** 3
        a = np.hstack([np.ones((len(idx), 1)), x])
        reg = self.MLS_RIDGE * np.eye(d + 1)
        reg[0, 0] = 0.0
        try:
            beta = np.linalg.solve(a.T @ (w[:, None] * a) + reg, a.T @ (w[:, None] * y))
        except np.linalg.LinAlgError:
            return None
        e = np.clip(beta[0], y.min(axis=0), y.max(axis=0))
        return float(np.exp(e[0])), float(np.exp(e[1]))

    def _log_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The points' log axes and log efficiencies as arrays (built at the first fit or distance query)."""
        if self._la is None or self._le is None:
            self._la = np.array([self._log_axes[p.axes] for p in self.points])
            self._le = np.log(np.array([[max(p.eff_cold, 1e-12), max(p.eff_warm, 1e-12)] for p in self.points]))
        return self._la, self._le

    def nearest(self, q: tuple[float, ...], k: int) -> list[tuple[float, Point]]:
        lq = _logs(q)
        if self.points and len(lq) < 8:
            # over the array: the same sums in the same order (numpy adds fewer than 8 terms one by one), and a
            # stable sort keeps the first of equally near points as the loop below does
            x = self._log_arrays()[0] - np.array(lq)
            dist = np.sqrt((x * x).sum(axis=1))
            return [(float(dist[i]), self.points[i]) for i in np.argsort(dist, kind="stable")[:k].tolist()]
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
            # past here q is no measured point (a point is its own multilinear corner): every distance is > 0.
            # Inside each axis's range of a scattered (FLOP-capped) grid, a call can still do more work than any
            # point measured: its efficiency is then carried past the data, and said so
            src = Source.INTERPOLATED if roof_q <= self.max_roofline_us * (1 + 1e-9) else Source.EXTRAPOLATED
            local = self.local_linear(q) if self.log_space else None
            if local is not None:
                return roof_q / local[0], roof_q / local[1], src, self.MLS_K
            near = self.nearest(q, 4)
            ws = [1.0 / (d * d) for d, _ in near]
            ec = sum(w * p.eff_cold for w, (_, p) in zip(ws, near, strict=True)) / sum(ws)
            ew = sum(w * p.eff_warm for w, (_, p) in zip(ws, near, strict=True)) / sum(ws)
            return roof_q / ec, roof_q / ew, src, len(near)
        (_, p), = self.nearest(q, 1)
        return roof_q / p.eff_cold, roof_q / p.eff_warm, Source.EXTRAPOLATED, 1


class PointSource(Protocol):
    def exact_all(self) -> dict[str, tuple[float, float | None]]: ...

    def family_rows(self, family: str, columns: list[str]) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class Query:
    key: str
    op: str
    info: CallInfo


def _exact_features(spec: FamilySpec, feats: dict[str, Any]) -> tuple[Any, ...]:
    return spec.exact_key(feats)


def _axes(spec: FamilySpec, feats: dict[str, Any]) -> tuple[float, ...]:
    return tuple(float(max(feats.get(a) or 1, 1)) for a in spec.axes)


def _from_memo(v: Any) -> Estimate | None:
    """A memo entry [cold us, warm us, source, points] as an estimate; None when absent or damaged."""
    if v is None:
        return None
    try:
        return Estimate(float(v[0]), float(v[1]), Source(v[2]), int(v[3]))
    except (TypeError, ValueError, IndexError, KeyError):
        return None


class LatencyModel:
    """Estimates for many calls: the exact table and each family's points are read once (one DuckDB
    query each), then every lookup is in memory."""

    @staticmethod
    def memo_name() -> str:
        """The memo is valid for this database and this code: a change to how calls are described or looked
        up (this module, the operator registry, the call signatures) names another memo."""
        import hashlib
        from pathlib import Path

        from tp_query.schema import gpus, ops, signature

        h = hashlib.blake2b(digest_size=8)
        for f in (__file__, ops.__file__, signature.__file__, gpus.__file__):
            try:
                h.update(Path(str(f)).read_bytes())
            except OSError:
                h.update(str(f).encode())
        return "estimates-" + h.hexdigest()

    def __init__(self, db: PointSource, gpu: GpuSpec) -> None:
        self.db = db
        self.gpu = gpu
        self._cache: dict[str, Estimate] = {}
        self._exact: dict[str, tuple[float, float | None]] | None = None
        self._families: dict[Family, _FamilyPoints] = {}
        self._operands_measured: dict[Operands, bool] = {}
        # estimates are a pure function of the database and the call: an earlier process's answers for this
        # database's fingerprint are reused (a database snapshot keeps them beside its tables)
        self._memo: dict[str, list[Any]] = {}
        self._unsaved = 0
        load = getattr(db, "memo_load", None)
        if load is not None:
            self._memo_name = self.memo_name()
            # entries become estimates when a query asks for them (a process asks for a few hundred of the
            # memo's thousands); a damaged entry is recomputed then
            self._memo = load(self._memo_name)

    MEMO_MAX = 200_000  # entries a memo keeps (a few tens of MB at most)

    def estimate(self, queries: list[Query]) -> dict[str, Estimate]:
        new = 0
        for q in queries:
            if q.key not in self._cache:
                e = _from_memo(self._memo.get(q.key))
                if e is not None:
                    self._cache[q.key] = e
                    continue
                e = self._cache[q.key] = self._resolve(q)
                if len(self._memo) < self.MEMO_MAX or q.key in self._memo:
                    self._memo[q.key] = [e.cold_us, e.warm_us, e.source.value, e.points]
                    new += 1
        if new and getattr(self.db, "memo_store", None) is not None:
            # written once when the process ends (a search resolves calls graph after graph: rewriting the
            # memo each time would cost more than it saves), or whenever many entries are waiting
            if not self._unsaved:
                atexit.register(self.flush_memo)
            self._unsaved += new
            if self._unsaved >= 20_000:
                self.flush_memo()
        return {q.key: self._cache[q.key] for q in queries}

    def flush_memo(self) -> None:
        """Write the memo, merged with what other processes wrote meanwhile (a planner's worker processes each
        flush theirs; an entry is the same in every process: a pure function of this database and this code)."""
        store = getattr(self.db, "memo_store", None)
        if self._unsaved and store is not None:
            load = getattr(self.db, "memo_load", None)
            on_disk = load(self._memo_name) if load is not None else {}
            if on_disk:
                room = max(self.MEMO_MAX - len(self._memo), 0)
                for k, v in on_disk.items():
                    if room <= 0:
                        break
                    if k not in self._memo:
                        self._memo[k] = v
                        room -= 1
            store(self._memo_name, self._memo)
            self._unsaved = 0

    def read_all_families(self) -> None:
        """Read every family's measured points and the exact table now (what a shipped snapshot must hold)."""
        if self._exact is None:
            self._exact = self.db.exact_all()
        for fam in FAMILIES:
            if fam not in (Family.VIEW, Family.HOST) and fam not in self._families:
                self._families[fam] = _FamilyPoints(self.db, fam, self.gpu)

    def measures_operands(self, operands: Operands) -> bool:
        """Whether this database timed any GEMM on `operands` data (NaN, a router's zero rows): a step whose GEMMs
        run on such data is otherwise priced from the random-data points of its shapes."""
        hit = self._operands_measured.get(operands)
        if hit is None:  # once per model: its points do not change
            fam = self._families.get(Family.GEMM)
            if fam is None:
                fam = self._families[Family.GEMM] = _FamilyPoints(self.db, Family.GEMM, self.gpu)
            suffix = f":{operands.value}"
            hit = self._operands_measured[operands] = any(isinstance(x, str) and x.endswith(suffix)
                                                          for key in fam.strict for x in key[4:])
        return hit

    def _resolve(self, q: Query) -> Estimate:
        if q.info.family in (Family.VIEW, Family.HOST):
            return Estimate(0.0, 0.0, Source.NO_KERNEL)
        if self._exact is None:
            self._exact = self.db.exact_all()
        hit = self._exact.get(q.key)
        if hit is not None:
            c, w = hit
            return Estimate(c, w if w is not None else c, Source.EXACT, 1)
        fam = self._families.get(q.info.family)
        if fam is None:
            fam = self._families[q.info.family] = _FamilyPoints(self.db, q.info.family, self.gpu)
        return fam.estimate(q)


class _FamilyPoints:
    """All measured points of one family, grouped into categories on demand."""

    def __init__(self, db: PointSource, fam: Family, gpu: GpuSpec) -> None:
        self.spec = spec = FAMILIES[fam]
        self.gpu = gpu
        stored = [c for c in ("m", "n", "k", *spec.exact) if c in FEATURE_COLUMNS]
        cols = ["op", "precision", "math_mode", "dtypes", "flops", "bytes", "latency_us", "latency_warm_us",
                *spec.axes, *stored]
        rows = db.family_rows(str(fam), list(dict.fromkeys(cols)))
        self.strict: dict[tuple[Any, ...], list[Point]] = defaultdict(list)
        self.loose: dict[tuple[Any, ...], list[Point]] = defaultdict(list)
        self.by_op: dict[tuple[str, str], list[Point]] = defaultdict(list)
        # by operator and whether it touched floating data: an integer op of the same name is index or mask
        # arithmetic (aten.gt.Tensor building a causal mask from broadcast aranges), another kernel class whose
        # time follows its broadcast output, not its inputs; a float call never holds its efficiency, nor back
        self.by_name: dict[tuple[str, bool], list[Point]] = defaultdict(list)
        for r in rows:
            base = (r["op"], r["precision"], r["math_mode"], _category_dtypes(fam, r["dtypes"]))
            pt = Point(_axes(spec, r), float(r["latency_us"]), float(r["latency_warm_us"] or r["latency_us"]),
                       roofline_us(r["flops"], r["bytes"], _prec(r["precision"]), gpu))
            self.strict[base + _exact_features(spec, r)].append(pt)
            self.loose[base].append(pt)
            self.by_op[(r["op"], r["precision"])].append(pt)
            self.by_name[(r["op"], r["precision"] == "int")].append(pt)
        effs = [p.eff_cold for ps in self.loose.values() for p in ps]
        self.default_eff = statistics.median(effs) if effs else 0.5
        # the family's efficiency on large calls (well past the launch floor), by precision and the family-exact
        # features (an elementwise call's layout pattern), and by precision alone: what a category measured only
        # at launch-bound sizes holds when a call is far larger
        large: dict[tuple[Any, ...], list[Point]] = defaultdict(list)
        for key, ps in self.strict.items():
            big = [p for p in ps if p.roofline_us >= LARGE_ROOFLINE_US]
            large[(key[1], *key[4:])] += big
            large[(key[1],)] += big
        self.large_eff = {k: (statistics.median(p.eff_cold for p in ps), statistics.median(p.eff_warm for p in ps))
                          for k, ps in large.items() if len(ps) >= 5}
        self._cats: dict[tuple[Any, ...], Category] = {}
        self._slowdowns: dict[tuple[Any, ...], Category] = {}

    def _category(self, key: tuple[Any, ...], pts: list[Point]) -> Category:
        cat = self._cats.get(key)
        if cat is None:
            cat = self._cats[key] = Category(pts, self.spec.log_space)
        return cat

    def estimate(self, q: Query) -> Estimate:
        """The call's time from this family's points, never faster than the GPU's datasheet compute peak for its
        FLOPs (the achievable rates are no bound: measured fp16 GEMMs pass them at full clock; nor would a bound
        on bytes hold: the byte counts follow a copy's read + write, and fills or reductions move up to twice
        that rate)."""
        est = self._estimate(q)
        peaks = self.gpu.datasheet_flops or self.gpu.peak_flops
        flops_us = q.info.flops / peaks.get(q.info.precision, min(peaks.values())) * 1e6
        if est.cold_us >= flops_us and est.warm_us >= flops_us:
            return est
        return Estimate(max(est.cold_us, flops_us), max(est.warm_us, flops_us), est.source, est.points)

    def _estimate(self, q: Query) -> Estimate:
        spec = self.spec
        base = (q.op, str(q.info.precision), q.info.math_mode, _category_dtypes(self.spec.family, q.info.dtypes))
        sk = base + _exact_features(spec, q.info.features)
        roof = roofline_us(q.info.flops, q.info.bytes, q.info.precision, self.gpu)
        ax = _axes(spec, q.info.features)
        if sk in self.strict:
            cat = self._category(("s", *sk), self.strict[sk])
            c, w, src, n = cat.estimate(ax, roof)
            if src != Source.EXTRAPOLATED:
                return Estimate(c, w, src, n)
            sib = self._half_sibling(sk, ax, roof)
            if sib is not None:
                return sib
            eff = self.large_eff.get((sk[1], *sk[4:])) or self.large_eff.get((sk[1],))
            if (eff is not None and cat.max_roofline_us <= FLOOR_US and roof >= LAUNCH_BOUND_US
                    and self._bandwidth_bound(q)):
                # every point of the category sits at the launch floor (2k-8k elements: 1-2 us, an "efficiency"
                # above 1 against bytes they barely move): held at a call of hundreds of MB it read 7 TB/s on
                # a 4.3 TB/s GPU (sigmoid over 268 MB: 52 us, measured 82). A far larger bandwidth-bound call
                # moves its bytes as the family's large calls do
                return Estimate(roof / eff[0], roof / eff[1], Source.EXTRAPOLATED, n)
            return Estimate(c, w, src, n)
        sib = self._half_sibling(sk, ax, roof)
        if sib is not None:
            return sib
        if base in self.loose and roof > 0 and spec.family in TRANSFER_FAMILIES:
            moved = self._transferred(base, sk[len(base):], ax)
            if moved is not None:
                c, w, n = moved
                return Estimate(roof * c, roof * w, Source.EXTRAPOLATED, n)
        if base in self.loose and roof > 0:
            # same operator and dtypes, other family-exact features (a causal mask, a layout, another head size):
            # their work differs, so what carries over is the efficiency against each one's own roofline, held
            # at these axes, and said so
            c, w, n = self._held_efficiency(("l", *base), self.loose[base], ax)
            return Estimate(roof * c, roof * w, Source.EXTRAPOLATED, n)
        pk = (q.op, str(q.info.precision))
        if pk in self.by_op:  # same operator in other dtypes
            c, w, _, n = self._category(("o", *pk), self.by_op[pk]).estimate(ax, roof)
            return Estimate(c, w, Source.EXTRAPOLATED, n)
        nk = (q.op, str(q.info.precision) == "int")
        if nk in self.by_name and roof > 0 and self._bandwidth_bound(q):
            # the same operator in another precision: its efficiency against its own roofline, held at these
            # axes (a memory-bound kernel moves bytes about as well in fp32 as in bf16). Not a compute-bound one:
            # fp32's efficiency against CUDA cores says nothing of a half-precision kernel's against tensor cores
            # (bf16 memory-efficient attention at head size 512 came out 4x fast from fp32's points): a miss
            c, w, n = self._held_efficiency(("n", *nk), self.by_name[nk], ax)
            if n:
                return Estimate(roof * c, roof * w, Source.EXTRAPOLATED, n)
        return Estimate(roof / self.default_eff, roof / self.default_eff, Source.MISS, 0)

    def _bandwidth_bound(self, q: Query) -> bool:
        """Whether the call's bytes, not its FLOPs, set its roofline (what an efficiency may carry across kernels)."""
        peak = self.gpu.peak_flops.get(q.info.precision, min(self.gpu.peak_flops.values()))
        return q.info.bytes / self.gpu.hbm_bytes_per_s >= q.info.flops / peak

    def _half_sibling(self, sk: tuple[Any, ...], ax: tuple[float, ...], roof: float) -> Estimate | None:
        """A half-precision call whose own category is missing or ends before these axes, from the other half
        precision's category where that one brackets them: fp16 and bf16 run on the same tensor cores and move
        the same bytes (the H200's measured pairs agree within a few percent: masked cuDNN attention with dropout
        within 1%), which says more than a held efficiency or a feature borrowed across categories (fp16's
        sliding-window attention at head size 256 was priced 31% fast that way, its 262k-vocab LM head 12-19%)."""
        other = _HALF_SIBLING.get(sk[1])
        if other is None or self.spec.family not in HALF_SIBLING_FAMILIES:
            return None
        mine = sk[1]
        twin = (sk[0], other, sk[2], ",".join(other if d == mine else d for d in str(sk[3]).split(",")), *sk[4:])
        if twin not in self.strict:
            return None
        c, w, src, n = self._category(("s", *twin), self.strict[twin]).estimate(ax, roof)
        if src == Source.EXTRAPOLATED:
            return None
        return Estimate(c, w, Source.EXTRAPOLATED, n)

    MAX_FLIPS: ClassVar[int] = 2

    def _transferred(self, base: tuple[Any, ...], want: tuple[Any, ...], ax: tuple[float, ...]
                     ) -> tuple[float, float, int] | None:
        """Time over roofline (cold, warm) at these axes from the measured categories nearest the query's (fewest
        family-exact features differing), each feature's change applied as the median ratio it makes between pairs
        of measured categories that differ in that feature alone. Pooling every category of the operator instead
        read cuDNN attention with dropout and a sliding-window mask (no such point) at the median efficiency of
        causal, unmasked kernels: 0.76x the same call without dropout, where the H200 runs it 2.2x slower."""
        nb = len(base)
        keys = [k[nb:] for k in self.strict if k[:nb] == base]
        have = set(keys)

        def held(x: tuple[Any, ...]) -> tuple[float, float] | None:
            c, w, n = self._held_efficiency(("t", *base, *x), self.strict[base + x], ax)
            return (c, w) if n and c > 0 and w > 0 else None

        def ratio(i: int, a: Any, b: Any) -> tuple[float, float] | None:
            rs = []
            for x in keys:
                y = (*x[:i], b, *x[i + 1:])
                if x[i] != a or y not in have:
                    continue
                hx, hy = held(x), held(y)
                if hx is not None and hy is not None:
                    rs.append((hy[0] / hx[0], hy[1] / hx[1]))
            if not rs:
                return None
            return statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)

        by_flips: dict[int, list[tuple[tuple[Any, ...], list[int]]]] = defaultdict(list)
        for x in keys:
            diff = [i for i, (u, v) in enumerate(zip(x, want, strict=True)) if u != v]
            if 0 < len(diff) <= self.MAX_FLIPS:
                by_flips[len(diff)].append((x, diff))
        for flips in sorted(by_flips):
            logs: list[tuple[float, float]] = []
            for x, diff in by_flips[flips]:
                h = held(x)
                if h is None:
                    continue
                c, w = h
                for i in diff:
                    r = ratio(i, x[i], want[i])
                    if r is None:
                        break
                    c, w = c * r[0], w * r[1]
                else:
                    logs.append((math.log(c), math.log(w)))
            if logs:  # geometric mean over the nearest categories
                return (math.exp(statistics.fmean(v[0] for v in logs)),
                        math.exp(statistics.fmean(v[1] for v in logs)), len(logs))
        return None

    def _held_efficiency(self, key: tuple[Any, ...], pts: list[Point], ax: tuple[float, ...]
                         ) -> tuple[float, float, int]:
        """Time over roofline (cold, warm) blended at these axes from points of other categories: multiply by a
        query's own roofline."""
        slow = self._slowdowns.get(key)
        if slow is None:
            slow = self._slowdowns[key] = Category(
                [Point(p.axes, p.cold_us / p.roofline_us, p.warm_us / p.roofline_us, 1.0)
                 for p in pts if p.roofline_us > 0], self.spec.log_space)
        if not slow.points:
            return 0.0, 0.0, 0
        c, w, _, n = slow.estimate(ax, 1.0)
        return c, w, n


_HALF_SIBLING = {"fp16": "bf16", "bf16": "fp16"}  # precisions of the same tensor-core and memory throughput
# tensor-core families only: the elementwise families' points differ between the two by layout and stride variants
# that the category does not key (fp16 silu over 4096 x 14336 would take bf16's 160 us, three times its bytes' time)
HALF_SIBLING_FAMILIES = frozenset({Family.GEMM, Family.ATTENTION})

# families whose missing categories borrow from their nearest measured ones, feature by feature (categorical features
# that change the kernel's work: dropout, a mask, causality), rather than from the pool of all the operator's points
TRANSFER_FAMILIES = frozenset({Family.ATTENTION})


def _category_dtypes(fam: Family, dtypes: str | None) -> str:
    """The dtypes that set a category: an attention call's int64 scalars are its RNG seed and offset, host tensors
    in a traced step and device tensors where the collector's forward made them; they carry no work (the grid's
    attention backward points were unreachable from traced calls before this, 2026-12-01). Its int32 tensors are
    cuDNN's and flash's cumulative sequence lengths, empty for dense inputs: the grid's cuDNN backward calls pass
    them, torch's traced ones pass None, and every grid point (its dropout points among them) was out of reach."""
    d = str(dtypes or "")
    if fam == Family.ATTENTION:
        return ",".join(x for x in d.split(",") if x not in ("i64", "i32"))
    return d


def _prec(s: str) -> Any:
    from tp_query.schema.precision import Precision

    return Precision(s)
