"""The prediction of one step: a step schedule's times turned into the user's answer (iteration time and
its breakdown, peak memory per stage, where the numbers came from, FLOPs and MFU, per-operator rows, and
every warning a user must see). The last module of the pipeline graph -> stages -> costed stages ->
schedule -> prediction."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, replace
from typing import Any, cast

import numpy as np
from tp_query.schema.model_config import (
    GATED_DELTA_NOTE,
    LINEAR_ATTENTION,
    VALIDATED_MODEL_TYPES,
    ArchFamily,
    config_notes,
    family_label,
    with_depth_defaults,
    with_own_class_defaults,
)
from tp_query.schema.ops import Operands, step_operands
from tp_query.schema.precision import SETTINGS, DType, Precision, Setting
from tp_query.schema.signature import OpCall, TensorSpec

from .compose import StageWork, make_item
from .flops import graph_parameter_count, megatron_model_flops, parameter_count
from .framework import Framework, PipeSchedule, in_flight_microbatches
from .graph import Graph, Phase, Section
from .hostsim import HostModel
from .lookup import Query, Source
from .memory import MemoryBreakdown, stage_memory
from .parallel import MEGATRON_MOE_ARGS, MEGATRON_MOE_AUX_LOSS_COEFF, ParallelConfig, PlanError
from .request import OpRow, PredictError, Prediction
from .schedule import StepSchedule
from .segments import SOURCES, Segment

HOST_SOURCE = "host-model"  # a source share: the exposed host time, from the host model


def _megatron_router_note(cfg: dict[str, Any]) -> str:
    """Megatron-Core's MoE router as priced, and the config's router keys it does not read (transformers' module
    reads them; Megatron's are launch flags)."""
    text = cfg.get("text_config")
    hf: dict[str, Any] = text if isinstance(text, dict) else cfg
    unread = {k: hf[k] for k in ("router_aux_loss_coef", "router_jitter_noise", "norm_topk_prob") if k in hf}
    return ("Megatron-Core's router as priced: softmax over the top-k experts chosen, aux-loss load balancing at "
            f"coefficient {MEGATRON_MOE_AUX_LOSS_COEFF:g}, no input jitter, the all-to-all dispatcher "
            f"({MEGATRON_MOE_ARGS})" + ("; not read from the config: "
                                       + ", ".join(f"{k} {v}" for k, v in unread.items()) if unread else ""))


class Assembled(StepSchedule):
    """A step schedule that answers: `run` evaluates it under the engine's host model and builds the
    Prediction (search, the API and the report call it)."""

    def run(self, host: HostModel | None = None, host_range: bool = False) -> Prediction:
        host = host or self.eng.host
        par = self.par
        total_us, breakdown, per_stage, crit = self.evaluate(host)
        mems = self.memories()
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
        mem = max(mems, key=lambda x: x.peak_bytes)
        fits = all(x.fits for x in mems)
        if not fits:
            self.warnings.append(f"does not fit: peak {mem.peak_bytes / 2**30:.1f} GiB on stage "
                                 f"{mems.index(mem)} > {mem.capacity_bytes / 2**30:.1f} GiB usable")
        # the data-parallel and pipeline transfers the step exposes, priced outside the operator lists
        if breakdown.get("dp_comm_ms"):
            source_time[str(Source.COMM_MEASURED if self._dp_measured() else Source.COMM_MODEL)] += \
                breakdown["dp_comm_ms"] * 1e3
        if breakdown.get("pp_comm_ms"):
            p2p = self.eng.comm.estimate("send_recv", self._p2p_bytes(), 2, per_node=self._p2p_per_node())
            source_time[str(p2p.source)] += breakdown["pp_comm_ms"] * 1e3
        total_src = sum(source_time.values()) or 1.0
        # the host time the GPU waits for comes from the host model (per-operator and framework host costs
        # measured per instance, the calibrated constants): its share of the step, the GPU's sources the rest
        host_part = min(max(breakdown.get("host_overhead_ms", 0.0) * 1e3 / total_us, 0.0), 1.0) if total_us else 0.0
        sources = {k: v / total_src * (1.0 - host_part) for k, v in sorted(source_time.items())}
        if host_part > 0:
            sources[HOST_SOURCE] = host_part
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
            spans = par.gpus > self.eng.comm.gpus_per_node
            self.warnings.append(f"{sources.get('comm-model', 0):.0%} of the time is communication from the ring "
                                 f"model, not measured ({cover}, all-reduces up to "
                                 f"{self.eng.comm.largest_bytes('all_reduce') / 1e9:.1f} GB, a larger message at the "
                                 "largest one's bandwidth; other counts inside a node scale the nearest table's ring"
                                 + (f"; across nodes, {self.eng.comm.network[0] / 1e9:.0f} GB/s per NIC, one NIC "
                                    "per GPU, a group crossing through as many NICs as it has ranks on a node, "
                                    "without NVLink SHARP or in-network reduction" if spans else "")
                                 + f"; {self.eng.comm.gpus_per_node} GPUs per node"
                                 + (f" from system {self.eng.system.name!r})" if self.eng.system else ")"))
        sysspec = self.eng.system
        if sysspec is not None and self.eng.comm.table and par.gpus > 1 and (
                abs(sysspec.nvlink_bytes_per_s / self.eng.gpu.nvlink_bytes_per_s - 1) > 0.05
                or abs(sysspec.nvlink_latency_s / self.eng.gpu.nvlink_latency_s - 1) > 0.05):
            # the measured tables price NVLink: other rank counts scale their ring, and a group spanning nodes
            # takes their bus bandwidth inside each node; the system's NVLink figures only stand in without tables
            self.warnings.append(f"system {sysspec.name!r}'s NVLink ({sysspec.nvlink_bytes_per_s / 1e9:.0f} GB/s, "
                                 f"{sysspec.nvlink_latency_s * 1e6:g} us) is not used: collectives inside a node come "
                                 f"from the NCCL tables measured on {self.eng.gpu.name} hosts (other rank counts "
                                 "scale their ring; across nodes their bus bandwidth is the node's side), and the "
                                 "system's network figures price the NICs")
        # a user's single answer states the step's range over the measured host instances where it spans more
        # than 5% (a planner's loop does not pay for those evaluations)
        spread = self._host_instances_ms(host) if host_range and self.fw.machine is None else None
        if spread and spread[1] - spread[0] > 0.05 * total_us / 1e3:
            self.warnings.append(f"host speed: {spread[0]:.1f} to {spread[1]:.1f} ms over the {spread[2]} measured "
                                 f"host instances of this GPU; {total_us / 1e3:.1f} ms is the typical host's (each "
                                 "host cost the median over the instances)")
        host_share = breakdown["host_overhead_ms"] * 1e3 / total_us if total_us else 0.0
        extras = [e.source for e in self.host_extras if e.source != "none"]
        self.warnings += self._unmeasured_framework(breakdown)
        group = max(par.dp, par.tp) if par.framework == Framework.TORCH else par.dp
        measured_at = max([e.measured_ranks for e in self.host_extras] + [self.interference().measured_ranks])
        if 0 < measured_at < group:
            self.warnings.append(f"the framework's host costs and compute-communication interference were measured "
                                 f"with {measured_at} ranks and stand for this group of {group} (their growth "
                                 "with the rank count is not measured)")
        if host_share > 0.3:
            self.warnings.append(f"host-bound: {host_share:.0%} of the step is host overhead"
                                 + (" (DTensor dispatch and framework hooks, measured)" if extras else "")
                                 + "; eager PyTorch cannot keep the GPU busy at this size")
        par = self.par
        if par.dp > 1 and par.zero >= 2 and par.framework == Framework.TORCH and not self.eng.framework.copies:
            self.warnings.append("FSDP2's parameter and gradient copies are not measured in this database: priced "
                                 "at peak HBM bandwidth (measured by `python -m tp_query.collector dist-probe --what copies`)")
        if par.framework == Framework.MEGATRON:
            self.warnings.append("Megatron-Core's gradient clipping is modelled as not taken (its norm is priced); a "
                                 "step whose gradient norm exceeds --clip-grad also scales every fp32 main gradient "
                                 f"(`dst.copy_(src * coeff)` per tensor without apex): +{self._megatron_clip_ms(host):.1f}"
                                 " ms on the slowest stage when taken, as in a randomly initialised model's first "
                                 "steps")
            if self.g.meta.model.get("num_experts"):
                self.warnings.append(_megatron_router_note(self.req.model))
        if step_operands(self.req.setting.value, self.req.optimizer) == Operands.NAN and \
                not self.eng.latency.measures_operands(Operands.NAN):
            self.warnings.append(f"{self.req.setting.value} with {self.req.optimizer}: every GEMM runs on NaN from "
                                 "the second step (Adam's eps underflows in fp16), and this database has no GEMM "
                                 "timed on NaN (`collect --operands nan`): they are priced on random data, which "
                                 "ran 6-9% slower on an H200")
        recipe = SETTINGS[self.req.setting].fp8_recipe
        if recipe:
            self.warnings.append(f"{self.req.setting.value}: torchao float8 training ({recipe} scaling) in eager mode on "
                                 "every nn.Linear whose dimensions are multiples of 16 except the LM head, which stays "
                                 "bf16 as torchao's README and torchtitan's recipes filter it (torchao's default "
                                 "filter converts it too); torch.compile'd FP8 is not modelled")
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
            if LINEAR_ATTENTION in (model.get("layer_types") or []):
                self.warnings.append(GATED_DELTA_NOTE)
            if self.par.tp > 1:
                self.warnings.append(f"{mt} under TP={self.par.tp}: the rank's module is built from the divided config "
                                     "(checked to be Megatron's column/row split) with DTensor's collectives and host "
                                     "costs as measured for the listed families; no TP run of a model type known only "
                                     "to transformers was measured")
        self.warnings += [w for w in (*config_notes(self.req.model), *self.g.meta.extra.get("warnings", []))
                          if w not in self.warnings]
        if self.eng.calibration_source.startswith("default"):
            self.warnings.append(f"host model: {self.eng.calibration_source}")
        if self.req.strict and (sources.get("extrapolated", 0) > 0 or sources.get("miss", 0) > 0):
            raise PredictError(f"--strict: {sources['extrapolated'] + sources['miss']:.1%} of the time would come "
                               "from extrapolation or misses")
        gb = par.batch
        tokens = self.tokens_per_step()
        flops = self._flops(total_us, gb)
        return Prediction(
            iteration_ms=total_us / 1e3, breakdown=breakdown, peak_memory_gib=mem.peak_bytes / 2**30, fits=fits,
            memory={"weights_gib": mem.weights_bytes / 2**30, "grads_gib": mem.grads_bytes / 2**30,
                    "optimizer_gib": mem.optimizer_bytes / 2**30, "activations_gib": mem.activations_bytes / 2**30,
                    "gathered_gib": mem.gathered_bytes / 2**30,
                    "transient_gib": mem.transient_bytes / 2**30, "buffers_gib": mem.buffers_bytes / 2**30,
                    "capacity_gib": mem.capacity_bytes / 2**30, "margin_gib": mem.margin_bytes / 2**30,
                    **{f"at_peak_{k}_gib": v / 2**30 for k, v in mem.at_peak.parts().items()}},
            peak_at=mem.at_peak.phase.value,
            sources=sources, warnings=self.warnings, config=self._config(self.host_model(host)),
            tokens_per_s=tokens / (total_us / 1e6) if tokens else None,  # a module without token inputs: none
            stages=[{"stage": s.index, "layers": s.layers, "fwd_ms": r["fwd_us"] / 1e3, "bwd_ms": r["bwd_us"] / 1e3,
                     "opt_ms": r["opt_us"] / 1e3, "peak_memory_gib": mm.peak_bytes / 2**30,
                     "peak_at": mm.at_peak.phase.value}
                    for s, r, mm in zip(self.stages, per_stage, mems, strict=True)],
            ops=self._op_rows(op_rows) if self.with_ops else [], **flops,
            sections=self._section_rows(crit, per_stage[crit]),
        )

    def _megatron_clip_ms(self, host: HostModel) -> float:
        """What a taken clip adds (ms): Megatron-Core's `clip_grad_by_total_norm_fp32` without apex scales every fp32
        main gradient of the rank through `local_multi_tensor_scale`, a multiply and a copy per tensor (profiled on
        H200: 101 copies and 66 multiplies of a Mixtral-shaped step); the distributed optimizer scales its shard.
        The largest stage's, from the database, each call blended between warm and cold as the step's are."""
        par = self.par
        shards = par.dp if par.zero >= 1 else 1
        best = 0.0
        for st in self.stages:
            # the calls of each distinct gradient size once, times how many gradients have it (a layer's copies alike)
            sizes = Counter(-(-p.numel // shards) for p in st.params)
            items = []
            for n in sizes:
                grad = TensorSpec((n,), DType.FP32)
                for call in (OpCall("aten.mul.Tensor", (grad, 0.5)), OpCall("aten.copy_.default", (grad, grad))):
                    items.append((n, make_item(call.op, call.to_json_str(), Phase.OPT, False, call)))
            est = self.eng.latency.estimate([Query(it.key, it.call.op, it.info) for _, it in items])
            best = max(best, sum(sizes[n] * est[it.key].blend(host.beta) for n, it in items))
        return best / 1e3

    def _unmeasured_framework(self, breakdown: dict[str, float]) -> list[str]:
        """What this database's framework tables leave unpriced for this split, said (and refused under --strict):
        an operator database alone (`make collect`) has no host costs of the framework's hooks and dispatch, and
        no interference of collectives with compute, and the step would come out fast without a word."""
        par, out = self.par, []
        missing = list(dict.fromkeys("DTensor TP dispatch" if e.kind.startswith("tp") else "data-parallel hooks"
                                     for e in self.host_extras if e.source == "none"))
        where = f"{self.eng.db.root}/{self.eng.gpu.name}/framework"
        if missing and par.framework == Framework.TORCH:
            out.append(f"host costs of {' and '.join(missing)} are not measured in this database ({where}): not "
                       f"priced (host-bound splits come out fast; `make validate-dist GPU={self.eng.gpu.name}` "
                       "measures them)")
        if not self.fw.per_op_host_us(self._host_setting()):
            h = self.eng.host
            out.append(f"eager host cost per operator not measured in this database ({where}): the host model's "
                       f"constants stand for it ({h.fwd_us:g}/{h.bwd_us:g}/{h.opt_us:g} us forward/backward/optimizer, "
                       f"from {self.eng.calibration_source})")
        comm_ms = sum(v for k, v in breakdown.items() if k in ("tp_comm_ms", "dp_comm_ms", "ep_comm_ms"))
        if comm_ms > 0 and self.interference().source == "none":
            out.append("compute-communication interference is not measured in this database "
                       f"({self.eng.db.root}/{self.eng.gpu.name}/overlap): collectives and compute overlap freely")
        if out and self.req.strict:
            raise PredictError("--strict: " + out[0])
        return out

    def memories(self) -> list[MemoryBreakdown]:
        """Each stage's memory; stages of one kind differ only in the micro-batches they hold in flight, so each
        (kind, in flight) is computed once."""
        par = self.par
        sched = PipeSchedule(par.pp_schedule)
        seen: dict[tuple[int, float], MemoryBreakdown] = {}
        out = []
        for s, raw in zip(self.stages, self.raw, strict=True):
            k = (id(raw), in_flight_microbatches(s.index, par.pp, par.micro_batches, sched))
            mem = seen.get(k)
            if mem is None:
                mem = seen[k] = stage_memory(self.g, s, par, self.req.optimizer, self.eng.gpu)
            out.append(mem)
        return out

    def tokens_per_step(self) -> int:
        par = self.par
        if self.g.meta.source == "module":  # its own batch of token ids per micro-batch (0 when it has none)
            return par.dp * par.micro_batches * self.g.meta.micro_batch * self.g.meta.seq_len
        return (par.batch) * self.g.meta.seq_len

    def plan_numbers(self) -> tuple[float, dict[str, float], MemoryBreakdown, bool]:
        """What a planner ranks by, without the rest of the answer (sources, warnings, FLOPs, configuration):
        iteration time (us), its breakdown (ms), the stage memory with the highest peak and whether every stage
        fits; the same numbers `run` reports."""
        total_us, breakdown, _, _ = self.evaluate(self.eng.host)
        mem = self.peak_memory()
        return total_us, breakdown, mem, mem.fits

    def peak_memory(self) -> MemoryBreakdown:
        """The stage memory with the highest peak, as max(memories()) finds it (every stage has one capacity, so
        it fits when that one does). Stages of one kind (the same work) differ only in the micro-batches they hold
        in flight, and their memory grows with those: each kind's stage with the most is the only one computed
        (PP=32 asks 3 stages, not 32)."""
        par = self.par
        sched = PipeSchedule(par.pp_schedule)
        most: dict[int, tuple[float, StageWork]] = {}
        for s, raw in zip(self.stages, self.raw, strict=True):
            f = in_flight_microbatches(s.index, par.pp, par.micro_batches, sched)
            if id(raw) not in most or f > most[id(raw)][0]:
                most[id(raw)] = (f, s)
        mems = [stage_memory(self.g, s, par, self.req.optimizer, self.eng.gpu) for _, s in most.values()]
        return max(mems, key=lambda x: x.peak_bytes)

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
        # the backward's other GPU work, as the breakdown counts it: accumulating each later micro-batch's
        # gradients, and the DDP/FSDP hooks' kernels
        rest = ((m - 1) * times.get("accum_us", 0.0) + times.get("ddp_us", 0.0)) / 1e3
        if rest > 0:
            rows.append({"section": "gradient accumulation and data-parallel hooks", "count": 1, "fwd_ms": 0.0,
                         "bwd_ms": rest, "each_ms": rest, "total_ms": rest})
        rows.append({"section": "optimizer step", "count": 1, "fwd_ms": 0.0, "bwd_ms": 0.0,
                     "each_ms": times["opt_gpu_us"] / 1e3, "total_ms": times["opt_gpu_us"] / 1e3})
        return rows

    def _seg_flops(self, seg: Segment) -> float:
        """Operator FLOPs of a segment, once per segment (search shares segments across candidates)."""
        cache = self.eng.segment_flops
        k = id(seg)
        if k not in cache:
            if seg.flops is not None:
                cache[k] = seg.flops
            elif seg.parts is not None:
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
        if spec and params is None and g.meta.traced_layers:
            params = self._graph_parameters(g)
        return {"parameters": params, "model_flops": model,
                "model_tflops_per_gpu": per_gpu_model / 1e12 if per_gpu_model else None,
                "hardware_tflops_per_gpu": hw / secs / par.gpus / 1e12 if secs > 0 else None,
                "mfu": per_gpu_model / peak if per_gpu_model and peak else None}

    def _graph_parameters(self, g: Graph) -> int | None:
        """A model without a parameter formula (a type known only to transformers) counted from its traced graph;
        under TP the rank's graph holds shards, so the count comes from the same model's graph at TP=1 (traced once,
        then cached like any graph); None where that graph cannot be built."""
        if g.meta.tp == 1:
            return graph_parameter_count(g)
        try:
            whole = self.eng.graph(replace(self.req, parallel=ParallelConfig(framework=self.par.framework)))
        except (PredictError, PlanError):
            return None
        return graph_parameter_count(whole)

    def _dp_measured(self) -> bool:
        """Whether the gradient collectives come from measured tables: of this rank count, and (Megatron-Core
        reducing its whole fp32 gradient buffer at once) of a message no larger than the largest measured; PyTorch's
        25 MB DDP buckets and FSDP2's per-unit reduce-scatters lie inside the tables."""
        par = self.par
        kind = "all_reduce" if par.zero == 0 else "reduce_scatter"
        nbytes = 4.0 * max((st.param_numel for st in self.stages), default=0) \
            if par.framework == Framework.MEGATRON else 1e6
        return self.eng.comm.estimate(kind, max(nbytes, 1.0), par.dp, self._dp_per_node()).source == \
            Source.COMM_MEASURED

    def _config(self, host: HostModel) -> dict[str, Any]:
        r, par = self.req, self.par
        return {"model": r.model_name, "gpu": self.eng.gpu.name, "precision": self.g.meta.setting, "dp": par.dp,
                "tp": par.tp, "pp": par.pp, "ep": par.ep, "micro_batch": par.micro_batch,
                "global_batch": par.batch, "micro_batches": par.micro_batches,
                "seq_len": self.g.meta.seq_len, "optimizer": r.optimizer, "sequence_parallel": par.sequence_parallel,
                "zero": par.zero, "recompute": "full" if par.recompute else "none", "gpus": par.gpus,
                "layers": self.g.meta.model.get("num_layers"), "host_model": asdict(host),
                "calibration": self.eng.calibration_source, "framework": par.framework,
                # which measurements answered: the database folder, its fingerprint (manifest, GPU, stack asked
                # for) and the software stack of the operator rows used
                "database": {"root": self.eng.db.root, "fingerprint": getattr(self.eng.db, "fingerprint", None),
                             **self.eng.software},
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
            hf = json.loads(m.get("hf_config") or "{}")
            # a window the file leaves to its class is the class's (gpt-oss: 128), as transformers builds it
            out["sliding_window"] = m.get("sliding_window") or (
                with_own_class_defaults(hf).get("sliding_window") if "sliding_attention" in types else None)
            if "chunked_attention" in types:  # Llama-4: its chunk, as transformers' config gives it
                out["attention_chunk_size"] = with_depth_defaults(hf).get("attention_chunk_size")
        mlps = m.get("mlp_layer_types") or []
        if mlps:
            out["mlp_layer_types"] = {t: mlps.count(t) for t in dict.fromkeys(mlps)}
        rope = m.get("rope_layers") or []
        if rope:
            out["rope_layers"] = {"rope": sum(map(bool, rope)), "none": len(rope) - sum(map(bool, rope))}
        e, k = int(m.get("num_experts") or 0), int(m.get("experts_per_token") or 0)
        if not e and m.get("family") == ArchFamily.TRANSFORMERS.value:  # a type known only to transformers
            hf = with_own_class_defaults(json.loads(m.get("hf_config") or "{}"))
            e = int(next((hf[x] for x in ("num_experts", "n_routed_experts", "num_local_experts") if hf.get(x)), 0))
            k = int(next((hf[x] for x in ("num_experts_per_tok", "moe_topk", "top_k") if hf.get(x)), 0))
        if e and k and m.get("model_type") == "llama4_text":
            # transformers' Llama4TextMoe: every routed expert runs on every token (inputs repeated per expert,
            # scaled by the router's scores, one batched GEMM), so no routing balance enters the time
            out["moe_routing"] = (f"dense: each of {e} experts runs on every token in one batched GEMM (transformers' "
                                  f"Llama4TextMoe), top-{k} scores scale the outputs; balance does not enter the time")
        elif e and k:
            experts = (f"SequentialMLP, {e // self.par.ep} local experts per rank, all-to-all over EP={self.par.ep}"
                       if megatron else "grouped GEMMs timed with equal groups")
            imb = self.req.moe_imbalance
            out["moe_routing"] = (
                f"balanced: each of {e} experts receives tokens x {k} / {e} rows ({experts}; "
                + ("--moe-imbalance skews it)" if megatron else "a skewed router is modelled with --framework megatron)"
                   if m.get("family") != ArchFamily.TRANSFORMERS.value else "a skewed router is not modelled for it)")
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
