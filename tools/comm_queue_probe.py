"""An NCCL collective timed alone (the comm campaign: barrier, event, call, event) against the same call
queued back to back (20 calls between two events, as a busy step issues them): the difference is the
launch cost a single timed call carries and a queued one hides. torchrun --nproc-per-node 2."""
from __future__ import annotations

import functools
import os
import statistics

import torch
import torch.distributed as dist


def main() -> None:
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    for coll in ("all_reduce", "all_gather", "reduce_scatter"):
        for nbytes, dt in ((4096 * 4, torch.float32), (2**20, torch.bfloat16), (16 * 2**20, torch.bfloat16),
                           (32 * 2**20, torch.bfloat16), (64 * 2**20, torch.float32), (256 * 2**20, torch.bfloat16)):
            el = nbytes // torch.tensor([], dtype=dt).element_size()
            x = torch.ones(el, dtype=dt, device=dev)
            if coll == "all_gather":
                out = torch.empty(el * 2, dtype=dt, device=dev)
                fn = functools.partial(dist.all_gather_into_tensor, out, x)
            elif coll == "reduce_scatter":
                out = torch.empty(el // 2, dtype=dt, device=dev)
                fn = functools.partial(dist.reduce_scatter_tensor, out, x)
            else:
                fn = functools.partial(dist.all_reduce, x)
            fn()
            single, queued = [], []
            for _ in range(15):
                dist.barrier()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                single.append(s.elapsed_time(e) * 1e3)
            for _ in range(5):
                dist.barrier()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(20):
                    fn()
                e.record()
                torch.cuda.synchronize()
                queued.append(s.elapsed_time(e) * 1e3 / 20)
            if dist.get_rank() == 0:
                print(f"{coll:15s} {nbytes:>11d} {dt!s:15s} single {statistics.median(single):8.1f} us  "
                      f"queued {statistics.median(queued):8.1f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
