"""Where a PyTorch-native distributed step spends GPU time, per aten operator (launch with torchrun, one
process per GPU): the campaign's own case (collector/dist_validate.py), one profiled step after warm-up.
Pipelining: the last rank (the critical stage) writes OUT/pp-ops-CASE.json; DTensor TP and DP: rank 0
writes OUT/dist-ops-CASE.json ({aten op: [device us, calls]}, per-shape rows). Compare offline with the
engine's operator rows of the critical stage (`--compare OUT`)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from gpu_profiles import aten_ops, kernel_timeline, print_comparison, shaped_ops


def record(out: Path, case_ids: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from tp_query.collector import dist_validate as dv

    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    cases = {c.case_id: c for c in dv.dist_cases(dist.get_world_size())}
    for cid in case_ids:
        case = cases[cid]
        torch.backends.cuda.matmul.allow_tf32 = case.setting == "tf32"
        pp = case.kind.startswith("pp")
        build = dv.build_torch_pp if pp else dv.build_torch_tp if case.kind.startswith("tp") else dv.build_torch_dp
        step = build(case, dv._mesh(case, dev), dev)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            step()
            torch.cuda.synchronize()
        timeline: list[Any] = [None] * dist.get_world_size()  # every rank's kernel timeline
        dist.all_gather_object(timeline, kernel_timeline(prof))
        if dist.get_rank() == (dist.get_world_size() - 1 if pp else 0):
            ops, shaped = aten_ops(prof), shaped_ops(prof, 300)
            (out / f"{'pp' if pp else 'dist'}-ops-{cid}.json").write_text(
                json.dumps({"ops": ops, "shaped": shaped, "timeline": timeline}))
            for r, t in enumerate(timeline):
                print(f"  rank{r}: span {t['span_us'] / 1e3:.1f} busy {t['busy_us'] / 1e3:.1f} compute "
                      f"{t['compute_busy_us'] / 1e3:.1f} nccl {t['nccl_us'] / 1e3:.2f} ms ({len(t['nccl_kernels_us'])}"
                      f" kernels), exposed {t['nccl_exposed_us'] / 1e3:.2f} ms", flush=True)
            print(f"{cid}: {sum(v[0] for v in ops.values()) / 1e3:.1f} ms of aten kernels", flush=True)
        del step
        dv.gc_cuda(dev)
    dist.destroy_process_group()


def compare(out: Path) -> None:
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.predict import Engine, PredictRequest
    from tp_query.engine.validation import DIST_KINDS, load_rows
    from tp_query.schema.precision import Setting

    root = Path(__file__).resolve().parent.parent
    rows = {r["case_id"]: r for r in load_rows(root / "data" / "validation")}
    eng = Engine("h200", str(root / "data"))
    for f in sorted([*out.glob("pp-ops-*.json"), *out.glob("dist-ops-*.json")]):
        cid = f.stem.removeprefix("pp-ops-").removeprefix("dist-ops-")
        # the case as measured without an instance, else its first instance's run (machine samples)
        r = rows.get(cid) or next(v for k, v in sorted(rows.items()) if k.startswith(cid + "@"))
        real = json.loads(f.read_text())
        dp = int(r["dp"] or 1)
        par = ParallelConfig(dp=dp, tp=int(r["tp"] or 1), pp=int(r["pp"] or 1), global_batch=int(r["accum"]) * dp,
                             **DIST_KINDS[r["dist_kind"]])
        p = eng.predict(PredictRequest(model=json.loads(r["config_json"]), gpu="h200", setting=Setting(r["setting"]),
                                       seq_len=r["seq_len"], parallel=par), with_ops=True)
        print(f"== {cid}: measured {r['iteration_ms']:.1f} ms | engine {p.iteration_ms:.1f} ms; aten kernels "
              f"{sum(v[0] for v in real['ops'].values()) / 1e3:.1f} ms real, "
              f"{sum(o.total_ms for o in p.ops):.1f} ms engine")
        print_comparison(real["ops"], p.ops, 16)

if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(Path(sys.argv[2]))
    else:
        record(Path(sys.argv[1]), sys.argv[2:])
