"""The Parquet writing edge. Rows go first to a journal (one JSON line per finished point, flushed
and fsynced), then in chunks to Parquet files written atomically (temporary file, then rename).
A killed campaign loses nothing it finished: the next run folds the journal into a chunk first.
One writer per folder (an exclusive lock); a row that supersedes a failed one for the same key
replaces it, so reruns never leave two rows for one key. Table folders of a GPU's database keep
its manifest (checksums) current.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import glob
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tp_query.schema import manifest
from tp_query.schema.messages import first_line
from tp_query.schema.tables import METADATA_KEY, Provenance


def stored_keys(folder: Path) -> set[str]:
    """The key of every point a table folder's Parquet chunks hold, across campaigns (what is measured)."""
    keys: set[str] = set()
    for f in Path(folder).glob("*.parquet"):
        keys.update(pq.read_table(f, columns=["key"]).column("key").to_pylist())
    return keys


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
    _atomic_write(path, table)


def _atomic_write(path: Path, table: pa.Table) -> None:
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, manifest.readable_mode())
    os.close(fd)
    pq.write_table(table, tmp, compression="zstd", compression_level=9)
    os.replace(tmp, path)


def read_columns(path: Path, columns: list[str]) -> pa.Table:
    """The named columns; a column added to the schema after the file was written reads as nulls."""
    try:
        have = set(pq.read_schema(path).names)
        t = pq.read_table(path, columns=[c for c in columns if c in have])
        for c in columns:
            if c not in have:
                t = t.append_column(c, pa.nulls(t.num_rows, pa.string()))
        return t.select(columns)
    except Exception as e:
        raise StoreError(f"corrupt or unreadable Parquet file {path}: {first_line(e)}") from None


def _file_gpu(meta: dict[bytes, bytes]) -> str | None:
    """The GPU a file's provenance names (None for a file without one)."""
    raw = meta.get(METADATA_KEY)
    try:
        gpu = json.loads(raw).get("gpu") if raw else None
    except (ValueError, AttributeError):
        return None
    return gpu if isinstance(gpu, str) else None


class ChunkedStore:
    """Resumable, append-only storage of one campaign's rows under `folder`."""

    def __init__(self, folder: Path, campaign: str, schema: pa.Schema, provenance: Provenance,
                 key_columns: tuple[str, ...] = ("key", "run"), remeasure: bool = False,
                 per_stack: bool = False) -> None:
        """remeasure: a new row replaces an earlier successful one for the same key (campaigns that are
        measured again as a whole, such as the framework host costs); otherwise only failures are replaced.
        per_stack: a key measured under another torch/CUDA/cuDNN is not done here, nor replaced (the operator
        table holds each software stack's rows apart: a new torch found every point 'already done')."""
        self.remeasure = remeasure
        self.per_stack = per_stack
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
        self._lock = (folder / ".lock").open("w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"another collector is writing into {folder} (its lock is held)") from None
        self.journal = folder / f".journal-{campaign}.jsonl"
        self.buffer: list[dict[str, Any]] = []
        for p in sorted(folder.glob("*.parquet")):  # refuse to build on a file we cannot read
            try:
                meta = pq.read_metadata(p).metadata or {}
            except Exception as e:
                raise StoreError(f"corrupt or unreadable Parquet file {p}: {first_line(e)}") from None
            # nor on another GPU's rows in a database table: they would count as measured here, and the database
            # would mix two GPUs (validation folders hold every GPU's runs, told apart by their rows)
            theirs = _file_gpu(meta)
            if folder.name in manifest.TABLE_DIRS and theirs is not None and theirs != provenance.gpu:
                raise StoreError(f"{p} holds rows measured on {theirs!r}, and this machine is {provenance.gpu!r}: "
                                 f"write into that GPU's own folder (data/{provenance.gpu}/...)")
        if folder.name in manifest.TABLE_DIRS and (folder.parent / manifest.MANIFEST_NAME).is_file():
            theirs = manifest.load(folder.parent).get("gpu")
            if theirs != provenance.gpu:
                raise StoreError(f"{folder.parent} is the database of GPU {theirs!r} (its manifest), and this machine "
                                 f"is {provenance.gpu!r}: write into data/{provenance.gpu}/{folder.name}")
        self._recover()

    def close(self) -> None:
        """Write what is buffered and release the folder's lock (another store may open it)."""
        self.flush()
        self._lock.close()

    def _chunk_paths(self) -> list[Path]:
        # (the name is text, not a pattern: "llama[8b]" matched no chunk of its own, and each chunk replaced the last)
        return sorted(self.folder.glob(f"{glob.escape(self.campaign)}-*.parquet"))

    def _next_chunk(self) -> Path:
        nums = [int(p.stem.rsplit("-", 1)[1]) for p in self._chunk_paths() if p.stem.rsplit("-", 1)[1].isdigit()]
        return self.folder / f"{self.campaign}-{(max(nums) + 1 if nums else 0):05d}.parquet"

    def _recover(self) -> None:
        """A killed run's journal: its rows not yet in a chunk are written, and the manifest is brought up to what
        the kill left (a chunk written but not recorded, a superseded file deleted but still listed); under
        remeasure every journal row is written again (it supersedes the earlier measurement of its key, also one
        already in a chunk of the killed run: the chunk's copy is replaced, not duplicated)."""
        for tmp in [*self.folder.glob(".*.parquet.*.tmp"), *self.folder.glob(".intent-*.json.*.tmp")]:
            tmp.unlink(missing_ok=True)  # an atomic write a kill cut short (we hold the lock)
        if self._intent.exists():
            self._finish_intent()
        if not self.journal.exists():
            return
        rows = []
        for line in self.journal.read_text().splitlines():
            try:
                rows.append(_decode_row(json.loads(line)))
            except json.JSONDecodeError:
                continue  # a line cut by a kill mid-write: that point was not finished
        if not self.remeasure:
            done = self.done_keys(include_journal=False, ok_only="status" in self.schema.names)
            rows = [r for r in rows if tuple(r[c] for c in self.key_columns) not in done]
        if rows:
            self._write_chunk(rows)
        if self.folder.name in manifest.TABLE_DIRS:  # entries of files a kill deleted
            listed = manifest.load(self.folder.parent).get("files", {}) if (
                self.folder.parent / manifest.MANIFEST_NAME).is_file() else {}
            gone = [self.folder.parent / rel for rel in listed if rel.startswith(f"{self.folder.name}/")
                    and not (self.folder.parent / rel).exists()]
            if gone:
                self._record(gone)
        self.journal.unlink()

    def done_keys(self, include_journal: bool = True, ok_only: bool = False) -> set[tuple[Any, ...]]:
        """Keys already measured (in any campaign's files); with ok_only, failed rows count as not done."""
        keys: set[tuple[Any, ...]] = set()
        for p in sorted(self.folder.glob("*.parquet")):  # every campaign: a point is measured once
            cols = list(self.key_columns) + (["status"] if ok_only else [])
            t = read_columns(p, cols + self._gpu_column).to_pydict()
            rows = (r for r, mine in zip(zip(*(t[c] for c in cols), strict=True), self._mine(t), strict=True)
                    if mine)
            if ok_only:
                keys.update(r[:-1] for r in rows if r[-1] == "ok")
            else:
                keys.update(rows)
        for r in self.buffer:
            keys.add(tuple(r[c] for c in self.key_columns))
        return keys

    STACK = ("torch", "cuda", "cudnn")

    @property
    def _gpu_column(self) -> list[str]:
        cols = ["gpu"] if "gpu" in self.schema.names and "gpu" not in self.key_columns else []
        return cols + ([c for c in self.STACK if c in self.schema.names] if self.per_stack else [])

    def _mine(self, t: dict[str, list[Any]]) -> list[bool]:
        """Which rows this machine's GPU (and, per_stack, its software stack) measured: a folder of validation
        runs holds every GPU's, and another GPU's run of a case neither counts as done here nor is replaced by
        this one."""
        n = len(next(iter(t.values()), []))
        out = [True] * n
        for c in self._gpu_column:
            want = getattr(self.provenance, c)
            # None: a file from before the column
            out = [o and (v is None or v == want) for o, v in zip(out, t[c], strict=True)]
        return out

    def append(self, row: dict[str, Any]) -> None:
        with self.journal.open("a") as f:
            f.write(json.dumps(_encode_row(row), default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.buffer.append(row)

    def flush(self) -> None:
        if not self.buffer:
            return
        self._write_chunk(self.buffer)
        self.buffer = []
        if self.journal.exists():
            self.journal.unlink()

    @property
    def _intent(self) -> Path:
        return self.folder / f".intent-{self.campaign}.json"

    def _write_chunk(self, rows: list[dict[str, Any]]) -> None:
        """Write rows as a new chunk; rows they supersede (failed measurements of the same key, or any under
        remeasure) go. Which files this rewrites is written down first: a kill part-way leaves the intent, and the
        next open finishes it and records exactly those files (rewritten files left unrecorded made the database
        refused for good, and re-hashing every chunk on recovery recorded a tampered one as good)."""
        keys = {tuple(r[c] for c in self.key_columns) for r in rows}
        path = self._next_chunk()
        holding = self._holding(keys)
        intent = {"chunk": path.name, "keys": sorted(([list(k) for k in keys]), key=json.dumps),
                  "rewrite": [p.name for p in holding]}
        text = json.dumps(intent, default=str)
        fd, tmp = tempfile.mkstemp(prefix=self._intent.name + ".", suffix=".tmp", dir=self.folder)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._intent)
        changed = self._drop_superseded(keys, holding)
        write_table(path, rows, self.schema, self.provenance)
        self._record([*changed, path])
        self._intent.unlink()

    def _finish_intent(self) -> None:
        """A write a kill cut short: its superseded rows dropped (again: it is idempotent) and the files it named
        recorded as they now are - those alone."""
        try:
            intent = json.loads(self._intent.read_text())
            keys = {tuple(k) for k in intent["keys"]}
            names = [str(n) for n in intent["rewrite"]] + [str(intent["chunk"])]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{self._intent}: an interrupted write's record is unreadable ({first_line(e)}); "
                             "check the folder against `tp-query db verify`") from None
        self._drop_superseded(keys, [self.folder / str(n) for n in intent["rewrite"]])
        self._record([self.folder / n for n in names])
        self._intent.unlink()

    def _hits(self, p: Path, keys: set[tuple[Any, ...]]) -> list[bool]:
        """Which of a file's rows are this GPU's rows of these keys."""
        t = read_columns(p, list(self.key_columns) + self._gpu_column).to_pydict()
        return [tuple(x) in keys and mine for x, mine in
                zip(zip(*(t[c] for c in self.key_columns), strict=True), self._mine(t), strict=True)]

    def _holding(self, keys: set[tuple[Any, ...]]) -> list[Path]:
        """This GPU's files holding a row of these keys (a new chunk's keys: it does not exist yet)."""
        return [p for p in sorted(self.folder.glob("*.parquet")) if any(self._hits(p, keys))]

    def _drop_superseded(self, keys: set[tuple[Any, ...]], files: list[Path]) -> list[Path]:
        """Rows of these keys dropped from the files that hold them (named by _holding; after a kill, some are
        rewritten or gone already)."""
        changed = []
        for p in files:
            if not p.exists():
                continue
            hit = self._hits(p, keys)
            if not any(hit):
                continue
            full = pq.read_table(p)
            if not self.remeasure and "status" in full.column_names and any(
                    st == "ok" for st, h in zip(full.column("status").to_pylist(), hit, strict=True) if h):
                raise StoreError(f"{p} already holds a successful row for a key being written again")
            kept = full.filter(pa.array([not h for h in hit]))
            if kept.num_rows:
                _atomic_write(p, kept)
            else:
                p.unlink()
            changed.append(p)
        return changed

    def _record(self, paths: list[Path]) -> None:
        """Keep the GPU database's manifest current when this folder is one of its tables."""
        if self.folder.name in manifest.TABLE_DIRS:
            root = self.folder.parent
            manifest.record(root, [f"{self.folder.name}/{p.name}" for p in paths], self.provenance.gpu)
