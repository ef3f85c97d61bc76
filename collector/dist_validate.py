"""Distributed validation: real training iterations over the GPUs of one host, with the stacks users run,
for `make validate-dist NGPU=N` (launched once with torchrun; the campaign loops over its cases).

    torchrun --nproc-per-node 2 -m tp_query.collector dist-validate --gpu h200 [--only fsdp,tp]

Frameworks and kinds (any N; splits that need more GPUs than N are left out):
- torch: DDP (defaults; gradient_as_bucket_view), FSDP2 (`fully_shard` per decoder layer and on the root,
  reshard_after_forward True = ZeRO-3 / False = ZeRO-2, optionally a MixedPrecisionPolicy), DTensor tensor
  parallel with Megatron semantics (vocab-parallel embedding, column-parallel q/k/v/gate/up, row-parallel
  o/down, column-parallel LM head with `loss_parallel`), with and without sequence parallel, and
  `torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B). DP x TP and DP x PP where N allows.
- megatron: Megatron-Core GPTModel (local spec), its TP, PP (1F1B), DDP and distributed optimizer
  (`dist_megatron.py`).

Timing: a barrier, then CUDA events around every iteration on every rank; the iteration is the max over
ranks of the per-rank median. Peak allocated memory per rank (the max is the row's figure). A few cases
also record a profiler timeline summary (NCCL kernel time and how much of it compute kernels hid).
Resumable: finished cases are rows; a case that killed the job is recorded as failed on the next run,
never retried forever. Rank 0 writes rows to data/validation/ (split "distributed"). On CPUs the gloo
backend runs the same code (tests).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tp_query.engine.trace.torchargs import torch_dtype
from tp_query.schema.precision import SETTINGS, Setting
from tp_query.schema.tables import VALIDATION_SCHEMA

from .device import Device, cpu_model, machine_id
from .hf_stages import PipeStage, autocast_for
from .store import ChunkedStore
from .timing import quantile

TORCH_KINDS = ("ddp", "ddp_bucket_view", "fsdp_z3", "fsdp_z2", "tp", "tp_sp", "pp_gpipe", "pp_1f1b",
               "pp_interleaved")
MEGATRON_KINDS = ("mcore_dp", "mcore_dp_distopt", "mcore_tp", "mcore_pp", "mcore_moe", "mcore_moe_distopt",
                  "mcore_1gpu")


@dataclass(frozen=True)
class DistCase:
    """One distributed training configuration, as a user would launch it."""

    case_id: str
    framework: str  # torch | megatron
    kind: str  # one of TORCH_KINDS / MEGATRON_KINDS
    model: str
    config: dict[str, Any]
    setting: str
    dp: int
    tp: int
    pp: int
    micro_batch: int = 1
    seq_len: int = 4096
    micro_batches: int = 1  # per optimizer step on each DP rank (pipeline micro-batches)
    split: str = "holdout"  # calibration | holdout
    profile: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])


def fit_split(kind: str, model: str, cfg: dict[str, Any], tp: int, pp: int, ep: int = 1
              ) -> tuple[str, dict[str, Any]] | None:
    """The cut model a split can run: more layers where a pipeline needs them (two chunks per rank under
    interleaved 1F1B) and the cut allows it; None where TP does not divide its heads or KV heads, EP its experts,
    or per-layer lists (cut with the model) cannot grow back."""
    layers_key = "n_layer" if "n_layer" in cfg else "num_hidden_layers"
    have, need = int(cfg[layers_key]), pp * (2 if kind == "pp_interleaved" else 1)
    if need > have:
        if any(isinstance(cfg.get(k), list) for k in ("layer_types", "mlp_layer_types", "no_rope_layers")):
            return None
        cfg = {**cfg, layers_key: need}
        model = model.replace(f"-L{have}", f"-L{need}")
    heads = int(cfg.get("num_attention_heads", cfg.get("n_head", 1)))
    kv = int(cfg.get("num_key_value_heads", heads))
    if heads % tp or kv % tp or ep > max(1, int(cfg.get("num_local_experts", 1))):
        return None
    return model, cfg


def tiny_cases(world: int, cfg: dict[str, Any]) -> list[DistCase]:
    """The torch campaign on a tiny model (CPU with gloo in the tests), each split the tiny model can take."""
    out = []
    for c in dist_cases(world):
        if c.framework == "torch" and c.model.startswith("llama3") and c.setting in ("tf32", "mp_bf16"):
            fitted = fit_split(c.kind, "tiny", cfg, c.tp, c.pp)
            if fitted is not None:
                out.append(dataclasses.replace(c, config=fitted[1], seq_len=64, model="tiny",
                                               case_id=c.case_id.replace(c.model, "tiny")))
    return out


def dist_cases(world: int) -> list[DistCase]:
    """The campaign for `world` GPUs. Calibration: the LLaMA-3-8B shape (host/dispatch constants are fitted
    there); holdout: the Qwen2-7B shape (other widths, biases, vocabulary) and every 8-micro-batch pipeline."""
    from .validate import LLAMA3_8B, MIXTRAL_8X7B, QWEN2_7B, QWEN3_8B, layers_of

    shapes = [("llama3-8b-L4", layers_of(LLAMA3_8B, 4), "calibration"),
              ("qwen2-7b-L4", layers_of(QWEN2_7B, 4), "holdout")]
    out: list[DistCase] = []
    # Megatron-Core's precision recipes: --bf16, --fp16 (dynamic loss scaling, its inf check and unscale in the
    # optimizer) and fp32/tf32
    mcore_settings = ("mp_bf16", "mp_fp16", "tf32")

    def add(fw: str, kind: str, model: str, cfg: dict[str, Any], setting: str, split: str, *, dp: int = 1,
            tp: int = 1, pp: int = 1, m: int = 1, profile: bool = False, **options: Any) -> None:
        if dp * tp * pp != world:
            return
        fitted = fit_split(kind, model, cfg, tp, pp, int(options.get("ep", 1)))
        if fitted is None:  # a split the cut model cannot take at this world size: left out, not listed to fail
            return
        model, cfg = fitted
        opt = "".join(f"-{k}" if v is True else f"-{k}{v}" for k, v in sorted(options.items())
                      if v is True or (isinstance(v, int) and not isinstance(v, bool)))
        cid = f"{fw}-{kind}-{model}-dp{dp}-tp{tp}-pp{pp}-m{m}{opt}-{setting}"
        out.append(DistCase(cid, fw, kind, model, cfg, setting, dp, tp, pp, micro_batches=m, split=split,
                            profile=profile, options=options))

    if world == 1:
        # One GPU: what every kind above degenerates to is one plain step, which only Megatron-Core runs
        # differently from the one-GPU HF campaign (its local layer spec, fp32 gradient buffer, --bf16/--fp16
        # master weights and loss scaling); one micro-batch, and four accumulated into one optimizer step
        for s in ("mp_fp16", "mp_bf16", "tf32"):  # the recipe never validated before first
            for model, cfg, split in [*shapes, ("qwen3-8b-L4", layers_of(QWEN3_8B, 4), "holdout")]:
                for m in (1, 4):
                    add("megatron", "mcore_1gpu", model, cfg, s, split, m=m)
        return out

    settings = ("amp_bf16", "bf16", "tf32")
    for model, cfg, split in shapes:
        for s in settings:
            prof = s == "amp_bf16" and split == "calibration"
            add("torch", "ddp", model, cfg, s, split, dp=world, profile=prof)
            add("torch", "ddp_bucket_view", model, cfg, s, split, dp=world)
            add("torch", "fsdp_z3", model, cfg, s, split, dp=world, profile=prof)
            add("torch", "fsdp_z2", model, cfg, s, split, dp=world)
            add("torch", "tp", model, cfg, s, split, tp=world, profile=prof)
            add("torch", "tp_sp", model, cfg, s, split, tp=world)
            for m in (4, 8):
                add("torch", "pp_1f1b", model, cfg, s, split if m == 4 else "holdout", pp=world, m=m,
                    profile=prof and m == 4)
            add("torch", "pp_gpipe", model, cfg, s, split, pp=world, m=4)
            add("torch", "pp_interleaved", model, cfg, s, split, pp=world, m=4)
            if world >= 4:
                add("torch", "tp", model, cfg, s, split, dp=world // 2, tp=2)
                add("torch", "pp_1f1b", model, cfg, s, split, dp=world // 2, pp=2, m=4)
        # FSDP2 with a MixedPrecisionPolicy (bf16 compute, fp32 master weights and gradient reduction)
        add("torch", "fsdp_z3", model, cfg, "mp_bf16", split, dp=world)
        add("torch", "fsdp_z2", model, cfg, "mp_bf16", split, dp=world)
        # Megatron-Core: its --bf16 and --fp16 recipes, and fp32/tf32
        for s in mcore_settings:
            add("megatron", "mcore_dp", model, cfg, s, split, dp=world)
            add("megatron", "mcore_dp_distopt", model, cfg, s, split, dp=world, distributed_optimizer=True)
            add("megatron", "mcore_tp", model, cfg, s, split, tp=world)
            add("megatron", "mcore_pp", model, cfg, s, split, pp=world, m=4)
    # A third shape, held out of everything: Qwen3-8B through transformers' own modules (q/k norms, other FFN
    # width and vocabulary), for the PyTorch-native kinds
    for s in settings:
        q3 = layers_of(QWEN3_8B, 4)
        add("torch", "ddp", "qwen3-8b-L4", q3, s, "holdout", dp=world)
        add("torch", "fsdp_z3", "qwen3-8b-L4", q3, s, "holdout", dp=world)
        add("torch", "tp", "qwen3-8b-L4", q3, s, "holdout", tp=world)
        add("torch", "tp_sp", "qwen3-8b-L4", q3, s, "holdout", tp=world)
        add("torch", "pp_1f1b", "qwen3-8b-L4", q3, s, "holdout", pp=world, m=4)
    for s in mcore_settings:  # and under Megatron-Core (its local spec with qk_layernorm)
        q3 = layers_of(QWEN3_8B, 4)
        add("megatron", "mcore_dp", "qwen3-8b-L4", q3, s, "holdout", dp=world)
        add("megatron", "mcore_tp", "qwen3-8b-L4", q3, s, "holdout", tp=world)
        add("megatron", "mcore_pp", "qwen3-8b-L4", q3, s, "holdout", pp=world, m=4)
    # Model types known only to transformers whose layers differ along the depth (2026-12-01, predicted before
    # they ran): SmolLM3-3B cut to 4 layers (one without RoPE) and GLM-4.5-Air cut to 3 (one dense, two MoE)
    from .validate import GLM45_AIR, SMOLLM3_3B

    for s in ("bf16", "amp_bf16"):
        sm = layers_of(SMOLLM3_3B, 4)
        add("torch", "ddp", "smollm3-3b-L4", sm, s, "holdout", dp=world)
        add("torch", "fsdp_z3", "smollm3-3b-L4", sm, s, "holdout", dp=world)
        add("torch", "pp_1f1b", "smollm3-3b-L4", sm, s, "holdout", pp=world, m=4)
    for kind in ("ddp", "fsdp_z3"):
        add("torch", kind, "glm4.5-air-L3", layers_of(GLM45_AIR, 3), "bf16", "holdout", dp=world)
    # Megatron-Core MoE (Mixtral-8x7B shape, 2 layers): experts replicated (ep 1) and split over the DP ranks
    for s in ("mp_bf16", "tf32"):
        for ep in (1, world):
            add("megatron", "mcore_moe", "mixtral-L2", layers_of(MIXTRAL_8X7B, 2), s, "holdout", dp=world, ep=ep)
    add("megatron", "mcore_moe_distopt", "mixtral-L2", layers_of(MIXTRAL_8X7B, 2), "mp_bf16", "holdout", dp=world,
        ep=world, distributed_optimizer=True)
    return out


# ---------------------------------------------------------------------------------------------
# building what each rank runs
# ---------------------------------------------------------------------------------------------

def _hf_model(cfg: dict[str, Any], dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    hcfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with device:
        model = AutoModelForCausalLM.from_config(hcfg, dtype=dtype, attn_implementation="sdpa")
    model.train()
    return model


def _param_dtype(setting: str) -> torch.dtype:
    st = SETTINGS[Setting(setting)]
    # FSDP2's MixedPrecisionPolicy keeps fp32 sharded parameters and casts them to bf16 when it gathers them
    return torch.float32 if st.master_weights else torch_dtype(st.param_dtype)


def _tp_layer_plan(sp: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
    }
    if sp:  # torchtitan's sequence parallel: norms on sequence shards, all-gather before attention/MLP
        plan.update({
            "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


def _apply_tp(model: Any, mesh: Any, sp: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    for layer in model.model.layers:
        parallelize_module(layer, mesh, _tp_layer_plan(sp))
    top: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    if sp:
        top["model.norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)


def _adamw(params: list[torch.nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
    """The default AdamW; DTensor and plain parameters in separate groups (one foreach call cannot mix them)."""
    from torch.distributed.tensor import DTensor

    groups: list[dict[str, Any]] = [{"params": [p for p in params if isinstance(p, DTensor)]},
                                    {"params": [p for p in params if not isinstance(p, DTensor)]}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-4,
                             foreach=True if device.type == "cpu" else None)


def _ids(case: DistCase, rows: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, int(case.config["vocab_size"]), (rows, case.seq_len), generator=g).to(device)


Step = Callable[[], None]


def build_torch_dp(case: DistCase, mesh: Any, device: torch.device) -> Step:
    """DDP or FSDP2 over the DP dimension (plus TP inside when the mesh has one)."""
    st = SETTINGS[Setting(case.setting)]
    model = _hf_model(case.config, _param_dtype(case.setting), device)
    dp_mesh = mesh["dp"]
    if case.tp > 1:
        _apply_tp(model, mesh["tp"], sp=False)
    if case.kind.startswith("fsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch_dtype(st.param_dtype), reduce_dtype=torch.float32) \
            if st.master_weights else MixedPrecisionPolicy()
        z3 = case.kind == "fsdp_z3"
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=z3, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=z3, mp_policy=mp)
    elif case.dp > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    process_group=dp_mesh.get_group(),
                    gradient_as_bucket_view=case.kind == "ddp_bucket_view")
    opt = _adamw(list(model.parameters()), device)
    scaler = torch.amp.GradScaler(device.type) if st.grad_scaler else None
    ids = _ids(case, case.micro_batch, device, 1000 + dp_mesh.get_local_rank())

    def step() -> None:
        with autocast_for(device, case.setting):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_torch_tp(case: DistCase, mesh: Any, device: torch.device) -> Step:
    """DTensor tensor parallel with Megatron semantics (as torchtitan does), loss under loss_parallel."""
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    if SETTINGS[Setting(case.setting)].grad_scaler:
        raise ValueError("GradScaler cannot unscale DTensor and plain gradients together (amp_fp16 with DTensor TP)")
    sp = case.kind == "tp_sp"
    model = _hf_model(case.config, _param_dtype(case.setting), device)
    _apply_tp(model, mesh["tp"], sp=sp)
    if case.dp > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = _adamw(list(model.parameters()), device)
    ids = _ids(case, case.micro_batch, device, 1000 + mesh["dp"].get_local_rank())
    pos = torch.arange(case.seq_len, device=device).unsqueeze(0)

    def step() -> None:
        with autocast_for(device, case.setting):
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_torch_pp(case: DistCase, mesh: Any, device: torch.device) -> Step:
    import torch.nn.functional as F
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    pp_mesh = mesh["pp"]
    rank, pp = pp_mesh.get_local_rank(), case.pp
    chunks = 2 if case.kind == "pp_interleaved" else 1
    n_stages = pp * chunks
    model = _hf_model(case.config, _param_dtype(case.setting), device)
    n = len(model.model.layers)
    if n % n_stages:
        raise ValueError(f"{n} layers do not split into {n_stages} stages")
    per = n // n_stages
    stage_ids = [rank + c * pp for c in range(chunks)]
    mods = [PipeStage(model, s * per, (s + 1) * per, s == 0, s == n_stages - 1, case.setting) for s in stage_ids]
    del model  # what a stage does not own goes with it
    if device.type == "cuda":
        torch.cuda.empty_cache()
    stages = [PipelineStage(m, s, n_stages, device, group=pp_mesh.get_group()) for m, s in zip(mods, stage_ids,
                                                                                             strict=True)]
    params = [p for m in mods for p in m.parameters()]
    opt = _adamw(params, device)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    m = case.micro_batches
    if case.kind == "pp_interleaved":
        sched: Any = ScheduleInterleaved1F1B(list[Any](stages), n_microbatches=m, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if case.kind == "pp_gpipe" else Schedule1F1B
        sched = cls(stages[0], n_microbatches=m, loss_fn=loss_fn)
    ids = _ids(case, m * case.micro_batch, device, 1000 + mesh["dp"].get_local_rank())
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids

    def step() -> None:
        kw: dict[str, Any] = {}
        if has_last:
            kw = {"target": ids, "losses": []}
        if has_first:
            sched.step(ids, **kw)
        else:
            sched.step(**kw)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_megatron(case: DistCase, mesh: Any, device: torch.device) -> tuple[Step, Callable[[], None]]:
    from .dist_megatron import build_megatron_step

    step, cleanup, _ = build_megatron_step(
        case.config, case.setting.replace("mp_", ""), tp=case.tp, pp=case.pp, micro_batch=case.micro_batch,
        seq_len=case.seq_len, micro_batches=case.micro_batches,
        distributed_optimizer=bool(case.options.get("distributed_optimizer")), device=device,
        ep=int(case.options.get("ep", 1)))
    return step, cleanup


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# nvbench-style stopping: batches of BATCH steps until the 20-80% spread of the samples is within
# TARGET_SPREAD of the median on every rank, at most MAX_ITERS steps or BUDGET_S seconds per case.
BATCH, MAX_ITERS, TARGET_SPREAD, BUDGET_S = 6, 30, 0.02, 15.0


def time_steps(step: Step, device: torch.device, warmup: int = 2, iters: int = BATCH,
               max_iters: int = MAX_ITERS) -> dict[str, Any]:
    """Per-rank CUDA-event samples after a barrier; the row keeps every rank's median and samples. Host-bound
    runs (DTensor TP) spread by 10% over a handful of steps, so sampling goes on while any rank is noisy; the
    decision is all-reduced, so every rank runs the same steps (their collectives must match)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    samples: list[float] = []
    host: list[float] = []  # how long the host took to issue the step: ~ the iteration when host-bound
    t_start = time.perf_counter()
    while True:
        for _ in range(iters):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                t0 = time.perf_counter()
                step()
                host.append((time.perf_counter() - t0) * 1e3)
                b.record()
                b.synchronize()
                samples.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                step()
                samples.append((time.perf_counter() - t0) * 1e3)
        med = statistics.median(samples)
        noisy = (quantile(samples, 0.8) - quantile(samples, 0.2)) > TARGET_SPREAD * med
        more = noisy and len(samples) + iters <= max_iters and time.perf_counter() - t_start < BUDGET_S
        flag = torch.tensor([1.0 if more else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0.0 or len(samples) + iters > max_iters:
            break
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    reserved = torch.cuda.max_memory_reserved() if cuda else 0
    return {"median_ms": statistics.median(samples), "samples_ms": samples, "peak": int(peak),
            "reserved": int(reserved), "host_ms": statistics.median(host) if host else None}


def intervals_union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered_length(iv: list[tuple[float, float]], by: list[tuple[float, float]]) -> float:
    """Length of `iv` (disjoint) covered by `by` (disjoint, sorted)."""
    tot, j = 0.0, 0
    for a, b in iv:
        while j < len(by) and by[j][1] <= a:
            j += 1
        k = j
        while k < len(by) and by[k][0] < b:
            tot += max(0.0, min(b, by[k][1]) - max(a, by[k][0]))
            k += 1
    return tot


def profile_step(step: Step) -> dict[str, Any]:
    """One profiled iteration: compute and NCCL kernel time, and how much NCCL time compute kernels hid."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    comm: list[tuple[float, float]] = []
    comp: list[tuple[float, float]] = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        iv = (ev.time_range.start / 1e3, ev.time_range.end / 1e3)
        (comm if "nccl" in ev.name.lower() else comp).append(iv)
    cu, mu = intervals_union(comm), intervals_union(comp)
    comm_ms = sum(b - a for a, b in cu)
    comp_ms = sum(b - a for a, b in mu)
    hidden = covered_length(cu, mu)
    span = (max(b for _, b in cu + mu) - min(a for a, _ in cu + mu)) if cu or mu else 0.0
    return {"nccl_ms": comm_ms, "compute_ms": comp_ms, "nccl_hidden_ms": hidden, "gpu_span_ms": span,
            "idle_ms": span - comp_ms - (comm_ms - hidden)}


# ---------------------------------------------------------------------------------------------
# the campaign
# ---------------------------------------------------------------------------------------------

_MESHES: dict[tuple[str, int, int, int], Any] = {}


def _mesh(case: DistCase, device: torch.device) -> Any:
    """One device mesh (and its process groups) per split, shared by every case of that split."""
    from torch.distributed.device_mesh import init_device_mesh

    k = (device.type, case.dp, case.pp, case.tp)
    if k not in _MESHES:
        _MESHES[k] = init_device_mesh(device.type, k[1:], mesh_dim_names=("dp", "pp", "tp"))
    return _MESHES[k]


def run_case(case: DistCase, device: torch.device, max_iters: int = MAX_ITERS) -> dict[str, Any]:
    cleanup: Callable[[], None] | None = None
    torch.backends.cuda.matmul.allow_tf32 = SETTINGS[Setting(case.setting)].allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    if case.framework == "megatron":
        step, cleanup = build_megatron(case, None, device)
    else:
        mesh = _mesh(case, device)
        if case.kind.startswith("pp"):
            step = build_torch_pp(case, mesh, device)
        elif case.kind.startswith("tp"):
            step = build_torch_tp(case, mesh, device)
        else:
            step = build_torch_dp(case, mesh, device)
    try:
        t = time_steps(step, device, max_iters=max_iters)
        prof = profile_step(step) if case.profile and device.type == "cuda" else None
    finally:
        if cleanup is not None:
            cleanup()
    return {**t, "profile": prof}


def _row(case: DistCase, per_rank: list[dict[str, Any]] | None, status: str, reason: str, prov: Any,
         sm_mhz: int) -> dict[str, Any]:
    base = {"case_id": case.case_id, "model": case.model, "config_json": json.dumps(case.config, sort_keys=True),
            "layers": case.layers, "setting": case.setting, "micro_batch": case.micro_batch,
            "seq_len": case.seq_len, "optimizer": "adamw", "tp_shard": 1, "accum": case.micro_batches,
            "dp": case.dp, "tp": case.tp, "pp": case.pp, "pp_stage": "", "split": case.split,
            "framework": case.framework, "dist_kind": case.kind,
            "options_json": json.dumps(case.options, sort_keys=True), "status": status, "reason": reason[:300],
            "iteration_ms": None, "p20_ms": None, "p80_ms": None, "iterations": 0, "samples_ms": [],
            "peak_allocated_bytes": None, "peak_reserved_bytes": None, "rank_json": None, "kernel_ms": None,
            "kernel_breakdown_json": None, "sm_clock_mhz": sm_mhz,
            "measured_at": dt.datetime.now(dt.UTC).replace(microsecond=0), **dataclasses.asdict(prov),
            "machine": machine_id(), "cpu": cpu_model()}
    if per_rank:
        medians = [r["median_ms"] for r in per_rank]
        slow = max(range(len(per_rank)), key=lambda i: medians[i])
        s = per_rank[slow]["samples_ms"]
        profs = [r.get("profile") for r in per_rank]
        base.update(iteration_ms=medians[slow], p20_ms=quantile(s, 0.2), p80_ms=quantile(s, 0.8),
                    iterations=len(s), samples_ms=s,
                    peak_allocated_bytes=max(r["peak"] for r in per_rank),
                    peak_reserved_bytes=max(r["reserved"] for r in per_rank),
                    rank_json=json.dumps([{"median_ms": r["median_ms"], "peak": r["peak"],
                                               "host_ms": r.get("host_ms")} for r in per_rank]),
                    kernel_breakdown_json=json.dumps(profs) if any(profs) else None)
    return base


def run_campaign(cases: list[DistCase], out: Path, gpu: str, budget_s: float | None = None,
                 retry_errors: bool = False, remeasure: bool = False, max_iters: int = MAX_ITERS) -> int:
    """Every rank runs every case; rank 0 records. A case left started by a killed job is recorded as failed.
    remeasure: run the cases again, each new row replacing the old one (after a change to how steps are timed).
    max_iters: the most timed steps per case (host-bound cases never reach the noise target)."""
    cpu = gpu == "cpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    rank = dist.get_rank()
    dev = Device(cpu=cpu)
    dev.check_matches(gpu)  # validation rows of another GPU would be compared with this GPU's database
    prov = dev.provenance()
    store = ChunkedStore(out, "validation-dist", VALIDATION_SCHEMA, prov, key_columns=("case_id",),
                         remeasure=remeasure) if rank == 0 else None
    attempts = out / ".dist-attempts"
    todo: list[str] = []
    if store is not None:
        done = set() if remeasure else {k[0] for k in store.done_keys(ok_only=retry_errors)}
        started = set(attempts.read_text().split()) if attempts.exists() else set()
        for c in cases:
            if c.case_id in done:
                continue
            if c.case_id in started and not (retry_errors or remeasure):  # the job died inside it: a failure row, not a loop
                store.append(_row(c, None, "error", "the job died during this case (killed, hung or crashed)",
                                  prov, 0))
                continue
            todo.append(c.case_id)
        store.flush()
    todo = _gather(todo)[0]
    by_id = {c.case_id: c for c in cases}
    t0 = time.perf_counter()
    n = 0
    for cid in todo:
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            break
        case = by_id[cid]
        if rank == 0:
            with attempts.open("a") as f:
                f.write(cid + "\n")
        status, reason, res = "ok", "", None
        try:
            res = run_case(case, device, max_iters)
        except torch.OutOfMemoryError:
            status, reason = "oom", "out of memory"
        except Exception as e:  # a configuration the stack refuses: a row with its reason
            status, reason = "error", f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        gc_cuda(device)
        results = _gather((status, reason, res))
        bad = [r for r in results if r[0] != "ok"]
        if store is not None:
            if bad:
                row = _row(case, None, bad[0][0], bad[0][1], prov, 0)
            else:
                row = _row(case, [r[2] for r in results], "ok", "", prov, dev.clocks().sm_mhz)
            store.append(row)  # journalled at once; chunks every few cases
            if n % 8 == 7:
                store.flush()
            ms = row["iteration_ms"]
            print(f"[dist-validate] {cid}: " + (f"{ms:.2f} ms, peak {row['peak_allocated_bytes'] / 2**30:.2f} GiB"
                                                if ms else f"{row['status']}: {row['reason']}"), flush=True)
        n += 1
    if store is not None:
        store.flush()
    return n


def gc_cuda(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main_dist(gpu: str, out: Path, only: str | None, budget_s: float | None, frameworks: str,
              tiny_model: Path | None = None, retry_errors: bool = False, remeasure: bool = False,
              machine_sample: bool = False, max_iters: int = MAX_ITERS) -> None:
    """machine_sample: measure the cases on this machine instance as another sample of the machine kind, into
    <out>/machines/<machine id>/ (a rerun on the same instance replaces its own rows); the report takes the
    median over instances."""
    from datetime import timedelta

    cpu = gpu == "cpu"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if not cpu:
        torch.cuda.set_device(local)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("gloo" if cpu else "nccl", timeout=timedelta(seconds=300))
    world = dist.get_world_size()
    cases = tiny_cases(world, json.loads(tiny_model.read_text())) if tiny_model else dist_cases(world)
    cases = [c for c in cases if c.framework in frameworks.split(",")]
    if only:
        cases = [c for c in cases if any(s in c.case_id for s in only.split(","))]
    try:
        if machine_sample:
            out = out / "machines" / machine_id()
        n = run_campaign(cases, out, gpu, budget_s, retry_errors, remeasure, max_iters)
        if dist.get_rank() == 0:
            print(f"[dist-validate] ran {n} cases")
    finally:
        dist.barrier()
        dist.destroy_process_group()
