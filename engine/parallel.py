"""The parallel configuration of a job: one validated record (in the spirit of vLLM's ParallelConfig)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import ClassVar

from tp_query.schema.messages import TpQueryError

_LABEL = {"dp": "DP", "tp": "TP", "pp": "PP", "ep": "EP", "micro_batch": "micro-batch", "global_batch": "global batch",
          "zero": "ZeRO stage"}


class PlanError(TpQueryError):
    """An impossible parallel configuration (one line for the user)."""


# The ZeRO stages each stack has, one rule for validation, prediction and search: PyTorch's DDP (0) and FSDP2
# (2: reshard_after_forward=False, 3: True), with no ZeRO-1 (ZeroRedundancyOptimizer is not modelled);
# Megatron-Core's DDP (0) and its distributed optimizer (1), which shards optimizer state only.
STACK_ZERO_STAGES: dict[str, tuple[int, ...]] = {"torch": (0, 2, 3), "megatron": (0, 1)}
# Megatron-Core MoE as modelled (engine/trace/megatron_local) and launched (`search --emit megatron`): the top-k
# router's softmax over the chosen experts, aux-loss load balancing at the Mixtral recipes' coefficient, no input
# jitter, the all-to-all token dispatcher (Megatron-LM's defaults are allgather and a coefficient of 0)
MEGATRON_MOE_AUX_LOSS_COEFF = 1e-2
MEGATRON_MOE_ARGS = ("--moe-router-load-balancing-type aux_loss "
                     f"--moe-aux-loss-coeff {MEGATRON_MOE_AUX_LOSS_COEFF:g} --moe-token-dispatcher-type alltoall")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Every parallel dimension of one job, validated once when it is built (an invalid one cannot exist);
    the request, the composer, the memory model, search, the CLI and the API all take this one record."""

    dp: int = 1  # data-parallel replicas (DDP, FSDP2 or Megatron-Core DP)
    tp: int = 1  # tensor-parallel degree (Megatron semantics)
    pp: int = 1  # pipeline stages
    micro_batch: int = 1  # sequences per micro-batch on one GPU
    global_batch: int | None = None  # sequences per optimizer step; default dp x micro_batch
    sequence_parallel: bool = False  # norms and residuals on seq/TP tokens (needs tp > 1)
    zero: int = 0  # 0: DDP; 1: sharded optimizer state; 2, 3: FSDP2 reshard_after_forward False / True
    recompute: bool = False  # full activation recomputation
    pp_schedule: str = "1f1b"  # 1f1b | gpipe | interleaved (two model chunks per rank)
    framework: str = "torch"  # torch (DDP/FSDP2/DTensor/pipelining) | megatron (Megatron-Core, local spec)
    ddp_bucket_view: bool = False  # DDP(gradient_as_bucket_view=True)
    ep: int = 1  # expert parallelism (MoE, Megatron-Core): experts split over ep of the DP ranks

    def __post_init__(self) -> None:
        self._normalise()
        self.validate()

    _INTS: ClassVar[tuple[str, ...]] = ("dp", "tp", "pp", "micro_batch", "global_batch", "zero", "ep")
    _BOOLS: ClassVar[tuple[str, ...]] = ("sequence_parallel", "recompute", "ddp_bucket_view")
    _STRS: ClassVar[tuple[str, ...]] = ("pp_schedule", "framework")

    def _normalise(self) -> None:
        """Each field of its own type: an integer (numpy's too, kept as int), a bool (numpy's too), a string. A
        string "no" for a bool or 2.0 for a degree is refused, not read as true or truncated."""
        for name in self._INTS:
            v = getattr(self, name)
            if type(v) is int or (v is None and name == "global_batch"):
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                what = "an integer 0..3" if name == "zero" else "a positive integer"
                raise PlanError(f"{_LABEL.get(name, name)} must be {what}, got {v!r}"[:200])
            object.__setattr__(self, name, int(v))
        for name in self._BOOLS:
            v = getattr(self, name)
            if v is True or v is False:
                continue
            t = type(v)  # numpy's bool (numpy.bool_ in 1.x, numpy.bool in 2.x) is the bool it holds
            if t.__module__ != "numpy" or t.__name__ not in ("bool_", "bool"):
                raise PlanError(f"{name} must be True or False, got {v!r}"[:200])
            object.__setattr__(self, name, bool(v))
        for name in self._STRS:
            if not isinstance(getattr(self, name), str):
                raise PlanError(f"{name} must be a string, got {getattr(self, name)!r}"[:200])

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: the data-parallel group over which expert gradients are reduced."""
        return self.dp // self.ep

    @property
    def micro_batches(self) -> int:
        return self.batch // (self.dp * self.micro_batch)

    @property
    def batch(self) -> int:
        """Sequences per optimizer step (the global batch)."""
        return self.dp * self.micro_batch if self.global_batch is None else self.global_batch

    # beyond any cluster or batch anyone plans: bigger is a typo or hostile input
    LIMITS: ClassVar[dict[str, int]] = {"DP": 1 << 20, "TP": 1 << 12, "PP": 1 << 12, "EP": 1 << 12,
                                        "micro-batch": 1 << 16, "global batch": 1 << 31}

    def unmodelled(self) -> str:
        """Why this valid split is not predicted ("" when it is): a combination without a model or a run here."""
        if self.framework == "torch" and self.zero not in STACK_ZERO_STAGES["torch"]:
            return ("--zero 1 with --framework torch: PyTorch has no ZeRO-1 in DDP or FSDP2 (ZeroRedundancyOptimizer "
                    "all-reduces and then broadcasts every parameter, which is not modelled); use --zero 2 (FSDP2, "
                    "reshard_after_forward=False), --zero 3, or --framework megatron --zero 1 (its distributed "
                    "optimizer)")
        if self.zero and self.pp > 1:
            return ("ZeRO with pipeline parallelism is not modelled (FSDP2 or a sharded optimizer per stage has no "
                    "validation run here): use --zero 0 with PP")
        return self._schedule_refusal()

    def validate(self) -> None:
        for name, v in (("DP", self.dp), ("TP", self.tp), ("PP", self.pp), ("EP", self.ep),
                        ("micro-batch", self.micro_batch),
                        ("global batch", self.batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise PlanError(f"{name} must be a positive integer, got {v!r}")
            if v > self.LIMITS[name]:
                raise PlanError(f"{name} {v} is beyond any real job (at most {self.LIMITS[name]})")
        if self.micro_batches > 1 << 20:
            raise PlanError(f"{self.micro_batches} micro-batches per step is beyond any real job")
        gb = self.batch
        if gb <= 0 or gb % (self.dp * self.micro_batch):
            raise PlanError(f"global batch {gb} is not a multiple of DP x micro-batch = {self.dp * self.micro_batch}")
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("sequence parallelism needs TP > 1")
        # options that only mean something beside another: refused alone, never silently dropped
        if self.zero and self.dp == 1:
            raise PlanError(f"ZeRO stage {self.zero} shards over data-parallel ranks: it needs DP > 1")
        if self.ddp_bucket_view and not (self.framework == "torch" and self.dp > 1 and self.zero == 0):
            raise PlanError("gradient_as_bucket_view is PyTorch DDP's option: it needs --framework torch, DP > 1 "
                            "and --zero 0")
        if self.pp_schedule != "1f1b" and self.pp == 1:
            raise PlanError(f"--pp-schedule {self.pp_schedule} orders pipeline stages: it needs PP > 1")
        if self.pp_schedule not in ("1f1b", "gpipe", "interleaved"):
            raise PlanError(f"unknown pipeline schedule {self.pp_schedule!r}: 1f1b, gpipe or interleaved")
        if self.framework not in ("torch", "megatron"):
            raise PlanError(f"unknown framework {self.framework!r}: torch or megatron")
        if self.framework == "megatron" and self.zero not in STACK_ZERO_STAGES["megatron"]:
            raise PlanError("Megatron-Core shards optimizer state only (its distributed optimizer): use --zero 1")
        if self.ep > 1 and self.dp % self.ep:
            raise PlanError(f"EP={self.ep} must divide DP={self.dp}: expert-parallel ranks are data-parallel "
                            "ranks that split the experts (Megatron-Core's layout)")
        if self.ep > 1 and self.framework != "megatron":
            raise PlanError("expert parallelism is modelled as Megatron-Core runs it (all-to-all token dispatcher): "
                            "use --framework megatron")
        if self.framework == "megatron" and self.pp_schedule == "gpipe":
            raise PlanError("Megatron-Core's schedules are 1F1B and interleaved 1F1B, not GPipe")

    def _schedule_refusal(self) -> str:
        """Why the stack's pipeline schedule refuses this micro-batch count ("" when it runs it): a describable
        split that the real schedule raises on, so a prediction refuses it and a search lists it as rejected."""
        m, pp = self.micro_batches, self.pp
        if pp == 1:
            return ""
        if self.framework == "torch" and self.pp_schedule == "1f1b" and m < pp:
            # torch.distributed.pipelining.Schedule1F1B.__init__ raises ValueError
            return (f"PyTorch's Schedule1F1B needs at least as many micro-batches as stages: {m} < PP={pp} "
                    f"(raise the global batch to {pp * self.dp * self.micro_batch}, or use --pp-schedule gpipe)")
        if self.framework == "torch" and self.pp_schedule == "interleaved" and m % max(1, m // pp):
            # ScheduleInterleaved1F1B.__init__: rounds = max(1, m // pp) must divide m
            return (f"PyTorch's ScheduleInterleaved1F1B needs the micro-batches ({m}) to be a multiple of its "
                    f"rounds ({max(1, m // pp)} = micro-batches // PP)")
        if self.framework == "megatron" and self.pp_schedule == "interleaved" and (m < pp or m % pp):
            # forward_backward_pipelining_with_interleaving: microbatch_group_size_per_vp_stage (default PP) must be
            # within [PP, M] and M's remainder by it 0 or at least PP
            return (f"Megatron-Core's interleaved schedule needs the micro-batches ({m}) to be a multiple of "
                    f"PP={pp} (its micro-batch groups per virtual stage)")
        return ""


def straddle_refusal(tp: int, gpus: int, gpus_per_node: int) -> str:
    """TP groups are consecutive ranks: where TP divides neither the node nor is a whole number of nodes and the job
    spans nodes, some group straddles two nodes, its collectives partly over the network, which is not priced."""
    if tp > 1 and gpus > gpus_per_node and gpus_per_node % tp and tp % gpus_per_node:
        return (f"TP={tp} does not divide the {gpus_per_node} GPUs of a node: over {gpus} GPUs some TP groups would "
                f"straddle two nodes (not modelled); choose a TP dividing {gpus_per_node}")
    return ""
