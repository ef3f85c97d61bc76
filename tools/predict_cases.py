"""Predictions of validation cases before they run, as a JSON file to commit ahead of the device call: one-GPU
cases (collector.validate, PP stage cases included) and distributed ones (collector.dist_validate, 2 GPUs), each
through the report's own Study with the typical host (no instance's probe), keyed by case id.
Usage: `.venv/bin/python tools/predict_cases.py OUT.json <case-id substrings, comma-separated> [--dist] [--gpu h100]`
(data/experiments/depth-kinds-h200/*predicted*.json were written this way)."""

import json
import sys

from tp_query.collector.validate import default_cases
from tp_query.engine.predict import Engine
from tp_query.engine.validation import Study


def rows_for(patterns: list[str], dist: bool) -> list[dict]:
    rows = []
    if dist:
        from tp_query.collector.dist_validate import dist_cases

        for c in dist_cases(2):
            if any(p in c.case_id for p in patterns):
                rows.append({"case_id": c.case_id, "model": c.model, "config_json": json.dumps(c.config),
                             "split": c.split, "micro_batch": c.micro_batch, "seq_len": c.seq_len, "tp_shard": 1,
                             "setting": c.setting, "optimizer": "adamw", "dist_kind": c.kind, "framework": c.framework,
                             "pp": c.pp, "pp_stage": None, "accum": c.micro_batches, "dp": c.dp, "tp": c.tp,
                             "options_json": json.dumps(c.options), "rank_json": None})
        return rows
    for c in default_cases():
        if any(p in c.case_id for p in patterns):
            rows.append({"case_id": c.case_id, "model": c.model, "config_json": json.dumps(c.config), "split": c.split,
                         "micro_batch": c.micro_batch, "seq_len": c.seq_len, "tp_shard": c.tp_shard,
                         "setting": c.setting, "optimizer": c.optimizer, "dist_kind": None, "pp": c.pp or 1,
                         "pp_stage": c.pp_stage or None, "accum": c.accum, "dp": None, "tp": None, "options_json": "{}"})
    return rows


def main() -> None:
    out, patterns = sys.argv[1], sys.argv[2].split(",")
    rows = [{**r, "status": "ok", "iteration_ms": 1.0, "peak_allocated_bytes": 0, "machine": "typical-host"}
            for r in rows_for(patterns, "--dist" in sys.argv)]
    gpu = sys.argv[sys.argv.index("--gpu") + 1] if "--gpu" in sys.argv else "h200"
    eng = Engine(gpu)
    study = Study(eng, rows, with_baselines=False)
    study.finalize(eng.host)
    res = {c.case_id: {"iteration_ms": c.predicted_ms, "peak_memory_gib": c.predicted_peak_gib, "error": c.error}
           for c in study.cases}
    for k, v in res.items():
        print(f"{k:70s} {v['iteration_ms']:9.2f} ms {v['peak_memory_gib']:7.2f} GiB {v['error']}")
    with open(out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
