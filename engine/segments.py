"""Costed operators: a stage's operator calls as raw arrays (cold and warm latency, communication, phase,
tensor counts, host syncs, where each number came from), built once per graph and TP/EP degree from the
lookup and the communication model, and re-timed under any host model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tp_query.schema.ops import Family
from tp_query.schema.signature import OpCall, SameAs

from .compose import Composer, Item
from .graph import Phase, Section
from .hostsim import HostModel
from .lookup import Query, Source
from .request import PredictError

if TYPE_CHECKING:
    from .engine import Engine

SYNC_OPS = ("aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.item.default")

SOURCES = list(Source)
_SRC_CODE = {src: i for i, src in enumerate(SOURCES)}
_NO_KERNEL = _SRC_CODE[Source.NO_KERNEL]


@dataclass
class Segment:
    """A stretch of operators as raw, host-model-free arrays (calibration and search re-time them
    quickly). `parts` keeps how a stage's segment was assembled, so its items are expanded only when
    per-operator rows are asked for."""

    cold: np.ndarray
    warm: np.ndarray
    comm_us: np.ndarray
    is_comm: np.ndarray
    phase: np.ndarray  # 0 fwd, 1 bwd, 2 opt
    tensors: np.ndarray  # tensors in a multi-tensor call (0 otherwise)
    sync: np.ndarray
    src: np.ndarray  # index into SOURCES
    base_items: list[Item] | None = None
    parts: list[tuple[Segment, int]] | None = None
    # how many layers' worth each operator stands for: 1, or a layer type's share of the model's layers
    # (a model whose layers differ, such as Gemma's sliding and global layers, has a mean layer)
    weight: np.ndarray | None = None
    ep_comm: np.ndarray | None = None  # collectives over the expert-parallel group (None: there are none)
    flops: float | None = None  # the operators' FLOPs, weighted (set on a section kept in the costed-graph cache)

    def ep_mask(self) -> np.ndarray:
        return self.ep_comm if self.ep_comm is not None else np.zeros(len(self.cold), dtype=bool)

    def weights(self) -> np.ndarray:
        return self.weight if self.weight is not None else np.ones(len(self.cold))

    @property
    def items(self) -> list[Item]:
        if self.base_items is not None:
            return self.base_items
        out: list[Item] = []
        for p, n in self.parts or []:
            out += p.items * n
        return out

    @staticmethod
    def empty() -> Segment:
        z = np.zeros(0)
        return Segment(z, z, z, np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64), z, np.zeros(0, dtype=bool),
                       np.zeros(0, dtype=np.int64), [])

    @staticmethod
    def concat(parts: list[tuple[Segment, int]]) -> Segment:
        parts = [(p, n) for p, n in parts if n > 0 and len(p.cold)]
        if not parts:
            return Segment.empty()
        if len(parts) == 1 and parts[0][1] == 1:
            return parts[0][0]

        def cat(attr: str) -> np.ndarray:
            return np.concatenate([np.tile(getattr(p, attr), n) for p, n in parts])

        weighted = any(p.weight is not None for p, _ in parts)
        with_ep = any(p.ep_comm is not None for p, _ in parts)
        return Segment(cat("cold"), cat("warm"), cat("comm_us"), cat("is_comm"), cat("phase"), cat("tensors"),
                       cat("sync"), cat("src"), None, parts,
                       np.concatenate([np.tile(p.weights(), n) for p, n in parts]) if weighted else None,
                       np.concatenate([np.tile(p.ep_mask(), n) for p, n in parts]) if with_ep else None)

    def times(self, host: HostModel) -> tuple[np.ndarray, np.ndarray]:
        return self.gpu_times(host.beta), self.host_times(host)

    def gpu_times(self, beta: float) -> np.ndarray:
        """Each operator's GPU time (us): its latency between warm and cold by beta, a collective's own time. It
        depends on nothing else of a host model: host instances share it."""
        g = np.where(self.is_comm, self.comm_us, self.warm + beta * (self.cold - self.warm))
        return g * self.weight if self.weight is not None else g

    def host_times(self, host: HostModel) -> np.ndarray:
        """Each operator's host cost (us) under a host model."""
        h = np.choose(self.phase, [host.fwd_us, host.bwd_us, host.opt_us])
        if host.fwd_view_us != host.fwd_us or host.bwd_view_us != host.bwd_us:  # views launch nothing
            view = (self.src == _NO_KERNEL) & ~self.sync
            h = np.where(view, np.choose(self.phase, [host.fwd_view_us, host.bwd_view_us, host.opt_us]), h)
        h = h + host.per_tensor_us * self.tensors
        return h * self.weight if self.weight is not None else h


_PHASE_CODE = {Phase.FWD: 0, Phase.BWD: 1, Phase.OPT: 2}
_EMPTY = Segment.empty()


class SegmentCache:
    """Per graph and TP (and EP) degree: raw operator arrays of every section, built once (search reuses them)."""

    def __init__(self, eng: Engine, comp: Composer, tp: int, ep: int = 1,
                 pre: dict[tuple[Phase, Section], Segment] | None = None) -> None:
        """pre: the graph's sections as the costed-graph cache kept them (its layers are uniform: no mix)."""
        self.eng, self.comp, self.tp, self.ep, self.pre = eng, comp, tp, ep, pre
        self._sections: dict[tuple[Phase, Section, Any], Segment] = {}
        self._stages: dict[tuple[Phase, tuple[tuple[Section, int], ...], Any], Segment] = {}

    def stage(self, phase: Phase, parts: list[tuple[Section, int]],
              mix: tuple[tuple[int, int], ...] | None = None) -> Segment:
        """A stage's sections concatenated; `mix`: its own layers per kind (Composer.stage_mix)."""
        k = (phase, tuple(parts), mix)
        if k not in self._stages:
            self._stages[k] = Segment.concat([(self.section(phase, sec, mix), n) for sec, n in parts])
        return self._stages[k]

    def stage_parts(self, phase: Phase, parts: list[tuple[Section, int]],
                    mix: tuple[tuple[int, int], ...] | None = None) -> list[tuple[Segment, int]]:
        """A stage's sections and how often each repeats (what `stage` concatenates), empty ones left out."""
        return [(seg, n) for sec, n in parts if n > 0 and len((seg := self.section(phase, sec, mix)).cold)]

    def section(self, phase: Phase, sec: Section, mix: tuple[tuple[int, int], ...] | None = None) -> Segment:
        k = (phase, sec, mix if sec == Section.LAYER else None)
        if self.pre is not None and k[2] is None:
            return self.pre.get((phase, sec)) or _EMPTY
        if k not in self._sections:
            self._sections[k] = self._segment(self.comp.part(phase, sec), self.comp.part_weights(phase, sec, k[2]))
        return self._sections[k]

    def costed_sections(self) -> dict[tuple[Phase, Section], Segment] | None:
        """Every section of the graph with its FLOPs, to keep in the costed-graph cache; None where a stage's
        sections depend on its mix of layer kinds."""
        if self.pre is not None or self.comp.layer_kinds_mixed:
            return None
        out: dict[tuple[Phase, Section], Segment] = {}
        for ph, sec in self.comp.sections:
            if ph == Phase.OPT:  # the traced optimizer step: a stage's is rebuilt from its calls (kept in the graph)
                continue
            seg = self.section(ph, sec)
            if seg.flops is None:
                seg.flops = float(sum(it.info.flops * w for it, w in zip(seg.items, seg.weights(), strict=True)))
            out[(ph, sec)] = seg
        return out

    def items_segment(self, a: list[Item], b: list[Item] | None, kind: str) -> Segment:
        k = (id(a), id(b), kind, self.tp, self.ep)
        shared = self.eng.item_segments  # across graphs: the optimizer lists themselves are shared
        if k not in shared:
            if kind == "opt":
                items = [it for it in a if it.phase == Phase.OPT] + list(b or [])
            elif kind == "ddp":
                items = [it for it in a if it.phase == Phase.BWD]
            else:
                items = list(a)
            shared[k] = self._segment(items)
        return shared[k]

    def _comm_us(self, it: Item) -> tuple[float, Source]:
        """An in-graph collective, priced over its own group (each record names it: tp today; the data,
        pipeline and expert groups' traffic is the framework model's, outside the graph)."""
        t = next(iter(it.call.tensors()))
        kind = it.call.op.split(".", 1)[1]
        group = str(dict(it.call.kwargs).get("group", "tp"))
        ranks = {"tp": self.tp, "ep": self.ep}.get(group)
        if ranks is None:
            raise PredictError(f"the graph has a {kind} over group {group!r}, which this split does not size")
        # a TP group lies inside one node; an EP group's ranks are TP ranks apart (it crosses nodes past one)
        per_node = None if group == "tp" else self.eng.comm.per_node(ranks, self.tp)
        e = self.eng.comm.estimate(kind, float(t.nbytes), ranks, per_node)
        return e.us, e.source

    def _segment(self, items: list[Item], weight: np.ndarray | None = None) -> Segment:
        # one row per distinct (call, phase) for the engine's life: search and new DP sizes re-use them
        cache = self.eng.item_rows.setdefault((self.tp, self.ep), {})
        qs = {it.key: Query(it.key, it.call.op, it.info) for it in items
              if not it.call.op.startswith("comm.") and (it.key, it.phase) not in cache}
        est = self.eng.latency.estimate(list(qs.values())) if qs else {}
        n = len(items)
        cold, warm, comm_us = np.zeros(n), np.zeros(n), np.zeros(n)
        is_comm, sync = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        phase, tensors = np.zeros(n, dtype=np.int64), np.zeros(n)
        src_codes = np.zeros(n, dtype=np.int64)
        for i, it in enumerate(items):
            c = cache.get((it.key, it.phase))
            if c is None:
                if it.call.op.startswith("comm."):
                    us, src = self._comm_us(it)
                    row = (0.0, 0.0, us, True, src)
                else:
                    e = est[it.key]
                    row = (e.cold_us, e.warm_us, 0.0, False, e.source)
                multi = it.info.family == Family.FOREACH or it.call.op.startswith("aten._foreach")
                nt = float(_tensor_arguments(it.call)) if multi else 0.0
                syncs = it.call.op in SYNC_OPS and not it.call.on_host_only()
                c = (row[0], row[1], row[2], row[3], _PHASE_CODE[it.phase], nt, syncs, row[4])
                cache[(it.key, it.phase)] = c
            cold[i], warm[i], comm_us[i], is_comm[i], phase[i], tensors[i], sync[i], src = c
            src_codes[i] = _SRC_CODE[src]
        ep = np.array([it.call.op.startswith("comm.") and dict(it.call.kwargs).get("group") == "ep" for it in items],
                      dtype=bool)
        return Segment(cold, warm, comm_us, is_comm, phase, tensors, sync, src_codes, items, None, weight,
                       ep if ep.any() else None)


def _tensor_arguments(call: OpCall) -> int:
    """Tensors a multi-tensor call hands the host, a list passed twice counted twice (the host walks every list
    argument; only the GPU reads a repeated list once)."""
    n = sum(1 for _ in call.tensors())
    for a in call.args:
        if isinstance(a, SameAs) and isinstance(call.args[a.arg], list):
            n += len(call.args[a.arg])
    return n
