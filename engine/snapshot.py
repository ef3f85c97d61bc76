"""The database snapshot shipped with a GPU's database (data/<gpu>/snapshot.json.gz): every read the engine
makes of it, derived once by DuckDB, so that a fresh install's first prediction opens no DuckDB at all.

    python -m tp_query.engine.snapshot h200 [--db ROOT]     (make snapshot GPU=h200)

Rebuild it after a campaign changes the database; until then its fingerprint does not match and the engine
derives every read from the database as before (a test says when the shipped one is stale)."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from tp_query.schema.gpus import gpu_spec

from .dbcache import SHIPPED_FORMAT, SHIPPED_NAME, DbSnapshot, encode_files
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


def encode(snap: dict[str, Any]) -> bytes:
    """A header line (format, fingerprint, the SHA-256 of the payload's bytes) and the payload, a line per file
    (`encode_files`): a reader checks it against the header, then parses only the files it reads."""
    body = encode_files(snap["files"])
    head = {"format": snap["format"], "fingerprint": snap["fingerprint"], "files_sha256": hashlib.sha256(body).hexdigest()}
    # mtime=0: the same database gives the same bytes
    return gzip.compress(json.dumps(head, sort_keys=True).encode() + b"\n" + body, 9, mtime=0)


def write(gpu: str, root: Path | str | None = None) -> Path:
    snap = derive(gpu, root)
    base = Path(str(root) if root is not None else DbSnapshot(gpu, root, shipped=False).root) / gpu
    out = base / SHIPPED_NAME
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_bytes(encode(snap))
    os.replace(tmp, out)
    return out


def check(gpu: str, root: Path | str | None = None) -> str:
    """What `db verify` says of the shipped snapshot: absent, stale (built from other files or code: unused), or
    equal to a fresh derivation from the files; raises DatabaseError when it claims these files but differs."""
    from .dbcache import DatabaseError, read_shipped

    snap = DbSnapshot(gpu, root, shipped=False)
    if snap._dir is None:
        return "no snapshot (a remote database or none built)"
    path = snap._base / SHIPPED_NAME
    if not path.exists():
        return "no snapshot: every read is derived from the files"
    files = read_shipped(path, snap.fingerprint)
    if files is None:
        return "snapshot stale or unreadable: unused (rebuild with `make snapshot`)"
    fresh = derive(gpu, root)["files"]
    if json.loads(json.dumps(fresh)) != {k: json.loads(v) for k, v in files.items()}:
        raise DatabaseError(f"{path} claims this database's fingerprint but its reads differ from the files' "
                            "(altered): remove it or rebuild it with `make snapshot`")
    return "snapshot equal to the files' reads"


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
