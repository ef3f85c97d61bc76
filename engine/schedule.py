"""The schedule of one step: a prediction's costed stages (per stage, its sections' operator arrays from
segments) timed under a host model: the two-queue host/GPU composition per section, the framework's host
extras, the pipeline schedule with its point-to-point transfers, and the data-parallel collectives with
their interference. Read after compose (stages) and segments (costed operators); prediction turns its
times into the user's answer."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from tp_query.schema.precision import SETTINGS, DType
from tp_query.schema.signature import OpCall

from .compose import Composer, StageWork, make_item
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
from .graph import Graph, Phase, Section
from .hostsim import (
    IDENTITY,
    HostMap,
    HostModel,
    ShiftedHostMap,
    compose,
    elapsed_us,
    host_map,
    power,
    simulate,
)
from .lookup import Query
from .memory import logits_spec, stage_io_bytes
from .parallel import ParallelConfig, PlanError
from .request import PredictRequest
from .segments import SOURCES, Segment, SegmentCache

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True)
class SectionSummary:
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


def _stage_kind(st: StageWork) -> tuple[Any, ...]:
    """What a stage's costed operators and host extras depend on: its sections and their counts, its layer mix,
    and its optimizer, accumulation and DDP lists (shared objects: their identity stands for their content)."""
    return (st.first, st.last, st.layers, st.layer_mix, id(st.opt), id(st.accum), id(st.ddp))


class StepSchedule:
    """A prediction's raw material (per stage: operator arrays) and its evaluation under a host model."""

    def __init__(self, eng: Engine, req: PredictRequest, g: Graph, comp: Composer, stages: list[StageWork],
                 par: ParallelConfig, with_ops: bool, host_machine: str | None = None) -> None:
        self.eng, self.req, self.g, self.comp, self.stages, self.par = eng, req, g, comp, stages, par
        self.with_ops = with_ops
        self.warnings: list[str] = []
        cache = eng.segments_for(comp, par.tp, par.ep)
        self.raw = []
        self._use_host_instance(eng.framework_on(host_machine))
        # stages alike in everything their time depends on share one costed record (a 32-stage pipeline has at
        # most four kinds: first, last, and middle stages of the two layer counts), so each kind is timed once
        alike = eng.stage_raws.setdefault(id(cache), {})  # a search's candidates share their stage kinds
        for st in stages:
            k = _stage_kind(st)
            raw = alike.get(k)
            if raw is None:
                raw = alike[k] = _StageRaw(
                    cache, st, sections={(ph, sec): cache.section(ph, sec, st.layer_mix) for ph, parts in
                                         ((Phase.FWD, st.fwd_parts), (Phase.BWD, st.bwd_parts)) for sec, _ in parts},
                    fwd_parts=cache.stage_parts(Phase.FWD, st.fwd_parts, st.layer_mix),
                    bwd_parts=cache.stage_parts(Phase.BWD, st.bwd_parts, st.layer_mix),
                    opt=cache.items_segment(st.ddp, st.opt, "opt"),
                    accum=cache.items_segment(st.accum, None, "accum"),
                    ddp=cache.items_segment(st.ddp, None, "ddp"))
            self.raw.append(raw)

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
            st_.grad_scaler and self.par.framework == Framework.TORCH) else 0.0
        by_shape: dict[tuple[bool, bool, int], tuple[float, float, float]] = {}  # a 64-stage split has 3 shapes
        self.extras = [by_shape.get((st.first, st.last, st.layers)) or by_shape.setdefault(
            (st.first, st.last, st.layers), self._host_extra_us(st)) for st in self.stages]
        self.host_measured = fw.per_op_host_us(self._host_setting())

    def host_model(self, host: HostModel) -> HostModel:
        return replace(host, **self.host_measured) if self.host_measured else host

    def _host_extras(self) -> list[HostExtra]:
        """The framework's measured host costs that apply to this split (DTensor TP, DDP/FSDP2 hooks)."""
        par, fw = self.par, self.par.framework
        setting = self._host_setting()
        kinds = []  # each kind's host work at its own group's size (the TP group's, the DP group's)
        if par.tp > 1:
            kinds.append(("tp_sp" if par.sequence_parallel else "tp", par.tp))
        if par.dp > 1:
            kinds.append(({0: "ddp", 2: "fsdp_z2", 3: "fsdp_z3"}.get(par.zero, ""), par.dp))
        return [self.fw.host_extra(fw, k, setting, ranks) for k, ranks in kinds if k]

    def _host_extra_us(self, st: StageWork) -> tuple[float, float, float]:
        """Extra host us per micro-batch (forward, backward) and per step (optimizer) for one stage."""
        out = [0.0, 0.0, self.scaler_us]
        for e in self.host_extras:
            for i, ph in enumerate(("fwd", "bwd", "opt")):
                out[i] += e.per_layer_us.get(ph, 0.0) * st.layers + (e.fixed_us.get(ph, 0.0) if
                                                                      (st.first or st.last) else 0.0)
        return out[0], out[1], out[2]

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
        both = (id(fb), id(rest))
        out = self.eng.stage_times.get(both)
        if out is None:
            out = {**fb, **rest}
            out["src"] = {**fb["src"], **rest["src"]}
            self.eng.stage_times[both] = out
        return out

    def _section_summary(self, seg: Segment, host: HostModel, delta_us: float) -> SectionSummary:
        """One section's host/GPU map and sums under a host model, each operator's host cost raised by
        delta_us (a framework's extra host cost spread over the stage's operators)."""
        key = (id(seg), host, delta_us)
        hit = self.eng.section_summaries.get(key)
        if hit is None:
            if delta_us:  # the unshifted sums, and the map of the shifted host costs from its envelope
                base = self._section_summary(seg, host, 0.0)
                shifted = self.eng.shifted_maps.get(key[:2])
                if shifted is None:
                    g, h = seg.times(host)
                    shifted = self.eng.shifted_maps[key[:2]] = ShiftedHostMap(g, h, seg.sync)
                hit = replace(base, map=shifted.at(delta_us), host_us=base.host_us + delta_us * len(seg.cold))
            else:
                g, gpu_us, compute_us, tp_us, ep_us, src = self._section_gpu(seg, host.beta)
                h = seg.host_times(host)
                hit = SectionSummary(host_map(g, h, seg.sync), gpu_us, float(h.sum()), compute_us, tp_us, ep_us, src)
            self.eng.section_summaries[key] = hit
        return hit

    def _section_gpu(self, seg: Segment, beta: float) -> tuple[Any, ...]:
        """A section's GPU times and their sums (all, outside collectives, TP and EP collectives, per source):
        once per beta, which every host instance of a prediction's range shares."""
        key = (id(seg), beta)
        hit = self.eng.section_gpu.get(key)
        if hit is None:
            g = seg.gpu_times(beta)
            comm, ep = seg.is_comm, seg.ep_mask()
            hit = self.eng.section_gpu[key] = (
                g, float(g.sum()), float(g[~comm].sum()), float(g[comm & ~ep].sum()), float(g[ep].sum()),
                np.bincount(seg.src, weights=g, minlength=len(SOURCES)))
        return hit

    def _section_gpu_us(self, seg: Segment, host: HostModel) -> float:
        return float(self._section_gpu(seg, host.beta)[1])

    def _fb_times(self, raw: dict[str, Any], host: HostModel, extra: tuple[float, float, float]
                  ) -> dict[str, Any]:
        """A stage's forward and backward of one micro-batch through the two-queue model: its sections' maps
        composed (n layers: the layer's map to the n-th power), equal to simulating the concatenated operators."""
        m = IDENTITY
        sums: dict[str, list[Any]] = {}
        # the forward's module Python, once per decoder layer: spread over the layer section's operators
        layer_fwd = raw["sections"].get((Phase.FWD, Section.LAYER)) if host.fwd_layer_us else None
        for ph, ex in (("fwd", extra[0]), ("bwd", extra[1])):
            parts = raw[f"{ph}_parts"]
            n_ops = sum(len(p.cold) * n for p, n in parts)
            delta = ex / n_ops if ex and n_ops else 0.0
            acc: list[Any] = [0.0, 0.0, 0.0, 0.0, 0.0, np.zeros(len(SOURCES))]
            for p, n in parts:
                per_layer = host.fwd_layer_us / len(p.cold) if layer_fwd is not None and p is layer_fwd else 0.0
                s = self._section_summary(p, host, delta + per_layer)
                m = compose(power(s.map, n), m)
                for i, v in enumerate((s.gpu_us, s.host_us, s.compute_us, s.tp_comm_us, s.ep_comm_us, s.src)):
                    acc[i] = acc[i] + n * v
            sums[ph] = acc
        f, b = sums["fwd"], sums["bwd"]
        elapsed = elapsed_us(m)
        share_f = (f[0] + f[1] + 1e-9) / (f[0] + b[0] + f[1] + b[1] + 1e-9)
        sections = {k: self._section_gpu_us(seg, host) for k, seg in raw["sections"].items()}
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
        seg = raw["opt"]
        # collectives inside the optimizer segment (sequence parallelism's norm-gradient all-reduce over TP, run
        # before the step): TP traffic in the breakdown, not optimizer time
        opt_tp = float(go[seg.is_comm & ~seg.ep_mask()].sum()) if len(go) else 0.0
        return {"src": src, "opt_us": so.elapsed_us, "opt_gpu_us": so.gpu_us, "opt_tp_comm_us": opt_tp,
                "accum_us": float(ga.sum()), "ddp_us": float(gd.sum())}

    def evaluate(self, host: HostModel) -> tuple[float, dict[str, float], list[dict[str, float]], int]:
        """Iteration time (us), breakdown (ms), per-stage times and the critical stage."""
        host = self.host_model(host)
        par, m = self.par, self.par.micro_batches
        timed: dict[int, dict[str, Any]] = {}
        per_stage = []
        for r, e in zip(self.raw, self.extras, strict=True):
            t = timed.get(id(r))
            if t is None:
                t = timed[id(r)] = self._stage_times(r, host, e)
            per_stage.append(t)
        p2p = self.eng.comm.estimate("send_recv", self._p2p_bytes(), 2, per_node=self._p2p_per_node()).us \
            if par.pp > 1 else 0.0
        cost = [r["fwd_us"] + r["bwd_us"] + 2 * p2p for r in per_stage]
        crit = max(range(len(cost)), key=cost.__getitem__)  # the first of equal ones, as np.argmax
        c = per_stage[crit]
        pipe = self._pipeline_us(per_stage, m, p2p) if par.pp > 1 else m * cost[0]
        fwd_compute = m * c["fwd_gpu_us"]
        bwd_compute = m * c["bwd_gpu_us"]
        tp_comm = m * c["tp_comm_us"]
        ep_comm = m * c["ep_comm_us"]
        host_fb = m * (c["fwd_us"] + c["bwd_us"] - c["fwd_gpu_us"] - c["bwd_gpu_us"] - c["tp_comm_us"]
                       - c["ep_comm_us"])
        # (the fill and drain transfers are on the simulated schedule's critical path, inside the bubble)
        pp_comm = (2 * m * p2p + self._tied_embedding_allreduce_us()) if par.pp > 1 else 0.0
        bubble = max(pipe - (fwd_compute + bwd_compute + tp_comm + ep_comm + host_fb + 2 * m * p2p), 0.0) \
            if par.pp > 1 else 0.0
        accum = (m - 1) * c["accum_us"]
        merge = self._merge_us(host) if par.pp > 1 else 0.0
        dp_exposed = self._dp_comm_us(self.stages[crit], c)
        opt_stage = max(per_stage, key=lambda r: r["opt_gpu_us"])
        opt_gpu, opt_tp = opt_stage["opt_gpu_us"], opt_stage.get("opt_tp_comm_us", 0.0)
        opt_host = max(r["opt_us"] for r in per_stage) - opt_gpu
        host_total = host_fb + opt_host + host.per_iteration_us
        breakdown = {
            "forward_ms": fwd_compute / 1e3,
            "backward_ms": (bwd_compute + accum + c["ddp_us"]) / 1e3,
            "optimizer_ms": (opt_gpu - opt_tp) / 1e3,
            "tp_comm_ms": (tp_comm + opt_tp) / 1e3,
            **({"ep_comm_ms": ep_comm / 1e3} if par.ep > 1 else {}),
            "pp_comm_ms": pp_comm / 1e3,
            "dp_comm_ms": dp_exposed / 1e3,
            "pipeline_bubble_ms": bubble / 1e3,
            **({"pp_output_merge_ms": merge / 1e3} if merge else {}),
            "host_overhead_ms": host_total / 1e3,
        }
        breakdown = {k: float(v) for k, v in breakdown.items()}
        return sum(breakdown.values()) * 1e3, breakdown, per_stage, crit

    def _pipeline_us(self, per_stage: list[dict[str, Any]], m: int, p2p: float) -> float:
        """The schedule's forward/backward time over m micro-batches. Interleaving splits each rank's layers
        into chunks: chunk s of pp x chunks runs on rank s % pp with that rank's per-layer cost (its own host
        scaling: a head's GPU work hides host time on the last rank, not on the others), the embedding on the
        first chunk, the head on the last; each rank's chunks add up to its stage under 1F1B."""
        par = self.par
        sched = PipeSchedule(par.pp_schedule)
        if sched != PipeSchedule.INTERLEAVED:
            return pipeline_time([r["fwd_us"] for r in per_stage], [r["bwd_us"] for r in per_stage], par.pp, m,
                                 sched, p2p)
        shapes = [self.stage_shape(st, c) for st, c in zip(self.stages, per_stage, strict=True)]
        n = par.pp * INTERLEAVED_CHUNKS
        per = sum(s.layers for s in self.stages) // n
        fwd = [per * shapes[s % par.pp].fwd_layer_us + (shapes[0].fwd_embed_us if s == 0 else 0.0) +
               (shapes[-1].fwd_head_us if s == n - 1 else 0.0) for s in range(n)]
        bwd = [per * shapes[s % par.pp].bwd_layer_us + (shapes[0].bwd_embed_us if s == 0 else 0.0) +
               (shapes[-1].bwd_head_us if s == n - 1 else 0.0) for s in range(n)]
        return pipeline_time(fwd, bwd, par.pp, m, sched, p2p)

    def stage_shape(self, s: StageWork, c: dict[str, Any]) -> StageShape:
        """Per-section compute of one micro-batch (host idle spread in proportion) and parameter bytes."""
        sec = c["sections"]
        scale = (c["fwd_us"] + c["bwd_us"]) / max(c["fb_gpu_us"], 1e-9)

        def t(ph: Phase, se: Section, per: int = 1) -> float:
            return sec.get((ph, se), 0.0) * scale / per

        per_section = s.sums.section_bytes

        def sizes(se: Section) -> tuple[int, ...]:
            return per_section.get(se, ())

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

    def _tied_embedding_allreduce_us(self) -> float:
        """Megatron-Core with tied embeddings under PP: the last stage holds a copy of the word embedding, and
        finalize_model_grads all-reduces its fp32 main_grad between the first and last stage
        (`_allreduce_word_embedding_grads` over the embedding group) after the step's backward, exposed. PyTorch's
        pipelining has no such group (a tied model is the user's to split)."""
        par = self.par
        if par.framework != Framework.MEGATRON or not self.g.meta.model.get("tie_word_embeddings"):
            return 0.0
        copy = next((p for p in self.stages[-1].params if p.name == "head.lm_head.weight"), None)
        if copy is None:
            return 0.0
        return self.eng.comm.estimate("all_reduce", 4.0 * copy.numel, 2, per_node=self._p2p_per_node()).us

    def _p2p_bytes(self) -> float:
        return float(stage_io_bytes(self.g, self.par))

    def _merge_us(self, host: HostModel) -> float:
        """torch.distributed.pipelining's schedule.step() ends on the last stage by concatenating every
        micro-batch's output (merge_chunks: the logits), after the last backward and before the optimizer;
        priced as that concatenation from the database (Megatron frees outputs per micro-batch)."""
        par = self.par
        if not pipelining_retained_outputs(par.framework) or not self.g.meta.traced_layers:
            return 0.0
        spec = logits_spec(self.g, par)
        key = ("merge", spec, par.micro_batches, host.beta)
        hit = self.eng.dp_overheads.get(key)
        if hit is None:
            call = OpCall("aten.cat.default", ([spec] * par.micro_batches,))
            it = make_item(call.op, call.to_json_str(), Phase.BWD, False, call)
            e = self.eng.latency.estimate([Query(it.key, call.op, it.info)])[it.key]
            hit = self.eng.dp_overheads[key] = e.warm_us + host.beta * (e.cold_us - e.warm_us)
        return hit

    def _dp_per_node(self) -> int:
        """Ranks of a data-parallel group on one node: its ranks are TP ranks apart, so it crosses nodes once
        TP x DP outgrows a node."""
        return self.eng.comm.per_node(self.par.dp, self.par.tp)

    def _p2p_per_node(self) -> int:
        """Stages hold consecutive blocks of TP x DP ranks, so a job over several nodes has a stage boundary
        between nodes, and every transfer is priced as that one (1F1B's steady state runs at its slowest
        stage and transfer); 2: the two stages share a node."""
        par = self.par
        return 1 if par.pp * par.tp * par.dp > self.eng.comm.gpus_per_node else 2

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
        per_node = self._dp_per_node()

        def comm(kind: str, nbytes: float) -> float:
            return self.eng.comm.estimate(kind, nbytes, par.dp, per_node).us

        inter = self.interference()
        torch_fw = par.framework == Framework.TORCH
        hbm = self.eng.gpu.hbm_bytes_per_s
        if not torch_fw:
            # Megatron-Core's DDP as it ships (overlap_grad_reduce=False): after backward, the whole fp32
            # gradient buffer is all-reduced (or reduce-scattered for the distributed optimizer, whose updated
            # parameters are then all-gathered in their own dtype); nothing overlaps. Its 1/DP scaling is an
            # operator of the backward graph (compose.megatron_grad_scaling), not counted here again.
            # With expert parallelism the routed experts' part reduces over its own replicas (DP / EP).
            buf = 4.0 * s.param_numel
            expert = s.expert_numel if par.ep > 1 else 0
            dense_share = (s.param_numel - expert) / max(s.param_numel, 1)

            def over(kind: str, nbytes: float, ranks: int, stride: int) -> float:
                return self.eng.comm.estimate(kind, nbytes, ranks, self.eng.comm.per_node(ranks, stride)).us \
                    if ranks > 1 and nbytes > 0 else 0.0

            # the dense part over DP (ranks TP apart), the routed experts' over their replicas (TP x EP apart)
            groups = ((par.dp, dense_share, par.tp), (par.expert_dp, 1.0 - dense_share, par.tp * par.ep))
            if par.zero == 0:
                return sum(over("all_reduce", buf * f, r, st) for r, f, st in groups)
            return sum(over("reduce_scatter", buf * f, r, st) + over("all_gather", s.param_bytes * f, r, st)
                       for r, f, st in groups)
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
                moved = nbytes / par.dp if phase == "copy_in" else nbytes  # copy_in moves the rank's shard
                return 2e6 * moved / hbm + 3.0 if nbytes > 0 else 0.0

            f, b = fsdp_overhead(shape, comm, inter, reshard=par.zero == 3, gather_ratio=1.0,
                                 reduce_ratio=reduce_ratio, copy_us=copy_us)
            return par.micro_batches * (f + b)
        raise PlanError("--zero 1 with --framework torch is not modelled (ParallelConfig.unmodelled refuses it)")
