"""Communication time: measured NCCL tables when the database has them, else a ring model built on them.

Ring algorithms: all-reduce moves 2(n-1)/n of the message per rank, all-gather and reduce-scatter
(n-1)/n of the full tensor, send/recv the message once (nccl-tests' bus bandwidth). A ring's bus bandwidth
does not depend on its rank count, only on its slowest link, so:
- inside one node, a rank count the tables do not hold is the nearest measured count's time scaled by the
  ratio of bus factors (its measured efficiency kept; NVLink's datasheet figure only without tables);
- a group spread over nodes, k of its ranks on each, crosses nodes through k NICs at once (one per GPU:
  NCCL's rings each take their own rail), so its bus bandwidth is the lesser of the node's measured
  NVLink ring and k NICs; k = 1 (one rank per node, e.g. DP across nodes with TP filling each) is one NIC.
NVLink SHARP (NVLS) and in-network reduction are not modelled: the tables were measured without them.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass
from typing import Any

from tp_query.schema.gpus import GpuSpec, bus_factor
from tp_query.schema.system import SystemSpec

from .lookup import Source

GPUS_PER_HOST = 8


@dataclass(frozen=True)
class CommEstimate:
    us: float
    source: Source
    link: str


class CommModel:
    def __init__(self, gpu: GpuSpec, table: list[dict[str, Any]] | None = None,
                 system: SystemSpec | None = None) -> None:
        """Link figures from the system file when given, else the GPU's own (one node of GPUS_PER_HOST)."""
        self.gpu = gpu
        self.gpus_per_node = system.gpus_per_node if system else GPUS_PER_HOST
        self.nvlink = (system.nvlink_bytes_per_s, system.nvlink_latency_s) if system else \
            (gpu.nvlink_bytes_per_s, gpu.nvlink_latency_s)
        self.network = (system.network_bytes_per_s, system.network_latency_s) if system else \
            (gpu.ib_bytes_per_s, gpu.ib_latency_s)
        by: dict[tuple[str, int], dict[float, list[float]]] = {}
        for r in table or []:
            if r.get("status") == "ok" and r.get("latency_us"):
                # The campaign records each rank's input buffer; an all-gather is looked up by the size of
                # the gathered tensor (what the graph records), ranks times larger.
                nbytes = float(r["bytes"]) * (int(r["ranks"]) if r["collective"] == "all_gather" else 1)
                by.setdefault((r["collective"], int(r["ranks"])), {}).setdefault(nbytes, []).append(
                    float(r["latency_us"]))
        # one point per message size (the median over dtypes: bandwidth-bound collectives barely care)
        self.table: dict[tuple[str, int], list[tuple[float, float]]] = {
            k: sorted((b, statistics.median(ts)) for b, ts in v.items()) for k, v in by.items()}
        self._memo: dict[tuple[str, float, int, int], CommEstimate] = {}

    def largest_bytes(self, collective: str) -> float:
        """The largest message a measured table of this collective holds (0 without one)."""
        return max((pts[-1][0] for (c, _), pts in self.table.items() if c == collective and pts), default=0.0)

    def per_node(self, ranks: int, stride: int = 1) -> int:
        """How many ranks of a group share a node when its ranks are `stride` apart in the launch order (a DP
        group's ranks are TP ranks apart: TP is the innermost dimension of torch's meshes and Megatron's)."""
        return max(1, min(ranks, self.gpus_per_node // max(1, stride)))

    def link(self, ranks: int, per_node: int | None = None) -> str:
        k = ranks if per_node is None else per_node
        return "nvlink" if k >= ranks and ranks <= self.gpus_per_node else "network"

    def estimate(self, collective: str, nbytes: float, ranks: int, per_node: int | None = None) -> CommEstimate:
        """A collective's time over `ranks` ranks, `per_node` of them on each node (None: all on one node where
        they fit); answers kept (a planner and a prediction's host range ask the same ones again)."""
        k = min(ranks, self.gpus_per_node) if per_node is None else max(1, min(per_node, ranks, self.gpus_per_node))
        key = (collective, nbytes, ranks, k)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._estimate(collective, nbytes, ranks, k)
        return hit

    def _nearest_measured(self, collective: str, ranks: int) -> tuple[int, list[tuple[float, float]]] | None:
        """The measured rank count a ring of `ranks` is scaled from: the largest at most `ranks`, else the
        smallest (tables with at least two sizes)."""
        have = sorted(r for (c, r), pts in self.table.items() if c == collective and len(pts) >= 2)
        if not have:
            return None
        below = [r for r in have if r <= ranks]
        r0 = below[-1] if below else have[0]
        return r0, self.table[(collective, r0)]

    def _nvlink_busbw(self, collective: str) -> float:
        """The node's ring bus bandwidth (bytes/s): the largest measured message's, else the datasheet's."""
        near = self._nearest_measured(collective, self.gpus_per_node)
        if near is None:
            return self.nvlink[0]
        r0, pts = near
        b, t = pts[-1]
        return bus_factor(collective, r0) * b / (t * 1e-6)

    def _estimate(self, collective: str, nbytes: float, ranks: int, k: int) -> CommEstimate:
        if ranks <= 1 or nbytes <= 0:
            return CommEstimate(0.0, Source.COMM_MODEL, "none")
        if k >= ranks:  # one node: NVLink
            pts = self.table.get((collective, ranks))
            if pts and len(pts) >= 2:
                if nbytes > pts[-1][0]:  # past the largest measured message: its bandwidth held, a model
                    return CommEstimate(_interp_loglog(pts, nbytes), Source.COMM_MODEL,
                                        f"nvlink (past the largest measured message, {pts[-1][0] / 1e9:.1f} GB: its "
                                        "bandwidth held)")
                return CommEstimate(_interp_loglog(pts, nbytes), Source.COMM_MEASURED, "nvlink")
            near = self._nearest_measured(collective, ranks)
            if near is not None and collective != "send_recv":
                r0, pts = near
                scale = bus_factor(collective, ranks) / bus_factor(collective, r0)
                return CommEstimate(_interp_loglog(pts, nbytes) * scale, Source.COMM_MODEL,
                                    f"nvlink (ring scaled from the {r0}-rank table)")
            return CommEstimate(self._alpha_beta(collective, nbytes, ranks, *self.nvlink), Source.COMM_MODEL,
                                "nvlink")
        nic_bw, nic_lat = self.network
        if collective == "send_recv":
            return CommEstimate(self._alpha_beta(collective, nbytes, 2, nic_bw, nic_lat), Source.COMM_MODEL,
                                "network (one NIC)")
        inside = self._nvlink_busbw(collective)
        if collective == "all_to_all":  # each rank's off-node share leaves through its own NIC
            bw_us = 1e6 * max(nbytes * (k - 1) / ranks / inside, nbytes * (ranks - k) / ranks / nic_bw)
            steps = ranks - 1
            return CommEstimate(bw_us + 1e6 * steps * nic_lat, Source.COMM_MODEL, f"network ({k} NICs per node)")
        bw = min(inside, k * nic_bw)
        return CommEstimate(self._alpha_beta(collective, nbytes, ranks, bw, nic_lat), Source.COMM_MODEL,
                            f"network ({k} NIC{'s' if k > 1 else ''} per node)")

    @staticmethod
    def _alpha_beta(collective: str, nbytes: float, ranks: int, bw: float, lat: float) -> float:
        """Ring steps at the link's latency (all-reduce's counted as a tree's log2 n rounds) plus the bus bytes
        at the bus bandwidth, in microseconds."""
        steps = 2 * (ranks - 1) if collective == "all_reduce" else (ranks - 1 if collective != "send_recv" else 1)
        t = steps * lat / max(1, math.log2(ranks) if collective == "all_reduce" else 1) + \
            bus_factor(collective, ranks) * nbytes / bw
        return t * 1e6


def _interp_loglog(pts: list[tuple[float, float]], x: float) -> float:
    if x <= pts[0][0]:
        return pts[0][1]  # below the smallest message: latency-bound
    if x >= pts[-1][0]:
        b1, t1 = pts[-1]
        return t1 * x / b1  # beyond the largest message: bandwidth-bound at the largest size's rate
    for (b0, t0), (b1, t1) in itertools.pairwise(pts):
        if b0 <= x <= b1:
            w = (math.log(x) - math.log(b0)) / (math.log(b1) - math.log(b0)) if b1 > b0 else 0.0
            return math.exp(math.log(t0) * (1 - w) + math.log(t1) * w)
    return pts[-1][1]
