"""One prediction: model + training setup + parallel split -> iteration time, breakdown, memory.

The pipeline, one module each: the graph (graphcache: traced, cached) -> stages (compose) -> costed stages
(segments: every operator looked up, exact / interpolated / extrapolated / miss) -> the schedule (here and
framework: host/GPU two-queue simulation per stage, 1F1B with TP, PP and DP communication) -> the
prediction (here, with peak memory per stage from memory).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
from tp_query.schema.gpus import GpuSpec, gpu_spec
from tp_query.schema.messages import first_line
from tp_query.schema.model_config import VALIDATED_MODEL_TYPES, ArchFamily, family_label
from tp_query.schema.precision import SETTINGS, DType, Precision, Setting
from tp_query.schema.signature import OpCall, TensorSpec
from tp_query.schema.system import SystemSpec

from .comm import CommModel
from .compose import Composer, StageWork, make_item
from .dbcache import DatabaseError, DbSnapshot
from .flops import graph_parameter_count, megatron_model_flops, parameter_count
from .framework import (
    INTERLEAVED_CHUNKS,
    Framework,
    FrameworkData,
    HostExtra,
    Interference,
    PipeSchedule,
    StageShape,
    ddp_overhead,
    fsdp_overhead,
    pipeline_time,
    pipelining_retained_outputs,
)
from .graph import Graph, Phase, Section, is_graph_json
from .graphcache import TRACE_VERSION, cache_dir, graph_for, trace_fields
from .hostsim import (
    IDENTITY,
    CalibrationError,
    HostMap,
    HostModel,
    compose,
    elapsed_us,
    host_map,
    power,
    simulate,
)
from .lookup import LatencyModel, Query, Source
from .memory import logits_spec, stage_memory
from .parallel import ParallelConfig, PlanError
from .request import (
    MAX_SEQ,
    MAX_TOKENS,
    OPTIMIZERS,
    OpRow,
    PredictError,
    Prediction,
    PredictRequest,
    setting_refusal,
)
from .segments import SOURCES, Segment, SegmentCache

__all__ = ["TRACE_VERSION", "Engine", "OpRow", "PredictError", "PredictRequest", "Prediction", "cache_dir",
           "graph_for", "predict"]


# ---------------------------------------------------------------------------------------------
# engine
# ---------------------------------------------------------------------------------------------

class Engine:
    """Holds the database connection and caches shared across predictions (search reuses it)."""

    def __init__(self, gpu: str = "h200", db_root: str | None = None, system: SystemSpec | None = None,
                 torch_version: str | None = None) -> None:
        try:
            self.gpu: GpuSpec = gpu_spec(gpu)
        except ValueError as e:
            raise PredictError(str(e)) from None
        self.torch_version = torch_version
        # what a planner's worker processes build their own engine from (search evaluates in several)
        self.init_args = (gpu, db_root, system, torch_version)
        self.db = DbSnapshot(self.gpu.name, db_root, torch_version)  # no DuckDB when a snapshot exists
        self.latency = LatencyModel(self.db, self.gpu)
        self.host = self._host_model(db_root)
        if system is not None and system.gpu != self.gpu.name:
            raise PredictError(f"system {system.name!r} has {system.gpu} GPUs, not {self.gpu.name}")
        self.system = system
        self.comm = CommModel(self.gpu, self._comm_table(), system)
        self.framework = FrameworkData(self._optional_table("overlap"), self._optional_table("framework"))
        self._framework_on: dict[str | None, FrameworkData] = {None: self.framework}
        try:
            stacks = self.db.software_versions()
        except DatabaseError as e:
            raise PredictError(str(e)) from None
        used = next((v for v in stacks if v.get("used")), stacks[0] if stacks else {})
        self.software = {k: used.get(k) for k in ("torch", "cuda", "cudnn")}
        others = [v for v in stacks if not v.get("used")]
        listed = "; ".join(f"torch {v['torch']} CUDA {v['cuda']} cuDNN {v['cudnn']}" for v in others[:3])
        self.version_warning = "" if not others else (
            f"operator costs measured under torch {used.get('torch')} (CUDA {used.get('cuda')}, cuDNN "
            f"{used.get('cudnn')}: {used.get('rows')} rows); the database also holds {listed}"
            + (f" and {len(others) - 3} more stacks" if len(others) > 3 else "") + " (choose with --torch)")
        self._graphs: dict[str, Graph] = {}
        self._composers: dict[tuple[int, bool], Composer] = {}
        self._segments: dict[tuple[int, int, int], SegmentCache] = {}
        self.stage_times: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._stage_lists: dict[tuple[object, ...], Any] = {}
        self.item_segments: dict[tuple[int, int, str, int, int], Segment] = {}
        # per TP degree: (call key, phase) -> the raw row of one operator (latencies, comm, flags, source)
        self.item_rows: dict[tuple[int, int], dict[tuple[str, Phase], tuple[float, float, float, bool, int, float, bool,
                                                                Source]]] = {}
        self.segment_flops: dict[int, float] = {}
        self.dp_overheads: dict[tuple[Any, ...], float] = {}
        self.section_summaries: dict[tuple[Any, ...], _SectionSummary] = {}

    def graph(self, req: PredictRequest) -> Graph:
        """The traced graph of a request, kept in memory (search asks for the same ones often)."""
        if is_graph_json(req.model):
            return graph_for(req)
        key = json.dumps({"model": req.model, **trace_fields(req)}, sort_keys=True, default=str)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = graph_for(req)
        return g

    def composer(self, g: Graph) -> Composer:
        k = (id(g), SETTINGS[Setting(g.meta.setting)].allow_tf32)
        if k not in self._composers:
            self._composers[k] = Composer(g, k[1], self._stage_lists)
        return self._composers[k]

    def segments_for(self, comp: Composer, tp: int, ep: int = 1) -> SegmentCache:
        k = (id(comp), tp, ep)
        if k not in self._segments:
            self._segments[k] = SegmentCache(self, comp, tp, ep)
        return self._segments[k]

    def _host_model(self, db_root: str | None) -> HostModel:
        """The database's calibration (local or in object storage), validated; defaults when it has none."""
        root = db_root or self.db.root
        try:
            if "://" in str(root):
                url = f"{str(root).rstrip('/')}/{self.gpu.name}/calibration.json"
                try:
                    text = self.db.sql("SELECT content FROM read_text(?)", [url]).to_pylist()[0]["content"]
                except Exception:
                    self.calibration_source = f"default constants (no calibration at {url})"
                    return HostModel()
                self.calibration_source = url
                return HostModel.from_dict(json.loads(text), url)
            p = Path(root) / self.gpu.name / "calibration.json"
            if not p.exists():
                self.calibration_source = f"default constants (no calibration at {p})"
                return HostModel()
            self.calibration_source = str(p)
            return HostModel.load(p)
        except (CalibrationError, ValueError) as e:
            raise PredictError(first_line(e)) from None

    def _comm_table(self) -> list[dict[str, Any]]:
        return self._optional_table("comm")

    def _optional_table(self, view: str) -> list[dict[str, Any]]:
        return self.db.optional_table(view)

    def predict(self, req: PredictRequest, graph: Graph | None = None, with_ops: bool = False,
                host_range: bool = False) -> Prediction:
        """host_range: also evaluate under the fastest measured host instance and say so when it differs
        (a user's single answer: `tp-query predict`, the API; not a planner's loop)."""
        return self.assemble(req, graph, with_ops).run(host_range=host_range)

    def framework_on(self, machine: str | None) -> FrameworkData:
        """The framework tables with one measured machine instance's host costs (None: the typical host, each
        cost the median over the instances)."""
        if machine not in self._framework_on:
            self._framework_on[machine] = self.framework.on(machine)
        return self._framework_on[machine]

    def assemble(self, req: PredictRequest, graph: Graph | None = None, with_ops: bool = False,
                 host_machine: str | None = None) -> _Assemble:
        """The raw material of a prediction, to evaluate under several host models (calibration); with
        host_machine, under the host costs measured on that instance (validation of its own runs)."""
        par = req.parallel  # validated when it was built
        if req.torch_version is not None and req.torch_version != self.torch_version:
            raise PredictError(f"this engine answers from the torch {self.torch_version or 'primary'} rows, the "
                               f"request asks for torch {req.torch_version}: use Engine(..., torch_version=...)")
        if req.optimizer not in OPTIMIZERS:
            raise PredictError(f"unknown optimizer {req.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        if isinstance(req.seq_len, bool) or not isinstance(req.seq_len, int) or not 1 < req.seq_len <= MAX_SEQ:
            # a causal LM's loss predicts each next token: one token leaves nothing to train on
            raise PredictError(f"sequence length must be an integer in 2..{MAX_SEQ}, got {req.seq_len!r}")
        why = setting_refusal(req.setting, par) or par.unmodelled()
        if why:
            raise PredictError(why)
        if req.seq_len * par.micro_batch > MAX_TOKENS:
            raise PredictError(f"micro-batch x sequence = {req.seq_len * par.micro_batch} tokens is beyond any real "
                               f"micro-batch (at most {MAX_TOKENS})")
        g = graph or self.graph(req)
        comp = self.composer(g)
        try:
            stages = comp.stages(par)
        except PlanError as e:
            raise PredictError(str(e)) from None
        return _Assemble(self, req, g, comp, stages, par, with_ops, host_machine)


@dataclass(frozen=True)
class _SectionSummary:
    """A section's operators under one host model: its two-queue map and its sums (us)."""

    map: HostMap
    gpu_us: float
    host_us: float
    compute_us: float  # GPU time outside collectives
    tp_comm_us: float
    ep_comm_us: float
    src: np.ndarray  # GPU time per source (exact, interpolated, ...)


class _StageRaw(dict[str, Any]):
    """A stage's costed operators; the concatenated forward and backward segments only when asked (the
    per-operator table): the timing composes the sections."""

    def __init__(self, cache: SegmentCache, st: StageWork, **parts: Any) -> None:
        super().__init__(**parts)
        self._cache, self._st = cache, st

    def __missing__(self, key: str) -> Segment:
        st = self._st
        if key == "fwd":
            v = self._cache.stage(Phase.FWD, st.fwd_parts, st.layer_mix)
        elif key == "bwd":
            v = self._cache.stage(Phase.BWD, st.bwd_parts, st.layer_mix)
        else:
            raise KeyError(key)
        self[key] = v
        return v


class _Assemble:
    """A prediction's raw material (per stage: operator arrays) and its evaluation under a host model."""

    def __init__(self, eng: Engine, req: PredictRequest, g: Graph, comp: Composer, stages: list[StageWork],
                 par: ParallelConfig, with_ops: bool, host_machine: str | None = None) -> None:
        self.eng, self.req, self.g, self.comp, self.stages, self.par = eng, req, g, comp, stages, par
        self.with_ops = with_ops
        self.warnings: list[str] = []
        cache = eng.segments_for(comp, par.tp, par.ep)
        self.raw = []
        self._use_host_instance(eng.framework_on(host_machine))
        for st in stages:
            self.raw.append(_StageRaw(
                cache, st, sections={(ph, sec): cache.section(ph, sec, st.layer_mix) for ph, parts in
                                     ((Phase.FWD, st.fwd_parts), (Phase.BWD, st.bwd_parts)) for sec, _ in parts},
                fwd_parts=cache.stage_parts(Phase.FWD, st.fwd_parts, st.layer_mix),
                bwd_parts=cache.stage_parts(Phase.BWD, st.bwd_parts, st.layer_mix),
                opt=cache.items_segment(st.ddp, st.opt, "opt"),
                accum=cache.items_segment(st.accum, None, "accum"),
                ddp=cache.items_segment(st.ddp, None, "ddp")))

    # -- framework ----------------------------------------------------------------------------
    def _host_setting(self) -> str:
        """Host costs were measured under autocast (extra casts) and without it."""
        return "amp_bf16" if self.req.setting.value.startswith("amp") else "bf16"

    def _use_host_instance(self, fw: FrameworkData) -> None:
        """Take one measured instance's host costs (or the typical host's): the framework extras that apply
        to this split, per stage, and plain eager PyTorch's per-operator costs where measured."""
        self.fw = fw
        self.host_extras = self._host_extras()
        st_ = SETTINGS[self.req.setting]
        # torch.amp.GradScaler's host work per step (every rank steps its own optimizer)
        self.scaler_us = (fw.grad_scaler_step_us() or 0.0) if (
            st_.grad_scaler and not st_.master_weights and self.par.framework == Framework.TORCH) else 0.0
        self.extras = [self._host_extra_us(st) for st in self.stages]
        self.host_measured = fw.per_op_host_us(self._host_setting())

    def host_model(self, host: HostModel) -> HostModel:
        return replace(host, **self.host_measured) if self.host_measured else host

    def _host_extras(self) -> list[HostExtra]:
        """The framework's measured host costs that apply to this split (DTensor TP, DDP/FSDP2 hooks)."""
        par, fw = self.par, self.par.framework
        setting = self._host_setting()
        kinds = []
        if par.tp > 1:
            kinds.append("tp_sp" if par.sequence_parallel else "tp")
        if par.dp > 1:
            kinds.append({0: "ddp", 2: "fsdp_z2", 3: "fsdp_z3"}.get(par.zero, ""))
        return [self.fw.host_extra(fw, k, setting, par.gpus) for k in kinds if k]

    def _host_extra_us(self, st: StageWork) -> tuple[float, float, float]:
        """Extra host us per micro-batch (forward, backward) and per step (optimizer) for one stage."""
        out = [0.0, 0.0, self.scaler_us]
        for e in self.host_extras:
            for i, ph in enumerate(("fwd", "bwd", "opt")):
                out[i] += e.per_layer_us.get(ph, 0.0) * st.layers + (e.fixed_us.get(ph, 0.0) if
                                                                      (st.first or st.last) else 0.0)
        return out[0], out[1], out[2]

    # -- evaluation ---------------------------------------------------------------------------
    def _stage_times(self, raw: dict[str, Any], host: HostModel, extra: tuple[float, float, float]
                     ) -> dict[str, Any]:
        """The forward/backward part keyed apart from the optimizer, gradient accumulation and DDP parts: a
        search's DP and ZeRO variants of one stage share it."""
        fb_key = (*((id(p), n) for p, n in raw["fwd_parts"]), None, *((id(p), n) for p, n in raw["bwd_parts"]),
                  host, extra[0], extra[1])
        fb = self.eng.stage_times.get(fb_key)
        if fb is None:
            fb = self.eng.stage_times[fb_key] = self._fb_times(raw, host, extra)
        key = (*(id(raw[k]) for k in ("opt", "accum", "ddp")), host, extra[2])
        rest = self.eng.stage_times.get(key)
        if rest is None:
            rest = self.eng.stage_times[key] = self._rest_times(raw, host, extra)
        out = {**fb, **rest}
        out["src"] = {**fb["src"], **rest["src"]}
        return out

    def _section_summary(self, seg: Segment, host: HostModel, delta_us: float) -> _SectionSummary:
        """One section's host/GPU map and sums under a host model, each operator's host cost raised by
        delta_us (a framework's extra host cost spread over the stage's operators)."""
        key = (id(seg), host, delta_us)
        hit = self.eng.section_summaries.get(key)
        if hit is None:
            g, h = seg.times(host)
            if delta_us:
                h = h + delta_us
            comm, ep = seg.is_comm, seg.ep_mask()
            hit = self.eng.section_summaries[key] = _SectionSummary(
                host_map(g, h, seg.sync), float(g.sum()), float(h.sum()), float(g[~comm].sum()),
                float(g[comm & ~ep].sum()), float(g[ep].sum()),
                np.bincount(seg.src, weights=g, minlength=len(SOURCES)))
        return hit

    def _fb_times(self, raw: dict[str, Any], host: HostModel, extra: tuple[float, float, float]
                  ) -> dict[str, Any]:
        """A stage's forward and backward of one micro-batch through the two-queue model: its sections' maps
        composed (n layers: the layer's map to the n-th power), equal to simulating the concatenated operators."""
        m = IDENTITY
        sums: dict[str, list[Any]] = {}
        for ph, ex in (("fwd", extra[0]), ("bwd", extra[1])):
            parts = raw[f"{ph}_parts"]
            n_ops = sum(len(p.cold) * n for p, n in parts)
            delta = ex / n_ops if ex and n_ops else 0.0
            acc: list[Any] = [0.0, 0.0, 0.0, 0.0, 0.0, np.zeros(len(SOURCES))]
            for p, n in parts:
                s = self._section_summary(p, host, delta)
                m = compose(power(s.map, n), m)
                for i, v in enumerate((s.gpu_us, s.host_us, s.compute_us, s.tp_comm_us, s.ep_comm_us, s.src)):
                    acc[i] = acc[i] + n * v
            sums[ph] = acc
        f, b = sums["fwd"], sums["bwd"]
        elapsed = elapsed_us(m)
        share_f = (f[0] + f[1] + 1e-9) / (f[0] + b[0] + f[1] + b[1] + 1e-9)
        sections = {k: float(seg.times(host)[0].sum()) for k, seg in raw["sections"].items()}
        return {"src": {"fwd": f[5], "bwd": b[5]}, "sections": sections, "fb_gpu_us": float(f[0] + b[0]),
                "fwd_us": elapsed * share_f, "bwd_us": elapsed * (1 - share_f),
                "fwd_gpu_us": float(f[2]), "bwd_gpu_us": float(b[2]),
                "tp_comm_us": float(f[3] + b[3]), "ep_comm_us": float(f[4] + b[4])}

    def _rest_times(self, raw: dict[str, Any], host: HostModel, extra: tuple[float, float, float]
                    ) -> dict[str, Any]:
        go, ho = raw["opt"].times(host)
        if extra[2] and len(ho):
            ho = ho + extra[2] / len(ho)
        so = simulate(go, ho, raw["opt"].sync)
        ga, _ = raw["accum"].times(host)
        gd, _ = raw["ddp"].times(host)
        src = {name: np.bincount(raw[name].src, weights=g, minlength=len(SOURCES))
               for name, g in (("opt", go), ("accum", ga), ("ddp", gd))}
        return {"src": src, "opt_us": so.elapsed_us, "opt_gpu_us": so.gpu_us, "accum_us": float(ga.sum()),
                "ddp_us": float(gd.sum())}

    def evaluate(self, host: HostModel) -> tuple[float, dict[str, float], list[dict[str, float]], int]:
        """Iteration time (us), breakdown (ms), per-stage times and the critical stage."""
        host = self.host_model(host)
        par, m = self.par, self.par.micro_batches
        per_stage = [self._stage_times(r, host, e) for r, e in zip(self.raw, self.extras, strict=True)]
        p2p = self.eng.comm.estimate("send_recv", self._p2p_bytes(), 2,
                                     spans_hosts=par.tp * par.dp >= self.eng.comm.gpus_per_node).us \
            if par.pp > 1 else 0.0
        cost = [r["fwd_us"] + r["bwd_us"] + 2 * p2p for r in per_stage]
        crit = int(np.argmax(cost))
        c = per_stage[crit]
        pipe = self._pipeline_us(per_stage, m, p2p) if par.pp > 1 else m * cost[0]
        fwd_compute = m * c["fwd_gpu_us"]
        bwd_compute = m * c["bwd_gpu_us"]
        tp_comm = m * c["tp_comm_us"]
        ep_comm = m * c["ep_comm_us"]
        host_fb = m * (c["fwd_us"] + c["bwd_us"] - c["fwd_gpu_us"] - c["bwd_gpu_us"] - c["tp_comm_us"]
                       - c["ep_comm_us"])
        pp_comm = (2 * m * p2p + 2 * (par.pp - 1) * p2p) if par.pp > 1 else 0.0
        bubble = max(pipe - (fwd_compute + bwd_compute + tp_comm + ep_comm + host_fb + 2 * m * p2p), 0.0) \
            if par.pp > 1 else 0.0
        accum = (m - 1) * c["accum_us"]
        merge = self._merge_us(host) if par.pp > 1 else 0.0
        dp_exposed = self._dp_comm_us(self.stages[crit], c)
        opt_gpu = max(r["opt_gpu_us"] for r in per_stage)
        opt_host = max(r["opt_us"] for r in per_stage) - opt_gpu
        host_total = host_fb + opt_host + host.per_iteration_us
        breakdown = {
            "forward_ms": fwd_compute / 1e3,
            "backward_ms": (bwd_compute + accum + c["ddp_us"]) / 1e3,
            "optimizer_ms": opt_gpu / 1e3,
            "tp_comm_ms": tp_comm / 1e3,
            **({"ep_comm_ms": ep_comm / 1e3} if par.ep > 1 else {}),
            "pp_comm_ms": pp_comm / 1e3,
            "dp_comm_ms": dp_exposed / 1e3,
            "pipeline_bubble_ms": bubble / 1e3,
            **({"pp_output_merge_ms": merge / 1e3} if merge else {}),
            "host_overhead_ms": host_total / 1e3,
        }
        breakdown = {k: float(v) for k, v in breakdown.items()}
        return sum(breakdown.values()) * 1e3, breakdown, per_stage, crit

    def run(self, host: HostModel | None = None, host_range: bool = False) -> Prediction:
        host = host or self.eng.host
        par = self.par
        total_us, breakdown, per_stage, crit = self.evaluate(host)
        m = par.micro_batches
        source_time: dict[str, float] = defaultdict(float)
        op_rows: dict[tuple[str, str], list[Any]] = {}
        raw = self.raw[crit]
        src_sums: dict[str, np.ndarray] = per_stage[crit]["src"]  # type: ignore[assignment]
        for name, mult in (("fwd", m), ("bwd", m), ("opt", 1), ("accum", max(m - 1, 0)), ("ddp", 1)):
            for i, v in enumerate(src_sums[name] * mult):
                if v:
                    source_time[str(SOURCES[i])] += float(v)
            if self.with_ops:
                seg = cast(Segment, raw[name])
                g, _ = seg.times(host)
                w = seg.weights()
                for it, t, wi, code in zip(seg.items, g, w, seg.src, strict=True):
                    if not wi:  # a layer kind this stage does not hold (its share of the layers is 0)
                        continue
                    row = op_rows.setdefault((it.phase.value, it.key), [it, 0, float(t / wi), str(SOURCES[code])])
                    row[1] += mult * wi
        mems = [stage_memory(self.g, s, par, self.req.optimizer, self.eng.gpu) for s in self.stages]
        mem = max(mems, key=lambda x: x.peak_bytes)
        fits = all(x.fits for x in mems)
        if not fits:
            self.warnings.append(f"does not fit: peak {mem.peak_bytes / 2**30:.1f} GiB on stage "
                                 f"{mems.index(mem)} > {mem.capacity_bytes / 2**30:.1f} GiB usable")
        total_src = sum(source_time.values()) or 1.0
        sources = {k: v / total_src for k, v in sorted(source_time.items())}
        for k in ("exact", "interpolated", "extrapolated", "miss"):
            sources.setdefault(k, 0.0)
        if sources.get("miss", 0) > 0.001:
            self.warnings.append(f"{sources['miss']:.1%} of the time comes from operators with no comparable "
                                 "measurement (roofline estimate)")
        if sources.get("extrapolated", 0) > 0.1:
            self.warnings.append(f"{sources['extrapolated']:.1%} of the time is extrapolated beyond measured shapes")
        if sources.get("comm-model", 0) > 0 or (par.dp > 1 and not self._dp_measured()):
            have = sorted({r for _, r in self.eng.comm.table})
            cover = f"measured tables cover {', '.join(map(str, have))} ranks" if have else "no measured collectives"
            self.warnings.append(f"communication uses the alpha-beta model where not measured ({cover}; NVLink "
                                 f"{self.eng.comm.nvlink[0] / 1e9:.0f} GB/s, "
                                 f"network {self.eng.comm.network[0] / 1e9:.0f} GB/s per GPU, "
                                 f"{self.eng.comm.gpus_per_node} GPUs per node"
                                 + (f" from system {self.eng.system.name!r})" if self.eng.system else ")"))
        sysspec = self.eng.system
        if sysspec is not None and self.eng.comm.table and par.gpus > 1 and \
                abs(sysspec.nvlink_bytes_per_s / self.eng.gpu.nvlink_bytes_per_s - 1) > 0.05:
            self.warnings.append(f"collectives inside a node come from the NCCL tables measured on {self.eng.gpu.name} "
                                 f"hosts ({self.eng.gpu.nvlink_bytes_per_s / 1e9:.0f} GB/s NVLink), not from system "
                                 f"{sysspec.name!r}'s {sysspec.nvlink_bytes_per_s / 1e9:.0f} GB/s; its figures price "
                                 "what the tables do not cover (more ranks, the network)")
        # a user's single answer states the step's range over the measured host instances where it spans more
        # than 5% (a planner's loop does not pay for those evaluations)
        spread = self._host_instances_ms(host) if host_range and self.fw.machine is None else None
        if spread and spread[1] - spread[0] > 0.05 * total_us / 1e3:
            self.warnings.append(f"host speed: {spread[0]:.1f} to {spread[1]:.1f} ms over the {spread[2]} measured "
                                 f"host instances of this GPU; {total_us / 1e3:.1f} ms is the typical host's (each "
                                 "host cost the median over the instances)")
        host_share = breakdown["host_overhead_ms"] * 1e3 / total_us if total_us else 0.0
        extras = [e.source for e in self.host_extras if e.source != "none"]
        if host_share > 0.3:
            self.warnings.append(f"host-bound: {host_share:.0%} of the step is host overhead"
                                 + (" (DTensor dispatch and framework hooks, measured)" if extras else "")
                                 + "; eager PyTorch cannot keep the GPU busy at this size")
        par = self.par
        if par.dp > 1 and par.zero >= 2 and par.framework == Framework.TORCH and not self.eng.framework.copies:
            self.warnings.append("FSDP2's parameter and gradient copies are not measured in this database: priced "
                                 "at peak HBM bandwidth (measured by `python -m tp_query.collector dist-probe --what copies`)")
        if par.framework == Framework.MEGATRON:
            self.warnings.append("Megatron-Core's gradient clipping is modelled as not taken; a step whose gradient "
                                 "norm exceeds --clip-grad also scales every gradient (one more pass over them)")
        if self.eng.version_warning:
            self.warnings.append(self.eng.version_warning)
        max_pos = self.g.meta.model.get("max_position_embeddings") if self.g.meta.source == "config" else None
        if isinstance(max_pos, int) and self.g.meta.seq_len > max_pos:
            self.warnings.append(f"sequence length {self.g.meta.seq_len} exceeds the model's max_position_embeddings "
                                 f"{max_pos}: predicted as the same model run at that length (context extension); "
                                 "as configured it was not trained for it")
        model = self.g.meta.model
        if model.get("family") == ArchFamily.TRANSFORMERS.value:
            mt = model.get("model_type")
            runs = ("a model type with held-out runs of cut models here (docs/validation.md)"
                    if mt in VALIDATED_MODEL_TYPES else "a model type without a validation run here")
            self.warnings.append(f"{mt}: transformers' own module as the config builds it, {runs} (its operators are "
                                 f"priced from the database like any other; MFU is not computed)")
            if self.par.tp > 1:
                self.warnings.append(f"{mt} under TP={self.par.tp}: the rank's module is built from the divided config "
                                     "(checked to be Megatron's column/row split) with DTensor's collectives and host "
                                     "costs as measured for the listed families; no TP run of a model type known only "
                                     "to transformers was measured")
        self.warnings += [w for w in self.g.meta.extra.get("warnings", []) if w not in self.warnings]
        if self.eng.calibration_source.startswith("default"):
            self.warnings.append(f"host model: {self.eng.calibration_source}")
        if self.req.strict and (sources.get("extrapolated", 0) > 0 or sources.get("miss", 0) > 0):
            raise PredictError(f"--strict: {sources['extrapolated'] + sources['miss']:.1%} of the time would come "
                               "from extrapolation or misses")
        gb = par.global_batch or par.dp * par.micro_batch
        tokens = gb * self.g.meta.seq_len
        if self.g.meta.source == "module":  # its own batch of token ids per micro-batch (0 when it has none)
            tokens = par.dp * par.micro_batches * self.g.meta.micro_batch * self.g.meta.seq_len
        flops = self._flops(total_us, gb)
        return Prediction(
            iteration_ms=total_us / 1e3, breakdown=breakdown, peak_memory_gib=mem.peak_bytes / 2**30, fits=fits,
            memory={"weights_gib": mem.weights_bytes / 2**30, "grads_gib": mem.grads_bytes / 2**30,
                    "optimizer_gib": mem.optimizer_bytes / 2**30, "activations_gib": mem.activations_bytes / 2**30,
                    "transient_gib": mem.transient_bytes / 2**30, "buffers_gib": mem.buffers_bytes / 2**30,
                    "capacity_gib": mem.capacity_bytes / 2**30, "margin_gib": mem.margin_bytes / 2**30},
            sources=sources, warnings=self.warnings, config=self._config(self.host_model(host)),
            tokens_per_s=tokens / (total_us / 1e6),
            stages=[{"stage": s.index, "layers": s.layers, "fwd_ms": r["fwd_us"] / 1e3, "bwd_ms": r["bwd_us"] / 1e3,
                     "opt_ms": r["opt_us"] / 1e3, "peak_memory_gib": mm.peak_bytes / 2**30}
                    for s, r, mm in zip(self.stages, per_stage, mems, strict=True)],
            ops=self._op_rows(op_rows) if self.with_ops else [], **flops,
            sections=self._section_rows(crit, per_stage[crit]),
        )

    def _host_instances_ms(self, host: HostModel) -> tuple[float, float, int] | None:
        """The shortest and the longest iteration over the measured host instances (each instance's own
        costs) and how many instances there are; None with fewer than 2."""
        machines = self.eng.framework.machines()
        if len(machines) < 2:
            return None
        current = self.fw
        out = []
        try:
            for m in machines:
                self._use_host_instance(self.eng.framework_on(m))
                out.append(self.evaluate(host)[0] / 1e3)
        finally:
            self._use_host_instance(current)
        return min(out), max(out), len(machines)

    def _section_rows(self, crit: int, times: dict[str, Any]) -> list[dict[str, Any]]:
        """The slowest stage's GPU time by section: one copy's forward and backward, the copies per
        micro-batch, and the iteration's total (micro-batches included)."""
        st = self.stages[crit]
        m = self.par.micro_batches
        sec = times["sections"]
        names = {Section.EMBED: "embedding", Section.LAYER: "decoder layer", Section.HEAD: "head (norm, LM head, loss)",
                 Section.BODY: "module"}
        copies = {sec_: n for sec_, n in st.fwd_parts}
        rows = []
        for se, name in names.items():
            f, b = sec.get((Phase.FWD, se)), sec.get((Phase.BWD, se))
            if f is None and b is None:
                continue
            n = copies.get(se, 1)
            each = ((f or 0.0) + (b or 0.0)) / 1e3
            rows.append({"section": name, "count": n, "fwd_ms": (f or 0.0) / 1e3, "bwd_ms": (b or 0.0) / 1e3,
                         "each_ms": each, "total_ms": each * n * m})
        rows.append({"section": "optimizer step", "count": 1, "fwd_ms": 0.0, "bwd_ms": 0.0,
                     "each_ms": times["opt_gpu_us"] / 1e3, "total_ms": times["opt_gpu_us"] / 1e3})
        return rows

    def _seg_flops(self, seg: Segment) -> float:
        """Operator FLOPs of a segment, once per segment (search shares segments across candidates)."""
        cache = self.eng.segment_flops
        k = id(seg)
        if k not in cache:
            if seg.parts is not None:
                cache[k] = sum(self._seg_flops(p) * n for p, n in seg.parts)
            else:
                cache[k] = float(sum(it.info.flops * w for it, w in zip(seg.items, seg.weights(), strict=True)))
        return cache[k]

    def _flops(self, total_us: float, global_batch: int) -> dict[str, Any]:
        """MFU and achieved TFLOP/s per GPU (model FLOPs as Megatron counts them; hardware FLOPs as run)."""
        par, g = self.par, self.g
        spec = g.meta.model if g.meta.source == "config" else {}
        model = megatron_model_flops(spec, global_batch, g.meta.seq_len) if spec else None
        m = par.micro_batches
        hw = 0.0
        for raw in self.raw:  # each DP replica and TP rank runs its stage's shard
            seg = cast(dict[str, Segment], raw)
            per = m * sum(self._seg_flops(p) * n for ph in ("fwd_parts", "bwd_parts") for p, n in raw[ph]) \
                + self._seg_flops(seg["opt"])
            per += max(m - 1, 0) * self._seg_flops(seg["accum"])
            hw += per * par.dp * par.tp
        secs = total_us / 1e6
        st_ = SETTINGS[Setting(g.meta.setting)]
        dt = st_.autocast_dtype or st_.param_dtype
        prec = {DType.BF16: Precision.BF16, DType.FP16: Precision.FP16}.get(
            dt, Precision.TF32 if st_.allow_tf32 else Precision.FP32)
        peak = (self.eng.gpu.datasheet_flops or self.eng.gpu.peak_flops).get(prec)
        per_gpu_model = model / secs / par.gpus if model and secs > 0 else None
        params = parameter_count(spec) if spec else None
        if spec and params is None and g.meta.traced_layers and g.meta.tp == 1:
            params = graph_parameter_count(g)
        return {"parameters": params, "model_flops": model,
                "model_tflops_per_gpu": per_gpu_model / 1e12 if per_gpu_model else None,
                "hardware_tflops_per_gpu": hw / secs / par.gpus / 1e12 if secs > 0 else None,
                "mfu": per_gpu_model / peak if per_gpu_model and peak else None}

    def _dp_measured(self) -> bool:
        par = self.par
        kind = "all_reduce" if par.zero == 0 else "reduce_scatter"
        return self.eng.comm.estimate(kind, 1e6, par.dp, self._dp_spans_nodes()).source == Source.COMM_MEASURED

    def _dp_spans_nodes(self) -> bool:
        """A data-parallel group crosses nodes once TP x DP outgrows a node."""
        return self.par.tp * self.par.dp > self.eng.comm.gpus_per_node

    def _merge_us(self, host: HostModel) -> float:
        """torch.distributed.pipelining's schedule.step() ends on the last stage by concatenating every
        micro-batch's output (merge_chunks: the logits), after the last backward and before the optimizer;
        priced as that concatenation from the database (Megatron frees outputs per micro-batch)."""
        par = self.par
        if not pipelining_retained_outputs(par.framework) or not self.g.meta.traced_layers:
            return 0.0
        call = OpCall("aten.cat.default", ([logits_spec(self.g, par)] * par.micro_batches,))
        it = make_item(call.op, call.to_json_str(), Phase.BWD, False, call)
        e = self.eng.latency.estimate([Query(it.key, call.op, it.info)])[it.key]
        return e.warm_us + host.beta * (e.cold_us - e.warm_us)

    def _p2p_bytes(self) -> float:
        spec = self.g.meta.model
        # the residual stream is in the parameters' dtype (fp32 under autocast with fp32 weights)
        act_dt = SETTINGS[Setting(self.g.meta.setting)].param_dtype
        seq = self.g.meta.seq_len // (self.par.tp if self.par.sequence_parallel else 1)
        return float(self.g.meta.micro_batch * seq * int(spec.get("hidden_size", 0)) * act_dt.itemsize)

    def _pipeline_us(self, per_stage: list[dict[str, Any]], m: int, p2p: float) -> float:
        """The schedule's forward/backward time over m micro-batches. Interleaving splits each rank's layers
        into chunks: stage s of pp x chunks has its share of layers, the embedding on the first, the head
        on the last (per-layer costs from the ranks' own sections)."""
        par = self.par
        sched = PipeSchedule(par.pp_schedule)
        if sched != PipeSchedule.INTERLEAVED:
            return pipeline_time([r["fwd_us"] for r in per_stage], [r["bwd_us"] for r in per_stage], par.pp, m,
                                 sched, p2p)
        first = self.stage_shape(self.stages[0], per_stage[0])
        last = self.stage_shape(self.stages[-1], per_stage[-1])
        n = par.pp * INTERLEAVED_CHUNKS
        per = sum(s.layers for s in self.stages) // n
        fwd = [per * first.fwd_layer_us + (first.fwd_embed_us if s == 0 else 0.0) +
               (last.fwd_head_us if s == n - 1 else 0.0) for s in range(n)]
        bwd = [per * first.bwd_layer_us + (first.bwd_embed_us if s == 0 else 0.0) +
               (last.bwd_head_us if s == n - 1 else 0.0) for s in range(n)]
        return pipeline_time(fwd, bwd, par.pp, m, sched, p2p)

    def stage_shape(self, s: StageWork, c: dict[str, Any]) -> StageShape:
        """Per-section compute of one micro-batch (host idle spread in proportion) and parameter bytes."""
        sec = c["sections"]
        scale = (c["fwd_us"] + c["bwd_us"]) / max(c["fb_gpu_us"], 1e-9)

        def t(ph: Phase, se: Section, per: int = 1) -> float:
            return sec.get((ph, se), 0.0) * scale / per

        def sizes(se: Section) -> tuple[int, ...]:
            return tuple(p.numel * DType(p.dtype).itemsize for p in s.params if p.section == se)

        body = Section.BODY if (Phase.FWD, Section.BODY) in sec else None
        return StageShape(
            fwd_embed_us=t(Phase.FWD, Section.EMBED) + (t(Phase.FWD, body) if body else 0.0),
            fwd_layer_us=t(Phase.FWD, Section.LAYER), fwd_head_us=t(Phase.FWD, Section.HEAD),
            bwd_head_us=t(Phase.BWD, Section.HEAD) + (t(Phase.BWD, body) if body else 0.0),
            bwd_layer_us=t(Phase.BWD, Section.LAYER), bwd_embed_us=t(Phase.BWD, Section.EMBED),
            layers=s.layers, embed_params=sizes(Section.EMBED) + (sizes(Section.BODY) if body else ()),
            layer_params=s.layer_param_bytes if s.layers else (), head_params=sizes(Section.HEAD))

    def interference(self) -> Interference:
        st = SETTINGS[self.req.setting]
        cls = "half" if st.autocast_dtype or st.param_dtype in (DType.BF16, DType.FP16) else (
            "tf32" if st.allow_tf32 else "fp32")
        if cls == "fp32":
            return Interference(source="fp32 SIMT GEMMs: not measured, none assumed")
        return self.eng.framework.interference(self.par.dp, cls)

    def _dp_comm_us(self, s: StageWork, c: dict[str, Any]) -> float:
        """Exposed data-parallel communication of a step (and the slowdown NCCL causes to compute beside it),
        once per distinct (stage shape, split, precision): search evaluates many candidates that share them."""
        par = self.par
        if par.dp <= 1:
            return 0.0
        shape = self.stage_shape(s, c)
        key = (shape, s.param_numel, s.param_bytes, par.dp, par.tp, par.ep, par.zero, par.framework,
               par.micro_batches, self.req.setting)
        hit = self.eng.dp_overheads.get(key)
        if hit is None:
            hit = self.eng.dp_overheads[key] = self._dp_comm_uncached(s, shape)
        return hit

    def _dp_comm_uncached(self, s: StageWork, shape: StageShape) -> float:
        par = self.par
        spans = self._dp_spans_nodes()

        def comm(kind: str, nbytes: float) -> float:
            return self.eng.comm.estimate(kind, nbytes, par.dp, spans).us

        inter = self.interference()
        torch_fw = par.framework == Framework.TORCH
        hbm = self.eng.gpu.hbm_bytes_per_s
        if not torch_fw:
            # Megatron-Core's DDP as it ships (overlap_grad_reduce=False): after backward, the whole fp32
            # gradient buffer is scaled by 1/DP and all-reduced (or reduce-scattered for the distributed
            # optimizer, whose updated parameters are then all-gathered in their own dtype); nothing overlaps
            # With expert parallelism the routed experts' part reduces over its own replicas (DP / EP).
            buf = 4.0 * s.param_numel
            scale_us = 2e6 * buf / hbm
            expert = s.expert_numel if par.ep > 1 else 0
            dense_share = (s.param_numel - expert) / max(s.param_numel, 1)

            def over(kind: str, nbytes: float, ranks: int) -> float:
                return self.eng.comm.estimate(kind, nbytes, ranks, spans).us if ranks > 1 and nbytes > 0 else 0.0

            groups = ((par.dp, dense_share), (par.expert_dp, 1.0 - dense_share))
            if par.zero == 0:
                return scale_us + sum(over("all_reduce", buf * f, r) for r, f in groups)
            return scale_us + sum(over("reduce_scatter", buf * f, r) + over("all_gather", s.param_bytes * f, r)
                                  for r, f in groups)
        if par.zero == 0:
            return ddp_overhead(shape, comm, inter)
        if par.zero >= 2 and torch_fw:  # FSDP2: every micro-batch gathers and reduce-scatters
            st = SETTINGS[self.req.setting]
            reduce_ratio = 4 / st.param_dtype.itemsize if st.master_weights else 1.0

            param_size = st.param_dtype.itemsize

            def copy_us(phase: str, nbytes: float) -> float:
                """FSDP2's parameter copies as measured (collector dist-probe --what copies); peak HBM bandwidth
                where this database has none (said in the prediction's warnings) and for the gradients'
                reduce-scatter copy-in, whose probe (`_chunk_cat` alone) runs 2-4x slower on units of 1 GB and
                more at 2 ranks than the same copy in profiled FSDP2 steps (docs/validation-notes.md)."""
                measured = None if phase == "rs_copy_in" else self.eng.framework.fsdp_copy_us(
                    phase, nbytes, param_size, par.dp)
                if measured is not None:
                    return measured
                moved = nbytes / 2 if phase == "copy_in" else nbytes
                return 2e6 * moved / hbm + 3.0 if nbytes > 0 else 0.0

            f, b = fsdp_overhead(shape, comm, inter, reshard=par.zero == 3, gather_ratio=1.0,
                                 reduce_ratio=reduce_ratio, copy_us=copy_us)
            return par.micro_batches * (f + b)
        # ZeRO-1 (and Megatron's distributed optimizer): gradients reduce-scattered as buckets fill, the
        # updated parameters all-gathered after the optimizer step
        gbytes = s.param_bytes
        rs = comm("reduce_scatter", gbytes)
        ag = comm("all_gather", gbytes)
        return max(0.0, rs - 0.9 * shape.plain_bwd_us) + ag

    def _config(self, host: HostModel) -> dict[str, Any]:
        r, par = self.req, self.par
        return {"model": r.model_name, "gpu": self.eng.gpu.name, "precision": self.g.meta.setting, "dp": par.dp,
                "tp": par.tp, "pp": par.pp, "ep": par.ep, "micro_batch": par.micro_batch,
                "global_batch": par.global_batch or par.dp * par.micro_batch, "micro_batches": par.micro_batches,
                "seq_len": self.g.meta.seq_len, "optimizer": r.optimizer, "sequence_parallel": par.sequence_parallel,
                "zero": par.zero, "recompute": "full" if par.recompute else "none", "gpus": par.gpus,
                "layers": self.g.meta.model.get("num_layers"), "host_model": asdict(host),
                "calibration": self.eng.calibration_source, "framework": par.framework,
                "system": self.eng.system.name if self.eng.system else None,
                "pp_schedule": par.pp_schedule,
                "model_graph": self._model_graph(),
                "framework_data": {"interference": self.interference().source,
                                   "host_costs": sorted({e.source for e in self.host_extras}) or ["none"],
                                   "per_op_host": "measured" if self.host_measured else "calibration",
                                   **({"grad_scaler_host_us": round(self.scaler_us, 1)} if self.scaler_us else {})}}

    def _model_graph(self) -> dict[str, Any]:
        """Where the operator graph came from and what it assumes (families, layer types, MoE routing)."""
        m = self.g.meta.model if self.g.meta.source == "config" else {}
        if not m:
            return {"source": self.g.meta.source}
        megatron = self.par.framework == "megatron"
        out: dict[str, Any] = {
            "family": family_label(m),
            "builder": "Megatron-Core local spec" if megatron else (
                "transformers' own modules" if m.get("builder") == "hf" else "op-for-op copy of transformers"),
            "graph": (f"template {self.g.meta.extra['template']} (its structural type's graph, every number fitted from "
                      f"{self.g.meta.extra.get('template_traces')} traces with torch {self.g.meta.torch_version} and "
                      "checked on each; no trace at query time)"
                      if isinstance(self.g.meta.extra, dict) and self.g.meta.extra.get("template")
                      else f"traced with torch {self.g.meta.torch_version}"),
        }
        types = m.get("layer_types") or []
        if types:
            out["layer_types"] = {t: types.count(t) for t in dict.fromkeys(types)}
            out["sliding_window"] = m.get("sliding_window")
        mlps = m.get("mlp_layer_types") or []
        if mlps:
            out["mlp_layer_types"] = {t: mlps.count(t) for t in dict.fromkeys(mlps)}
        rope = m.get("rope_layers") or []
        if rope:
            out["rope_layers"] = {"rope": sum(map(bool, rope)), "none": len(rope) - sum(map(bool, rope))}
        if m.get("num_experts"):
            e, k = int(m["num_experts"]), int(m["experts_per_token"])
            experts = (f"SequentialMLP, {e // self.par.ep} local experts per rank, all-to-all over EP={self.par.ep}"
                       if megatron else "grouped GEMMs timed with equal groups")
            imb = self.req.moe_imbalance
            out["moe_routing"] = (
                f"balanced: each of {e} experts receives tokens x {k} / {e} rows ({experts}; "
                + ("--moe-imbalance skews it)" if megatron else "a skewed router is modelled with --framework megatron)")
                if imb == 1.0 else
                f"skewed (--moe-imbalance {imb:g}): the busiest expert receives {imb:g} x tokens x {k} / {e} rows, "
                f"the others share the rest evenly; this rank hosts it ({experts})")
        return out

    def _op_rows(self, rows: dict[tuple[str, str], list[Any]]) -> list[OpRow]:
        out = []
        for (phase, _), (it, count, us, src) in rows.items():
            shapes = " ".join("x".join(map(str, t.shape)) + f":{t.dtype}" for t in it.call.tensors()
                              if isinstance(t, TensorSpec))[:120]
            comm = it.call.op.startswith("comm.")
            out.append(OpRow(phase, it.call.op, "communication" if comm else it.info.kind,
                             "-" if comm else str(it.info.precision), shapes, count, us, us * count / 1e3, src))
        out.sort(key=lambda r: -r.total_ms)
        return out


def predict(req: PredictRequest, with_ops: bool = False, system: SystemSpec | None = None) -> Prediction:
    """One prediction with a fresh engine."""
    return Engine(req.gpu, req.db_root, system, req.torch_version).predict(req, with_ops=with_ops, host_range=True)
