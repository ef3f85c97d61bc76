"""Communication time: measured NCCL tables when the database has them, else an alpha-beta model.

Ring algorithms: all-reduce moves 2(n-1)/n of the message per rank, all-gather and reduce-scatter
(n-1)/n of the full tensor, send/recv the message once. Links: TP and any group of at most 8 GPUs
inside one host use NVLink; larger groups cross hosts over InfiniBand (GpuSpec figures).
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
        self._memo: dict[tuple[str, float, int, bool], CommEstimate] = {}

    def link(self, ranks: int, spans_hosts: bool) -> str:
        return "ib" if spans_hosts or ranks > self.gpus_per_node else "nvlink"

    def estimate(self, collective: str, nbytes: float, ranks: int, spans_hosts: bool = False) -> CommEstimate:
        """A collective's time; answers kept (a planner and a prediction's host range ask the same ones again)."""
        key = (collective, nbytes, ranks, spans_hosts)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._estimate(collective, nbytes, ranks, spans_hosts)
        return hit

    def _estimate(self, collective: str, nbytes: float, ranks: int, spans_hosts: bool) -> CommEstimate:
        if ranks <= 1 or nbytes <= 0:
            return CommEstimate(0.0, Source.COMM_MODEL, "none")
        link = self.link(ranks, spans_hosts)
        pts = self.table.get((collective, ranks)) if link == "nvlink" else None
        if pts and len(pts) >= 2:
            return CommEstimate(_interp_loglog(pts, nbytes), Source.COMM_MEASURED, link)
        bw, lat = self.nvlink if link == "nvlink" else self.network
        steps = 2 * (ranks - 1) if collective == "all_reduce" else (ranks - 1 if collective != "send_recv" else 1)
        t = steps * lat / max(1, math.log2(ranks) if collective == "all_reduce" else 1) + \
            bus_factor(collective, ranks) * nbytes / bw
        return CommEstimate(t * 1e6, Source.COMM_MODEL, link)


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
