"""Peak memory of one GPU: weights, gradients, optimizer state, activations kept for backward (per
micro-batch in flight under 1F1B), transient peaks, and DDP buckets, against the GPU's capacity.

The traced step gives per-micro-batch pieces (MemoryProfile); this module scales them to a stage's
layers, micro-batches in flight and ZeRO sharding. Peaks are taken at the two points where they
occur in practice: the start of backward (all activations live plus the loss/logit transient) and
the optimizer step (gradients plus the optimizer's temporaries).
"""

from __future__ import annotations

from dataclasses import dataclass

from tp_query.schema.gpus import GpuSpec

from .compose import Parallel, StageWork
from .graph import Graph, MemoryProfile

WORKSPACE_BYTES = 64 * 2**20  # cuBLAS/cuDNN workspaces that the caching allocator serves
FRAGMENTATION = 0.03  # share of capacity the caching allocator cannot hand out at the peak


@dataclass(frozen=True)
class MemoryBreakdown:
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    transient_bytes: int
    buffers_bytes: int
    peak_bytes: int
    capacity_bytes: int
    fits: bool

    @property
    def margin_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes


def stage_memory(graph: Graph, stage: StageWork, par: Parallel, optimizer: str, gpu: GpuSpec) -> MemoryBreakdown:
    mp: MemoryProfile = graph.memory
    traced_numel = stage.composer.traced_numel
    w = stage.param_bytes
    g = w  # gradients share the parameters' dtype
    states = 0 if optimizer == "sgd" else 2
    o = states * w
    if par.zero >= 1:
        o //= par.dp
    if par.zero >= 2:
        g //= par.dp
    if par.zero >= 3:
        w //= par.dp
    m = par.micro_batches
    in_flight = min(par.pp - stage.index, m) if par.pp > 1 else 1
    act_mb = stage.layers * mp.layer_act_bytes + (mp.embed_act_bytes if stage.first else 0)
    if not graph.meta.traced_layers:
        act_mb = mp.fwd_end_bytes
    acts = in_flight * act_mb
    grads_live = g if m > 1 else 0  # later micro-batches run with the gradients of earlier ones
    head = mp.head_peak_bytes if stage.last else 0
    start_bwd = w + o + grads_live + acts + max(head, mp.layer_bwd_transient_bytes if stage.layers else 0)
    share = stage.param_numel / traced_numel
    opt_transient = int(mp.opt_peak_bytes * share / (par.dp if par.zero >= 1 else 1))
    at_opt = w + o + g + opt_transient
    buffers = WORKSPACE_BYTES + (g if par.dp > 1 and par.zero == 0 else 0)
    peak = max(start_bwd, at_opt) + buffers
    capacity = int((gpu.memory_bytes - gpu.context_bytes) * (1 - FRAGMENTATION))
    transient = max(head, mp.layer_bwd_transient_bytes, opt_transient)
    return MemoryBreakdown(w, g, o, acts, transient, buffers, int(peak), capacity, peak <= capacity)
