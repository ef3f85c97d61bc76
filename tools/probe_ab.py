"""Repeatability of the host probe on one instance: the probe module given (the collector's, or a variant saved
beside it, e.g. `git show REV:collector/dist_probe.py > collector/_old_dist_probe.py`) run without storing, printing
the plain per-operator costs; run it several times, variants interleaved, in one device call.
    torchrun --nproc-per-node 1 tools/probe_ab.py tp_query.collector.dist_probe"""
import importlib
import sys
import time

import torch
import torch.distributed as dist
from tp_query.collector.device import Device

mod = importlib.import_module(sys.argv[1])
torch.cuda.set_device(0)
dist.init_process_group("nccl")
t0 = time.time()
rows = []
orig = mod._framework_row
mod._framework_row = lambda *a, **k: rows.append(orig(*a, **k)) or rows[-1]
mod.host_campaign(torch.device("cuda", 0), Device().provenance(), None, kinds=("plain",))
vals = {(r["setting"], r["phase"]): r["value_us"] for r in rows if r["quantity"] == "per_op_us"}
print(f"[ab] {sys.argv[1].split('.')[-1]} {time.time() - t0:.0f}s " + " ".join(
    f"{s}/{p}={v:.1f}" for (s, p), v in sorted(vals.items())), flush=True)
dist.destroy_process_group()
