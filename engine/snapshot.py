"""The database snapshot shipped with a GPU's database (data/<gpu>/snapshot.json.gz): every read the engine
makes of it, derived once by DuckDB, so that a fresh install's first prediction opens no DuckDB at all.

    python -m tp_query.engine.snapshot h200 [--db ROOT]     (make snapshot GPU=h200)

Rebuild it after a campaign changes the database; until then its fingerprint does not match and the engine
derives every read from the database as before (a test says when the shipped one is stale)."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from tp_query.schema.gpus import gpu_spec

from .dbcache import SHIPPED_FORMAT, SHIPPED_NAME, DbSnapshot
from .lookup import LatencyModel

TABLES = ("comm", "overlap", "framework")  # the optional views the engine reads whole


def derive(gpu: str, root: Path | str | None = None) -> dict[str, Any]:
    """{"format", "fingerprint", "files"}: every read of this database, derived from DuckDB in a fresh cache."""
    with tempfile.TemporaryDirectory(prefix="tpq-snapshot-") as d:
        snap = DbSnapshot(gpu, root, cache=Path(d), shipped=False)
        if snap._dir is None:
            raise SystemExit(f"error: {gpu}: only a local database with a manifest has a snapshot")
        snap.software_versions()
        for view in TABLES:
            snap.optional_table(view)
        LatencyModel(snap, gpu_spec(gpu)).read_all_families()
        return {"format": SHIPPED_FORMAT, "fingerprint": snap.fingerprint, "files": snap.derived_files()}


def write(gpu: str, root: Path | str | None = None) -> Path:
    snap = derive(gpu, root)
    base = Path(str(root) if root is not None else DbSnapshot(gpu, root, shipped=False).root) / gpu
    out = base / SHIPPED_NAME
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    # mtime=0: the same database gives the same bytes
    tmp.write_bytes(gzip.compress(json.dumps(snap, separators=(",", ":"), sort_keys=True).encode(), 9, mtime=0))
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tp_query.engine.snapshot", description=__doc__.split("\n")[0])
    ap.add_argument("gpu")
    ap.add_argument("--db", default=None, help="database root (default: the shipped data/)")
    a = ap.parse_args(argv)
    p = write(a.gpu, a.db)
    print(f"{p} ({p.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
