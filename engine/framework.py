"""Framework models: what a distributed training stack adds around the operators of a stage.

The graph says what each GPU computes; how a stack communicates around it is the framework's: DDP's
gradient buckets, FSDP2's per-block all-gather prefetch and reduce-scatter (with its exposed first
all-gather and last reduce-scatter), DTensor's per-operator dispatch on the host, the pipeline schedule's
bubble and the activations and outputs it keeps. Everything here is a two-queue timeline (compute
stream, NCCL stream) over per-section compute times and measured collectives, slowed by the measured
interference of concurrent NCCL kernels and compute (data/<gpu>/overlap/), plus host costs measured per
framework (data/<gpu>/framework/).
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np


class Framework(StrEnum):
    TORCH = "torch"  # PyTorch native: DDP, FSDP2, DTensor TP/SP, torch.distributed.pipelining
    MEGATRON = "megatron"  # Megatron-Core: its DDP and distributed optimizer, TP layers, 1F1B


class PipeSchedule(StrEnum):
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"  # two model chunks per rank (torch's ScheduleInterleaved1F1B)


INTERLEAVED_CHUNKS = 2
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 1 * 2**20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


@dataclass(frozen=True)
class HostExtra:
    """Extra host microseconds a framework adds beyond plain eager PyTorch, per phase."""

    per_layer_us: dict[str, float]
    fixed_us: dict[str, float]
    source: str  # "measured (N ranks)" | "none"
    measured_ranks: int = 0  # the group size its rows were measured with (0: none)
    kind: str = ""  # the framework part it prices: tp, tp_sp, ddp, fsdp_z2, fsdp_z3

    @staticmethod
    def none(kind: str = "") -> HostExtra:
        return HostExtra({}, {}, "none", kind=kind)


@dataclass(frozen=True)
class Interference:
    """Slowdown factors (>= 1) of compute while a collective runs beside it, and of that collective beside
    compute, as functions of the collective and its size (measured rows, interpolated in log bytes)."""

    points: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)  # coll -> (bytes, c, m)
    source: str = "none"
    measured_ranks: int = 0  # the group size its rows were measured with (0: none)

    def factors(self, collective: str, nbytes: float) -> tuple[float, float]:
        pts = self.points.get(collective) or self.points.get("all_reduce")
        if not pts:
            return 1.0, 1.0
        if nbytes <= pts[0][0]:
            return pts[0][1], pts[0][2]
        if nbytes >= pts[-1][0]:
            return pts[-1][1], pts[-1][2]
        for (b0, c0, m0), (b1, c1, m1) in itertools.pairwise(pts):
            if b0 <= nbytes <= b1:
                w = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
                return c0 + w * (c1 - c0), m0 + w * (m1 - m0)
        return pts[-1][1], pts[-1][2]


def utc_time(at: Any) -> dt.datetime:
    """A timestamp as an aware UTC datetime (rows carry datetimes; a snapshot's rows ISO text)."""
    t = at if isinstance(at, dt.datetime) else dt.datetime.fromisoformat(str(at))
    return t if t.tzinfo is not None else t.replace(tzinfo=dt.UTC)


FIRST_MACHINE = "first"  # host rows written before instances were told apart (one instance's)
TYPICAL_HOST = "typical"  # not an instance: each host cost is the median over the measured instances
FSDP_COPY_KIND = "fsdp_copy"  # collector.dist_probe.copies_campaign
FSDP_KINDS = ("fsdp_z2", "fsdp_z3")  # the probe's FSDP2 kinds (reshard_after_forward False, True)
# kinds whose host work is hooks on parameters and buckets, the same in any dtype (DDP's autograd hooks and bucket
# copies, FSDP2's all-gather/reduce-scatter issue and copies): every measured setting's rows answer for each
DTYPE_FREE_HOST_KINDS = ("ddp", "ddp_bucket_view", *FSDP_KINDS)


@dataclass
class FrameworkData:
    """The framework tables of a database: overlap interference and host costs. Host costs are measured per
    machine instance (host-bound timings differ between instances of one machine kind: the H200 hosts
    measured so far spent 10 to 20 us per eager forward operator). By default every host cost is the median
    over the instances that measured it (the typical host: the expected instance of a pool, and on runs of
    instances left out of it closer than the run's own instance's noisy probe); `machine` names one instance
    instead, whose kinds it did not measure come from that median. A user's prediction also states the step's
    range over the instances."""

    overlap: list[dict[str, Any]] = field(default_factory=list)
    host: list[dict[str, Any]] = field(default_factory=list)
    machine: str | None = None
    _extras: dict[tuple[str, str, str, int], HostExtra] = field(default_factory=dict, repr=False)
    # a planner asks the same few questions for every candidate: answers kept per view
    _per_op: dict[str, dict[str, float]] = field(default_factory=dict, repr=False)
    _scaler: dict[str, float | None] = field(default_factory=dict, repr=False)
    _copy_lines: dict[tuple[str, str, int], tuple[float, float, int] | None] = field(default_factory=dict, repr=False)
    # FSDP2's copy kernels (kind fsdp_copy in the framework table): GPU work, not a host instance's cost
    copies: list[dict[str, Any]] = field(default_factory=list)
    # host rows by (framework, kind, setting, phase, quantity), shared by the views of one table
    _index: dict[tuple[str, str, str, str, str], list[dict[str, Any]]] | None = field(default=None, repr=False)
    _machines: list[str] | None = field(default=None, repr=False)
    _named_since: tuple[dt.datetime | None] | None = field(default=None, repr=False)
    # per-instance derivations every view of one table shares (each view picks its instance's or the median): a
    # prediction's range over the instances derives them once, not once per instance
    _by_machine: dict[Any, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self._by_machine is None:
            self._by_machine = {}
        if self._index is not None:  # a view of tables already split and indexed (`on`): nothing to redo
            return
        self.copies = self.copies or [r for r in self.host if r.get("kind") == FSDP_COPY_KIND]
        self.host = [r for r in self.host if r.get("kind") != FSDP_COPY_KIND]
        self._index = {}
        for r in self.host:
            key = (str(r["framework"]), str(r["kind"]), str(r.get("setting")), str(r["phase"]), str(r["quantity"]))
            self._index.setdefault(key, []).append(r)

    def _indexed(self, framework: str, kind: str, setting: str, phase: str | None = None,
                 quantity: str | None = None, prefix: bool = False) -> list[dict[str, Any]]:
        """Host rows of a framework of one kind (every kind that starts with it, with prefix), of one setting (and
        phase, quantity); found once per question for every view of the table (a prediction's range over the
        host instances asks each view the same ones)."""
        assert self._index is not None and self._by_machine is not None
        key = ("rows", framework, kind, prefix, setting, phase, quantity)
        hit = self._by_machine.get(key)
        if hit is None:
            hit = self._by_machine[key] = [
                r for (fw, k, st, ph, q), rows in self._index.items() if fw == framework and st == setting
                and (k.startswith(kind) if prefix else k == kind) and (phase is None or ph == phase)
                and (quantity is None or q == quantity) for r in rows]
        return hit

    def settings_of(self, framework: str, kind: str) -> list[str]:
        """The settings a framework's kind has host rows for."""
        assert self._index is not None
        return sorted({st for (fw, k, st, _, _) in self._index if fw == framework and k == kind})

    def machines(self) -> list[str]:
        """The instances with host rows (found once per table: a user's prediction asks per instance)."""
        if self._machines is None:
            self._machines = sorted({r.get("machine") or FIRST_MACHINE for r in self.host if r.get("status") == "ok"})
        return self._machines

    def instances_named_since(self) -> dt.datetime | None:
        """When host rows began to name their instance (the earliest such row's time; None: none does). A run
        measured since on an instance it does not name ran on one of unknown host speed, not the first one."""
        if self._named_since is None:
            ts = [utc_time(r["measured_at"]) for r in self.host if r.get("machine") and r.get("measured_at") is not None]
            self._named_since = (min(ts),) if ts else (None,)
        return self._named_since[0]

    def fsdp_copy_us(self, phase: str, unit_bytes: float, itemsize: int, ranks: int) -> float | None:
        """FSDP2's copy kernel `phase` (copy_in: the rank's shards into the all-gather input; copy_out: the
        all-gather output into the unsharded parameters; rs_copy_in: the unsharded gradients into the
        reduce-scatter input) for a unit of `unit_bytes` full bytes over `ranks`: the measured line of the
        nearest world size and the element size's dtype (median over instances); None when not measured. copy_in
        moves the rank's shard, 1/ranks of the unit (its measured slope per full MiB halves from 2 to 4 to 8
        ranks): another world size's slope is scaled by measured ranks / ranks. The other two move the whole
        unit at any world size."""
        setting = "bf16" if itemsize <= 2 else "fp32"
        key = (phase, setting, ranks)
        if key not in self._copy_lines:
            line = self._copy_line(phase, setting, ranks)
            if line is not None and phase == "copy_in":
                line = (line[0], line[1] * line[2] / ranks, line[2])
            self._copy_lines[key] = line
        line = self._copy_lines[key]
        if line is None or unit_bytes <= 0:
            return None
        return max(line[0] + line[1] * unit_bytes / 2**20, 0.0)

    def _copy_line(self, phase: str, setting: str, ranks: int) -> tuple[float, float, int] | None:
        """(fixed us, us per MiB, the world size measured) of a copy kernel at the nearest measured world size;
        None when not measured."""
        rows = [r for r in self.copies if r.get("status") == "ok" and r["phase"] == phase and r["setting"] == setting]
        if not rows:
            return None
        have = sorted({int(r["ranks"]) for r in rows})
        rk = min(have, key=lambda r: (abs(r - ranks), r))
        q = {name: self._median_over_machines([r for r in rows if int(r["ranks"]) == rk and r["quantity"] == name])
             for name in ("us_per_mib", "fixed_us")}
        return q["fixed_us"], q["us_per_mib"], rk

    def instances(self) -> list[dict[str, Any]]:
        """Per measured instance: its CPU, plain eager host cost per forward operator and DTensor TP's extra
        per layer (forward + backward), both in bf16 (the report's instance table)."""
        out = []
        for m in self.machines():
            fd = self.on(m)
            cpus = {r.get("cpu") for r in self.host if (r.get("machine") or FIRST_MACHINE) == m and r.get("cpu")}
            tp = fd.host_extra("torch", "tp", "bf16", 2).per_layer_us
            out.append({"machine": m, "cpu": ", ".join(sorted(str(c) for c in cpus)),
                        "per_op_us": fd.mean_op_host_us("bf16", "fwd"),
                        "tp_extra_ms": (tp.get("fwd", 0.0) + tp.get("bwd", 0.0)) / 1e3})
        return out

    def on(self, machine: str | None) -> FrameworkData:
        """The same tables with host costs of one instance (None or TYPICAL_HOST: the median over instances)."""
        if machine is not None and machine != TYPICAL_HOST and machine not in self.machines():
            raise ValueError(f"no host measurements of machine {machine!r}; measured: {', '.join(self.machines())}")
        return FrameworkData(self.overlap, self.host, machine, copies=self.copies, _index=self._index,
                             _machines=self._machines, _by_machine=self._by_machine)

    def without(self, machine: str) -> FrameworkData:
        """The typical host of the other instances (validation: a run predicted as a user's prediction would be,
        its own instance's measurements left out)."""
        return FrameworkData(self.overlap, [r for r in self.host if (r.get("machine") or FIRST_MACHINE) != machine],
                             TYPICAL_HOST, copies=self.copies)

    @functools.cached_property
    def chosen(self) -> str:
        """The instance whose host costs this view uses, or TYPICAL_HOST."""
        return self.machine if self.machine is not None else TYPICAL_HOST

    def _host_rows(self, kind_rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The chosen instance's rows (of `kind_rows` when given); where it has none of them, or for the
        typical host, every instance's (their median is taken)."""
        rows = [r for r in (self.host if kind_rows is None else kind_rows) if r.get("status") == "ok"]
        if self.chosen == TYPICAL_HOST:
            return rows
        mine = [r for r in rows if (r.get("machine") or FIRST_MACHINE) == self.chosen]
        return mine or rows

    @staticmethod
    def _mean_per_machine(rows: list[dict[str, Any]]) -> dict[str, float]:
        """Each instance's mean of its rows' values (an instance may hold several variants)."""
        per: dict[str, list[float]] = {}
        for r in rows:
            per.setdefault(r.get("machine") or FIRST_MACHINE, []).append(float(r["value_us"]))
        return {m: sum(v) / len(v) for m, v in per.items()}

    @staticmethod
    def _median_over_machines(rows: list[dict[str, Any]]) -> float:
        """Median over instances of each instance's mean."""
        return statistics.median(FrameworkData._mean_per_machine(rows).values())

    def _probe_means(self, kind: str, setting: str, phase: str, quantity: str) -> dict[str, float]:
        """Each instance's mean of one quantity of a host-probe kind (plain, chain_views, chain_launches)."""
        return self._mean_per_machine([r for r in self._indexed("torch", kind, setting, phase, quantity)
                                       if r.get("status") == "ok"])

    def interference(self, ranks: int, precision_class: str) -> Interference:
        """The measured slowdowns for the compute class that dominates the step (tensor-core GEMMs in half
        precision or TF32), per collective and size, from the nearest measured group size."""
        rows = [r for r in self.overlap if r.get("status") == "ok"]
        if not rows:
            return Interference()
        have = sorted({int(r["ranks"]) for r in rows})
        rk = min(have, key=lambda r: (abs(r - ranks), r))
        comp = {"half": "gemm_bf16", "tf32": "gemm_tf32"}.get(precision_class, "gemm_tf32")
        sel = [r for r in rows if int(r["ranks"]) == rk and r["compute"] == comp]
        pts: dict[str, list[tuple[float, float, float]]] = {}
        for r in sorted(sel, key=lambda r: r["bytes"]):
            pts.setdefault(r["collective"], []).append(
                (float(r["bytes"]), max(r["compute_concurrent_us"] / r["compute_alone_us"], 1.0),
                 max(r["comm_concurrent_us"] / r["comm_alone_us"], 1.0)))
        return Interference(pts, f"measured ({rk} ranks, {comp})", rk)

    def per_op_host_us(self, setting: str) -> dict[str, float]:
        """Plain eager PyTorch's host cost per aten operator (forward, backward, optimizer), measured on
        host-bound runs: the per-layer time slope over the per-layer operator count, averaged over the plain
        variants of an instance, then the median over instances."""
        if setting in self._per_op:
            return dict(self._per_op[setting])
        out: dict[str, float] = {}
        for phase in ("fwd", "bwd", "opt"):
            mean = self.mean_op_host_us(setting, phase)
            if not math.isnan(mean):
                out[f"{phase}_us"] = mean
        tight = self.tight_loop_costs(setting) if "fwd_us" in out else None
        if tight is not None:  # forward: each operator's own dispatch, and the layer's module Python apart
            out["fwd_us"], out["fwd_view_us"], out["fwd_layer_us"] = self._forward_split(out["fwd_us"], *tight)
        for phase in ("fwd", "bwd"):  # a view's host cost and a launching operator's, their mean kept
            if f"{phase}_us" not in out or f"{phase}_layer_us" in out:
                continue
            mean = out[f"{phase}_us"]
            split = self.launch_split(setting, phase)
            if split is None:
                out[f"{phase}_view_us"] = mean
                continue
            frac, share = split
            d = min(max(frac, 0.0), 1.0 / max(1.0 - share, 1e-9)) * mean  # a view costs the host >= 0
            out[f"{phase}_us"], out[f"{phase}_view_us"] = mean + share * d, max(mean - (1.0 - share) * d, 0.0)
        self._per_op[setting] = out
        return dict(out)

    def mean_op_host_us(self, setting: str, phase: str) -> float:
        """The plain layer's mean host cost per operator of a phase, views and launching ones together (nan when
        not measured): what the probe measured before its operators were told apart."""
        rows = self._host_rows([r for r in self._indexed("torch", "plain", setting, phase, "per_op_us",
                                                         prefix=True) if r["value_us"] > 0])
        return self._median_over_machines(rows) if rows else float("nan")

    @staticmethod
    def _forward_split(mean: float, lam: float, nu: float, ops: float, views: float) -> tuple[float, float, float]:
        """(launching operator us, view us, layer us) of the forward: each operator at its tight-loop cost (lam, nu
        times the plain mean), the rest of the plain layer's measured time once per layer. Where the operators alone
        would exceed the layer (probe noise), they are scaled down to it and nothing is left per layer."""
        launch, view = lam * mean, nu * mean
        ops_us = (ops - views) * launch + views * view
        if ops_us <= 0:
            return mean, mean, 0.0
        layer = ops * mean - ops_us
        if layer < 0:
            k = ops * mean / ops_us
            return launch * k, view * k, 0.0
        return launch, view, layer

    def tight_loop_costs(self, setting: str) -> tuple[float, float, float, float] | None:
        """(lam, nu, ops, views) of the forward: what a launching and a viewing operator cost the host when a loop
        issues them (the chain probe's slopes per added operator, as fractions of the same instance's plain
        per-operator mean), and the plain layer's operators and views. The plain layer costs more per operator
        than its operators issued in a loop: its modules' Python (calls, hooks, argument handling) runs once per
        layer, not per operator, so a layer of many more operators (the gated-delta fallback's chunk loop: 2,700 a
        layer) is charged its operators at their own cost and the module Python once.

        An instance's slopes are used when both are positive and each is known to within
        TIGHT_LOOP_MAX_SE of the plain mean (one standard error, from the per-layer fits' scatter: a probe timed
        variant by variant drifted with its host); the chosen instance's, else the median over those that qualify;
        None where none does (the mean-keeping split of launch_split applies).
        The backward keeps that split: autograd's engine issues it in C++, without per-module Python."""
        key = f"tight:{setting}"
        if key in self._per_op:
            kept = self._per_op[key]
            return (kept["lam"], kept["nu"], kept["ops"], kept["views"]) if kept else None

        assert self._by_machine is not None
        shared = self._by_machine.get(key)
        if shared is None:
            shared = self._by_machine[key] = self._tight_loop_per_machine(setting)
        lams, nus, ops_n, views_n = shared
        got: dict[str, float] = {}
        if lams and ops_n and views_n:
            own = self.chosen in lams
            got = {"lam": lams[self.chosen] if own else statistics.median(lams.values()),
                   "nu": nus[self.chosen] if own else statistics.median(nus.values()),
                   "ops": statistics.median(ops_n.values()), "views": statistics.median(views_n.values())}
        self._per_op[key] = got
        return (got["lam"], got["nu"], got["ops"], got["views"]) if got else None

    def _tight_loop_per_machine(self, setting: str) -> tuple[Any, ...]:
        """Each instance's qualifying slopes (as fractions of its plain mean) and the plain layer's counts."""
        def fits(kind: str) -> dict[str, tuple[float, float]]:
            out: dict[str, tuple[float, float]] = {}
            for r in self._indexed("torch", kind, setting, "fwd", "per_layer_us"):
                fit = _slope_and_se(r.get("samples_json")) if r.get("status") == "ok" else None
                if fit is not None:
                    out[r.get("machine") or FIRST_MACHINE] = fit
            return out

        plain, views_c, launch_c = fits("plain"), fits("chain_views"), fits("chain_launches")
        ops_n = {k: self._probe_means(k, setting, "fwd", "per_layer_ops") for k in ("plain", "chain_views",
                                                                                   "chain_launches")}
        views_n = self._probe_means("plain", setting, "fwd", "per_layer_views")
        lams: dict[str, float] = {}
        nus: dict[str, float] = {}
        for m, (p_us, p_se) in plain.items():
            try:
                po = ops_n["plain"][m]
                (l_us, l_se), (v_us, v_se) = launch_c[m], views_c[m]
                nl, nv = ops_n["chain_launches"][m] - po, ops_n["chain_views"][m] - po
            except KeyError:
                continue
            if po <= 0 or nl <= 0 or nv <= 0:
                continue
            mean = p_us / po
            launch, view = (l_us - p_us) / nl, (v_us - p_us) / nv
            se_l, se_v = math.hypot(l_se, p_se) / nl, math.hypot(v_se, p_se) / nv
            if launch > 0 and view > 0 and max(se_l, se_v) <= TIGHT_LOOP_MAX_SE * mean:
                lams[m], nus[m] = launch / mean, view / mean
        return lams, nus, ops_n["plain"], views_n

    def launch_split(self, setting: str, phase: str) -> tuple[float, float] | None:
        """(f, s) of one phase: what a kernel-launching operator costs the host beyond a view, as a fraction f of
        the same instance's plain per-operator cost, and the share s of views among the plain layer's operators;
        None where no instance ran the chain probe (collector.dist_probe: the plain model with 128 views or 128
        launching operators added to each layer, the two slopes' difference over the operators told apart).

        With d = f x mean, a view is charged mean - (1 - s) d and a launching operator mean + s d: the plain layer
        costs what it was measured to, and a model whose operators are more often views costs less. The Python
        that issues each operator stays in both charges (the chains are issued by one loop, so their difference
        holds none of it). f is the chosen instance's where it ran the probe, else the median over those that
        did; s is the same for every instance (one model, one torch)."""
        key = f"split:{setting}:{phase}"
        if key in self._per_op:
            kept = self._per_op[key]
            return (kept["f"], kept["s"]) if kept else None

        assert self._by_machine is not None
        if key not in self._by_machine:  # every instance's, once for all views of the table
            self._by_machine[key] = self._split_per_machine(setting, phase)
        fracs, shares = self._by_machine[key]
        got: dict[str, float] = {}
        if fracs and shares:
            got = {"f": fracs[self.chosen] if self.chosen in fracs else statistics.median(fracs.values()),
                   "s": statistics.median(shares)}
        self._per_op[key] = got
        return (got["f"], got["s"]) if got else None

    def _split_per_machine(self, setting: str, phase: str) -> tuple[dict[str, float], list[float]]:
        """Each probed instance's f and every instance's share of views (launch_split)."""
        def by_machine(kind: str, quantity: str) -> dict[str, float]:
            return self._probe_means(kind, setting, phase, quantity)

        per = {k: {q: by_machine(k, q) for q in ("per_layer_us", "per_layer_ops", "per_layer_views")}
               for k in ("chain_views", "chain_launches")}
        plain = {q: by_machine("plain", q) for q in ("per_op_us", "per_layer_ops", "per_layer_views")}
        fracs: dict[str, float] = {}
        shares: list[float] = []
        for m, mean in plain["per_op_us"].items():
            ops, views = plain["per_layer_ops"].get(m), plain["per_layer_views"].get(m)
            if ops and views is not None:
                shares.append(views / ops)
            v, la = per["chain_views"], per["chain_launches"]
            try:
                lv = (la["per_layer_ops"][m] - la["per_layer_views"][m]) - (v["per_layer_ops"][m] - v["per_layer_views"][m])
                vv = v["per_layer_views"][m] - la["per_layer_views"][m]
                n = (lv + vv) / 2  # operators that launch in one chain and are views in the other
                gap_us = la["per_layer_us"][m] - v["per_layer_us"][m]
            except KeyError:
                continue
            if n > 0 and mean > 0:
                fracs[m] = gap_us / n / mean
        return fracs, shares

    def grad_scaler_step_us(self) -> float | None:
        """GradScaler's host work per optimizer step (unscale_ with its per-parameter Python, the read of the inf
        flag, update): the plain model's fixed optimizer host time under amp_fp16 less under amp_bf16, on each
        instance that measured both, the median over them (the chosen instance's where it has both); None when
        no instance has. Its device kernels are traced operators; this is the host time around them."""
        if "step" in self._scaler:
            return self._scaler["step"]
        deltas: dict[str, float] = {}
        for m in {r.get("machine") or FIRST_MACHINE for r in self.host}:
            fixed = {}
            for st in ("amp_fp16", "amp_bf16"):
                rows = [r for r in self._indexed("torch", "plain", st, "opt", "fixed_us")
                        if (r.get("machine") or FIRST_MACHINE) == m and r.get("status") == "ok"]
                if rows:
                    fixed[st] = statistics.median(float(r["value_us"]) for r in rows)
            if len(fixed) == 2:
                deltas[m] = max(fixed["amp_fp16"] - fixed["amp_bf16"], 0.0)
        out = None
        if deltas:
            out = deltas[self.chosen] if self.chosen in deltas else statistics.median(deltas.values())
        self._scaler["step"] = out
        return out

    def host_extra(self, framework: str, kind: str, setting: str, ranks: int) -> HostExtra:
        key = (framework, kind, setting, ranks)
        if key not in self._extras:
            self._extras[key] = self._host_extra(framework, kind, setting, ranks)
        return self._extras[key]

    def _host_extra(self, framework: str, kind: str, setting: str, ranks: int) -> HostExtra:
        if kind in DTYPE_FREE_HOST_KINDS:
            # DDP's and FSDP2's hooks (bucket copies and all-reduce issue; all-gather and reduce-scatter issue,
            # copy-in/out, reshard) do the same host work in any dtype: every measured setting's rows answer for
            # each setting (median over them), not one setting's single fit (DDP's amp_bf16 fit alone gave
            # 1 ms of forward host work a layer, where DDP's forward does nothing per layer; its bf16 fit gave 0)
            rows = self._host_rows([r for st in self.settings_of(framework, kind)
                                    for r in self._indexed(framework, kind, st)])
        else:
            rows = self._host_rows(self._indexed(framework, kind, setting))
        if not rows:
            return HostExtra.none(kind)
        have = sorted({int(r["ranks"]) for r in rows})
        rk = min(have, key=lambda r: (abs(r - ranks), r))
        per: dict[str, float] = {}
        fixed: dict[str, float] = {}
        for quantity, out in (("extra_per_layer_us", per), ("extra_fixed_us", fixed)):
            for phase in ("fwd", "bwd", "opt"):
                sel = [r for r in rows if int(r["ranks"]) == rk and r["quantity"] == quantity and r["phase"] == phase]
                if sel:  # host costs are non-negative by construction; a negative fit is noise around zero
                    out[phase] = max(self._median_over_machines(sel), 0.0)
        used = sorted({r.get("machine") or FIRST_MACHINE for r in rows if int(r["ranks"]) == rk})
        return HostExtra(per, fixed, f"measured ({rk} ranks, " + (
            f"machine {used[0]})" if len(used) == 1 else f"median of {len(used)} machines)"), rk, kind)


# The tight-loop slopes of an instance's chain probe are used when each is known to within this fraction of the
# plain per-operator mean (one standard error): every H100 probe timed in interleaved rounds is within 13%, the
# H200 probe timed variant by variant 25-33% (bf16) or gives a view a negative cost (amp_bf16)
TIGHT_LOOP_MAX_SE = 0.15


def _slope_and_se(samples_json: Any) -> tuple[float, float] | None:
    """(slope, its standard error) of a probe's time against its layer count ({layers: us}); None with fewer than
    three points or unreadable samples."""
    try:
        pts = sorted((int(k), float(v)) for k, v in json.loads(samples_json).items())
    except (TypeError, ValueError, AttributeError):
        return None
    n = len(pts)
    if n < 3:
        return None
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in pts)
    return slope, math.sqrt(resid / (n - 2) / sxx)


# ---------------------------------------------------------------------------------------------
# a two-stream timeline
# ---------------------------------------------------------------------------------------------

class _Task:
    __slots__ = ("deps", "end", "slow", "stream", "us")

    def __init__(self, stream: int, us: float, deps: list[int], slow: tuple[float, float]) -> None:
        self.stream = stream  # 0 compute, 1 comm
        self.us = us
        self.deps = deps
        self.slow = slow  # comm tasks: (compute, comm) slowdown while both run
        self.end = -1.0


_STREAMS = {"compute": 0, "comm": 1}


class Timeline:
    """Tasks in issue order on two in-order streams (compute, NCCL), each starting when its stream is free
    and its dependencies are done. While both streams run, each progresses at the measured slowed rate
    (1 / slowdown): a fluid simulation, exact for piecewise-constant rates."""

    def __init__(self) -> None:
        self.tasks: list[_Task] = []

    def add(self, stream: str, us: float, deps: list[int | None] | None = None,
            slow: tuple[float, float] = (1.0, 1.0)) -> int:
        self.tasks.append(_Task(_STREAMS[stream], us if us > 0.0 else 0.0,
                                [d for d in deps if d is not None] if deps else [], slow))
        return len(self.tasks) - 1

    def comm(self, inter: Interference, collective: str, nbytes: float, us: float,
             deps: list[int | None] | None = None) -> int:
        return self.add("comm", us, deps, inter.factors(collective, nbytes))

    def run(self) -> tuple[float, float]:
        """(end of the compute stream, end of everything) in us."""
        tasks = self.tasks
        for t in tasks:
            t.end = -1.0
        queues = ([t for t in tasks if t.stream == 0], [t for t in tasks if t.stream == 1])
        head = [0, 0]
        running: list[_Task | None] = [None, None]  # per stream: the task it runs, and its remaining us of work
        rem = [0.0, 0.0]
        now = 0.0
        ends = [0.0, 0.0]
        while True:
            for st in (0, 1):  # start what can start
                q = queues[st]
                while running[st] is None and head[st] < len(q):
                    t = q[head[st]]
                    if any(tasks[d].end < 0 for d in t.deps):
                        break
                    head[st] += 1
                    if t.us <= 0:
                        t.end = now
                        continue
                    running[st] = t
                    rem[st] = t.us
            c, k = running
            if c is not None and k is not None:  # both run, each at its slowed rate
                rate_c, rate_k = 1.0 / k.slow[0], 1.0 / k.slow[1]
                dt = min(rem[0] / rate_c, rem[1] / rate_k)
                now += dt
                for st, t, rate in ((0, c, rate_c), (1, k, rate_k)):
                    r = rem[st] - dt * rate
                    if r <= 1e-9:
                        t.end = ends[st] = now
                        running[st] = None
                    else:
                        rem[st] = r
            elif c is not None or k is not None:
                st = 0 if c is not None else 1
                now += rem[st] / 1.0
                running[st].end = ends[st] = now  # type: ignore[union-attr]
                running[st] = None
            else:
                break
        if any(t.end < 0 for t in tasks):
            raise RuntimeError("timeline deadlock: a dependency on a task issued later on the same stream")
        return ends[0], max(ends[0], ends[1])


# ---------------------------------------------------------------------------------------------
# data parallelism around one micro-batch's backward (and forward, for FSDP)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageShape:
    """Per-section compute of one micro-batch on one stage (us, host idle included) and the bytes of each
    parameter a section owns, in model order (in the parameters' own dtype)."""

    fwd_embed_us: float
    fwd_layer_us: float
    fwd_head_us: float
    bwd_head_us: float
    bwd_layer_us: float
    bwd_embed_us: float
    layers: int
    embed_params: tuple[int, ...]  # embedding (first stage)
    layer_params: tuple[int, ...]  # one decoder layer
    head_params: tuple[int, ...]  # final norm and LM head (last stage)

    @property
    def root_bytes(self) -> int:
        """FSDP2's root unit: everything outside the decoder layers."""
        return sum(self.embed_params) + sum(self.head_params)

    @property
    def layer_bytes(self) -> int:
        return sum(self.layer_params)

    @property
    def plain_bwd_us(self) -> float:
        return self.bwd_head_us + self.layers * self.bwd_layer_us + self.bwd_embed_us


CommFn = Callable[[str, float], float]  # (collective, bytes) -> us


def _bucket_ends(grads: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """DDP's bucket assignment (`_compute_bucket_assignment_by_size`) over (producer, bytes) in the order
    backward produces them: a bucket closes once it holds at least the cap (1 MiB for the first); a parameter
    is never split. Returns (bucket bytes, producer of its last gradient)."""
    out, cur, limit, producer = [], 0, DDP_FIRST_BUCKET_BYTES, 0
    for task, b in grads:
        cur += b
        producer = task
        if cur >= limit:
            out.append((cur, producer))
            cur, limit = 0, DDP_BUCKET_BYTES
    if cur:
        out.append((cur, producer))
    return out


def ddp_buckets(sizes: list[int]) -> list[int]:
    """Bucket sizes for parameter sizes given in reverse parameter order."""
    return [b for b, _ in _bucket_ends([(0, s) for s in sizes])]


@functools.lru_cache(maxsize=4096)
def _ddp_buckets(head: tuple[int, ...], layer: tuple[int, ...], embed: tuple[int, ...], layers: int
                 ) -> tuple[tuple[int, int], ...]:
    """DDP's buckets of one stage's backward: (bytes, index of the compute task that fills it), the compute
    tasks being the head, each layer, the embedding. A pure function of the parameter sizes (every host and
    every DP size of a search shares it)."""
    grads: list[tuple[int, int]] = [(0, b) for b in reversed(head)]
    rl = tuple(reversed(layer))
    for i in range(layers):
        grads += [(1 + i, b) for b in rl]
    grads += [(1 + layers, b) for b in reversed(embed)]
    return tuple(_bucket_ends(grads))


def _chain_after_compute(compute: list[float], comms: list[tuple[float, int, float, float]]) -> tuple[float, float]:
    """`Timeline.run` for the shape DDP has: compute tasks in order without dependencies, and one chain of
    collectives, each (us, the compute task it waits for, compute slowdown, its own slowdown beside compute)
    starting once that task and the previous collective are done. The same fluid simulation, in one pass
    (a search runs it for every candidate; tests check it against the general timeline)."""
    n, nk = len(compute), len(comms)
    done_c = -1  # the last compute task finished
    ci = k = 0
    c_run = k_run = False
    crem = krem = 0.0
    cs = ms = 1.0
    now = end_c = end_m = 0.0
    while True:
        while not c_run and ci < n:
            if compute[ci] <= 0.0:
                done_c = ci
                ci += 1
                continue
            c_run, crem = True, compute[ci]
            ci += 1
        while not k_run and k < nk:
            us, producer, c_slow, m_slow = comms[k]
            if producer > done_c:
                break
            k += 1
            if us <= 0.0:
                continue
            k_run, krem, cs, ms = True, us, c_slow, m_slow
        if c_run and k_run:
            dt = min(crem * cs, krem * ms)
            now += dt
            r = crem - dt / cs
            if r <= 1e-9:
                c_run, done_c, end_c = False, ci - 1, now
            else:
                crem = r
            r = krem - dt / ms
            if r <= 1e-9:
                k_run, end_m = False, now
            else:
                krem = r
        elif c_run:
            now += crem
            c_run, done_c, end_c = False, ci - 1, now
        elif k_run:
            now += krem
            k_run, end_m = False, now
        else:
            break
    if k < nk:
        raise RuntimeError("timeline deadlock: a collective waits for a compute task that does not exist")
    return end_c, max(end_c, end_m)


def ddp_overhead(s: StageShape, comm: CommFn, inter: Interference) -> float:
    """DDP: gradients fill buckets in reverse parameter order as backward produces them (LM head first,
    embedding last); each bucket's all-reduce starts when it is full and the previous one is done; compute
    and NCCL slow each other while both run. Returns the time backward plus the gradient reduction take
    beyond backward's plain compute, in us."""
    compute = [s.bwd_head_us, *([s.bwd_layer_us] * s.layers), s.bwd_embed_us]
    priced: dict[int, tuple[float, float, float]] = {}
    comms = []
    for nbytes, producer in _ddp_buckets(s.head_params, s.layer_params, s.embed_params, s.layers):
        p = priced.get(nbytes)
        if p is None:
            p = priced[nbytes] = (comm("all_reduce", nbytes), *inter.factors("all_reduce", nbytes))
        comms.append((p[0], producer, p[1], p[2]))
    _, end = _chain_after_compute(compute, comms)
    return end - s.plain_bwd_us


def fsdp_overhead(s: StageShape, comm: CommFn, inter: Interference, *, reshard: bool, gather_ratio: float,
                  reduce_ratio: float, copy_us: Callable[[str, float], float]) -> tuple[float, float]:
    """FSDP2 on one micro-batch: `fully_shard` per decoder layer and on the root (embedding, final norm,
    LM head). Forward: the root's all-gather first (exposed), each layer's all-gather prefetched while the
    previous layer computes (at most two gathered units in flight), its copy-out on the compute stream.
    Backward: the root stays gathered; with reshard (ZeRO-3) each layer is gathered again, one ahead; each
    unit's gradients are copied into the reduce-scatter input on the compute stream (FSDP2's foreach_reduce
    copies before the reduce-scatter stream waits on it), then reduce-scattered, the root's (embedding and
    head gradients) last and exposed. Returns the time forward and backward take beyond their plain compute,
    in us."""
    L = s.layers
    priced: dict[tuple[str, float], Any] = {}  # every layer's unit is the same size: each cost once

    def once(what: str, nbytes: float, cost: Callable[[], Any]) -> Any:
        hit = priced.get((what, nbytes))
        if hit is None:
            hit = priced[(what, nbytes)] = cost()
        return hit

    def gather(tl: Timeline, nbytes: float, deps: list[int | None]) -> int:
        full = nbytes * gather_ratio
        us, slow = once("gather", full, lambda: (copy_us("copy_in", full) + comm("all_gather", full),
                                                 inter.factors("all_gather", full)))
        return tl.add("comm", us, deps, slow)

    def reduce(tl: Timeline, nbytes: float, after: int) -> int:
        """The copy-in on the compute stream after `after`, then the reduce-scatter; returns the copy-in."""
        full = nbytes * reduce_ratio
        copy, us, slow = once("reduce", full, lambda: (copy_us("rs_copy_in", full), comm("reduce_scatter", full),
                                                       inter.factors("reduce_scatter", full)))
        c = tl.add("compute", copy, [after])
        tl.add("comm", us, [c], slow)
        return c

    tl = Timeline()
    g_root = gather(tl, s.root_bytes, []) if s.root_bytes else None
    f_prev2: int | None = None
    f_prev = tl.add("compute", s.fwd_embed_us + copy_us("copy_out", s.root_bytes * gather_ratio), [g_root])
    layer_out = copy_us("copy_out", s.layer_bytes * gather_ratio)
    for _ in range(L):
        g = gather(tl, s.layer_bytes, [f_prev2])
        f = tl.add("compute", s.fwd_layer_us + layer_out, [g, f_prev])
        f_prev2, f_prev = f_prev, f
    tl.add("compute", s.fwd_head_us, [f_prev])
    _, f_all = tl.run()
    tl = Timeline()
    prev = tl.add("compute", s.bwd_head_us)
    gathers: dict[int, int] = {}
    if reshard and L:
        gathers[L] = gather(tl, s.layer_bytes, [])
    for i in range(L, 0, -1):
        if reshard and i > 1:
            gathers[i - 1] = gather(tl, s.layer_bytes, [prev])
        b = tl.add("compute", s.bwd_layer_us + (layer_out if reshard else 0.0), [gathers.get(i), prev])
        prev = reduce(tl, s.layer_bytes, b)
    b_emb = tl.add("compute", s.bwd_embed_us, [prev])
    if s.root_bytes:
        reduce(tl, s.root_bytes, b_emb)
    _, b_all = tl.run()
    plain_f = s.fwd_embed_us + L * s.fwd_layer_us + s.fwd_head_us
    return f_all - plain_f, b_all - s.plain_bwd_us


# ---------------------------------------------------------------------------------------------
# pipeline schedules
# ---------------------------------------------------------------------------------------------

def schedule_actions(rank: int, pp: int, m: int, schedule: PipeSchedule) -> list[tuple[str, int, int]]:
    """The order in which torch.distributed.pipelining's schedules run (F|B, stage, micro-batch) on a rank."""
    if schedule == PipeSchedule.GPIPE:
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    if schedule == PipeSchedule.ONE_F_ONE_B:  # Schedule1F1B: warm-up of pp - rank forwards, then B/F pairs
        warm = min(m, pp - rank)
        out = [("F", rank, i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            out.append(("B", rank, b))
            b += 1
            if f < m:
                out.append(("F", rank, f))
                f += 1
        return out
    v = INTERLEAVED_CHUNKS  # ScheduleInterleaved1F1B._calculate_single_rank_operations
    rounds = max(1, m // pp)
    per_round = m // rounds
    total = m * v
    warm = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)
    nf = {c: 0 for c in range(v)}
    nb = {c: 0 for c in range(v)}
    fk = bk = 0
    acts: list[tuple[str, int, int]] = []

    def fwd() -> None:
        nonlocal fk
        c = (fk // per_round) % v
        acts.append(("F", rank + c * pp, nf[c]))
        nf[c] += 1
        fk += 1

    def bwd() -> None:
        nonlocal bk
        c = v - 1 - (bk // per_round) % v
        acts.append(("B", rank + c * pp, nb[c]))
        nb[c] += 1
        bk += 1

    for _ in range(warm):
        fwd()
    for _ in range(total - warm):
        fwd()
        bwd()
    while bk < total:
        bwd()
    return acts


@functools.lru_cache(maxsize=512)
def _schedule_order(pp: int, m: int, schedule: PipeSchedule, n_stages: int
                    ) -> tuple[tuple[int, int, int, bool], ...]:
    """The order in which the event simulation completes every rank's actions: (rank, cost index into
    fwd + bwd, index of the action it waits on or -1, whether a point-to-point transfer precedes it). Which
    action can run next depends only on which have run, never on their costs, so one order serves every
    cost vector of a (pp, m, schedule) (a search evaluates thousands)."""
    acts = [schedule_actions(r, pp, m, schedule) for r in range(pp)]
    done: dict[tuple[str, int, int], int] = {}
    pos = [0] * pp
    left = sum(len(a) for a in acts)
    out: list[tuple[int, int, int, bool]] = []
    while left:
        progressed = False
        for r in range(pp):
            while pos[r] < len(acts[r]):
                kind, s, i = acts[r][pos[r]]
                if kind == "F":
                    dep = done.get(("F", s - 1, i)) if s > 0 else -1
                    p2p, cost = s > 0, s
                else:
                    dep = done.get(("B", s + 1, i)) if s < n_stages - 1 else done.get(("F", s, i))
                    p2p, cost = s < n_stages - 1, n_stages + s
                if dep is None:
                    break
                done[(kind, s, i)] = len(out)
                out.append((r, cost, dep, p2p))
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlock")
    return tuple(out)


def pipeline_time(fwd_us: list[float], bwd_us: list[float], pp: int, m: int, schedule: PipeSchedule,
                  p2p_us: float) -> float:
    """One step's forward and backward over m micro-batches: an event simulation of the schedule's actions
    on every rank, with a point-to-point transfer between consecutive stages. fwd_us/bwd_us are per stage
    (pp of them; pp x chunks under interleaving, stage s on rank s % pp). An action starts when its rank is
    free and its input has arrived; the order comes from `_schedule_order`."""
    if pp <= 1:
        return m * (fwd_us[0] + bwd_us[0])
    if schedule == PipeSchedule.ONE_F_ONE_B and m > pp and 2 * pp * m > ONE_F_ONE_B_PERIODIC_ACTIONS:
        return _one_f_one_b_periodic(tuple(fwd_us), tuple(bwd_us), pp, m, p2p_us)
    if schedule == PipeSchedule.GPIPE:  # (faster than the simulation at any size: 8 us against 33 at 12 actions)
        return _gpipe_longest_path(tuple(fwd_us), tuple(bwd_us), pp, m, p2p_us)
    return _pipeline_time(tuple(fwd_us), tuple(bwd_us), pp, m, schedule, p2p_us)


# Above this many actions 1F1B is timed through its steady state's max-plus matrix (a few numpy products) rather
# than action by action (a planner's PP=32 split of 512 micro-batches has 32,768 actions); the two cost the same
# near 128 actions here (pp 2 x m 32: 155 against 175 us; pp 2 x m 16: 145 against 96)
ONE_F_ONE_B_PERIODIC_ACTIONS = 128


def _maxplus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The max-plus product: (a (x) b)[i, j] = max_k a[i, k] + b[k, j]."""
    return np.max(a[:, :, None] + b[None, :, :], axis=1)


@functools.lru_cache(maxsize=4096)
def _one_f_one_b_periodic(fwd_us: tuple[float, ...], bwd_us: tuple[float, ...], pp: int, m: int, p2p_us: float
                          ) -> float:
    """Schedule1F1B's event simulation (`_pipeline_time`) for m > pp in three parts. Warm-up: rank r runs its
    pp - r forwards. Steady state: m - pp periods in which every rank r runs B(k) then F(pp - r + k); B(k) on rank
    r waits for B(k) of rank r + 1 (the last rank's for its own forward, its clock), F waits for rank r - 1's
    previous forward, which is that rank's clock before the period. So a period maps the ranks' clocks x to
    A (x) x in max-plus algebra (A built symbolically from the period's recurrences), and the m - pp periods are
    A's power by squaring. Cool-down: the remaining O(pp^2) actions simulated from those clocks. The same
    maxima of the same sums as the simulation, in another association (equal to float rounding)."""
    neg = -np.inf
    # warm-up: F(i) on rank r after F(i) on rank r - 1 (every dependency is a warm-up forward)
    clock = [0.0] * pp
    prev: list[float] = []
    for r in range(pp):
        f_us, mine = fwd_us[r], []
        for i in range(pp - r):
            ready = prev[i] + p2p_us if r else 0.0
            clock[r] = (clock[r] if clock[r] > ready else ready) + f_us
            mine.append(clock[r])
        prev = mine
    # one steady period as a max-plus matrix over the clocks before it
    eye = np.full((pp, pp), neg)
    np.fill_diagonal(eye, 0.0)
    rows = np.empty((pp, pp))
    b_next = eye[pp - 1] + bwd_us[pp - 1]
    b_end = [b_next]
    for r in range(pp - 2, -1, -1):
        b_next = np.maximum(eye[r], b_next + p2p_us) + bwd_us[r]
        b_end.append(b_next)
    b_end.reverse()
    for r in range(pp):
        rows[r] = (np.maximum(b_end[r], eye[r - 1] + p2p_us) if r else b_end[r]) + fwd_us[r]
    periods = m - pp
    power, base, n = eye, rows, periods
    while n:
        if n & 1:
            power = _maxplus(base, power)
        n >>= 1
        if n:
            base = _maxplus(base, base)
    clock = np.max(power + np.asarray(clock)[None, :], axis=1).tolist()
    # cool-down: rank r has r pairs B(b), F(pp - r + b) left (b from `periods`), then B of the last pp - r
    # micro-batches. B(b) of rank r waits for rank r + 1's B(b) (the last rank's for its own F(b), its latest
    # forward), F(pp - r + b) for rank r - 1's F of the pair before (that rank's latest forward): so each b in
    # turn, ranks from the last to the first
    f_last = list(clock)  # each rank's latest forward: the last period's
    last = pp - 1
    for b in range(periods, m):
        dep = 0.0
        for r in range(last, -1, -1):
            ready = f_last[r] if r == last else dep + p2p_us
            c = (clock[r] if clock[r] > ready else ready) + bwd_us[r]
            dep = c
            if b < m - pp + r:  # this rank's forward of the pair
                ready = f_last[r - 1] + p2p_us if r else 0.0
                c = (c if c > ready else ready) + fwd_us[r]
                f_last[r] = c
            clock[r] = c
    return max(clock)


@functools.lru_cache(maxsize=4096)
def _gpipe_longest_path(fwd_us: tuple[float, ...], bwd_us: tuple[float, ...], pp: int, m: int, p2p_us: float
                        ) -> float:
    """GPipe's event simulation (`_pipeline_time`) as the longest path through its grid of actions, in O(pp^2)
    whatever m (the simulation's 2 pp m actions took minutes and gigabytes at a million micro-batches). Forward:
    F(i) on rank r waits for the rank's F(i - 1) and rank r - 1's F(i) plus a transfer, so rank r's last forward
    ends at sum(f[0..r]) + r p2p + (m - 1) max(f[0..r]) (every step to the next micro-batch is taken on the
    slowest rank of the path). Backward: B(i) on rank r waits for the rank's B(i - 1) (its last forward before
    B(0)) and rank r + 1's B(i) plus a transfer; a path enters at some rank q >= r from q's last forward, so
    rank r ends at the largest over q of that start + sum(b[r..q]) + (q - r) p2p + (m - 1) max(b[r..q])."""
    fwd_end, run, top = [], 0.0, 0.0
    for r in range(pp):
        run += fwd_us[r]
        top = max(top, fwd_us[r])
        fwd_end.append(run + r * p2p_us + (m - 1) * top)
    out = 0.0
    for r in range(pp):
        run = top = 0.0
        for q in range(r, pp):
            run += bwd_us[q]
            top = max(top, bwd_us[q])
            out = max(out, fwd_end[q] + run + (q - r) * p2p_us + (m - 1) * top)
    return out


@functools.lru_cache(maxsize=4096)
def _pipeline_time(fwd_us: tuple[float, ...], bwd_us: tuple[float, ...], pp: int, m: int, schedule: PipeSchedule,
                   p2p_us: float) -> float:
    """pipeline_time, once per distinct input (a search's ZeRO variants of one split share their stage times)."""
    costs = [*fwd_us, *bwd_us]
    clock = [0.0] * pp
    end: list[float] = []
    for r, c, dep, p2p in _schedule_order(pp, m, schedule, len(fwd_us)):
        ready = (end[dep] if dep >= 0 else 0.0) + (p2p_us if p2p else 0.0)
        t = clock[r] = (clock[r] if clock[r] > ready else ready) + costs[c]
        end.append(t)
    return max(clock)


def in_flight_microbatches(stage: int, pp: int, m: int, schedule: PipeSchedule) -> float:
    """Micro-batches of a stage's activations alive at its peak (in units of the stage's whole layer range)."""
    if pp <= 1:
        return 1.0
    if schedule == PipeSchedule.GPIPE:
        return float(m)
    if schedule == PipeSchedule.INTERLEAVED:
        # the warm-up forwards as schedule_actions runs them (ScheduleInterleaved1F1B: micro-batches per round
        # m // max(1, m // pp), which is Megatron-Core's group of PP wherever its schedule runs, m a multiple of
        # PP), then the first steady forward: chunk-micro-batches in flight, never more than the step's m x v
        v = INTERLEAVED_CHUNKS
        per_round = m // max(1, m // pp)
        warmup = min(m * v, (v - 1) * per_round + 2 * (pp - stage - 1))
        return min(warmup + 1, m * v) / v
    return float(min(pp - stage, m))


def tp_step_keeps_logits(framework: str, tp: int, pp: int) -> bool:
    """DTensor TP as PyTorch's `loss_parallel` documents it (and as the campaign runs it): the step's `pred`
    (the vocab-sharded logits) stays referenced through backward and the optimizer step. Allocator traces of
    2 x H200 steps show it live at every peak (0.49 GiB of bf16 Llama logits, 1.16 GiB of fp32 Qwen2 ones).
    Megatron's step and pipelining's schedule manage their outputs themselves."""
    return framework == Framework.TORCH and tp > 1 and pp == 1


def pipelining_retained_outputs(framework: str) -> bool:
    """torch.distributed.pipelining keeps every micro-batch's stage output until the step ends (to merge
    them); on the last stage that is the logits of all micro-batches. Megatron frees them per micro-batch."""
    return framework == Framework.TORCH

