"""DTensor's host cost at real sizes, on one GPU (issue 9, notes section 20): the distributed runs' DTensor TP steps
issue 15-20% more host time than the tiny-model probe charges. Here one process plays rank 0 of a TP=2 mesh over
PyTorch's fake process group (collectives return at once, so NCCL's own host work is absent; DTensor's dispatch
and sharding propagation run as they do on two GPUs) and times each phase's host issue (the CPU time until the
phase's Python call returns, the GPU left to catch up) and its synced wall time, for the plain TP-shard model, TP
and TP+SP, at the probe's tiny size and at LLaMA-3-8B's, over 1, 2 and 4 layers. Writes OUT/dtensor-host-real.json.
Under torchrun on two GPUs the same over NCCL (OUT/dtensor-host-nccl.json), where the collectives are real.
    python3 tools/dtensor_host_real.py OUT                               (one GPU, fake process group)
    torchrun --nproc-per-node 2 tools/dtensor_host_real.py OUT           (two GPUs, NCCL)"""
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main(out: Path) -> None:
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from tp_query.collector.dist_probe import TINY
    from tp_query.collector.dist_validate import _adamw, _apply_tp, _hf_model
    from tp_query.collector.validate import LLAMA3_8B, tp_shard_config

    real = "WORLD_SIZE" in os.environ  # under torchrun on two GPUs: NCCL itself, for the comparison
    if real:
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    rank = dist.get_rank()
    device = torch.device("cuda", rank if real else 0)
    torch.cuda.set_device(device)
    mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("tp",))
    sizes = {"tiny": ({**TINY}, 32), "llama3-8b": ({k: v for k, v in LLAMA3_8B.items()}, 4096)}
    rows = []
    for setting in ("bf16", "amp_bf16"):
        for size, (base, seq) in sizes.items():
            for kind in ("plain_tp_shard", "tp", "tp_sp"):
                for layers in (1, 2, 4):
                    cfg = {**base, "num_hidden_layers": layers}
                    if kind == "plain_tp_shard":
                        cfg = tp_shard_config(cfg, 2)
                    model = _hf_model(cfg, torch.float32 if setting == "amp_bf16" else torch.bfloat16, device)
                    loss_ctx: object = contextlib.nullcontext
                    if kind != "plain_tp_shard":
                        _apply_tp(model, mesh["tp"], sp=kind == "tp_sp")
                        loss_ctx = loss_parallel
                    opt = _adamw(list(model.parameters()), device)
                    vocab = int(cfg["vocab_size"])
                    ids = torch.randint(0, vocab, (1, seq), device=device)
                    pos = torch.arange(seq, device=device).unsqueeze(0)
                    ac = (torch.autocast("cuda", dtype=torch.bfloat16) if setting == "amp_bf16"
                          else contextlib.nullcontext())
                    issue = {"fwd": [], "bwd": [], "opt": []}
                    wall = {"fwd": [], "bwd": [], "opt": []}
                    for i in range(13):
                        res = {}
                        for phase in ("fwd", "bwd", "opt"):
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            if phase == "fwd":
                                with ac:
                                    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
                                with loss_ctx():  # type: ignore[operator]
                                    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
                            elif phase == "bwd":
                                with loss_ctx():  # type: ignore[operator]
                                    loss.backward()
                            else:
                                opt.step()
                                opt.zero_grad(set_to_none=True)
                            t1 = time.perf_counter()
                            torch.cuda.synchronize()
                            res[phase] = ((t1 - t0) * 1e6, (time.perf_counter() - t0) * 1e6)
                        if i >= 3:
                            for phase, (a, b) in res.items():
                                issue[phase].append(a)
                                wall[phase].append(b)
                    row = {"setting": setting, "size": size, "kind": kind, "layers": layers,
                           **{f"{p}_issue_us": statistics.median(v) for p, v in issue.items()},
                           **{f"{p}_wall_us": statistics.median(v) for p, v in wall.items()}}
                    rows.append(row)
                    if rank == 0:
                        print(json.dumps(row), flush=True)
                    del model, opt, logits, loss
                    torch.cuda.empty_cache()
    if rank == 0:
        (out / ("dtensor-host-nccl.json" if real else "dtensor-host-real.json")).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
