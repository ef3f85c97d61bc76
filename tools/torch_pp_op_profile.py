"""Where torch.distributed.pipelining's last stage spends GPU time, per aten operator (launch with torchrun,
one process per GPU): the campaign's own case (collector/dist_validate.py), one profiled step after warm-up;
the last rank writes OUT/pp-ops-CASE.json ({aten op: [device us, calls]}, per-shape rows, busy time).
Compare offline with the engine's operator rows of the critical stage (`--compare OUT`)."""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

_GROUPS = {"_to_copy": "copy", "clone": "copy", "copy_": "copy", "masked_fill_": "masked_fill", "contiguous": "copy"}


def _group(op: str) -> str:
    base = op.removeprefix("aten.").split(".")[0]
    return _GROUPS.get(base, base)


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
        step = dv.build_torch_pp(case, dv._mesh(case, dev), dev)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            step()
            torch.cuda.synchronize()
        if dist.get_rank() == dist.get_world_size() - 1:
            ops = {e.key.replace("aten::", "aten."): [e.self_device_time_total, e.count]
                   for e in prof.key_averages() if e.key.startswith("aten::") and e.self_device_time_total > 0}
            shaped = [[e.key.replace("aten::", "aten."), str(e.input_shapes)[:160], e.self_device_time_total,
                       e.count] for e in prof.key_averages(group_by_input_shape=True)
                      if e.key.startswith("aten::") and e.self_device_time_total > 300]
            (out / f"pp-ops-{cid}.json").write_text(json.dumps({"ops": ops, "shaped": shaped}))
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
    for f in sorted(out.glob("pp-ops-*.json")):
        cid = f.stem.removeprefix("pp-ops-")
        r, real = rows[cid], json.loads(f.read_text())
        par = ParallelConfig(pp=int(r["pp"]), global_batch=int(r["accum"]), **DIST_KINDS[r["dist_kind"]])
        p = eng.predict(PredictRequest(model=json.loads(r["config_json"]), gpu="h200", setting=Setting(r["setting"]),
                                       seq_len=r["seq_len"], parallel=par), with_ops=True)
        ours: dict[str, float] = defaultdict(float)
        theirs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for o in p.ops:
            ours[_group(o.op)] += o.total_ms * 1e3
        for n, (us, calls) in real["ops"].items():
            theirs[_group(n)][0] += us
            theirs[_group(n)][1] += calls
        print(f"== {cid}: measured {r['iteration_ms']:.1f} ms | engine {p.iteration_ms:.1f} ms; aten kernels "
              f"{sum(v[0] for v in theirs.values()) / 1e3:.1f} ms real, {sum(ours.values()) / 1e3:.1f} ms engine")
        names = sorted(set(theirs) | set(ours), key=lambda n: -abs(theirs.get(n, [0])[0] - ours.get(n, 0)))
        for n in names[:16]:
            t = theirs.get(n, [0.0, 0])
            print(f"  {n:32s} real {t[0] / 1e3:8.2f} ms ({t[1]:4d})  engine {ours.get(n, 0) / 1e3:8.2f} ms")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(Path(sys.argv[2]))
    else:
        record(Path(sys.argv[1]), sys.argv[2:])
