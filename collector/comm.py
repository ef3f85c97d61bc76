"""The communication campaign: NCCL collectives on the GPUs of one host, launched with torchrun.

    torchrun --nproc-per-node 8 -m tp_query.collector comm --gpu h200

all-reduce, all-gather, reduce-scatter, broadcast, all-to-all and send/recv; 1 KiB to 2 GiB
(powers of two and off-by-one points); fp32, bf16, fp16; every power-of-two group size up to the
world size (sub-groups of consecutive ranks). Rank 0 owns the store; the plan is broadcast so
every rank runs the same collectives in the same order. Resumable like the compute campaign.
NVLink multicast (NVLS) stays off. On CPUs (tests) the gloo backend runs the same code.
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tp_query.schema.gpus import bus_factor
from tp_query.schema.messages import first_line
from tp_query.schema.tables import COMM_SCHEMA

from .device import Device
from .store import ChunkedStore
from .timing import quantile

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sizes(max_bytes: int = 2**31, tiny: bool = False) -> list[int]:
    top = 2**20 if tiny else max_bytes
    out: list[int] = []
    b = 1024
    while b <= top:
        out.append(b)
        if b >= 2**20:
            out.append(b + 4096)  # off the power of two: chunking and protocol switches show up here
        b *= 2 if not tiny else 16
    return out


def plan(world: int, tiny: bool) -> list[tuple[str, int, int, str]]:
    groups = [g for g in (2, 4, 8, 16, 32, 64) if g <= world]
    dtypes = ["fp32"] if tiny else list(DTYPES)
    return [(c, b, g, d) for g in groups for c in COLLECTIVES for d in dtypes for b in sizes(tiny=tiny)
            if not (c == "send_recv" and g != 2)]


def collective_fn(coll: str, nbytes: int, group: Any, ranks: int, dtype: torch.dtype,
                  device: torch.device) -> Callable[[], object]:
    """One collective of `nbytes` per rank (a multiple of the rank count in elements) as the campaign runs it,
    its buffers bound."""
    el = max(nbytes // torch.tensor([], dtype=dtype).element_size(), ranks)
    el -= el % ranks
    x = torch.ones(el, dtype=dtype, device=device)
    rank = dist.get_rank(group)
    if coll == "all_gather":
        out = torch.empty(el * ranks, dtype=dtype, device=device)
        fn = lambda: dist.all_gather_into_tensor(out, x, group=group)  # noqa: E731
    elif coll == "reduce_scatter":
        out = torch.empty(el // ranks, dtype=dtype, device=device)
        fn = lambda: dist.reduce_scatter_tensor(out, x, group=group)  # noqa: E731
    elif coll == "broadcast":
        fn = lambda: dist.broadcast(x, group_src=0, group=group)  # noqa: E731
    elif coll == "all_to_all":
        out = torch.empty_like(x)
        fn = lambda: dist.all_to_all_single(out, x, group=group)  # noqa: E731
    elif coll == "send_recv":
        peer = 1 - rank

        def fn() -> None:
            if rank == 0:
                dist.send(x, group_dst=peer, group=group)
            else:
                dist.recv(x, group_src=peer, group=group)
    else:
        fn = lambda: dist.all_reduce(x, group=group)  # noqa: E731
    return fn


def time_collective(coll: str, nbytes: int, group: Any, ranks: int, dtype: torch.dtype, device: torch.device,
                    reps: int) -> list[float]:
    """The campaign's samples of one collective (us): barrier, event, the call, event, one call per sample."""
    fn = collective_fn(coll, nbytes, group, ranks, dtype, device)
    fn()
    samples = []
    cuda = device.type == "cuda"
    for _ in range(reps):
        dist.barrier(group=group)
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            samples.append(s.elapsed_time(e) * 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return samples


def link_type(device: torch.device, world: int) -> str:
    if device.type != "cuda":
        return "cpu-gloo"
    if world > 1 and torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1):
        return "nvlink"
    return "pcie"


def run_comm_campaign(out: Path, gpu: str, tiny: bool = False, budget_s: float | None = None, reps: int = 20) -> int:
    """Run under torchrun (or any launcher that sets RANK/WORLD_SIZE/MASTER_ADDR)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    cpu = gpu == "cpu"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if not cpu:
        torch.cuda.set_device(local)
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if cpu else torch.device("cuda", local)
    dev = Device(cpu=cpu)
    if not cpu:
        dev.check_matches(gpu)
    prov = dev.provenance()
    store = ChunkedStore(out, "comm", COMM_SCHEMA, prov, key_columns=("collective", "bytes", "ranks", "dtype")) \
        if rank == 0 else None
    todo = plan(world, tiny)
    if store is not None:
        done = store.done_keys()
        todo = [p for p in todo if p not in done]
    box: list[Any] = [todo]
    dist.broadcast_object_list(box, src=0)
    todo = box[0]
    groups = {g: dist.new_group(list(range(g))) for g in sorted({p[2] for p in todo})}
    link = link_type(device, world)
    t0 = time.perf_counter()
    n = 0
    for coll, nbytes, g, dname in todo:
        stop = [budget_s is not None and time.perf_counter() - t0 > budget_s]
        dist.broadcast_object_list(stop, src=0)
        if stop[0]:
            break
        if rank < g:
            status, reason, samples = "ok", "", []
            try:
                samples = time_collective(coll, nbytes, groups[g], g, DTYPES[dname], device, reps)
            except torch.OutOfMemoryError:
                status, reason = "oom", "out of memory"
            except RuntimeError as e:
                status, reason = "error", first_line(e)[:300]
            if rank == 0 and store is not None:
                med = statistics.median(samples) if samples else None
                store.append({
                    "collective": coll, "bytes": nbytes, "ranks": g, "dtype": dname, "link": link,
                    "latency_us": med, "p20_us": quantile(samples, 0.2) if samples else None,
                    "p80_us": quantile(samples, 0.8) if samples else None, "samples": len(samples),
                    "bus_bw_gbps": (nbytes * bus_factor(coll, g) / (med * 1e-6) / 1e9) if med else None,
                    "status": status, "reason": reason,
                    "measured_at": dt.datetime.now(dt.UTC).replace(microsecond=0), **asdict(prov)})
                n += 1
        dist.barrier()
    if store is not None:
        store.flush()
    dist.barrier()
    dist.destroy_process_group()
    return n
