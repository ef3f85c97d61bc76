"""The collector end to end in its CPU mode: planning, replay, timing, resumption, writing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tp_query.collector.campaign import run_campaign
from tp_query.collector.device import Device
from tp_query.collector.plan import grid_points, signature_points, write_signature_file
from tp_query.collector.store import ChunkedStore, StoreError
from tp_query.collector.timing import Timer
from tp_query.schema.tables import METADATA_KEY, OPS_SCHEMA, Provenance

from .conftest import TINY_LLAMA, run_cli, run_collector

KINDS = {"mm", "elementwise", "rms_norm_fwd", "embedding_bwd", "foreach:_foreach_addcdiv_.ScalarList"}


def _rows(folder: Path) -> list[dict]:
    rows = []
    for f in sorted(folder.glob("*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return rows


def _flush_killed_at(monkeypatch: pytest.MonkeyPatch, store: ChunkedStore, module: object, name: str) -> None:
    """The store's flush killed where it calls module.name: the process is gone, and its folder lock with it."""

    def killed(*a: object, **k: object) -> None:
        raise KeyboardInterrupt(f"killed at {name}")

    monkeypatch.setattr(module, name, killed)
    with pytest.raises(KeyboardInterrupt):
        store.flush()
    store._lock.close()
    monkeypatch.undo()


def test_plan_is_deterministic_and_keyed() -> None:
    a = grid_points(kinds=KINDS, tiny=2)
    b = grid_points(kinds=KINDS, tiny=2)
    assert [p.key for p in a] == [p.key for p in b]
    assert len({p.key for p in a}) == len(a)
    assert {p.info.kind for p in a} == KINDS


def test_campaign_resumes_without_duplicates(tmp_path: Path) -> None:
    pts = grid_points(kinds=KINDS, tiny=2)
    dev = Device(cpu=True)
    timer = Timer(dev.torch_device, max_point_s=0.05)
    first = run_campaign(pts, tmp_path, dev, budget_s=0.0, progress=False, timer=timer)  # stops after one point
    assert first.measured == 1 and first.remaining == len(pts) - 1
    second = run_campaign(pts, tmp_path, dev, progress=False, timer=timer)
    assert second.skipped_done == 1 and second.measured == len(pts) - 1 and second.remaining == 0
    rows = _rows(tmp_path)
    assert sorted(r["key"] for r in rows) == sorted(p.key for p in pts)
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(r["latency_us"] > 0 and r["p20_us"] <= r["latency_us"] <= r["p80_us"] for r in ok)
    assert all(r["precision"] and r["gpu"] == "cpu" and r["schema_version"] == 1 for r in rows)
    md = pq.read_metadata(next(tmp_path.glob("*.parquet"))).metadata
    assert Provenance.from_json(md[METADATA_KEY]).gpu == "cpu"
    third = run_campaign(pts, tmp_path, dev, progress=False, timer=timer)
    assert third.measured == 0 and third.skipped_done == len(pts)


def test_failures_are_rows_with_reasons(tmp_path: Path) -> None:
    pts = grid_points(kinds={"attn_cudnn_fwd"}, tiny=1)
    res = run_campaign(pts, tmp_path, Device(cpu=True), progress=False)
    rows = _rows(tmp_path)
    assert res.failed == len(pts) == len(rows)
    assert all(r["status"] == "unsupported" and "CPU" in r["reason"] for r in rows)


def test_journal_survives_a_kill(tmp_path: Path) -> None:
    prov = Device(cpu=True).provenance()
    pts = grid_points(kinds={"elementwise"}, tiny=3)
    dev = Device(cpu=True)
    from tp_query.collector.campaign import measure_point

    store = ChunkedStore(tmp_path, "grid", OPS_SCHEMA, prov)
    timer = Timer(dev.torch_device, max_point_s=0.02)
    for p in pts[:2]:
        store.append(measure_point(p, dev, timer, 1, prov))
    with store.journal.open("a") as f:
        f.write('{"key": "half a line')  # the kill happened mid-write
    del store  # no flush: as if SIGKILLed
    again = ChunkedStore(tmp_path, "grid", OPS_SCHEMA, prov)
    assert {k[0] for k in again.done_keys()} == {p.key for p in pts[:2]}
    assert not again.journal.exists()


@pytest.mark.parametrize("remeasure", [False, True])
def test_a_kill_between_a_chunk_and_its_manifest_entry_is_recorded_on_rerun(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remeasure: bool) -> None:
    """Killed after a chunk was written and before the manifest recorded it: the rerun records it (the engine
    refused the database until someone adopted every file blindly), keeps one row per key, and under remeasure
    writes the journal's rows again rather than dropping them as done; a cut atomic write's temp file goes."""
    from tp_query.collector.campaign import measure_point
    from tp_query.collector.store import write_table
    from tp_query.schema import manifest

    dev = Device(cpu=True)
    prov = dev.provenance()
    root, folder = tmp_path, tmp_path / "ops"
    folder.mkdir()
    write_table(folder / "grid-00000.parquet", [], OPS_SCHEMA, prov)
    manifest.adopt(root, "cpu")
    pts = grid_points(kinds={"elementwise"}, tiny=3)
    timer = Timer(dev.torch_device, max_point_s=0.02)
    rows = [measure_point(p, dev, timer, 1, prov) for p in pts[:3]]
    store = ChunkedStore(folder, "grid", OPS_SCHEMA, prov, remeasure=remeasure)
    for r in rows:
        store.append(r)

    _flush_killed_at(monkeypatch, store, manifest, "record")  # before the manifest entry
    with pytest.raises(manifest.ManifestError):
        manifest.verify(root, "cpu")
    (folder / ".grid-00009.parquet.abc.tmp").write_bytes(b"cut")
    again = ChunkedStore(folder, "grid", OPS_SCHEMA, prov, remeasure=remeasure)
    again.close()
    manifest.verify(root, "cpu")
    keys = [r["key"] for r in _rows(folder)]
    assert sorted(keys) == sorted(p.key for p in pts[:3]) and not list(folder.glob(".*.tmp"))


def test_corrupt_parquet_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "grid-00000.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(StoreError, match="corrupt or unreadable Parquet file"):
        ChunkedStore(tmp_path, "grid", OPS_SCHEMA, Device(cpu=True).provenance())
    r = run_collector("collect", "--gpu", "cpu", "--grid", "--tiny", "1", "--kinds", "mm", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith("error: corrupt") and "Traceback" not in r.stderr
    assert (tmp_path / "grid-00000.parquet").read_bytes() == b"PAR1 not really"  # nothing deleted


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_folder(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    r = run_collector("collect", "--gpu", "cpu", "--grid", "--tiny", "1", "--kinds", "mm", "--out", str(ro / "x"))
    assert r.returncode == 2 and "not writable" in r.stderr


def test_unwritable_folder_as_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run_collector("collect", "--gpu", "cpu", "--grid", "--tiny", "1", "--kinds", "mm", "--out", str(blocker / "ops"))
    assert r.returncode == 2 and "not writable" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("gpu, msg", [("h200", "no CUDA GPU is visible"), ("rtx9090", "unknown GPU")])
def test_gpu_name_checks(tmp_path: Path, gpu: str, msg: str) -> None:
    r = run_collector("collect", "--gpu", gpu, "--grid", "--out", str(tmp_path))
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("nvml, key", [
    ("NVIDIA H200", "h200"), ("NVIDIA  h200 ", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GH200 480GB", None), ("NVIDIA H200 NVL", None),
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA A100-SXM4-40GB", None),
    ("NVIDIA A100 80GB PCIe", None)])
def test_a_gpu_is_its_whole_device_name(nvml: str, key: str | None) -> None:
    """Each GPU spec is one part (its capacity, peaks and links): another part of the same chip is not it, so
    the collector cannot fill data/h200 from a GH200 nor data/h100 from an H100 PCIe."""
    from tp_query.collector.device import Device, DeviceError
    from tp_query.schema.gpus import normalise_nvml_name

    assert normalise_nvml_name(nvml) == key

    class Named(Device):
        name = nvml  # type: ignore[assignment]

    dev = Named(cpu=True)
    dev.cpu = False
    wanted = key or ("h200" if "H200" in nvml else "h100" if "H100" in nvml else "a100")
    if key:
        dev.check_matches(wanted)
    else:
        with pytest.raises(DeviceError, match="not a part the project knows"):
            dev.check_matches(wanted)


def test_signature_file_roundtrip(tmp_path: Path) -> None:
    pts = grid_points(kinds={"mm"}, tiny=3)
    f = tmp_path / "s.jsonl"
    n = write_signature_file(f, [(p.call.op, p.call.to_json_str(), p.allow_tf32) for p in pts + pts])
    assert n == len(pts)
    back = signature_points(f)
    assert [p.key for p in back] == [p.key for p in pts]
    assert all(json.loads(line)["op"] == "aten.mm.default" for line in f.read_text().splitlines())


def test_real_kill_minus_9_loses_nothing_and_duplicates_nothing(tmp_path: Path) -> None:
    """A collector subprocess is SIGKILLed mid-campaign (real CPU timing, so it is slow enough to kill);
    the rerun finishes the campaign with exactly one row per point, like an uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time

    from .conftest import ROOT

    out = tmp_path / "ops"
    args = [sys.executable, "-m", "tp_query.collector", "collect", "--gpu", "cpu", "--grid", "--tiny", "4",
            "--kinds", "mm,elementwise,softmax_fwd", "--out", str(out), "--quiet"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = out / ".journal-grid.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists() and len(journal.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the campaign finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_rows = len(journal.read_text().splitlines())
    assert killed_rows >= 3
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = _rows(out)
    keys = [(x["key"], x["run"]) for x in rows]
    planned = {p.key for p in grid_points(kinds={"mm", "elementwise", "softmax_fwd"}, tiny=4)}
    assert len(keys) == len(set(keys)) and {k for k, _ in keys} == planned
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)  # a third run adds nothing
    assert r.returncode == 0 and len(_rows(out)) == len(rows)


def test_three_reruns_give_the_same_rows_and_a_valid_manifest(tmp_path: Path) -> None:
    """Reruns, retries of failed points and the repeat sample never add a second row for a key and run."""
    from tp_query.schema import manifest

    out = tmp_path / "cpu" / "ops"
    base = ["collect", "--gpu", "cpu", "--grid", "--tiny", "2", "--kinds", "mm,elementwise,attn_cudnn_fwd",
            "--out", str(out), "--quiet", "--timer", "closed-form", "--repeat-fraction", "0.5"]
    snapshots = []
    for extra in ([], ["--retry-errors"], ["--retry-errors"]):
        r = run_collector(*base, *extra)
        assert r.returncode == 0, r.stderr
        rows = _rows(out)
        keys = [(x["key"], x["run"]) for x in rows]
        assert len(keys) == len(set(keys))
        snapshots.append(sorted((x["key"], x["run"], x["status"]) for x in rows))
    assert snapshots[0] == snapshots[1] == snapshots[2]
    assert any(s == "unsupported" for _, _, s in snapshots[0]) and any(r == 2 for _, r, _ in snapshots[0])
    assert manifest.verify(out.parent, "cpu") == len(list(out.glob("*.parquet")))


def test_one_collector_per_folder(tmp_path: Path) -> None:
    prov = Device(cpu=True).provenance()
    first = ChunkedStore(tmp_path, "grid", OPS_SCHEMA, prov)
    with pytest.raises(StoreError, match="another collector is writing"):
        ChunkedStore(tmp_path, "grid", OPS_SCHEMA, prov)
    del first


def test_remeasure_ops_replaces_rows_and_adds_none(tmp_path: Path) -> None:
    """After a fix to how an operator's inputs are made, `--remeasure-ops` measures its points again: the
    new rows replace the old ones (whatever file held them), nothing else is touched or duplicated."""
    from tp_query.schema import manifest

    out = tmp_path / "cpu" / "ops"
    sigs = tmp_path / "s.jsonl"
    model = tmp_path / "m.json"
    model.write_text(json.dumps(TINY_LLAMA))
    r = run_cli("sigs", str(model), "--out", str(sigs), "--seq-len", "32", "--precision", "bf16")
    assert r.returncode == 0, r.stderr
    base = ["collect", "--gpu", "cpu", "--sigs", str(sigs), "--out", str(out), "--quiet", "--timer", "closed-form"]
    assert run_collector(*base).returncode == 0
    before = {(x["key"], x["run"]): x for x in _rows(out)}
    r = run_collector(*base, "--remeasure-ops", "aten.mm.default")
    assert r.returncode == 0, r.stderr
    after = {(x["key"], x["run"]): x for x in _rows(out)}
    assert len(after) == len(_rows(out)) == len(before) and set(after) == set(before)
    redone = [k for k, x in after.items() if x["op"] == "aten.mm.default"]
    assert redone and all(after[k]["measured_at"] >= before[k]["measured_at"] for k in redone)
    assert manifest.verify(out.parent, "cpu") == len(list(out.glob("*.parquet")))


def test_routed_points_zero_each_tokens_row_outside_its_expert() -> None:
    """The dense experts' GEMMs measured with a top-1 router's zeros: one point per routed call of the expert grid,
    keyed apart from its random-operand twin; replayed (on the CPU, at the call's real shape), every token keeps its
    entries in exactly one expert, in the operands and axes the engine's classification names."""
    import torch
    from tp_query.collector import replay
    from tp_query.collector.plan import routed_points
    from tp_query.schema.ops import Operands, routed_operands
    from tp_query.schema.precision import DType, Precision
    from tp_query.schema.signature import OpCall, TensorSpec

    pts = routed_points([Precision.BF16])
    assert len(pts) == len({p.key for p in pts}) == 40
    assert all(p.key.endswith("|" + p.operands.value) and p.operands != Operands.RANDOM for p in pts)
    assert {p.operands for p in pts} == {Operands.ROUTED_A_ROWS, Operands.ROUTED_A_COLS, Operands.ROUTED_A_COLS_B_ROWS}
    dt = DType.FP32
    e, t, h, f = 4, 6, 8, 5  # a small stand-in of each layout the classification tells apart
    cases = {Operands.ROUTED_A_ROWS: (TensorSpec((e, t, h), dt), TensorSpec((e, h, 2 * f), dt)),
             Operands.ROUTED_A_COLS: (TensorSpec((e, f, t), dt, (f * t, 1, f)), TensorSpec((e, t, h), dt)),
             Operands.ROUTED_A_COLS_B_ROWS: (TensorSpec((e, h, t), dt, (h * t, 1, h)), TensorSpec((e, t, 2 * f), dt))}
    for ops, (a, b) in cases.items():
        assert routed_operands(a, b, e, h, f) == ops
        call = OpCall("aten.bmm.default", (a, b))
        fn = replay.build(call, torch.device("cpu"), ops)
        got = replay.materialized_inputs(call, torch.device("cpu"), ops)
        for i, axis in replay.ROUTED_AXES[ops]:
            x = got[i]
            nonzero = (x != 0).any(dim=3 - axis)  # [experts, tokens]: does the token keep entries there
            assert nonzero.sum(dim=0).tolist() == [1] * t, (ops, i)
        assert fn() is not None
    # the down projection's input gradient reads the full output gradient
    assert routed_operands(TensorSpec((e, t, h), dt), TensorSpec((e, h, f), dt, (f * h, 1, h)), e, h, f) == \
        Operands.RANDOM
    # its own points: a selection beside it would be dropped, so it is refused
    r = run_collector("collect", "--gpu", "cpu", "--grid", "--kinds", "bmm", "--operands", "routed", "--plan-only")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--operands routed" in r.stderr


def test_a_database_of_another_gpu_is_not_written_into(tmp_path: Path) -> None:
    """The collector refuses an output folder whose database (manifest) or rows belong to another GPU: they
    would count as measured here, and the manifest would record them as that GPU's."""
    from tp_query.schema import manifest

    root = tmp_path / "h100"
    (root / "ops").mkdir(parents=True)
    manifest.adopt(root, "h100")
    r = run_collector("collect", "--gpu", "cpu", "--grid", "--tiny", "1", "--kinds", "mm", "--timer", "closed-form",
                      "--out", str(root / "ops"))
    assert r.returncode == 2 and "database of GPU 'h100'" in r.stderr and "Traceback" not in r.stderr
    assert not list((root / "ops").glob("*.parquet"))

    mine = tmp_path / "cpu" / "ops"
    args = ("collect", "--gpu", "cpu", "--grid", "--tiny", "1", "--kinds", "mm", "--timer", "closed-form",
            "--out", str(mine))
    assert run_collector(*args).returncode == 0
    (f,) = sorted(mine.glob("*.parquet"))
    t = pq.read_table(f)
    meta = dict(t.schema.metadata)
    prov = json.loads(meta[b"tp_query"])
    meta[b"tp_query"] = json.dumps({**prov, "gpu": "h100"}).encode()
    pq.write_table(t.replace_schema_metadata(meta), f)
    r = run_collector(*args)
    assert r.returncode == 2 and "measured on 'h100'" in r.stderr
    with pytest.raises(manifest.ManifestError, match="files measured on 'cpu' are not recorded"):
        manifest.record(root, ["ops/x.parquet"], "cpu")


def test_validation_runs_of_another_gpu_are_neither_done_nor_replaced(tmp_path: Path) -> None:
    """A validation folder holds every GPU's runs of the same cases: another GPU's run of a case does not count
    as this machine's, and this machine's run does not replace it."""
    from tp_query.collector.store import write_table
    from tp_query.schema.tables import VALIDATION_SCHEMA, Provenance

    theirs = Provenance(gpu="h100", gpu_name="NVIDIA H100 80GB HBM3", driver="x", cuda="x", torch="x", cudnn="x")
    ours = Provenance(gpu="cpu", gpu_name="cpu", driver="n/a", cuda="n/a", torch="x", cudnn="n/a")
    folder = tmp_path / "validation"
    folder.mkdir()
    write_table(folder / "validation-00000.parquet", [{"case_id": "c1", "gpu": "h100", "status": "ok"}],
                VALIDATION_SCHEMA, theirs)
    store = ChunkedStore(folder, "validation", VALIDATION_SCHEMA, ours, key_columns=("case_id",))
    assert ("c1",) not in store.done_keys()
    store.append({"case_id": "c1", "gpu": "cpu", "status": "ok"})
    store.close()
    rows = [r for p in sorted(folder.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert sorted((r["case_id"], r["gpu"]) for r in rows) == [("c1", "cpu"), ("c1", "h100")]
    again = ChunkedStore(folder, "validation", VALIDATION_SCHEMA, ours, key_columns=("case_id",))
    assert ("c1",) in again.done_keys()
    again.close()


def _tiny_sigs(tmp_path: Path, name: str) -> Path:
    sigs = tmp_path / name
    model = tmp_path / "m.json"
    model.write_text(json.dumps(TINY_LLAMA))
    r = run_cli("sigs", str(model), "--out", str(sigs), "--seq-len", "32", "--precision", "bf16")
    assert r.returncode == 0, r.stderr
    return sigs


def test_a_campaign_name_with_pattern_characters_keeps_every_chunk(tmp_path: Path) -> None:
    """A sigs file named `llama[8b].jsonl`: its chunks were found by a glob of that name, which matched none of
    them, so each run wrote chunk 00000 over the last one (1 of 31 rows survived, and the manifest agreed)."""
    from tp_query.schema import manifest

    sigs = _tiny_sigs(tmp_path, "llama[8b].jsonl")
    out = tmp_path / "cpu" / "ops"
    base = ["collect", "--gpu", "cpu", "--sigs", str(sigs), "--out", str(out), "--quiet", "--timer", "closed-form"]
    for extra in (["--budget-s", "0"], [], []):
        r = run_collector(*base, *extra)
        assert r.returncode == 0, r.stderr
    keys = [x["key"] for x in _rows(out)]
    assert len(keys) == len(set(keys)) == len(signature_points(sigs))
    assert len(list(out.glob("*.parquet"))) == 2  # the first run's point, then the rest
    assert manifest.verify(out.parent, "cpu") == 2


def test_one_call_planned_twice_is_measured_once(tmp_path: Path) -> None:
    """The same sigs file given twice (or two that share calls), with a repeat sample: each (key, run) once. The
    second row of a key made the database refused as a duplicate measurement, for good."""
    sigs = _tiny_sigs(tmp_path, "s.jsonl")
    out = tmp_path / "cpu" / "ops"
    r = run_collector("collect", "--gpu", "cpu", "--sigs", str(sigs), str(sigs), "--out", str(out), "--quiet",
                      "--timer", "closed-form", "--repeat-fraction", "0.5")
    assert r.returncode == 0, r.stderr
    keys = [(x["key"], x["run"]) for x in _rows(out)]
    assert len(keys) == len(set(keys)) and any(run == 2 for _, run in keys)
    assert {k for k, run in keys if run == 1} == {p.key for p in signature_points(sigs)}


@pytest.mark.parametrize("case", ["bad_json", "no_op", "tf32_text", "json_list", "missing_file", "precision_bf17",
                                  "unknown_kind", "unknown_remeasure_op", "budget_nan", "budget_negative",
                                  "tiny_negative"])
def test_bad_collector_input_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    """What a user can get wrong in a campaign's input is refused in one line with exit code 2 (each was a
    traceback, or ran: "tf32": "no" measured TF32, --budget-s nan measured everything, --kinds mmm nothing)."""
    sigs = tmp_path / "s.jsonl"
    line = '{"op": "aten.mm.default", "sig": "{\\"a\\":[{\\"T\\":[8,8],\\"d\\":\\"bf16\\"},{\\"T\\":[8,8],\\"d\\":\\"bf16\\"}]}"'
    sigs.write_text({"bad_json": line + "\n", "no_op": '{"sig": "{}"}\n', "tf32_text": line + ', "tf32": "no"}\n',
                     "json_list": "[1, 2]\n"}.get(case, line + "}\n"))
    out = ["--out", str(tmp_path / "cpu" / "ops"), "--quiet", "--timer", "closed-form"]
    args = {"missing_file": ["--sigs", str(tmp_path / "none.jsonl")],
            "precision_bf17": ["--grid", "--tiny", "1", "--kinds", "mm", "--precisions", "bf17"],
            "unknown_kind": ["--grid", "--tiny", "1", "--kinds", "mmm"],
            "unknown_remeasure_op": ["--sigs", str(sigs), "--remeasure-ops", "aten.mmm"],
            "budget_nan": ["--sigs", str(sigs), "--budget-s", "nan"],
            "budget_negative": ["--sigs", str(sigs), "--budget-s", "-5"],
            "tiny_negative": ["--grid", "--tiny", "-1", "--kinds", "mm"]}.get(case, ["--sigs", str(sigs)])
    r = run_collector("collect", "--gpu", "cpu", *args, *out)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not list((tmp_path / "cpu").glob("ops/*.parquet"))


def _measured_rows(n: int, status: str = "ok") -> tuple[list[dict], Provenance]:
    """n elementwise points measured by the closed-form timer, with this status, and the provenance they carry."""
    from tp_query.collector.campaign import measure_point
    from tp_query.collector.timing import ClosedFormTimer

    dev = Device(cpu=True)
    prov = dev.provenance()
    pts = grid_points(kinds={"elementwise"}, tiny=n)[:n]
    rows = [{**measure_point(p, dev, ClosedFormTimer(), 1, prov), "status": status} for p in pts]
    return rows, prov


def test_a_kill_while_superseded_rows_are_rewritten_is_finished_on_rerun(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retrying failed points rewrites the files that hold their failed rows, then writes the new chunk. Killed in
    between, the rewritten file was never recorded: every later run and predict refused the database (checksum
    mismatch). The write's intent is kept first, and the next open finishes it and records those files."""
    from tp_query.collector import store as store_mod
    from tp_query.schema import manifest

    root, folder = tmp_path, tmp_path / "ops"
    folder.mkdir()
    failed, prov = _measured_rows(3, status="error")
    first = ChunkedStore(folder, "grid", OPS_SCHEMA, prov)
    for r in failed:
        first.append(r)
    first.close()
    manifest.verify(root, "cpu")
    ok = [{**r, "status": "ok"} for r in failed[:2]]
    retry = ChunkedStore(folder, "grid", OPS_SCHEMA, prov)
    for r in ok:
        retry.append(r)

    _flush_killed_at(monkeypatch, retry, store_mod, "write_table")  # after the superseded rows went
    with pytest.raises(manifest.ManifestError, match="checksum mismatch"):
        manifest.verify(root, "cpu")
    ChunkedStore(folder, "grid", OPS_SCHEMA, prov).close()
    manifest.verify(root, "cpu")
    rows = {r["key"]: r["status"] for r in _rows(folder)}
    assert len(rows) == len(_rows(folder)) == 3
    assert sorted(rows.values()) == ["error", "ok", "ok"]


def test_a_rerun_records_no_file_the_interrupted_write_did_not_name(tmp_path: Path) -> None:
    """Killed after its chunk was recorded and before its journal went, a run left a journal whose rows are all
    done; the next open re-hashed every chunk of the campaign into the manifest, so a file edited meanwhile
    was recorded as good. Now only what an interrupted write named is recorded: the edit stays refused."""
    import pyarrow.compute as pc
    from tp_query.schema import manifest

    root, folder = tmp_path, tmp_path / "ops"
    folder.mkdir()
    rows, prov = _measured_rows(3)
    st = ChunkedStore(folder, "grid", OPS_SCHEMA, prov)
    for r in rows:
        st.append(r)
    st._write_chunk(st.buffer)  # the chunk written and recorded; the journal not yet removed: the kill
    st._lock.close()
    chunk = next(folder.glob("grid-*.parquet"))
    pf = pq.ParquetFile(chunk)
    t = pf.read()
    t = t.set_column(t.schema.get_field_index("latency_us"), "latency_us", pc.multiply(t.column("latency_us"), 100.0))
    pq.write_table(t.replace_schema_metadata(pf.schema_arrow.metadata), chunk)
    ChunkedStore(folder, "grid", OPS_SCHEMA, prov).close()
    with pytest.raises(manifest.ManifestError, match="checksum mismatch"):
        manifest.verify(root, "cpu")


def test_a_new_software_stack_measures_its_own_rows(tmp_path: Path) -> None:
    """The operator table keeps each torch/CUDA/cuDNN stack's rows apart (the engine chooses one); a campaign under
    a new torch found every point 'already done' from the old stack's rows and measured nothing."""
    from dataclasses import replace

    from tp_query.collector.timing import ClosedFormTimer

    pts = grid_points(kinds={"elementwise"}, tiny=2)
    dev = Device(cpu=True)
    old = replace(dev.provenance(), torch="2.0.0+old")
    rows, _ = _measured_rows(len(pts))
    st = ChunkedStore(tmp_path, "grid", OPS_SCHEMA, old)
    for r in rows:
        st.append({**r, "torch": "2.0.0+old"})
    st.close()
    res = run_campaign(pts, tmp_path, dev, progress=False, timer=ClosedFormTimer())
    assert res.skipped_done == 0 and res.measured == len(pts)
    again = run_campaign(pts, tmp_path, dev, progress=False, timer=ClosedFormTimer())
    assert again.measured == 0 and again.skipped_done == len(pts)


def test_written_files_are_readable_under_the_umask(tmp_path: Path) -> None:
    """mkstemp makes 0600 files: a shared database's chunks and manifest were unreadable to its other users."""
    from tp_query.schema import manifest

    old = os.umask(0o022)
    try:
        folder = tmp_path / "ops"
        folder.mkdir()
        rows, prov = _measured_rows(2)
        st = ChunkedStore(folder, "grid", OPS_SCHEMA, prov)
        for r in rows:
            st.append(r)
        st.close()
    finally:
        os.umask(old)
    for f in [*folder.glob("*.parquet"), tmp_path / manifest.MANIFEST_NAME]:
        assert f.stat().st_mode & 0o777 == 0o644, f
