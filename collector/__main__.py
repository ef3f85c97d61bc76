"""Command line of the GPU side: `python -m tp_query.collector {collect,validate,oplog,probe}`.

Runs with torch, nvidia-ml-py, pyarrow and rich only (no duckdb, no polars), so it works on a GPU
machine without network. Errors the user can fix are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from tp_query.schema.gpus import UnknownGpu, gpu_spec, validation_folder
from tp_query.schema.manifest import ManifestError
from tp_query.schema.precision import Precision

from .device import Device, DeviceError
from .plan import InputError
from .store import StoreError


def _collect(a: argparse.Namespace) -> int:
    from tp_query.schema.ops import REGISTRY, Operands

    from .campaign import CampaignAbort, run_campaign
    from .plan import (
        GRID_ORDER,
        grid_points,
        repeat_sample,
        routed_points,
        signature_points,
        summary,
        with_operand_variant,
    )
    from .timing import ClosedFormTimer, Timer

    for what, v, low, high in (("--budget-s", a.budget_s, 0.0, 1e7), ("--repeat-fraction", a.repeat_fraction, 0.0, 1.0),
                               ("--tiny", a.tiny, 0, 1 << 20)):
        if v is not None and not (math.isfinite(v) and low <= v <= high):
            raise InputError(f"{what} must be a number in [{low:g}, {high:g}], got {v!r}")
    precisions = None
    if a.precisions:
        try:
            precisions = [Precision(p) for p in a.precisions.split(",")]
        except ValueError as e:
            raise InputError(f"--precisions: {e}; choose from {', '.join(p.value for p in Precision)}") from None
    kind_names = {k.name for k in REGISTRY.kinds()}
    unknown = sorted(set(a.kinds.split(",")) - kind_names) if a.kinds else []
    if unknown:
        raise InputError(f"--kinds: unknown {', '.join(unknown)} (the registry's kinds: `python -m tp_query.collector "
                         "collect --grid --plan-only` lists them)")
    spec = gpu_spec(a.gpu)
    device = Device(cpu=a.gpu == "cpu")
    device.check_matches(spec.name)
    out = Path(a.out or f"data/{spec.name}/ops")
    points = []
    if a.grid:
        points += grid_points(precisions=precisions or GRID_ORDER,
                              kinds=set(a.kinds.split(",")) if a.kinds else None, tiny=a.tiny)
    for f in a.sigs or []:
        points += signature_points(Path(f))
    if a.operands == "routed" and (a.grid or a.sigs or a.kinds):
        print("error: --operands routed measures its own points (the grid's expert-shaped batched GEMMs): "
              "drop --grid, --sigs and --kinds", file=sys.stderr)
        return 2
    if a.operands == "routed":  # the experts' batched GEMMs with a top-1 router's zero rows
        points = routed_points([Precision(p) for p in a.precisions.split(",")] if a.precisions else GRID_ORDER)
    elif a.operands:  # the fp16 GEMM points again, with other operands
        points = with_operand_variant(points, Operands(a.operands))
    remeasure = bool(a.remeasure_ops)
    if remeasure:  # only those operators, measured again over their old rows
        ops = set(a.remeasure_ops.split(","))
        planned = {p.call.op for p in points}
        if ops - planned:
            raise InputError(f"--remeasure-ops: {', '.join(sorted(ops - planned))} is in none of the planned points "
                             "(name aten ops as aten.mm.default, with --grid or --sigs that hold them)")
        points = [p for p in points if p.call.op in ops]
    if a.plan_only:
        print(json.dumps(summary(points), indent=1))
        return 0
    if a.timer == "closed-form" and not device.cpu:
        print("error: --timer closed-form writes synthetic latencies: only with --gpu cpu (tests)", file=sys.stderr)
        return 2
    timer = ClosedFormTimer() if a.timer == "closed-form" else Timer(device.torch_device, l2_bytes=spec.l2_bytes,
                                                                      duty=a.timer == "duty")
    t0 = time.perf_counter()
    by_campaign: dict[str, list] = {}
    for p in points:
        by_campaign.setdefault(p.campaign, []).append(p)
    total = 0
    for camp, pts in by_campaign.items():
        left = None if a.budget_s is None else max(a.budget_s - (time.perf_counter() - t0), 0)
        try:
            res = run_campaign(pts, out, device, budget_s=left, progress=not a.quiet, timer=timer,
                               retry_errors=a.retry_errors, remeasure=remeasure)
        except CampaignAbort as e:
            print(f"error: {e} (finished points are saved; rerun to continue)", file=sys.stderr)
            return 3
        total += res.measured
        print(f"[collect] {camp}: measured {res.measured} ({res.failed} failed), already done {res.skipped_done}, "
              f"left {res.remaining}, {res.points_per_s:.1f} points/s", flush=True)
    if a.repeat_fraction > 0:
        left = None if a.budget_s is None else max(a.budget_s - (time.perf_counter() - t0), 0)
        sample = repeat_sample(points, a.repeat_fraction)
        res = run_campaign(sample, out, device, budget_s=left, run=2, progress=not a.quiet, timer=timer,
                           retry_errors=True)
        print(f"[collect] repeat sample: measured {res.measured}, left {res.remaining}", flush=True)
    return 0


def _validate(a: argparse.Namespace) -> int:
    from .validate import default_cases, run_validation

    spec = gpu_spec(a.gpu)
    device = Device(cpu=a.gpu == "cpu")
    device.check_matches(spec.name)
    cases = default_cases()
    if a.only:
        cases = [c for c in cases if any(s in c.case_id for s in a.only.split(","))]
    out = Path(a.out or validation_folder(spec.name))
    if a.machine_sample:  # another sample of the machine kind: this instance's own folder (see dist-validate)
        from .device import machine_id

        out = out / "machines" / machine_id()
    n = run_validation(cases, out, device, budget_s=a.budget_s)
    print(f"[validate] ran {n} cases")
    return 0


def _oplog(a: argparse.Namespace) -> int:
    from .validate import oplog_cases, run_oplog

    device = Device()
    n = run_oplog(oplog_cases(), Path(a.out), device)
    print(f"[oplog] {n} rows -> {a.out}")
    return 0


def _comm(a: argparse.Namespace) -> int:
    from .comm import run_comm_campaign

    spec = gpu_spec(a.gpu)
    n = run_comm_campaign(Path(a.out or f"data/{spec.name}/comm"), spec.name, tiny=a.tiny, budget_s=a.budget_s)
    print(f"[comm] measured {n} points")
    return 0


def _dist_validate(a: argparse.Namespace) -> int:
    from .dist_validate import main_dist

    out = Path(a.out or validation_folder(gpu_spec(a.gpu).name))
    main_dist(a.gpu, out, a.only, a.budget_s, a.frameworks, Path(a.tiny_model) if a.tiny_model else None,
              a.retry_errors, a.remeasure, a.machine_sample, a.max_iters)
    return 0


def _dist_probe(a: argparse.Namespace) -> int:
    from .dist_probe import main_probe

    spec = gpu_spec(a.gpu)
    main_probe(spec.name, Path(a.out or f"data/{spec.name}"), a.what, a.host_kinds)
    return 0


def _memtrace(a: argparse.Namespace) -> int:
    from .validate import run_memtrace

    run_memtrace(a.cases.split(","), Path(a.out), Device())
    return 0


def _probe(a: argparse.Namespace) -> int:
    from .probe import run_probe

    rep = run_probe(Device(), Path(a.out))
    print(json.dumps({"provenance": rep["provenance"], "transformers": rep["transformers"],
                      "sdp_priority_order": rep.get("sdp_priority_order"),
                      "sdpa_mismatches": len(rep.get("sdpa_mismatches", [])),
                      "autocast_missing": rep["autocast"]["missing_from_policy"]}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tp_query.collector")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="run a profiling campaign")
    c.add_argument("--gpu", required=True)
    c.add_argument("--out")
    c.add_argument("--grid", action="store_true", help="the generic sweep of every operator kind")
    c.add_argument("--sigs", nargs="*", help="signature files (exact calls of traced graphs)")
    c.add_argument("--kinds")
    c.add_argument("--precisions")
    c.add_argument("--tiny", type=int, default=0, help="keep the N smallest points per kind (CPU mode)")
    c.add_argument("--budget-s", type=float)
    c.add_argument("--repeat-fraction", type=float, default=0.0)
    c.add_argument("--plan-only", action="store_true")
    c.add_argument("--retry-errors", action="store_true", help="measure again points whose row failed")
    c.add_argument("--operands", choices=("nan", "routed"), help="measure the selected fp16 GEMM points with these "
                   "operands (nan: pure fp16 with Adam, whose weights are NaN after its first step); routed: the "
                   "expert-shaped batched GEMMs with the zero rows a top-1 router leaves (transformers' Llama-4)")
    c.add_argument("--remeasure-ops", help="comma-separated aten ops: measure their points again, replacing "
                   "the old rows (after a fix to how their inputs are made)")
    c.add_argument("--quiet", action="store_true")
    c.add_argument("--timer", choices=("measure", "duty", "closed-form"), default="measure",
                   help="duty: points of 100 us or more timed with memory-bound work of their own length after "
                        "each sample (a training step's duty cycle; no back-to-back warm replays); closed-form: "
                        "deterministic synthetic latencies from FLOPs and bytes (CPU tests only)")
    v = sub.add_parser("validate", help="time real training iterations")
    v.add_argument("--gpu", required=True)
    v.add_argument("--out", help="default data/validation (h200) or data/validation/<gpu>")
    v.add_argument("--only")
    v.add_argument("--budget-s", type=float)
    v.add_argument("--machine-sample", action="store_true",
                   help="measure again on this machine instance (<out>/machines/<id>/), beside other instances")
    o = sub.add_parser("oplog", help="log the aten ops of real iterations")
    o.add_argument("--out", default="data/validation/oplog.parquet")
    cm = sub.add_parser("comm", help="NCCL collectives (launch with torchrun --nproc-per-node N)")
    cm.add_argument("--gpu", required=True)
    cm.add_argument("--out")
    cm.add_argument("--tiny", action="store_true", help="few small sizes (CPU mode with gloo)")
    cm.add_argument("--budget-s", type=float)
    dv = sub.add_parser("dist-validate", help="a distributed training iteration (launch with torchrun)")
    dv.add_argument("--gpu", required=True)
    dv.add_argument("--only", help="comma-separated substrings of case ids")
    dv.add_argument("--frameworks", default="torch,megatron")
    dv.add_argument("--tiny-model", help="run the torch campaign on this small config at 64 tokens (CPU tests)")
    dv.add_argument("--retry-errors", action="store_true",
                    help="run again cases recorded as failed (e.g. after installing megatron-core)")
    dv.add_argument("--remeasure", action="store_true",
                    help="run the selected cases again, new rows replacing old ones (after a timing change)")
    dv.add_argument("--machine-sample", action="store_true",
                    help="measure again on this machine instance as another sample of the machine kind "
                         "(<out>/machines/<id>/; the report takes the median over instances)")
    dv.add_argument("--max-iters", type=int, default=30, help="the most timed steps per case")
    dv.add_argument("--budget-s", type=float)
    dv.add_argument("--out", help="default data/validation (h200) or data/validation/<gpu>")
    dp_ = sub.add_parser("dist-probe", help="overlap, framework host costs and FSDP2's copy kernels (launch with "
                                            "torchrun)")
    dp_.add_argument("--gpu", required=True)
    dp_.add_argument("--out", help="the GPU's database folder (default data/<gpu>)")
    dp_.add_argument("--what", default="overlap,host,copies", help="comma-separated: overlap, host, copies")
    dp_.add_argument("--host-kinds", help="comma-separated framework kinds of the host campaign (default all)")
    mt = sub.add_parser("memtrace", help="allocated memory after every op of one real iteration")
    mt.add_argument("--cases", required=True)
    mt.add_argument("--out", default="data/validation/memtrace.json")
    p = sub.add_parser("probe", help="check the tracer's assumptions on this GPU")
    p.add_argument("--out", default="data/probe.json")
    a = ap.parse_args(argv)
    try:
        return {"collect": _collect, "validate": _validate, "oplog": _oplog, "probe": _probe,
                "memtrace": _memtrace, "comm": _comm, "dist-validate": _dist_validate,
                "dist-probe": _dist_probe}[a.cmd](a)
    except (UnknownGpu, DeviceError, StoreError, ManifestError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _exit_launched(rc: int) -> None:
    """Under torchrun, leave without interpreter teardown: gloo's and NCCL's background threads of sub-groups
    (device meshes, pipeline stages) can still be joinable when C++ static destructors run, and a rare
    `terminate called without an active exception` would turn a finished, fully written campaign into a
    SIGABRT. Every row is flushed to Parquet before this point, so skipping teardown loses nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        _exit_launched(code)
    sys.exit(code)
