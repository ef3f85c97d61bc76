"""Where Megatron-Core's memory goes in one training step (launch with torchrun, one process per GPU):
allocated bytes after building, after warm-up steps, and the peaks of forward+backward and of the
optimizer step, per rank; the engine's prediction is compared offline."""
import os
import sys

import torch
import torch.distributed as dist
from gpu_profiles import GiB, live_at_peak
from tp_query.collector.dist_megatron import build_megatron_step
from tp_query.collector.validate import LLAMA3_8B, layers_of


def _state(step):  # the step closure's model/optimizer dict
    for cell in step.__closure__ or ():
        v = cell.cell_contents
        if isinstance(v, dict) and "optimizer" in v:
            return v
    raise RuntimeError("no state")


def _where(frames: list) -> str:
    for f in frames:
        if "megatron/" in f["filename"] or "torch/nn/functional" in f["filename"] or "collector/" in f["filename"]:
            return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
    return frames[0]["filename"].split("/")[-1] + ":" + str(frames[0]["line"]) if frames else "?"


def _print_peak(rank: int, arg: str, trace: list) -> None:
    """The step's own allocations live at their peak (HISTORY=1), grouped by the allocating frame."""
    best, by = live_at_peak(trace, _where)
    print(f"rank{rank} {arg} step_allocs_at_peak={best / GiB:.2f}", flush=True)
    for where, size in sorted(by.items(), key=lambda kv: -kv[1])[:16]:
        print(f"rank{rank}    {size / GiB:7.3f} GiB  {where}", flush=True)


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    cfg = layers_of(LLAMA3_8B, 4)
    for arg in sys.argv[1:]:
        setting, split, distopt = arg.split(":")
        tp, pp = (int(x) for x in split.split("x"))
        base = torch.cuda.memory_allocated(dev)
        step, cleanup, info = build_megatron_step(cfg, setting, tp=tp, pp=pp, micro_batch=1, seq_len=4096,
                                                  micro_batches=4 if pp > 1 else 1,
                                                  distributed_optimizer=distopt == "1", device=dev)
        built = torch.cuda.memory_allocated(dev) - base
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        steady = torch.cuda.memory_allocated(dev) - base
        st = _state(step)
        opt = st["optimizer"]
        orig = opt.step
        marks = {}

        def wrapped(marks=marks, base=base, orig=orig):
            torch.cuda.synchronize()
            marks["fb_peak"] = torch.cuda.max_memory_allocated(dev) - base
            marks["after_fb"] = torch.cuda.memory_allocated(dev) - base
            torch.cuda.reset_peak_memory_stats(dev)
            out = orig()
            torch.cuda.synchronize()
            marks["opt_peak"] = torch.cuda.max_memory_allocated(dev) - base
            return out

        opt.step = wrapped
        torch.cuda.reset_peak_memory_stats(dev)
        if os.environ.get("HISTORY"):
            torch.cuda.memory._record_memory_history(max_entries=2_000_000)
        step()
        torch.cuda.synchronize()
        opt.step = orig
        if os.environ.get("HISTORY"):
            _print_peak(rank, arg, torch.cuda.memory._snapshot()["device_traces"][dev.index])
            torch.cuda.memory._record_memory_history(enabled=None)
        print(f"rank{rank} {arg} params={info['params_per_rank']} grad_buffer={info['grad_buffer_bytes'] / GiB:.2f} "
              f"built={built / GiB:.2f} steady={steady / GiB:.2f} fb_peak={marks['fb_peak'] / GiB:.2f} "
              f"after_fb={marks['after_fb'] / GiB:.2f} opt_peak={marks['opt_peak'] / GiB:.2f} "
              f"opt={info['optimizer_impl']} foreach={info['optimizer_foreach']}", flush=True)
        cleanup()
        torch.cuda.reset_peak_memory_stats(dev)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
