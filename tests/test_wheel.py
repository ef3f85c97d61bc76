"""The wheel is a tool people install: built with `pip wheel .`, installed apart from the checkout and run
from another folder, it predicts, searches, answers SQL and verifies its database with no --db."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheels = tmp_path_factory.mktemp("wheel")
    # setuptools builds through ROOT/build/lib and never deletes from it: a data file removed or renamed since an
    # earlier build would ship (and fail the manifest check). Build from nothing, as a clean clone does.
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                        "-w", str(wheels)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}")
    whl = next(wheels.glob("tp_query-*.whl"))
    names = zipfile.ZipFile(whl).namelist()
    assert "tp_query/data/h200/manifest.json" in names and "tp_query/data/h200/calibration.json" in names
    assert "tp_query/data/h200/snapshot.json.gz" in names  # a fresh install's first predict opens no DuckDB
    assert sum(n.startswith("tp_query/data/h200/ops/") for n in names) >= 30
    assert not any("/validation/" in n for n in names)
    target = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(whl)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return target


def _run(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONWARNINGS": "ignore"}
    env.pop("TP_QUERY_DB", None)
    return subprocess.run([sys.executable, "-m", "tp_query.engine.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def test_the_installed_wheel_runs_from_another_folder(installed: Path, tmp_path: Path) -> None:
    model = tmp_path / "llama.json"
    model.write_text((ROOT / "examples" / "llama3.1-8b.json").read_text())
    r = _run(installed, tmp_path, "db", "path")
    assert r.returncode == 0 and r.stdout.strip().startswith(str(installed)), r.stdout + r.stderr
    r = _run(installed, tmp_path, "db", "verify")
    assert r.returncode == 0 and "match the manifest" in r.stdout, r.stderr
    r = _run(installed, tmp_path, "predict", str(model), "--dp", "2", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["iteration_ms"] > 0 and p["config"]["calibration"].startswith(str(installed))
    r = _run(installed, tmp_path, "sql", "SELECT count(*) AS n FROM ops_ok", "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)[0]["n"] > 10_000, r.stderr
    r = _run(installed, tmp_path, "db", "info")
    assert r.returncode == 0 and "h200" in r.stdout.lower(), r.stderr
    r = _run(installed, tmp_path, "search", str(model), "--gpus", "2", "--global-batch", "2", "--micro-batch", "1",
             "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ranked"], r.stderr
    r = _run(installed, tmp_path, "--version")
    assert r.returncode == 0 and r.stdout.startswith("tp-query "), r.stderr
    r = _run(installed, tmp_path, "plot", "latency", "--kind", "mm", "-o", str(tmp_path / "mm.svg"))
    assert r.returncode == 0 and (tmp_path / "mm.svg").read_text().lstrip().startswith("<"), r.stderr
    pytest.importorskip("matplotlib")
    for name, magic in (("mm.png", b"\x89PNG\r\n\x1a\n"), ("mm.pdf", b"%PDF-")):  # each file is its format
        r = _run(installed, tmp_path, "plot", "latency", "--kind", "mm", "-o", str(tmp_path / name))
        assert r.returncode == 0 and (tmp_path / name).read_bytes().startswith(magic), r.stderr


def test_tp_query_db_points_elsewhere(installed: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(installed), "TP_QUERY_DB": str(tmp_path / "nowhere")}
    r = subprocess.run([sys.executable, "-m", "tp_query.engine.cli", "db", "verify"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 2 and "nowhere" in r.stderr and len(r.stderr.strip().splitlines()) == 1
