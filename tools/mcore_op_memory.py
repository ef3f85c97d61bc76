"""Allocated bytes after every aten operator of one Megatron-Core training step (launch with torchrun, one process
per GPU), to find the operator where the real step's memory and the trace's part ways: the trace records the
same operators on fake tensors with its own live-bytes count (`--compare` replays the trace here).
    torchrun --nproc-per-node 1 tools/mcore_op_memory.py OUT bf16:1x1 tf32:1x1     (on a GPU)
    .venv/bin/python tools/mcore_op_memory.py --compare OUT                        (here)
Writes OUT/mcore-opmem-SETTING-TPxPP-rankR.json: [[op, allocated bytes after it, peak during it, output MiB], ...]
and the index of the operator during which the step peaks."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

GiB = 2**30


def record(out: Path, args: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from tp_query.collector.dist_megatron import build_megatron_step
    from tp_query.collector.validate import LLAMA3_8B, layers_of

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))

    class OpMemory(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[str, int, int, float]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            torch.cuda.reset_peak_memory_stats(dev)
            res = func(*args, **(kwargs or {}))
            mib = sum(t.numel() * t.element_size() for t in tree_leaves(res) if isinstance(t, torch.Tensor)) / 2**20
            self.rows.append((str(func), torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev),
                              round(mib, 2)))
            return res

    for arg in args:
        setting, split = arg.split(":")
        tp, pp = (int(x) for x in split.split("x"))
        base = torch.cuda.memory_allocated(dev)
        step, cleanup, _ = build_megatron_step(layers_of(LLAMA3_8B, 4), setting, tp=tp, pp=pp, micro_batch=1,
                                               seq_len=4096, micro_batches=4 if pp > 1 else 1,
                                               distributed_optimizer=False, device=dev)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        mode = OpMemory()
        with mode:
            step()
        torch.cuda.synchronize()
        rows = [(op, a - base, pk - base, mib) for op, a, pk, mib in mode.rows]
        at = max(range(len(rows)), key=lambda i: rows[i][2])
        peak = rows[at][2] + base
        (out / f"mcore-opmem-{setting}-{split}-rank{rank}.json").write_text(json.dumps(
            {"before_step": before - base, "peak": peak - base, "peak_index": at, "rows": rows}))
        print(f"rank{rank} {arg}: {len(rows)} ops, before {(before - base) / GiB:.2f} GiB, peak {(peak - base) / GiB:.2f}"
              f" GiB (at {at}: {rows[at][0]})", flush=True)
        for op, a, pk, mib in rows[max(at - 25, 0):at + 6]:
            print(f"rank{rank}   {a / GiB:8.3f} {pk / GiB:8.3f} {mib:9.1f} MiB  {op}", flush=True)
        cleanup()
    dist.destroy_process_group()


def _trace_live(setting: str) -> list[tuple[str, int, str]]:
    """The trace's own live bytes after every recorded operator (fake tensors; static state excluded)."""
    from tp_query.collector.validate import LLAMA3_8B, layers_of
    from tp_query.engine.trace import capture
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.schema.model_config import parse_config
    from tp_query.schema.precision import Setting

    rows: list[tuple[str, int, str]] = []
    orig = capture._Capture.on_op

    def on_op(self, func, args, kwargs, out):
        orig(self, func, args, kwargs, out)
        rows.append((str(func), self.live, self.phase.value))

    capture._Capture.on_op = on_op
    try:
        spec = parse_config(layers_of(LLAMA3_8B, 4), "llama3-8b-L4")
        trace_config(TraceRequest(spec, Setting(setting), 1, 4096, 1, False, False, "adamw", framework="megatron"))
    finally:
        capture._Capture.on_op = orig
    return rows


def compare(out: Path) -> None:
    """The real step's allocated bytes around its peak, and the trace's live bytes around its backward peak."""
    for f in sorted(out.glob("mcore-opmem-*-rank0.json")):
        d = json.loads(f.read_text())
        setting = f.name.split("-")[2]
        real, at = d["rows"], d["peak_index"]
        fake = _trace_live("mp_bf16" if setting == "bf16" else setting)
        print(f"== {f.name}: real peak {d['peak'] / GiB:.2f} GiB (step start {d['before_step'] / GiB:.2f}); "
              f"trace ops {len(fake)}, real ops {len(real)}")
        for op, a, pk, mib in real[max(at - 40, 0):at + 5]:
            print(f"  real {a / GiB:8.3f} {pk / GiB:8.3f} {mib:9.1f} MiB  {op}")
        fat = max(range(len(fake)), key=lambda i: fake[i][1])
        for op, live, phase in fake[max(fat - 40, 0):fat + 5]:
            print(f"  trace {live / GiB:8.3f} {phase}  {op}")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(Path(sys.argv[2]))
    else:
        out = Path(sys.argv[1])
        out.mkdir(parents=True, exist_ok=True)
        record(out, sys.argv[2:])
