"""An NCCL collective timed alone (the comm campaign: barrier, event, call, event) against the same call
queued back to back (20 calls between two events, as a busy step issues them): the difference is the
launch cost a single timed call carries and a queued one hides. torchrun --nproc-per-node 2 (2 ranks)."""
from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist
from tp_query.collector.comm import collective_fn, time_collective
from tp_query.collector.timing import events_us


def main() -> None:
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    for coll in ("all_reduce", "all_gather", "reduce_scatter"):
        for nbytes, dt in ((4096 * 4, torch.float32), (2**20, torch.bfloat16), (16 * 2**20, torch.bfloat16),
                           (32 * 2**20, torch.bfloat16), (64 * 2**20, torch.float32), (256 * 2**20, torch.bfloat16)):
            single = time_collective(coll, nbytes, None, 2, dt, dev, 15)  # as the comm campaign times it
            queued = events_us(collective_fn(coll, nbytes, None, 2, dt, dev), 5, queued=20, before=dist.barrier)
            if dist.get_rank() == 0:
                print(f"{coll:15s} {nbytes:>11d} {dt!s:15s} single {statistics.median(single):8.1f} us  "
                      f"queued {statistics.median(queued):8.1f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
