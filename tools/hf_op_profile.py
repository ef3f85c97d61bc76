"""Where a one-GPU validation case spends GPU time, per aten operator: the case exactly as the campaign
runs it (collector/validate.py: the HF model, its optimizer, GradScaler under fp16 autocast), one profiled
step after warm-up; writes OUT/hf-ops-CASE.json with {aten op: [device us, calls]}, per-shape rows, the
kernels' busy time and the step's span. Compare offline with the engine's operator rows (`--compare OUT`).
    python3 tools/hf_op_profile.py OUT CASE_ID [CASE_ID ...]      (on a GPU)
    .venv/bin/python tools/hf_op_profile.py --compare OUT         (here)"""
from __future__ import annotations

import functools
import json
import sys
from collections import defaultdict
from pathlib import Path

_GROUPS = {"_to_copy": "copy", "clone": "copy", "copy_": "copy", "masked_fill_": "masked_fill", "contiguous": "copy"}


def _group(op: str) -> str:
    base = op.removeprefix("aten.").split(".")[0]
    return _GROUPS.get(base, base)


def record(out: Path, case_ids: list[str]) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from tp_query.collector.validate import _hf_model, _iteration, default_cases, family_cases, make_optimizer
    from tp_query.engine.trace.torchargs import torch_dtype
    from tp_query.schema.precision import SETTINGS, Setting

    cases = {c.case_id: c for c in default_cases() + family_cases()}
    for cid in case_ids:
        case = cases[cid]
        st = SETTINGS[Setting(case.setting)]
        torch.backends.cuda.matmul.allow_tf32 = st.allow_tf32
        ac = torch_dtype(st.autocast_dtype) if st.autocast_dtype else None
        model = _hf_model(case.config, torch_dtype(st.param_dtype), torch.device("cuda"))
        opt = make_optimizer(case.optimizer, model)
        scaler = torch.amp.GradScaler("cuda") if st.grad_scaler else None
        ids = torch.randint(0, int(case.config["vocab_size"]), (case.micro_batch, case.seq_len), device="cuda")
        step = functools.partial(_iteration, model, opt, scaler, ids, ac, accum=case.accum)
        for _ in range(4):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            step()
            torch.cuda.synchronize()
        ops = {e.key.replace("aten::", "aten."): [e.self_device_time_total, e.count] for e in prof.key_averages()
               if e.key.startswith("aten::") and e.self_device_time_total > 0}
        shaped = [[e.key.replace("aten::", "aten."), str(e.input_shapes)[:160], e.self_device_time_total, e.count]
                  for e in prof.key_averages(group_by_input_shape=True)
                  if e.key.startswith("aten::") and e.self_device_time_total > 100]
        kernels = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                         if ev.device_type == torch.autograd.DeviceType.CUDA)
        busy, cs, ce = 0.0, *kernels[0]
        for a, b in kernels[1:]:
            if a > ce:
                busy, cs, ce = busy + ce - cs, a, b
            else:
                ce = max(ce, b)
        busy += ce - cs
        (out / f"hf-ops-{cid}.json").write_text(json.dumps({"ops": ops, "shaped": shaped, "busy_us": busy,
                                                            "span_us": kernels[-1][1] - kernels[0][0]}))
        print(f"{cid}: busy {busy / 1e3:.1f} ms, span {(kernels[-1][1] - kernels[0][0]) / 1e3:.1f} ms", flush=True)
        del model, opt, scaler, step
        torch.cuda.empty_cache()


def compare(out: Path) -> None:
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.predict import Engine, PredictRequest
    from tp_query.engine.validation import load_rows
    from tp_query.schema.precision import Setting

    root = Path(__file__).resolve().parent.parent
    rows = {r["case_id"]: r for r in load_rows(root / "data" / "validation")}
    eng = Engine("h200", str(root / "data"))
    for f in sorted(out.glob("hf-ops-*.json")):
        cid = f.stem.removeprefix("hf-ops-")
        r, real = rows[cid], json.loads(f.read_text())
        accum = int(r.get("accum") or 1)
        p = eng.predict(PredictRequest(model=json.loads(r["config_json"]), model_name=r["model"], gpu="h200",
                                       setting=Setting(r["setting"]), seq_len=r["seq_len"],
                                       parallel=ParallelConfig(micro_batch=r["micro_batch"],
                                                               global_batch=r["micro_batch"] * accum)),
                        with_ops=True)
        ours: dict[str, float] = defaultdict(float)
        theirs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for o in p.ops:
            ours[_group(o.op)] += o.total_ms * 1e3
        for n, (us, calls) in real["ops"].items():
            theirs[_group(n)][0] += us
            theirs[_group(n)][1] += calls
        gpu_ms = sum(ours.values()) / 1e3
        print(f"== {cid}: measured {r['iteration_ms']:.1f} ms, kernels busy {real['busy_us'] / 1e3:.1f} ms | engine "
              f"{p.iteration_ms:.1f} ms, operators {gpu_ms:.1f} ms")
        names = sorted(set(theirs) | set(ours), key=lambda n: -abs(theirs.get(n, [0])[0] - ours.get(n, 0)))
        for n in names[:int(__import__("os").environ.get("TOP", "14"))]:
            t = theirs.get(n, [0.0, 0])
            print(f"  {n:32s} real {t[0] / 1e3:8.2f} ms ({t[1]:4d})  engine {ours.get(n, 0) / 1e3:8.2f} ms")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(Path(sys.argv[2]))
    else:
        record(Path(sys.argv[1]), sys.argv[2:])
