"""The engine's graph is what CUDA actually runs: compare traces made here (CPU, fake tensors) with
the aten operators real iterations dispatched on the H200 (data/validation/oplog-h200.parquet,
logged by `make validate`): operator multiset with shapes, dtypes, strides and flags."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tp_query.collector.validate import oplog_cases
from tp_query.engine.trace.capture import EAGER_IN_PLACE, TraceRequest, trace_config
from tp_query.schema.model_config import parse_config
from tp_query.schema.precision import Setting
from tp_query.schema.signature import OpCall

OPLOG = Path(__file__).resolve().parent.parent / "data" / "validation" / "oplog-h200.parquet"
# Differences that remain between the CPU trace and the GPU log, with the reason (none today).
KNOWN_DIFFERENCES: dict[str, str] = {}


_TRACED_BRANCH = {e.op: (traced, len(e.extra)) for traced, e in EAGER_IN_PLACE.items()}


def _as_dispatch_mode_logs(phase: str, op: str, sig: str) -> tuple[str, str, str]:
    """The GPU log was taken under a dispatch mode (collector/validate.py `_OpCounter`), where autograd formulas take
    their tensor-subclass branch as in any trace; the engine records the eager branch (capture.EAGER_IN_PLACE), so
    its in-place updates are compared as the out-of-place calls such a log holds (their extra arguments dropped)."""
    hit = _TRACED_BRANCH.get(op) if phase == "bwd" else None
    if hit is None:
        return phase, op, sig
    traced, extra = hit
    call = OpCall.from_json_str(op, sig)
    return phase, traced, OpCall(traced, call.args[:len(call.args) - extra], call.kwargs).to_json_str()


def _gpu_log() -> dict[str, Counter[tuple[str, str, str]]]:
    out: dict[str, Counter[tuple[str, str, str]]] = {}
    for r in pq.read_table(OPLOG).to_pylist():
        out.setdefault(r["case_id"], Counter())[(r["phase"], r["op"], r["signature"])] += r["count"]
    return out


@pytest.fixture(scope="module")
def gpu_log() -> dict[str, Counter[tuple[str, str, str]]]:
    if not OPLOG.exists():
        pytest.skip("no GPU operator log committed")
    return _gpu_log()


@pytest.mark.parametrize("case", oplog_cases(), ids=lambda c: c.case_id)
def test_trace_matches_gpu_dispatch(case, gpu_log) -> None:  # type: ignore[no-untyped-def]
    spec = parse_config(case.config)
    g = trace_config(TraceRequest(spec, Setting(case.setting), case.micro_batch, case.seq_len,
                                  traced_layers=spec.num_layers))
    ours = Counter(_as_dispatch_mode_logs(o.phase.value, o.op, o.sig) for o in g.ops if not o.op.startswith("comm."))
    theirs = gpu_log[case.case_id]
    only_ours = {k: v for k, v in (ours - theirs).items() if k[1] not in KNOWN_DIFFERENCES}
    only_gpu = {k: v for k, v in (theirs - ours).items() if k[1] not in KNOWN_DIFFERENCES}
    assert not only_ours and not only_gpu, (list(only_ours.items())[:3], list(only_gpu.items())[:3])
    assert sum(ours.values()) == sum(theirs.values()) > 300
