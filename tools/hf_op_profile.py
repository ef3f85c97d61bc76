"""Where a one-GPU validation case spends GPU time, per aten operator: the case exactly as the campaign
runs it (collector/validate.py: the HF model, its optimizer, GradScaler under fp16 autocast), one profiled
step after warm-up; writes OUT/hf-ops-CASE.json with {aten op: [device us, calls]}, per-shape rows, the
kernels' busy time and the step's span. Compare offline with the engine's operator rows (`--compare OUT`).
    python3 tools/hf_op_profile.py OUT CASE_ID [CASE_ID ...]      (on a GPU)
    .venv/bin/python tools/hf_op_profile.py --compare OUT         (here; GPU=h100 for an H100's profiles)"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from gpu_profiles import aten_ops, kernel_busy, print_comparison, shaped_ops


def record(out: Path, case_ids: list[str]) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from tp_query.collector.validate import build_case_step, default_cases, family_cases

    cases = {c.case_id: c for c in default_cases() + family_cases()}
    for cid in case_ids:
        step = build_case_step(cases[cid], torch.device("cuda")).step
        for _ in range(4):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            step()
            torch.cuda.synchronize()
        ops, shaped = aten_ops(prof), shaped_ops(prof, 100)
        busy, span = kernel_busy(prof)
        (out / f"hf-ops-{cid}.json").write_text(json.dumps({"ops": ops, "shaped": shaped, "busy_us": busy,
                                                            "span_us": span}))
        print(f"{cid}: busy {busy / 1e3:.1f} ms, span {span / 1e3:.1f} ms", flush=True)
        del step
        torch.cuda.empty_cache()


def compare(out: Path) -> None:
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.predict import Engine, PredictRequest
    from tp_query.engine.validation import load_rows
    from tp_query.schema.precision import Setting

    from tp_query.schema.gpus import validation_folder

    root = Path(__file__).resolve().parent.parent
    gpu = os.environ.get("GPU", "h200")
    rows = {r["case_id"]: r for r in load_rows(root / validation_folder(gpu), gpu)}
    eng = Engine(gpu, str(root / "data"))
    for f in sorted(out.glob("hf-ops-*.json")):
        cid = f.stem.removeprefix("hf-ops-")
        # a case measured on a sampled instance is stored as CASE@INSTANCE
        # (a profile kept beside an earlier one of the same case carries a tag of its own: CASE@TAG)
        if cid not in rows:
            base = cid.split("@")[0]
            cid = next((k for k in rows if k.split("@")[0] == base), cid)
        r, real = rows[cid], json.loads(f.read_text())
        accum = int(r.get("accum") or 1)
        p = eng.predict(PredictRequest(model=json.loads(r["config_json"]), model_name=r["model"], gpu=gpu,
                                       setting=Setting(r["setting"]), seq_len=r["seq_len"],
                                       parallel=ParallelConfig(micro_batch=r["micro_batch"],
                                                               global_batch=r["micro_batch"] * accum)),
                        with_ops=True)
        gpu_ms = sum(o.total_ms for o in p.ops)
        print(f"== {cid}: measured {r['iteration_ms']:.1f} ms, kernels busy {real['busy_us'] / 1e3:.1f} ms | engine "
              f"{p.iteration_ms:.1f} ms, operators {gpu_ms:.1f} ms")
        print_comparison(real["ops"], p.ops, int(os.environ.get("TOP", "14")))

if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(Path(sys.argv[2]))
    else:
        record(Path(sys.argv[1]), sys.argv[2:])
