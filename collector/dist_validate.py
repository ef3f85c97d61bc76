"""Distributed validation: real training iterations of a HuggingFace Llama-family model over several
GPUs of one host, launched with torchrun, for `make validate-dist`.

    torchrun --nproc-per-node 8 -m tp_query.collector dist-validate --gpu h200 --dp 2 --tp 4

DP is DistributedDataParallel; TP is torch.distributed.tensor.parallel (column-parallel q/k/v and
gate/up, row-parallel o and down, as Megatron does), DP x TP on a 2-D device mesh. Pipeline
parallelism (torch.distributed.pipelining, 1F1B) is not implemented yet. Rank 0 writes one row per
case to data/validation/ with the split. On CPUs the gloo backend runs the same code (tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tp_query.engine.trace.torchargs import torch_dtype
from tp_query.schema.precision import SETTINGS, Setting
from tp_query.schema.tables import VALIDATION_SCHEMA

from .device import Device
from .store import ChunkedStore
from .timing import quantile


def _tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}


def build(cfg: dict[str, Any], setting: Setting, dp: int, tp: int, device: torch.device) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import AutoConfig, AutoModelForCausalLM

    st = SETTINGS[setting]
    hcfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with device:
        model = AutoModelForCausalLM.from_config(hcfg, dtype=torch_dtype(st.param_dtype), attn_implementation="sdpa")
    model.train()
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], _tp_plan())
    if dp > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    process_group=mesh["dp"].get_group())
    return model, mesh


def run_dist_case(cfg: dict[str, Any], setting: Setting, dp: int, tp: int, mb: int, seq: int, device: torch.device,
                  iters: int = 6) -> dict[str, Any]:
    st = SETTINGS[setting]
    torch.backends.cuda.matmul.allow_tf32 = st.allow_tf32
    ac = torch_dtype(st.autocast_dtype) if st.autocast_dtype else None
    model, mesh = build(cfg, setting, dp, tp, device)
    # Sharded (DTensor) and replicated (plain) parameters in separate groups: the default foreach
    # AdamW cannot mix the two in one multi-tensor call.
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [{"params": [p for p in params if isinstance(p, DTensor)]},
              {"params": [p for p in params if not isinstance(p, DTensor)]}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-4,
                            foreach=True if device.type == "cpu" else None)
    scaler = torch.amp.GradScaler(device.type) if st.grad_scaler else None
    g = torch.Generator(device="cpu").manual_seed(1000 + mesh.get_local_rank("dp"))  # same ids across a TP group
    ids = torch.randint(0, int(cfg["vocab_size"]), (mb, seq), generator=g).to(device)

    def step() -> None:
        ctx = torch.autocast(device.type, dtype=ac) if ac else contextlib.nullcontext()
        with ctx:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    samples = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return {"iteration_ms": statistics.median(samples), "p20_ms": quantile(samples, 0.2),
            "p80_ms": quantile(samples, 0.8), "iterations": len(samples), "samples_ms": samples,
            "peak_allocated_bytes": int(peak)}


def main_dist(gpu: str, cfg_path: Path, setting: Setting, dp: int, tp: int, mb: int, seq: int, out: Path) -> None:
    cpu = gpu == "cpu"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if not cpu:
        torch.cuda.set_device(local)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("gloo" if cpu else "nccl")
    world = dist.get_world_size()
    if dp * tp != world:
        raise SystemExit(f"error: DP x TP = {dp * tp} but {world} processes were launched")
    device = torch.device("cpu") if cpu else torch.device("cuda", local)
    cfg = json.loads(cfg_path.read_text())
    res = run_dist_case(cfg, setting, dp, tp, mb, seq, device)
    if dist.get_rank() == 0:
        dev = Device(cpu=cpu)
        prov = dev.provenance()
        store = ChunkedStore(out, "validation-dist", VALIDATION_SCHEMA, prov, key_columns=("case_id",))
        cid = f"{cfg_path.stem}-dp{dp}-tp{tp}-mb{mb}-s{seq}-{setting.value}"
        store.append({"case_id": cid, "model": cfg_path.stem, "config_json": json.dumps(cfg, sort_keys=True),
                      "layers": int(cfg.get("num_hidden_layers", 0)), "setting": setting.value, "micro_batch": mb,
                      "seq_len": seq, "optimizer": "adamw", "tp_shard": 1, "split": "distributed", "status": "ok",
                      "reason": "", **res, "kernel_ms": None, "kernel_breakdown_json": None,
                      "peak_reserved_bytes": None, "accum": 1, "dp": dp, "tp": tp, "pp": 1,
                      "sm_clock_mhz": dev.clocks().sm_mhz,
                      "measured_at": dt.datetime.now(dt.UTC).replace(microsecond=0), **dataclasses.asdict(prov)})
        store.flush()
        print(f"[dist-validate] {cid}: {res['iteration_ms']:.2f} ms")
    dist.barrier()
    dist.destroy_process_group()
