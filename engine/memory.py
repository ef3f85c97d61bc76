"""Peak memory of one GPU: weights, gradients, optimizer state, activations kept for backward (per
micro-batch in flight under 1F1B), transient peaks, and DDP buckets, against the GPU's capacity.

The traced step gives per-micro-batch pieces (MemoryProfile); this module scales them to a stage's
layers, micro-batches in flight and ZeRO sharding. Peaks are taken at the two points where they
occur in practice: the start of backward (all activations live plus the loss/logit transient) and
the optimizer step (gradients plus the optimizer's temporaries).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum

from tp_query.schema.gpus import GpuSpec
from tp_query.schema.precision import SETTINGS, Setting, SettingSpec
from tp_query.schema.signature import TensorSpec

from .compose import StageWork
from .framework import (
    INTERLEAVED_CHUNKS,
    PipeSchedule,
    in_flight_microbatches,
    pipelining_retained_outputs,
    tp_step_keeps_logits,
)
from .graph import Graph, MemoryProfile
from .parallel import ParallelConfig

WORKSPACE_BYTES = 64 * 2**20  # cuBLAS/cuDNN workspaces that the caching allocator serves
FRAGMENTATION = 0.03  # share of capacity the caching allocator cannot hand out at the peak


class PeakPhase(StrEnum):
    """Where in the step a stage's memory peaks."""

    START_OF_BACKWARD = "start of backward"
    OPTIMIZER_STEP = "optimizer step"
    PIPELINE_MERGE = "pipeline output merge"
    LAYER_BACKWARD = "layer backward"


@dataclass(frozen=True, kw_only=True)
class PeakParts:
    """What is live at one point of the step, by kind; the parts sum to that point's memory."""

    phase: PeakPhase
    weights_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0
    gathered_bytes: int = 0
    transient_bytes: int = 0
    buffers_bytes: int = 0

    def total(self) -> int:
        return (self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.gathered_bytes + self.transient_bytes + self.buffers_bytes)

    def parts(self) -> dict[str, int]:
        """Each kind's bytes by its name without the unit (weights, grads, ...)."""
        return {name.removesuffix("_bytes"): getattr(self, name) for name in _PART_FIELDS}


# PeakParts' byte fields, in order (total() adds them by name: a field added here must be added there)
_PART_FIELDS = tuple(f.name for f in fields(PeakParts) if f.name != "phase")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Each kind's largest size over the step (they need not be live together), the peak, and what is live at
    the peak (`at_peak`, whose parts sum to it)."""

    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    gathered_bytes: int  # FSDP2's unsharded parameters at the peak (the root and the layers in flight); 0 otherwise
    transient_bytes: int
    buffers_bytes: int
    peak_bytes: int
    capacity_bytes: int
    fits: bool
    at_peak: PeakParts

    @property
    def margin_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes


def stage_memory(graph: Graph, stage: StageWork, par: ParallelConfig, optimizer: str, gpu: GpuSpec) -> MemoryBreakdown:
    mp: MemoryProfile = graph.memory
    st = SETTINGS[Setting(graph.meta.setting)]
    traced_numel = stage.composer.traced_numel
    torch_fsdp = par.framework == "torch" and par.zero >= 2 and par.dp > 1
    w = stage.param_bytes
    g = w  # gradients share the parameters' dtype
    states = 0 if optimizer == "sgd" else 2
    master = 4 * stage.param_numel if st.master_weights else 0  # fp32 copy of half-precision parameters
    o = states * (4 * stage.param_numel if st.master_weights else w) + master
    if st.master_weights:
        g = 4 * stage.param_numel  # fp32 gradients (Megatron's main_grad buffer, FSDP2's fp32 reduce)
    if par.zero >= 1:  # routed experts' state shards over their own replicas (DP / EP), the rest over DP
        expert = stage.expert_numel if par.ep > 1 else 0
        o = int(o * ((stage.param_numel - expert) / par.dp + expert / par.expert_dp) / max(stage.param_numel, 1))
    g_full = g
    if par.zero >= 2:
        g //= par.dp
    if par.zero >= 3 or torch_fsdp:  # FSDP2 shards the parameters at rest for either reshard setting
        w //= par.dp
    unsharded = root_full = 0
    per_layer: dict[int, int] = {}
    if torch_fsdp:  # gathered units in compute precision: the root all step, one or all layers in flight
        itemsize = st.param_dtype.itemsize
        per_layer = dict(stage.sums.layer_numel)
        layer_numel = sum(per_layer.values())
        root_full = (stage.param_numel - layer_numel) * itemsize
        # at the start of backward: ZeRO-3 holds the prefetched last layer (the largest unit where layer kinds
        # differ: a dense-first MoE ends in MoE layers), ZeRO-2 every layer since forward
        unit = max(per_layer.values(), default=0) if par.zero == 3 else layer_numel
        unsharded = root_full + unit * itemsize
        if st.master_weights:
            w = 4 * stage.param_numel // par.dp  # the sharded parameters are the fp32 master weights
            o -= master // (par.dp if par.zero >= 1 else 1)
    m = par.micro_batches
    sched = PipeSchedule(par.pp_schedule)
    in_flight = in_flight_microbatches(stage.index, par.pp, m, sched)
    act_mb = stage.layers * mp.layer_act_bytes + (mp.embed_act_bytes if stage.first else 0)
    if not graph.meta.traced_layers:
        act_mb = mp.fwd_end_bytes
    acts = int(in_flight * act_mb)
    merged = 0
    if par.pp > 1 and stage.last and pipelining_retained_outputs(par.framework):
        kept_logits = m * logits_bytes(graph, par)
        acts += kept_logits  # kept in the stage's output chunks until the step ends
        # ...where schedule.step() merges them (merge_chunks: a concatenated copy) while the chunks and every
        # gradient are still live: one more copy of all micro-batches' logits (allocator trace, 2 x H200:
        # 18.6 GiB of chunks and 18.6 GiB merged at the peak of 8 TF32 micro-batches)
        merged = 2 * kept_logits
    kept_pred = logits_bytes(graph, par) if stage.last and tp_step_keeps_logits(par.framework, par.tp, par.pp) \
        else 0
    acts += kept_pred
    if stage.last and graph.meta.traced_layers and sched == PipeSchedule.GPIPE and in_flight > 1:
        # GPipe runs every forward before the last stage's first backward: each micro-batch's loss activations
        # (the fp32 log-softmax) stay too, as measured on 2 x H200; the current one is in the head transient
        acts += int((in_flight - 1) * _head_kept_bytes(mp, graph))
    # Later micro-batches run with the gradients of earlier ones; Megatron-Core's DDP holds every gradient
    # in one contiguous buffer (main_grad) allocated when it wraps the model, live through the whole step.
    # DDP allocates its buckets when it wraps the model; gradient_as_bucket_view makes .grad views into them,
    # so the gradients take no memory of their own beside the buckets (every micro-batch and the optimizer)
    ddp_buckets = g if par.dp > 1 and par.zero == 0 and par.framework == "torch" else 0
    g_own = 0 if ddp_buckets and par.ddp_bucket_view else g
    grads_live = g_own if (m > 1 or par.framework == "megatron") else 0
    head = mp.head_peak_bytes if stage.last else 0
    transient_bwd = max(head, mp.layer_bwd_transient_bytes if stage.layers else 0)
    if sched == PipeSchedule.GPIPE and par.framework == "torch" and in_flight > 1:
        # GPipe runs every forward first: its first backward starts before any gradient exists, and once the
        # gradients exist one micro-batch's activations are gone (allocator trace of the last stage, 2 x
        # H200: every micro-batch's kept tensors and every parameter gradient, no head transient, at the peak)
        one_mb = act_mb + (_head_kept_bytes(mp, graph) if stage.last and graph.meta.traced_layers else 0)
        no_grads = PeakParts(phase=PeakPhase.START_OF_BACKWARD, weights_bytes=w, optimizer_bytes=o,
                             gathered_bytes=unsharded, activations_bytes=acts, transient_bytes=transient_bwd)
        with_grads = replace(no_grads, grads_bytes=g_own, activations_bytes=acts - one_mb)
        start_bwd = with_grads if with_grads.total() > no_grads.total() else no_grads
    else:
        start_bwd = PeakParts(phase=PeakPhase.START_OF_BACKWARD, weights_bytes=w, optimizer_bytes=o,
                              grads_bytes=grads_live, activations_bytes=acts, gathered_bytes=unsharded,
                              transient_bytes=transient_bwd)
    share = stage.param_numel / traced_numel
    opt_transient = int(mp.opt_peak_bytes * share / (par.dp if par.zero >= 1 else 1))
    recv, input_grads, saved_inputs = pipelining_buffers(graph, stage, par, in_flight)
    start_bwd = replace(start_bwd, activations_bytes=start_bwd.activations_bytes - saved_inputs)
    phases = [start_bwd, PeakParts(phase=PeakPhase.OPTIMIZER_STEP, weights_bytes=w, optimizer_bytes=o,
                                   grads_bytes=g_own, transient_bytes=opt_transient,
                                   activations_bytes=kept_pred + input_grads)]
    if merged:
        phases.append(PeakParts(phase=PeakPhase.PIPELINE_MERGE, weights_bytes=w, optimizer_bytes=o, grads_bytes=g_own,
                                activations_bytes=merged + input_grads))
    if torch_fsdp:
        phases += _fsdp_in_backward(stage, par, st, mp, w, o, root_full, g, g_full, per_layer, m)
    buffers = WORKSPACE_BYTES + ddp_buckets + _megatron_attention_buffer(graph, par) + recv
    top = max(phases, key=PeakParts.total)  # the first of equal ones
    at_peak = replace(top, buffers_bytes=buffers)
    peak = at_peak.total()
    capacity = int((gpu.memory_bytes - gpu.context_bytes) * (1 - FRAGMENTATION))
    # each kind's largest: its size at rest or in its own phase, or what any phase holds of it (FSDP2's layer
    # backward holds two gathered layers, the head's gradient beside the sharded ones, a reduce-scatter input)
    return MemoryBreakdown(
        max(w, *(ph.weights_bytes for ph in phases)), max(g, *(ph.grads_bytes for ph in phases)),
        max(o, *(ph.optimizer_bytes for ph in phases)), max(acts, *(ph.activations_bytes for ph in phases)),
        max(unsharded, *(ph.gathered_bytes for ph in phases)),
        max(head, mp.layer_bwd_transient_bytes, opt_transient, *(ph.transient_bytes for ph in phases)),
        max(buffers, *(ph.buffers_bytes for ph in phases)), peak, capacity, peak <= capacity, at_peak)


def _fsdp_in_backward(stage: StageWork, par: ParallelConfig, st: SettingSpec, mp: MemoryProfile, w: int, o: int,
                      root_full: int, g: int, g_full: int, per_layer: dict[int, int], m: int) -> list[PeakParts]:
    """What is live inside each layer's backward under FSDP2, one phase per layer: the sharded state and the
    unsharded root, the LM head's unsharded gradient (the root reduces last), the current layer unsharded and the
    next one prefetched (ZeRO-3; ZeRO-2 keeps every layer since forward), the reduce-scatter input of the layer
    just done (in the reduce dtype: fp32 under a half-precision policy with fp32 reduction), the sharded
    gradients of the layers already reduced (all of them from earlier micro-batches), the activations still
    kept and the layer's backward transient. From FSDP2's default backward prefetch and one reduce-scatter
    buffer in flight; a dense-first MoE's unit sizes differ along the depth, so every layer is a candidate."""
    order = sorted(per_layer)
    units = [per_layer[k] for k in order]
    param_item = st.param_dtype.itemsize
    grad_item = g_full / max(stage.param_numel, 1)
    rs_item = 4.0 if st.master_weights else grad_item
    head_grad = int(stage.sums.head_numel * grad_item)
    embed_act = mp.embed_act_bytes if stage.first else 0
    out = []
    for k, u in enumerate(units):
        held = sum(units[:k + 1]) if par.zero == 2 else u + (units[k - 1] if k else 0)
        rs_in = int(units[k + 1] * rs_item) if k + 1 < len(units) else 0
        grads = g if m > 1 else int(sum(units[k + 1:]) * grad_item / par.dp)
        out.append(PeakParts(phase=PeakPhase.LAYER_BACKWARD, weights_bytes=w, optimizer_bytes=o,
                             gathered_bytes=root_full + held * param_item, grads_bytes=head_grad + grads,
                             activations_bytes=embed_act + (k + 1) * mp.layer_act_bytes,
                             transient_bytes=rs_in + mp.layer_bwd_transient_bytes))
    return out


def stage_io_bytes(graph: Graph, par: ParallelConfig) -> int:
    """One micro-batch's hidden states between pipeline stages (what a stage sends and receives, and the gradient
    that comes back): the residual stream in the parameters' dtype (fp32 under autocast with fp32 weights), its
    tokens split over TP under sequence parallelism."""
    act_dt = SETTINGS[Setting(graph.meta.setting)].param_dtype
    seq = graph.meta.seq_len // (par.tp if par.sequence_parallel else 1)
    return graph.meta.micro_batch * seq * int(graph.meta.model.get("hidden_size", 0)) * act_dt.itemsize


def pipelining_buffers(graph: Graph, stage: StageWork, par: ParallelConfig, in_flight: float) -> tuple[int, int, int]:
    """torch.distributed.pipelining's receive buffers on one rank: (allocated for the whole step, the input
    gradients held at the step's end, the in-flight inputs the activations already count).

    The stage allocates one receive buffer per micro-batch for its input (stages after the first:
    `_prepare_forward_infra`, `_create_act_recv_info`) and one for its output's gradient (stages before the last:
    `_setup_backward_recv_info`) when the schedule first runs, and keeps them (args_recv_info, grad_recv_info).
    Each input buffer is the micro-batch's autograd leaf: backward accumulates the gradient sent back into its
    .grad, which stays until clear_runtime_states at the next step, so every micro-batch's input gradient is live
    through the optimizer step. Under interleaving a rank holds a set per chunk. Where the residual stream is
    fp32, the first norm of the stage saves its input for backward (the dtype cast is a no-op): the in-flight
    micro-batches' inputs are the receive buffers already, not activations of their own. Megatron-Core receives
    into fresh tensors per micro-batch (p2p_communication): none."""
    if par.pp == 1 or par.framework != "torch":
        return 0, 0, 0
    one = stage_io_bytes(graph, par)
    chunks = INTERLEAVED_CHUNKS if par.pp_schedule == PipeSchedule.INTERLEAVED else 1
    n = par.pp * chunks
    mine = [stage.index + c * par.pp for c in range(chunks)]
    with_input = sum(1 for s in mine if s > 0)
    with_grad = sum(1 for s in mine if s < n - 1)
    m = par.micro_batches
    fp32_stream = SETTINGS[Setting(graph.meta.setting)].param_dtype.itemsize == 4
    saved = int(min(in_flight * with_input, m * with_input) * one) if fp32_stream and graph.meta.traced_layers else 0
    return (with_input + with_grad) * m * one, with_input * m * one, saved


def _megatron_attention_buffer(graph: Graph, par: ParallelConfig) -> int:
    """Megatron-Core's unfused core attention writes its scores into a persistent global memory buffer
    ([b x heads/TP, s, s] in the activations' dtype), allocated at the first step and kept."""
    if par.framework != "megatron":
        return 0
    st = SETTINGS[Setting(graph.meta.setting)]
    heads = int(graph.meta.model.get("num_heads", 0)) // max(par.tp, 1)
    s = graph.meta.seq_len
    return graph.meta.micro_batch * heads * s * s * st.param_dtype.itemsize


def _head_kept_bytes(mp: MemoryProfile, graph: Graph) -> int:
    """What one micro-batch's head keeps for backward: live bytes at the end of forward beyond the
    embedding's and the traced layers' kept activations."""
    return max(mp.fwd_end_bytes - mp.embed_act_bytes - graph.meta.traced_layers * mp.layer_act_bytes, 0)


def logits_spec(graph: Graph, par: ParallelConfig) -> TensorSpec:
    """One micro-batch's LM-head output on a TP rank, in the dtype the head computes in."""
    st = SETTINGS[Setting(graph.meta.setting)]
    vocab = int(graph.meta.model.get("vocab_size", 0))
    return TensorSpec((graph.meta.micro_batch, graph.meta.seq_len, vocab // max(par.tp, 1)),
                      st.autocast_dtype or st.param_dtype)


def logits_bytes(graph: Graph, par: ParallelConfig) -> int:
    return logits_spec(graph, par).nbytes
