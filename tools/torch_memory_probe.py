"""What is live at the peak of one PyTorch-native distributed step (launch with torchrun, one process
per GPU): the case is built by collector/dist_validate.py as the campaign runs it; the allocator's
history of one step after warm-up is replayed to its peak, and the live blocks are grouped by the
innermost frame of user-level code that allocated them."""
import os
import sys

import torch
import torch.distributed as dist
from gpu_profiles import GiB, live_at_peak
from tp_query.collector import dist_validate as dv
from tp_query.collector.dist_validate import dist_cases, run_case  # noqa: F401

KEEP = ("transformers/", "collector/", "torch/distributed/tensor", "torch/distributed/pipelining",
        "torch/optim/", "torch/nn/functional", "torch/autograd")


def _where(frames: list[dict]) -> str:
    for f in frames:
        if any(k in f["filename"] for k in KEEP):
            return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
    return frames[0]["filename"].split("/")[-1] + ":" + str(frames[0]["line"]) if frames else "?"


def main() -> None:
    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl")
    cases = {c.case_id: c for c in dist_cases(dist.get_world_size())}
    for cid in sys.argv[1:]:
        case = cases[cid]
        torch.backends.cuda.matmul.allow_tf32 = case.setting == "tf32"
        mesh = dv._mesh(case, dev)
        build = dv.build_torch_pp if case.kind.startswith("pp") else (
            dv.build_torch_tp if case.kind.startswith("tp") else dv.build_torch_dp)
        step = build(case, mesh, dev)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        steady = torch.cuda.memory_allocated(dev)
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak = torch.cuda.max_memory_allocated(dev)
        best, by = live_at_peak(snap["device_traces"][dev.index], _where)
        print(f"rank{rank} {cid} steady={steady / GiB:.2f} peak={peak / GiB:.2f} step_allocs_at_peak={best / GiB:.2f}",
              flush=True)
        for where, size in sorted(by.items(), key=lambda kv: -kv[1])[:14]:
            print(f"rank{rank}    {size / GiB:7.3f} GiB  {where}", flush=True)
        del step
        dv.gc_cuda(dev)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
