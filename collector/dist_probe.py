"""Three small campaigns that distributed predictions need besides operator and NCCL tables, run under
torchrun across the GPUs of one host (`make collect-comm` runs them after the collectives):

- overlap: a GEMM, a TF32 GEMM or a bandwidth-bound elementwise loop on the compute stream while NCCL
  collectives of several sizes run on another; how much each slows the other (data/<gpu>/overlap/).
- framework host costs: host-bound iterations of a tiny Llama-shaped model (GPU work negligible) under
  DDP, FSDP2 and DTensor tensor parallel against plain eager PyTorch, at two layer counts, per phase: the
  extra host microseconds per decoder layer (slope) and per micro-batch (intercept) that the framework's
  dispatch, hooks and bookkeeping add (data/<gpu>/framework/).
- FSDP2's copy kernels (all-gather copy-in and copy-out, reduce-scatter copy-in) over unit sizes and world
  sizes, on one GPU (data/<gpu>/framework/fsdp-copies-*).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from tp_query.schema.tables import FRAMEWORK_SCHEMA, OVERLAP_SCHEMA

from .device import Device, cpu_model, machine_id
from .store import ChunkedStore
from .timing import events_us


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


# ---------------------------------------------------------------------------------------------
# overlap
# ---------------------------------------------------------------------------------------------

def _compute_fn(kind: str, device: torch.device) -> tuple[Any, str]:
    if kind == "gemm_bf16":
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        b = torch.randn(4096, 14336, device=device, dtype=torch.bfloat16)
        return (lambda: torch.mm(a, b)), "bf16"
    if kind == "gemm_tf32":
        a = torch.randn(4096, 4096, device=device)
        b = torch.randn(4096, 14336, device=device)
        return (lambda: torch.mm(a, b)), "tf32"
    x = torch.randn(64 * 2**20, device=device)
    y = torch.randn(64 * 2**20, device=device)
    return (lambda: x.add_(y)), "fp32"


def _comm_fn(collective: str, nbytes: int, device: torch.device) -> Any:
    n = nbytes // 2
    world = dist.get_world_size()
    if collective == "all_reduce":
        t = torch.randn(n, device=device, dtype=torch.bfloat16)
        return lambda: dist.all_reduce(t, async_op=True)
    if collective == "all_gather":
        inp = torch.randn(n // world, device=device, dtype=torch.bfloat16)
        out = torch.empty(n, device=device, dtype=torch.bfloat16)
        return lambda: dist.all_gather_into_tensor(out, inp, async_op=True)
    if collective == "send_recv":  # pipelining's steady state: each rank sends to the next and receives from the last
        rank = dist.get_rank()
        snd = torch.randn(n, device=device, dtype=torch.bfloat16)
        rcv = torch.empty(n, device=device, dtype=torch.bfloat16)
        ops = [dist.P2POp(dist.isend, snd, (rank + 1) % world), dist.P2POp(dist.irecv, rcv, (rank - 1) % world)]
        return lambda: _AllWorks(dist.batch_isend_irecv(ops))
    inp = torch.randn(n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n // world, device=device, dtype=torch.bfloat16)
    return lambda: dist.reduce_scatter_tensor(out, inp, async_op=True)


class _AllWorks:
    """batch_isend_irecv's works as one (the campaign waits on one handle per issue)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _run_together(compute: Any, k: int, comm: Any, r: int) -> tuple[float, float]:
    """Both loops start together (comm issued first on a side stream); each one's duration in us."""
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    e0 = torch.cuda.Event(enable_timing=True)
    e0.record(main)
    side.wait_event(e0)
    works = []
    with torch.cuda.stream(side):
        for _ in range(r):
            works.append(comm())
        for w in works:
            w.wait()
        es = torch.cuda.Event(enable_timing=True)
        es.record(side)
    for _ in range(k):
        compute()
    ec = torch.cuda.Event(enable_timing=True)
    ec.record(main)
    torch.cuda.synchronize()
    return e0.elapsed_time(ec) * 1e3, e0.elapsed_time(es) * 1e3


def _max_over_ranks(*xs: float) -> list[float]:
    """Loop counts derived from timings must agree on every rank (or the collectives mismatch and hang)."""
    t = torch.tensor(xs, device=torch.device("cuda", torch.cuda.current_device()), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _alone(fn: Any, n: int, comm: bool) -> float:
    for _ in range(2):
        w = fn()
        if comm:
            w.wait()
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    works = [fn() for _ in range(n)]
    if comm:
        for w in works:
            w.wait()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def overlap_campaign(device: torch.device, prov: Any, out: Path | None) -> int:
    world = dist.get_world_size()
    rows: list[dict[str, Any]] = []
    for ck in ("gemm_bf16", "gemm_tf32", "add_fp32"):
        torch.backends.cuda.matmul.allow_tf32 = ck == "gemm_tf32"
        compute, cdt = _compute_fn(ck, device)
        (c_us,) = _max_over_ranks(_alone(compute, 10, comm=False))
        for coll, nbytes in (("all_reduce", 8 * 2**20), ("all_reduce", 64 * 2**20), ("all_reduce", 512 * 2**20),
                             ("all_gather", 64 * 2**20), ("reduce_scatter", 64 * 2**20),
                             # pipeline transfers beside compute (interleaved 1F1B posts its receives early)
                             ("send_recv", 32 * 2**20), ("send_recv", 64 * 2**20)):
            if dist.get_rank() == 0:
                print(f"[overlap] {ck} {coll} {nbytes >> 20} MiB", flush=True)
            comm = _comm_fn(coll, nbytes, device)
            (m_us,) = _max_over_ranks(_alone(comm, 5, comm=True))
            # (a) communication covers the whole compute loop: the compute slowdown
            k = max(3, math.ceil(20e3 / c_us))
            r = max(1, math.ceil(1.3 * k * c_us / m_us))
            dist.barrier()
            _run_together(compute, k, comm, r)
            dist.barrier()
            tc, _ = _run_together(compute, k, comm, r)
            # (b) compute covers the whole communication loop: the communication slowdown
            r2 = max(1, math.ceil(20e3 / m_us))
            k2 = max(1, math.ceil(1.3 * r2 * m_us / c_us))
            dist.barrier()
            _, tm = _run_together(compute, k2, comm, r2)
            # the slowest rank sets the pace of a collective; report the max over ranks
            tck, tmr, ca, ma = _max_over_ranks(tc / k, tm / r2, c_us, m_us)
            rows.append({"compute": ck, "compute_dtype": cdt, "collective": coll, "bytes": nbytes, "ranks": world,
                         "compute_alone_us": ca, "compute_concurrent_us": tck, "comm_alone_us": ma,
                         "comm_concurrent_us": tmr, "status": "ok", "reason": "", "measured_at": _now(),
                         **dataclasses.asdict(prov)})
            del comm
        torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    if dist.get_rank() == 0 and out is not None:
        store = ChunkedStore(out, f"overlap-r{world}", OVERLAP_SCHEMA, prov, remeasure=True,
                             key_columns=("compute", "collective", "bytes", "ranks"))
        for r_ in rows:
            store.append(r_)
        store.flush()
        for r_ in rows:
            print(f"[overlap] {r_['compute']:>9} + {r_['collective']:>14} {r_['bytes'] >> 20:>4} MiB: compute "
                  f"x{r_['compute_concurrent_us'] / r_['compute_alone_us']:.3f}, comm "
                  f"x{r_['comm_concurrent_us'] / r_['comm_alone_us']:.3f}", flush=True)
    return len(rows)


# ---------------------------------------------------------------------------------------------
# framework host costs
# ---------------------------------------------------------------------------------------------

TINY: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024}
HOST_KINDS = ("plain", "plain_tp_shard", "ddp", "fsdp_z3", "fsdp_z2", "tp", "tp_sp", "chain_views", "chain_launches")
# The plain model with a chain of operators added to each decoder layer's input: metadata-only views (view and
# transpose; their gradients are views too) or kernel-launching pointwise ones (mul, neg; theirs
# launch too), CHAIN_OPS of them, issued by the same Python loop. The two kinds' per-layer slopes differ only in
# what a launching operator costs the host beyond a view: dispatch to a CUDA kernel, its allocation and launch.
CHAIN_KINDS = ("chain_views", "chain_launches")
CHAIN_OPS = 128


def _chain(kind: str, h: torch.Tensor) -> torch.Tensor:
    """CHAIN_OPS forward operators of one class on the hidden states, shape and values kept (to rounding)."""
    b, s, d = h.shape
    for _ in range(CHAIN_OPS // 4):
        if kind == "chain_views":
            h = h.view(b, s, 4, d // 4).transpose(1, 2).transpose(1, 2).view(b, s, d)
        else:
            h = (h * 1.0).neg().neg() * 1.0
    return h


def _add_chains(model: Any, kind: str) -> None:
    """Each decoder layer's hidden-state input passes through `_chain` first (a forward pre-hook)."""

    def hook(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (_chain(kind, args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _chain(kind, kwargs["hidden_states"])}

    for layer in model.model.layers:
        layer.register_forward_pre_hook(hook, with_kwargs=True)


class _HostRun:
    """One host-probe variant (kind, layer count, setting) kept built, so that rounds can interleave the
    variants: a host's state drifts over a campaign (another tenant, clocks), and timing each variant in one
    block put that drift into the slopes (one instance's plain forward took less time at 8 layers than at 6)."""

    def __init__(self, kind: str, layers: int, setting: str, device: torch.device) -> None:
        from .dist_validate import DistCase, _adamw, _apply_tp, _hf_model, _mesh
        from .validate import tp_shard_config

        world = dist.get_world_size()
        cfg = {**TINY, "num_hidden_layers": layers}
        if kind == "plain_tp_shard":
            cfg = tp_shard_config(cfg, world)
        model = _hf_model(cfg, torch.float32 if setting.startswith("amp") else torch.bfloat16, device)
        half = torch.float16 if setting == "amp_fp16" else torch.bfloat16
        self.ac = (lambda: torch.autocast("cuda", dtype=half)) if setting.startswith("amp") else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler("cuda") if setting == "amp_fp16" else None
        dp, tp = (world, 1) if kind in ("ddp", "fsdp_z3", "fsdp_z2") else ((1, world) if kind.startswith("tp") else
                                                                            (world, 1))
        case = DistCase("probe", "torch", kind, "tiny", cfg, "bf16", dp, tp, 1)
        mesh = _mesh(case, device)
        self.loss_ctx: Any = None
        if kind.startswith("tp"):
            from torch.distributed.tensor.parallel import loss_parallel

            _apply_tp(model, mesh["tp"], sp=kind == "tp_sp")
            self.loss_ctx = loss_parallel
        elif kind.startswith("fsdp"):
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=kind == "fsdp_z3")
            fully_shard(model, mesh=mesh["dp"], reshard_after_forward=kind == "fsdp_z3")
        elif kind in CHAIN_KINDS:
            _add_chains(model, kind)
        elif kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[device.index], process_group=mesh["dp"].get_group())
        self.model = model
        self.opt = _adamw(list(model.parameters()), device)
        self.ids = torch.randint(0, int(TINY["vocab_size"]) // (world if kind == "plain_tp_shard" else 1), (1, 32),
                                 device=device)
        self.pos = torch.arange(32, device=device).unsqueeze(0)
        self.samples: dict[str, list[float]] = {"fwd": [], "bwd": [], "opt": []}
        self.counts: dict[str, float] = {}

    def step(self, keep: bool, counter: _OpCount | None = None) -> None:
        """One iteration, each phase timed to the GPU's end (kept when `keep`); with `counter`, its operators
        counted per phase instead."""
        import torch.nn.functional as F

        if counter is not None:
            counter.__enter__()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        with self.ac():
            logits = self.model(input_ids=self.ids, position_ids=self.pos, use_cache=False).logits
        with self.loss_ctx() if self.loss_ctx is not None else contextlib.nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), self.ids.flatten())
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        if counter is not None:
            counter.phase = "bwd"
        if self.loss_ctx is not None:
            with self.loss_ctx():
                loss.backward()
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if counter is not None:
            counter.phase = "opt"
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if counter is not None:
            counter.__exit__(None, None, None)
            self.counts = {**{f"{k}_ops": float(v) for k, v in counter.counts.items()},
                           **{f"{k}_views": float(v) for k, v in counter.views.items()}}
        elif keep:
            self.samples["fwd"].append((t1 - t0) * 1e6)
            self.samples["bwd"].append((t2 - t1) * 1e6)
            self.samples["opt"].append((t3 - t2) * 1e6)

    def result(self) -> dict[str, float]:
        """Median host-bound wall time of forward (with loss), backward and optimizer step (us), and the
        operators of each phase (all, and those that launch no kernel)."""
        return {**{k: statistics.median(v) for k, v in self.samples.items()}, **self.counts}


HOST_ROUNDS = 8  # each variant's timed iterations are spread over this many interleaved rounds


def _phase_times_interleaved(variants: list[tuple[str, int]], setting: str, device: torch.device, iters: int
                             ) -> dict[tuple[str, int], dict[str, float]]:
    """Every variant built first, warmed up and its operators counted; then `iters` timed iterations each, in
    HOST_ROUNDS rounds that visit the variants in turn (alternating direction), so slow spells of the host fall
    on all of them alike."""
    runs = {}
    for v in variants:
        if dist.get_rank() == 0:
            print(f"[host] {setting} {v[0]} L{v[1]}", flush=True)
        r = runs[v] = _HostRun(*v, setting, device)
        for _ in range(3):
            r.step(keep=False)
        r.step(keep=False, counter=_OpCount())
    per_round = max(1, -(-iters // HOST_ROUNDS))
    for rnd in range(HOST_ROUNDS):
        for v in variants if rnd % 2 == 0 else variants[::-1]:
            for _ in range(per_round):
                runs[v].step(keep=True)
    out = {v: r.result() for v, r in runs.items()}
    del runs
    torch.cuda.empty_cache()
    return out


class _OpCount(TorchDispatchMode):
    """Aten operators dispatched per phase (host costs per operator = per-layer time / per-layer count), and how
    many of them launch no kernel (the operator registry's view family, as the engine classes them)."""

    def __init__(self) -> None:
        super().__init__()
        from tp_query.schema.ops import REGISTRY, Family

        self._view = lambda name: REGISTRY.for_op(name).family == Family.VIEW
        self.phase = "fwd"
        self.counts = {"fwd": 0, "bwd": 0, "opt": 0}
        self.views = {"fwd": 0, "bwd": 0, "opt": 0}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith("aten."):
            self.counts[self.phase] += 1
            self.views[self.phase] += self._view(name)
        return func(*args, **(kwargs or {}))


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Theil-Sen slope (median of the pairwise slopes) and intercept (median residual): host-bound timings
    carry outliers (one layer count 30% slow from a scheduler hiccup) that pull a least-squares line."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    slope = statistics.median(slopes)
    return slope, statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))


def _framework_row(kind: str, setting: str, phase: str, quantity: str, value_us: float, ranks: int, samples: Any,
                   prov: Any) -> dict[str, Any]:
    """One row of the framework table, of this machine instance."""
    return {"framework": "torch", "kind": kind, "setting": setting, "phase": phase, "quantity": quantity,
            "value_us": value_us, "ranks": ranks, "samples_json": json.dumps(samples), "status": "ok", "reason": "",
            "measured_at": _now(), **dataclasses.asdict(prov), "machine": machine_id(), "cpu": cpu_model()}


def _store_framework_rows(out: Path, campaign: str, prov: Any, rows: list[dict[str, Any]]) -> None:
    """A campaign's rows in its own chunks: a rerun on the same instance replaces them, another adds."""
    store = ChunkedStore(out, campaign, FRAMEWORK_SCHEMA, prov,
                         key_columns=("framework", "kind", "setting", "phase", "quantity", "ranks", "machine"),
                         remeasure=True)
    for r in rows:
        store.append(r)
    store.flush()


def host_campaign(device: torch.device, prov: Any, out: Path | None, iters: int = 40,
                  kinds: tuple[str, ...] = HOST_KINDS) -> int:
    """Each machine instance keeps its own rows (a rerun on it replaces them; another instance adds)."""
    rows = []
    for setting in ("bf16", "amp_bf16"):
        rows += _host_rows(device, prov, setting, iters, kinds)
    if "plain" in kinds:  # GradScaler's host work (unscale_, its inf-flag read, update) on the plain model
        rows += _host_rows(device, prov, "amp_fp16", iters, ("plain",))
    if dist.get_rank() == 0 and out is not None:
        _store_framework_rows(out, f"framework-r{dist.get_world_size()}-{machine_id()}", prov, rows)
        for r in rows:
            print(f"[host] {r['kind']:>15} {r['setting']:>8} {r['phase']} {r['quantity']:>18}: {r['value_us']:9.1f} us",
                  flush=True)
    return len(rows)


LAYER_COUNTS = (1, 2, 4, 6, 8)


def _base_kind(kind: str) -> str:
    """What a framework kind's extra host cost is measured against: the plain model of the same shapes."""
    return "plain_tp_shard" if kind.startswith("tp") else "plain"


def _with_bases(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The kinds asked for and the plain kinds they are measured against, in HOST_KINDS order."""
    want = set(kinds) | {_base_kind(k) for k in kinds if not k.startswith("plain")}
    return tuple(k for k in HOST_KINDS if k in want)


def _host_rows(device: torch.device, prov: Any, setting: str, iters: int,
               kinds: tuple[str, ...] = HOST_KINDS) -> list[dict[str, Any]]:
    world = dist.get_world_size()
    kinds = _with_bases(kinds)
    times: dict[tuple[str, int], dict[str, float]] = {}
    measured = _phase_times_interleaved([(k, n) for k in kinds for n in LAYER_COUNTS], setting, device, iters)
    names = ("fwd", "bwd", "opt", "fwd_ops", "bwd_ops", "opt_ops", "fwd_views", "bwd_views", "opt_views")
    for variant, t in measured.items():
        times[variant] = dict(zip(names, _max_over_ranks(*(t[k] for k in names)), strict=True))
    rows = []
    xs = [float(n) for n in LAYER_COUNTS]
    for kind in kinds:
        base = _base_kind(kind)
        for phase in ("fwd", "bwd", "opt"):
            slope, fixed = _fit_line(xs, [times[(kind, n)][phase] for n in LAYER_COUNTS])
            ops, _ = _fit_line(xs, [times[(kind, n)][phase + "_ops"] for n in LAYER_COUNTS])
            views, _ = _fit_line(xs, [times[(kind, n)][phase + "_views"] for n in LAYER_COUNTS])
            if kind.startswith("plain"):
                vals = {"per_layer_us": slope, "fixed_us": fixed, "per_layer_ops": ops,
                        "per_op_us": slope / ops if ops > 0 else 0.0, "per_layer_views": views}
            else:
                bslope, bfixed = _fit_line(xs, [times[(base, n)][phase] for n in LAYER_COUNTS])
                vals = {"extra_per_layer_us": slope - bslope, "extra_fixed_us": fixed - bfixed}
                if kind in CHAIN_KINDS:  # what the chain adds a layer, by class (engine.framework reads the pair)
                    vals.update({"per_layer_us": slope, "per_layer_ops": ops, "per_layer_views": views})
            for q, v in vals.items():
                rows.append(_framework_row(kind, setting, phase, q, v, world,
                                           {str(k[1]): times[k][phase] for k in times if k[0] == kind}, prov))
    return rows


# ---------------------------------------------------------------------------------------------
# FSDP2's copy kernels
# ---------------------------------------------------------------------------------------------

# decoder-layer parameter shapes (out, in) of a few widths: the copy kernels' time follows the unit's bytes
# and its tensor count, and these span 0.2-1.6 GB units
COPY_UNITS: dict[str, list[tuple[int, ...]]] = {
    **{f"h{h}-f{f}-kv{kv}": [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
       for h, f, kv in ((2048, 8192, 512), (3584, 18944, 512), (4096, 14336, 1024), (4096, 12288, 1024),
                        (5120, 13824, 5120), (8192, 28672, 1024))},
    # root units (`fully_shard(model)`): embedding, final norm and LM head
    **{f"root-v{v}-h{h}": [(v, h), (h,), (v, h)] for v, h in ((32000, 4096), (128256, 4096), (151936, 3584))}}
COPY_WORLDS = (2, 4, 8)


def _fsdp_copy_kernels(shapes: list[tuple[int, ...]], world: int, dtype: torch.dtype,
                       device: torch.device) -> dict[str, float]:
    """One FSDP2 unit's three copies as `fully_shard` runs them (torch.distributed.fsdp._fully_shard.
    _fsdp_collectives), each timed as 8 calls queued back to back (a step issues them behind other work, so
    the host's launch and `_chunk_cat`'s host-side setup stay hidden, as they are not for one call timed
    alone, which ran `_chunk_cat` 2x slower than a profiled step did): copy_in (the rank's shards into the all-gather input, `_foreach_copy_`),
    copy_out (the all-gather output into the unsharded parameters, `fsdp.split_with_sizes_copy`),
    rs_copy_in (the unsharded gradients into the reduce-scatter input, `fsdp.chunk_cat`). Median us."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # registers torch.ops.fsdp

    # FSDP2 shards each parameter on dim 0, padded to a multiple of the world size; shards are flat
    padded = [(-(-s[0] // world) * world, *s[1:]) for s in shapes]
    shard = [math.prod(s) // world for s in padded]
    total = sum(shard)
    srcs = [torch.randn(n, device=device, dtype=dtype) for n in shard]
    ag_out = torch.empty(total * world, device=device, dtype=dtype)
    dsts = torch.split(ag_out.narrow(0, 0, total), shard)
    unsharded = [torch.empty(world, n, device=device, dtype=dtype) for n in shard]
    grads = [torch.randn(s, device=device, dtype=dtype) for s in padded]  # unsharded gradients, their own shapes
    rs_in = torch.empty(world, total, device=device, dtype=dtype)
    times = {
        "copy_in": events_us(lambda: torch._foreach_copy_(dsts, srcs), 9, queued=8),
        "copy_out": events_us(lambda: torch.ops.fsdp.split_with_sizes_copy(ag_out.view(world, -1), shard, dim=1,
                                                                           out=unsharded), 9, queued=8),
        "rs_copy_in": events_us(lambda: torch.ops.fsdp.chunk_cat(grads, 0, world, out=rs_in), 9, queued=8),
    }
    return {k: statistics.median(v) for k, v in times.items()}


def copies_campaign(device: torch.device, prov: Any, out: Path | None) -> int:
    """FSDP2's copy kernels over unit sizes and world sizes, on this rank's GPU (no collective involved):
    per (dtype, copy, world) a line latency = fixed_us + us_per_mib x the unit's full bytes, Theil-Sen over
    the units; the FSDP model prices its copies with it instead of assuming peak HBM bandwidth."""
    if dist.get_rank() != 0:
        return 0
    rows = []
    for dtype, setting in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for world in COPY_WORLDS:
            pts: dict[str, list[tuple[float, float]]] = {}
            for shapes in COPY_UNITS.values():
                mib = sum(math.prod(s) for s in shapes) * torch.tensor([], dtype=dtype).element_size() / 2**20
                for phase, us in _fsdp_copy_kernels(shapes, world, dtype, device).items():
                    pts.setdefault(phase, []).append((mib, us))
                torch.cuda.empty_cache()
            for phase, xy in pts.items():
                slope, fixed = _fit_line([x for x, _ in xy], [y for _, y in xy])
                rows += [_framework_row("fsdp_copy", setting, phase, q, v, world,
                                        [[round(x, 3), round(y, 2)] for x, y in xy], prov)
                         for q, v in (("us_per_mib", slope), ("fixed_us", fixed))]
                print(f"[copies] {setting} world {world} {phase:>10}: {slope:7.2f} us/MiB + {fixed:6.1f} us "
                      f"({', '.join(f'{x:.0f} MiB {y:.0f} us' for x, y in xy)})", flush=True)
    if out is not None:
        _store_framework_rows(out, f"fsdp-copies-{machine_id()}", prov, rows)
    return len(rows)


def main_probe(gpu: str, out_root: Path, what: str, host_kinds: str | None = None) -> None:
    from datetime import timedelta

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", timeout=timedelta(seconds=300))
    device = torch.device("cuda", local)
    dev = Device()
    dev.check_matches(gpu)  # an H200 host's rows must not fill data/h100
    prov = dev.provenance()
    try:
        if "overlap" in what:
            overlap_campaign(device, prov, out_root / "overlap")
        if "copies" in what:
            copies_campaign(device, prov, out_root / "framework")
        if "host" in what:
            kinds = tuple(host_kinds.split(",")) if host_kinds else HOST_KINDS
            unknown = set(kinds) - set(HOST_KINDS)
            if unknown:
                raise ValueError(f"unknown host kinds {sorted(unknown)}; choose from {', '.join(HOST_KINDS)}")
            host_campaign(device, prov, out_root / "framework", kinds=kinds)
    finally:
        dist.barrier()
        dist.destroy_process_group()
