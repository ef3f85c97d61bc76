"""The operators Megatron-Core's MoE training step dispatches on CUDA, to check the engine's Megatron MoE
graph (engine/trace/megatron_local.py MegatronMoE) op for op. Under torchrun, 2 ranks:
    torchrun --nproc-per-node 2 tools/mcore_moe_oplog.py OUT_DIR
A tiny Mixtral shape (the same structure as the validation cases), ep = 1 and 2: two warm steps, then one
step under a TorchDispatchMode that records every aten/c10d call with its argument shapes; rank 0 writes
OUT_DIR/mcore-moe-oplog-ep{N}.json. Compare with `tools/mcore_moe_oplog.py --compare OUT_DIR` on the CPU."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

CFG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 512,
       "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 2,
       "vocab_size": 1024, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 4096,
       "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu", "tie_word_embeddings": False}
SEQ = 256


def _shapes(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append([list(a.shape), str(a.dtype).replace("torch.", "")])
        elif isinstance(a, list | tuple) and a and all(isinstance(x, torch.Tensor) for x in a):
            out.append([[list(x.shape), str(x.dtype).replace("torch.", "")] for x in a])
    return out


def record(out_dir: Path) -> None:
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from tp_query.collector.dist_megatron import build_megatron_step

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[Any] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.calls.append([str(func.overloadpacket.__qualname__ if hasattr(func, "overloadpacket") else func)
                               + "." + func._overloadname, _shapes(args)])
            return func(*args, **(kwargs or {}))

    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    for ep in (1, 2):
        step, cleanup, _ = build_megatron_step(CFG, "bf16", tp=1, pp=1, micro_batch=1, seq_len=SEQ, micro_batches=1,
                                               distributed_optimizer=False, device=device, ep=ep)
        step()
        step()
        torch.cuda.synchronize()
        log = Log()
        with log:
            step()
        torch.cuda.synchronize()
        cleanup()
        if rank == 0:
            (out_dir / f"mcore-moe-oplog-ep{ep}.json").write_text(json.dumps(log.calls))
            print(f"ep{ep}: {len(log.calls)} calls", flush=True)
    dist.destroy_process_group()


def compare(out_dir: Path) -> None:
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.schema.model_config import parse_config
    from tp_query.schema.precision import Setting

    spec = parse_config(CFG, "tiny-mixtral")
    for ep in (1, 2):
        real = json.loads((out_dir / f"mcore-moe-oplog-ep{ep}.json").read_text())
        g = trace_config(TraceRequest(spec, Setting("mp_bf16"), 1, SEQ, 1, framework="megatron", ep=ep))
        ours = Counter(o.op.removeprefix("aten.") for o in g.ops if not o.op.startswith("comm."))
        theirs = Counter(".".join(c[0].split(".")[-2:]) for c in real)
        names = sorted(set(ours) | set(theirs))
        print(f"ep={ep}: real {sum(theirs.values())} calls, engine {sum(ours.values())}")
        for n in names:
            if ours[n] != theirs[n]:
                print(f"  {n:45s} real {theirs[n]:5d}  engine {ours[n]:5d}")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(Path(sys.argv[2]))
    else:
        record(Path(sys.argv[1]))
