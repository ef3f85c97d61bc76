"""Host and GPU as two queues: where eager PyTorch leaves the GPU idle.

The host issues operators one after another (a per-operator cost that depends on the phase: Python
modules in forward, the C++ autograd engine in backward, the optimizer's multi-tensor bookkeeping);
the GPU runs each as soon as it is issued and the previous one finished. A synchronising operator
(`.item()`, `bool(tensor)`) makes the host wait for the GPU to drain. Sum of kernel times is a lower
bound; this gives the idle time between kernels, calibrated from measured iterations.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tp_query.schema.messages import TpQueryError


class CalibrationError(TpQueryError):
    """A calibration file that cannot be used (one line for the user)."""


# What a calibration may hold besides the constants: where it was fitted.
CALIBRATION_NOTES = frozenset({"fitted_on_cases", "split"})
# Physical ceilings of each host cost (us): the fit's own bounds (engine.validation) for the fitted ones, and
# far above any eager operator's host cost for the per-operator ones.
CALIBRATION_MAX_US = {"fwd_us": 1000.0, "bwd_us": 1000.0, "opt_us": 1000.0, "fwd_view_us": 1000.0,
                      "bwd_view_us": 1000.0, "fwd_layer_us": 100000.0, "per_tensor_us": 20.0,
                      "per_iteration_us": 5000.0}


@dataclass(frozen=True)
class HostModel:
    """Per-operator host costs in microseconds (fitted by `tp-query calibrate`)."""

    fwd_us: float = 12.0  # an operator that launches a kernel
    bwd_us: float = 6.0
    opt_us: float = 15.0
    fwd_view_us: float = 12.0  # one that launches none (a view, an allocation): less dispatch, no launch
    bwd_view_us: float = 6.0
    fwd_layer_us: float = 0.0  # once per decoder layer's forward beyond its operators: its modules' Python
    per_tensor_us: float = 1.0  # per tensor in a multi-tensor (foreach) call
    per_iteration_us: float = 300.0
    beta: float = 0.5  # GPU time = warm + beta * (cold - warm)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def load(path: Path) -> HostModel:
        """A calibration file, validated: every constant present, a finite number, >= 0 (beta <= 1)."""
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CalibrationError(f"unreadable calibration {path}: {e}") from None
        return HostModel.from_dict(d, str(path))

    @staticmethod
    def from_dict(d: object, where: str) -> HostModel:
        if not isinstance(d, dict):
            raise CalibrationError(f"calibration {where} is not a JSON object")
        vals: dict[str, float] = {}
        unknown = sorted(set(d) - set(HostModel.__dataclass_fields__) - CALIBRATION_NOTES)
        if unknown:  # a misspelt constant would leave its default in force without a word
            raise CalibrationError(f"calibration {where}: unknown key {unknown[0]!r} (constants: "
                                   f"{', '.join(HostModel.__dataclass_fields__)})")
        # a calibration written before views were told apart charges them as the other operators
        # and one written before the forward's module Python was told apart charges none per layer
        d = {"fwd_view_us": d.get("fwd_us"), "bwd_view_us": d.get("bwd_us"), "fwd_layer_us": 0.0, **d}
        for k in HostModel.__dataclass_fields__:
            v = d.get(k)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise CalibrationError(f"calibration {where}: {k} must be a finite number >= 0, got {v!r}")
            if k == "beta" and v > 1:
                raise CalibrationError(f"calibration {where}: beta must be within [0, 1], got {v!r}")
            top = CALIBRATION_MAX_US.get(k)
            if top is not None and v > top:
                raise CalibrationError(f"calibration {where}: {k} must be within [0, {top:g}] us (a host cost per "
                                       f"operator, tensor or iteration), got {v!r}")
            vals[k] = float(v)
        return HostModel(**vals)


@dataclass(frozen=True)
class SimResult:
    elapsed_us: float
    gpu_us: float

    @property
    def idle_us(self) -> float:
        return max(self.elapsed_us - self.gpu_us, 0.0)


def _stretches(sync: np.ndarray) -> list[tuple[int, int]]:
    """The runs of operators between synchronising ones: each starts at a sync (or at 0) and ends before the next."""
    bounds = [0, *[int(c) for c in np.flatnonzero(sync) if c > 0], len(sync)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if a < b]


def simulate(gpu_us: np.ndarray, host_us: np.ndarray, sync: np.ndarray) -> SimResult:
    """Elapsed time from an empty queue to the end of both host and GPU work.

    Within a stretch without synchronisation, with G the cumulative GPU time and C the host issue
    times, the GPU finishes op i at G_i + max(start, max_j<=i (C_j - G_{j-1})) (a max-plus scan)."""
    if len(gpu_us) == 0:
        return SimResult(0.0, 0.0)
    cpu = 0.0
    gpu_end = 0.0
    for a, b in _stretches(sync):
        if sync[a]:
            cpu = max(cpu, gpu_end)
        g = gpu_us[a:b]
        c = cpu + np.cumsum(host_us[a:b])
        G = np.cumsum(g)
        A = c - (G - g)
        ends = G + np.maximum(gpu_end, np.maximum.accumulate(A))
        gpu_end = float(ends[-1])
        cpu = float(c[-1])
    return SimResult(max(gpu_end, cpu), float(gpu_us.sum()))


# -- the same simulation as a map: a stage of n identical layers without replaying them ---------------------------
# Within a stretch without synchronisation the end state (host clock c, GPU end g) is max-plus linear in the start
# state: c' = c + H, g' = max(g + G, c + M), with H the stretch's host time, G its GPU time and
# M = max_k (H_k - G_{k-1}) + G (the max-plus scan of `simulate`); a sync makes c' = max(c, g). So a run of
# operators is a 2 x 2 max-plus matrix, a concatenation is their product and n copies of a layer its n-th power:
# the result equals `simulate` on the concatenated arrays (to float rounding).

NEG = float("-inf")
HostMap = tuple[float, float, float, float]  # (c<-c, c<-g, g<-c, g<-g)
IDENTITY: HostMap = (0.0, NEG, NEG, 0.0)
_SYNC: HostMap = (0.0, 0.0, NEG, 0.0)


def compose(b: HostMap, a: HostMap) -> HostMap:
    """The map of `a` followed by `b`."""
    return (max(b[0] + a[0], b[1] + a[2]), max(b[0] + a[1], b[1] + a[3]),
            max(b[2] + a[0], b[3] + a[2]), max(b[2] + a[1], b[3] + a[3]))


def power(a: HostMap, n: int) -> HostMap:
    out, sq = IDENTITY, a
    while n > 0:
        if n & 1:
            out = compose(sq, out)
        n >>= 1
        if n:
            sq = compose(sq, sq)
    return out


def host_map(gpu_us: np.ndarray, host_us: np.ndarray, sync: np.ndarray) -> HostMap:
    """The map of a run of operators (the stretches between synchronising operators, as `simulate` cuts them)."""
    out = IDENTITY
    for a, b in _stretches(sync):
        if sync[a]:
            out = compose(_SYNC, out)
        g = gpu_us[a:b]
        h = np.cumsum(host_us[a:b])
        G = np.cumsum(g)
        m = float(np.max(h - (G - g))) + float(G[-1])
        out = compose((float(h[-1]), NEG, m, float(G[-1])), out)
    return out


def elapsed_us(m: HostMap) -> float:
    """The end of host and GPU work from an empty queue (both clocks at 0)."""
    return max(m[0], m[1], m[2], m[3])


class ShiftedHostMap:
    """`host_map(gpu_us, host_us + delta, sync)` for any delta >= 0 without the arrays: a framework's extra host
    cost spread evenly over a stage's operators shifts every host cost by the same delta, which differs per stage
    layout. Within a stretch the GPU end is max_k (C_k + (k + 1) delta) + G, with C_k = H_k - G_{k-1} the
    unshifted scan: the upper envelope of lines of increasing slope. The first read takes the lines
    directly (one vectorised maximum); from the HULL_AFTER-th read on the envelope is kept (their hull) and read by
    bisection, as a planner asks one section for many deltas. Either equals host_map to float rounding (the
    sums are associated differently): each line's value is the same float sum, the hull picks a line by
    breakpoints computed in floats."""

    __slots__ = ("_asked", "_hulls", "_stretches")
    HULL_AFTER = 2  # a prediction reads most maps once; a planner reads one map for many deltas

    def __init__(self, gpu_us: np.ndarray, host_us: np.ndarray, sync: np.ndarray) -> None:
        out = []
        for a, b in _stretches(sync):
            g = gpu_us[a:b]
            h = np.cumsum(host_us[a:b])
            gc = np.cumsum(g)
            out.append((bool(sync[a]), float(h[-1]), len(g), float(gc[-1]), h - (gc - g)))
        self._stretches = out
        self._asked = 0
        self._hulls: list[tuple[list[float], list[tuple[int, float]]]] | None = None

    def at(self, delta: float) -> HostMap:
        self._asked += 1
        if self._hulls is None and self._asked >= self.HULL_AFTER:
            self._hulls = []
            for *_, intercepts in self._stretches:
                lines = _upper_hull(intercepts.tolist())
                self._hulls.append(([(c0 - c1) / (s1 - s0) for (s0, c0), (s1, c1) in itertools.pairwise(lines)],
                                    lines))
        out = IDENTITY
        for i, (synced, h_end, n, g_end, intercepts) in enumerate(self._stretches):
            if synced:
                out = compose(_SYNC, out)
            if self._hulls is not None:
                breaks, lines = self._hulls[i]
                s, c = lines[bisect.bisect_right(breaks, delta)]
                top = c + s * delta
            else:
                top = float(np.max(intercepts + np.arange(1, n + 1) * delta))
            out = compose((h_end + n * delta, NEG, top + g_end, g_end), out)
        return out


def _upper_hull(intercepts: list[float]) -> list[tuple[int, float]]:
    """The lines y = intercepts[k] + (k + 1) x that are the maximum somewhere, in order of slope (the convex hull
    trick: a line leaves when the next one overtakes its predecessor no later than it did)."""
    hull: list[tuple[int, float]] = []
    for k, c in enumerate(intercepts):
        line = (k + 1, c)
        while len(hull) >= 2:
            (s0, c0), (s1, c1) = hull[-2], hull[-1]
            # x where line overtakes hull[-2] <= x where hull[-1] did: hull[-1] is never the maximum
            if (c0 - c) * (s1 - s0) <= (c0 - c1) * (line[0] - s0):
                hull.pop()
            else:
                break
        hull.append(line)
    return hull
