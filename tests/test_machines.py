"""Machine instances as samples of a machine kind: host-bound timings differ between instances (7 to 20 us
per eager operator on the H200 hosts measured), so their rows are kept apart and combined, never replaced."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tp_query.collector.dist_probe import _fit_line
from tp_query.collector.store import ChunkedStore, read_columns
from tp_query.engine.validation import load_rows
from tp_query.schema.tables import FRAMEWORK_SCHEMA, VALIDATION_SCHEMA, Provenance

PROV = Provenance(gpu="cpu", gpu_name="cpu", driver="n/a", cuda="n/a", torch="x", cudnn="n/a")


def test_theil_sen_fit_ignores_one_outlier() -> None:
    xs = [1.0, 2.0, 4.0, 6.0, 8.0]
    ys = [100.0 + 50.0 * x for x in xs]
    ys[3] *= 1.8  # one layer count hit by a scheduler hiccup
    slope, fixed = _fit_line(xs, ys)
    assert abs(slope - 50.0) < 1e-9 and abs(fixed - 100.0) < 1e-9


def _val_row(case_id: str, ms: float) -> dict[str, object]:
    row: dict[str, object] = {f.name: None for f in VALIDATION_SCHEMA}
    row.update(case_id=case_id, model="m", config_json="{}", layers=1, setting="bf16", micro_batch=1, seq_len=8,
               optimizer="adamw", tp_shard=1, split="holdout", status="ok", reason="", iteration_ms=ms,
               samples_ms=[ms], iterations=1, measured_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
               **{k: getattr(PROV, k) for k in ("gpu", "gpu_name", "driver", "cuda", "torch", "cudnn",
                                                 "collector_version", "schema_version")})
    return row


def test_machine_samples_are_cases_of_their_own(tmp_path: Path) -> None:
    main = ChunkedStore(tmp_path, "validation-dist", VALIDATION_SCHEMA, PROV, key_columns=("case_id",))
    main.append(_val_row("torch-tp-x", 100.0))
    main.flush()
    for machine, ms in (("mA", 70.0), ("mB", 72.0)):
        st = ChunkedStore(tmp_path / "machines" / machine, "validation-dist", VALIDATION_SCHEMA, PROV,
                          key_columns=("case_id",), remeasure=True)
        st.append(_val_row("torch-tp-x", ms))
        st.close()
    # a rerun on mA replaces mA's row only
    st = ChunkedStore(tmp_path / "machines" / "mA", "validation-dist", VALIDATION_SCHEMA, PROV,
                      key_columns=("case_id",), remeasure=True)
    st.append(_val_row("torch-tp-x", 69.0))
    st.flush()
    rows = {r["case_id"]: (r["iteration_ms"], r["machine"]) for r in load_rows(tmp_path)}
    assert rows == {"torch-tp-x": (100.0, None), "torch-tp-x@mA": (69.0, "mA"), "torch-tp-x@mB": (72.0, "mB")}


def test_host_rows_of_a_new_instance_sit_beside_older_ones(tmp_path: Path) -> None:
    """Rows written before the machine column existed read it as null; a new instance adds, not replaces."""
    old_schema = pa.schema([f for f in FRAMEWORK_SCHEMA if f.name not in ("machine", "cpu")])
    base = {"framework": "torch", "kind": "tp", "setting": "bf16", "phase": "fwd", "quantity": "per_op_us",
            "ranks": 2, "samples_json": "{}", "status": "ok", "reason": "",
            "measured_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
            **{k: getattr(PROV, k) for k in ("gpu", "gpu_name", "driver", "cuda", "torch", "cudnn",
                                              "collector_version", "schema_version")}}
    pq.write_table(pa.Table.from_pylist([{**base, "value_us": 20.0}], schema=old_schema),
                   tmp_path / "framework-r2-00000.parquet")
    assert read_columns(tmp_path / "framework-r2-00000.parquet", ["kind", "machine"]).to_pylist() == [
        {"kind": "tp", "machine": None}]
    keys = ("framework", "kind", "setting", "phase", "quantity", "ranks", "machine")
    for value in (7.0, 8.0):  # measured twice on instance mA: the second replaces the first
        st = ChunkedStore(tmp_path, "framework-r2-mA", FRAMEWORK_SCHEMA, PROV, key_columns=keys, remeasure=True)
        st.append({**base, "value_us": value, "machine": "mA", "cpu": "test"})
        st.close()
    got = sorted((r["value_us"], r.get("machine")) for p in sorted(tmp_path.glob("*.parquet"))
                 for r in pq.read_table(p).to_pylist())
    assert got == [(8.0, "mA"), (20.0, None)]


def test_host_probe_runs_the_base_of_every_extra() -> None:
    """An extra host cost is a difference against the plain model of the same shapes: asking for DTensor TP
    runs the TP-shard-shaped plain model too, asking for FSDP the plain one, in the probe's own order."""
    from tp_query.collector.dist_probe import _with_bases

    assert _with_bases(("tp_sp", "tp")) == ("plain_tp_shard", "tp", "tp_sp")
    assert _with_bases(("fsdp_z3",)) == ("plain", "fsdp_z3")
    assert _with_bases(("plain",)) == ("plain",)


def test_calibration_fits_only_runs_with_their_own_host_costs() -> None:
    """A run of an instance without a host probe is predicted with the other instances' median per-operator costs:
    reported (every split), never fitted on (the calibration split's constants sit beyond measured host costs)."""
    from tp_query.engine.hostsim import HostModel
    from tp_query.engine.validation import CaseResult, Study

    class Fixed:  # an assembled prediction that takes `us` under any host model
        def __init__(self, us: float) -> None:
            self.us = us

        def evaluate(self, host: HostModel) -> tuple[float, dict[str, float], list[object], int]:
            return self.us, {}, [], 0

    study = Study.__new__(Study)
    study.stage_of = {}
    study.cases, study.assembled = [], {}
    for cid, own, pred_us in (("a", True, 110e3), ("a@mX", False, 200e3), ("b", True, 90e3)):
        c = CaseResult(cid, "m", "bf16", "calibration" if cid != "b" else "holdout", 1, 8, 1, "ok", 100.0)
        c.own_host = own
        study.cases.append(c)
        study.assembled[cid] = Fixed(pred_us)
    import math

    assert study.errors(HostModel(), "calibration") == [math.log(1.1)]
    assert sorted(study.errors(HostModel(), None)) == sorted([math.log(1.1), math.log(2.0), math.log(0.9)])


def test_a_run_is_predicted_with_the_host_it_ran_on() -> None:
    """A run that names its instance takes that instance's host costs; one that names none was measured on the
    first instance only if it predates the instances being told apart; after that its instance is unknown (the
    typical host), not the first one's (a slow host's costs had priced 13 runs of another instance +30-55%)."""
    from types import SimpleNamespace

    from tp_query.engine.framework import FIRST_MACHINE, FrameworkData
    from tp_query.engine.validation import Study

    def host(machine: str | None, day: int) -> dict[str, object]:
        return {"framework": "torch", "kind": "plain", "setting": "bf16", "phase": "fwd", "quantity": "per_op_us",
                "value_us": 10.0, "ranks": 1, "status": "ok", "machine": machine,
                "measured_at": dt.datetime(2026, 6, day, tzinfo=dt.UTC)}

    fd = FrameworkData([], [host(None, 1), host("mA", 10), host("mB", 20)])
    assert fd.instances_named_since() == dt.datetime(2026, 6, 10, tzinfo=dt.UTC)
    study = Study.__new__(Study)
    study.engine = SimpleNamespace(framework=fd)  # type: ignore[assignment]

    def at(day: int, machine: str | None = None) -> str | None:
        return study._host_machine({"machine": machine, "measured_at": dt.datetime(2026, 6, day, tzinfo=dt.UTC)})

    assert at(5) == FIRST_MACHINE and at(15) is None  # before any instance was named / after: unknown
    assert at(15, "mB") == "mB" and at(2, "mA") == "mA"
    assert at(15, "mZ") is None  # an instance without host measurements: the typical host
    # a snapshot's rows carry ISO text
    fd_text = FrameworkData([], [{**host("mA", 10), "measured_at": "2026-06-10T00:00:00+00:00"}])
    assert fd_text.instances_named_since() == dt.datetime(2026, 6, 10, tzinfo=dt.UTC)


def test_a_validation_run_records_the_instance_it_ran_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector writes each run's machine instance and CPU beside it, and the report reads it back: the run
    is then predicted with its own host's costs, not the typical host's."""
    from types import SimpleNamespace

    from tp_query.collector import validate as cv
    from tp_query.collector.device import cpu_model, machine_id

    row = _val_row("x", 10.0)
    measured = {k: row[k] for k in ("status", "reason", "iteration_ms", "samples_ms", "iterations")}
    monkeypatch.setattr(cv, "run_case", lambda case, device: dict(measured))
    case = cv.default_type_cases()[0]
    device = SimpleNamespace(provenance=lambda: PROV, clocks=lambda: SimpleNamespace(sm_mhz=1980))
    assert cv.run_validation([case], tmp_path, device) == 1  # type: ignore[arg-type]
    (got,) = load_rows(tmp_path)
    assert got["case_id"] == case.case_id and got["iteration_ms"] == 10.0
    assert got["machine"] == machine_id() and got["cpu"] == cpu_model() and got["machine"]
