"""The Parquet writing edge. Rows go first to a journal (one JSON line per finished point, flushed
and fsynced), then in chunks to Parquet files written atomically (temporary file, then rename).
A killed campaign loses nothing it finished: the next run folds the journal into a chunk first.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tp_query.schema.tables import METADATA_KEY, Provenance


class StoreError(RuntimeError):
    """The output folder or an existing file cannot be used (one line for the user)."""


def _encode_row(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for k, v in out.items():
        if isinstance(v, dt.datetime):
            out[k] = {"__ts__": v.isoformat()}
    return out


def _decode_row(row: dict[str, Any]) -> dict[str, Any]:
    for k, v in list(row.items()):
        if isinstance(v, dict) and "__ts__" in v:
            row[k] = dt.datetime.fromisoformat(v["__ts__"])
    return row


def write_table(path: Path, rows: list[dict[str, Any]], schema: pa.Schema, provenance: Provenance) -> None:
    meta = dict(schema.metadata or {})
    meta[METADATA_KEY] = provenance.to_json().encode()
    table = pa.Table.from_pylist(rows, schema=schema.with_metadata(meta))
    tmp = path.with_name("." + path.name + ".tmp")
    pq.write_table(table, tmp, compression="zstd", compression_level=9)
    os.replace(tmp, path)


def read_columns(path: Path, columns: list[str]) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns)
    except Exception as e:
        raise StoreError(f"corrupt or unreadable Parquet file {path}: {str(e).splitlines()[0]}") from None


class ChunkedStore:
    """Resumable, append-only storage of one campaign's rows under `folder`."""

    def __init__(self, folder: Path, campaign: str, schema: pa.Schema, provenance: Provenance,
                 key_columns: tuple[str, ...] = ("key", "run")) -> None:
        self.folder = folder
        self.campaign = campaign
        self.schema = schema
        self.provenance = provenance
        self.key_columns = key_columns
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise StoreError(f"output folder {folder} is not writable: {e.strerror or e}") from None
        self.journal = folder / f".journal-{campaign}.jsonl"
        self.buffer: list[dict[str, Any]] = []
        for p in sorted(folder.glob("*.parquet")):  # refuse to build on a file we cannot read
            try:
                pq.read_metadata(p)
            except Exception as e:
                raise StoreError(f"corrupt or unreadable Parquet file {p}: {str(e).splitlines()[0]}") from None
        self._recover()

    def _chunk_paths(self) -> list[Path]:
        return sorted(self.folder.glob(f"{self.campaign}-*.parquet"))

    def _next_chunk(self) -> Path:
        nums = [int(p.stem.rsplit("-", 1)[1]) for p in self._chunk_paths() if p.stem.rsplit("-", 1)[1].isdigit()]
        return self.folder / f"{self.campaign}-{(max(nums) + 1 if nums else 0):05d}.parquet"

    def _recover(self) -> None:
        if not self.journal.exists():
            return
        rows = []
        for line in self.journal.read_text().splitlines():
            try:
                rows.append(_decode_row(json.loads(line)))
            except json.JSONDecodeError:
                continue  # a line cut by a kill mid-write: that point was not finished
        done = self.done_keys(include_journal=False)
        rows = [r for r in rows if tuple(r[c] for c in self.key_columns) not in done]
        if rows:
            write_table(self._next_chunk(), rows, self.schema, self.provenance)
        self.journal.unlink()

    def done_keys(self, include_journal: bool = True, ok_only: bool = False) -> set[tuple[Any, ...]]:
        """Keys already measured (in any campaign's files); with ok_only, failed rows count as not done."""
        keys: set[tuple[Any, ...]] = set()
        for p in sorted(self.folder.glob("*.parquet")):  # every campaign: a point is measured once
            cols = list(self.key_columns) + (["status"] if ok_only else [])
            t = read_columns(p, cols).to_pydict()
            rows = zip(*(t[c] for c in cols), strict=True)
            if ok_only:
                keys.update(r[:-1] for r in rows if r[-1] == "ok")
            else:
                keys.update(rows)
        for r in self.buffer:
            keys.add(tuple(r[c] for c in self.key_columns))
        return keys

    def append(self, row: dict[str, Any]) -> None:
        with self.journal.open("a") as f:
            f.write(json.dumps(_encode_row(row), default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.buffer.append(row)

    def flush(self) -> None:
        if not self.buffer:
            return
        write_table(self._next_chunk(), self.buffer, self.schema, self.provenance)
        self.buffer = []
        if self.journal.exists():
            self.journal.unlink()
