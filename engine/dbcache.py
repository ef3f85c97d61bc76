"""What the engine reads from a local database, kept per database fingerprint so that a process with
warm caches answers without DuckDB.

The fingerprint is the database's manifest (every file's size and SHA-256) with the GPU, the project
version and the reading code's own file. Each process still checks every file against the manifest (a file whose
size, mtime, ctime and inode match its last full hash is not hashed again: milliseconds for thousands of files);
only the reads derived from those exact bytes come from the snapshot, and a snapshot is only ever
written from a `Database` that passed its full validation (manifest, provenance, unique keys). A changed,
added or missing file changes or fails the check, never a stale answer. Snapshots are JSON (no code runs
when one is read). Object-storage databases are read directly.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tp_query.schema import manifest
from tp_query.schema.messages import TpQueryError

SNAPSHOT_VERSION = 1
DB_ENV = "TP_QUERY_DB"


def is_remote(root: str | Path) -> bool:
    """Whether a database root is object storage or a web address (read through DuckDB's httpfs), not a folder."""
    return str(root).startswith(("s3://", "http://", "https://"))


def default_root() -> Path | str:
    """Where databases live unless --db says: $TP_QUERY_DB (a folder or s3:// prefix), else data/ beside the
    engine: the checkout's data/ folder, or the copy shipped inside the installed package (tp_query/data)."""
    import os

    env = os.environ.get(DB_ENV)
    if env:
        return env if "://" in env else Path(env)
    return Path(__file__).resolve().parent.parent / "data"


class DatabaseError(TpQueryError, RuntimeError):
    """Missing or unusable profile data (one line for the user)."""


# the code that derives what a snapshot holds (its bytes are part of the fingerprint)
_READERS = (Path(__file__).with_name("db.py"), Path(__file__),
            Path(__file__).resolve().parent.parent / "schema" / "tables.py")
SHIPPED_MAX_BYTES = 64 << 20  # the shipped one is under 2 MB
SHIPPED_MAX_UNPACKED = 256 << 20  # the shipped one unpacks to 10 MB
SHIPPED_NAME = "snapshot.json.gz"  # beside a GPU's manifest: the snapshot built with the database (make snapshot)
SHIPPED_FORMAT = "tp-query-db-snapshot/3"  # a header line, then one line per file: its name, a tab, its JSON


def _cache_root() -> Path:
    return Path(os.environ.get("TP_QUERY_CACHE", Path.home() / ".cache" / "tp-query")) / "db"


def _reader_digest() -> bytes:
    """The reading code's own bytes: a change to how a snapshot is derived names another snapshot."""
    h = hashlib.blake2b(digest_size=12)
    for f in _READERS:
        try:
            h.update(f.read_bytes())
        except OSError:
            h.update(str(f).encode())
    return h.digest()


def fingerprint(manifest_body: bytes, gpu: str, torch_version: str | None) -> str:
    """What a snapshot's reads depend on: every database file (the manifest holds their hashes), the GPU, the
    software stack whose rows answer, and the code that reads them; nothing of where or when the files lie, so
    the snapshot built with the database serves any checkout or wheel of the same bytes."""
    h = hashlib.blake2b(digest_size=12)
    for part in (manifest_body, gpu.encode(), str(SNAPSHOT_VERSION).encode(), _reader_digest(),
                 str(torch_version).encode()):
        h.update(part)
        h.update(b"|")
    return h.hexdigest()


_SEAL = b"tp-query-cache/1 "  # then the seal's hex digest, a newline and the JSON


def _seal(name: str, body: bytes) -> bytes:
    """A digest of a cache file's name and JSON: a file changed in place (valid JSON of the right shape too: an
    empty table read as 'not measured') or copied under another name is derived again, never believed."""
    return hashlib.blake2b(body, key=_SEAL + name.encode()[:40], digest_size=16).hexdigest().encode()


def _read_json(path: Path) -> Any:
    """A cache file's JSON, or None when it is missing, unreadable or its seal does not match (then it is
    derived again)."""
    try:
        raw = path.read_bytes()
        head, _, body = raw.partition(b"\n")
        if not head.startswith(_SEAL) or head[len(_SEAL):] != _seal(path.name, body):
            return None
        return json.loads(body)
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value: Any) -> None:
    """Write a cache file atomically (a temporary of this process, then a rename); a read-only cache only
    costs the next process the work again."""
    _write_bytes(path, json.dumps(value, separators=(",", ":"), default=str).encode())


def _write_bytes(path: Path, body: bytes) -> None:
    """Write JSON bytes as a sealed cache file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(_SEAL + _seal(path.name, body) + b"\n" + body)
        tmp.replace(path)
    except OSError:
        pass


def encode_files(files: dict[str, Any]) -> bytes:
    """A snapshot's payload: one line per file, sorted by name: the name, a tab, its compact JSON (which holds
    no newline). A reader parses only the files it reads, and caches them as the bytes they are."""
    lines = []
    for name in sorted(files):
        if not name or any(c in name for c in "\t\n"):
            raise ValueError(f"a snapshot file name must be one line without a tab: {name!r}")
        lines.append(name.encode() + b"\t" + json.dumps(files[name], separators=(",", ":"), sort_keys=True,
                                                        default=str).encode())
    return b"\n".join(lines)


def decode_files(body: bytes) -> dict[str, bytes]:
    """The payload's files by name, each its JSON's bytes (unparsed); ValueError for a malformed payload."""
    out: dict[str, bytes] = {}
    for line in body.split(b"\n") if body else []:
        name, tab, raw = line.partition(b"\t")
        if not tab or not name or name.decode() in out:
            raise ValueError("malformed snapshot payload")
        out[name.decode()] = raw
    return out


def read_shipped(path: Path, fp: str | None) -> dict[str, bytes] | None:
    """A shipped snapshot's reads (each its JSON's bytes) when it was built from the database of fingerprint
    `fp` and its payload is the bytes its header hashed; None otherwise (none, damaged, edited or stale: every
    read derived instead)."""
    try:
        # a regular file, read within bounds: a FIFO waited forever, /dev/zero or a gzip bomb grew to gigabytes
        if not path.is_file() or path.stat().st_size > SHIPPED_MAX_BYTES:
            return None
        with gzip.open(path, "rb") as f:
            raw = f.read(SHIPPED_MAX_UNPACKED + 1)
        if len(raw) > SHIPPED_MAX_UNPACKED:
            return None
        head_b, sep, body = raw.partition(b"\n")
        head = json.loads(head_b)
        if not sep or not isinstance(head, dict) or head.get("format") != SHIPPED_FORMAT or \
                head.get("fingerprint") != fp or head.get("files_sha256") != hashlib.sha256(body).hexdigest():
            return None
        return decode_files(body)
    except (OSError, ValueError, EOFError):  # none, or damaged (gzip's CRC)
        return None


class DbSnapshot:
    """The engine's reads of one GPU's database: from the snapshot when its fingerprint matches, else from
    a fully validated `Database` (created on first need), saved for the next process."""

    def __init__(self, gpu: str, root: Path | str | None = None, torch_version: str | None = None,
                 cache: Path | None = None, shipped: bool = True) -> None:
        """cache: where snapshots are kept (default $TP_QUERY_CACHE/db); shipped: take the reads from the
        database's own snapshot file when its fingerprint is this database's (False: derive them, to build it)."""
        self.gpu = gpu
        self.root = str(root) if root is not None else str(default_root())
        self.torch_version = torch_version  # which software stack's rows answer (Database)
        self._db: Any = None
        self._dir: Path | None = None
        self.fingerprint: str | None = None  # a local database's (remote ones are read directly)
        self._shipped: dict[str, bytes] | None = None if shipped else {}
        cache_root = cache or _cache_root()
        base = Path(self.root) / gpu
        self._base = base
        remote = is_remote(self.root)
        if remote or not (base / manifest.MANIFEST_NAME).is_file():
            self.database  # noqa: B018 - validates now and says why it cannot open, as before
            return
        # every process: the files are the bytes the manifest records (those unchanged since the last passed
        # check by their stamps, the rest by their hashes); only a passed check rewrites the stamps
        seen = cache_root / "verified" / (hashlib.blake2b(str(base.resolve()).encode(), digest_size=10
                                                            ).hexdigest() + ".json")
        before = _read_json(seen)
        before = before if isinstance(before, dict) else {}
        try:
            _, after = manifest.verify_stamped(base, gpu, before)
        except manifest.ManifestError as e:
            raise DatabaseError(str(e)) from None
        if after != before:
            _write_json(seen, after)
        self.fingerprint = fingerprint((base / manifest.MANIFEST_NAME).read_bytes(), gpu, torch_version)
        self._dir = cache_root / self.fingerprint

    @property
    def database(self) -> Any:
        """The DuckDB-backed database, validated in full (created at most once)."""
        if self._db is None:
            from .db import Database

            self._db = Database(self.gpu, self.root, torch_version=self.torch_version)
        return self._db

    def _get(self, name: str, read: Callable[[Any], Any]) -> Any:
        if self._dir is None:
            return read(self.database)
        path = self._dir / f"{name}.json"
        hit = _read_json(path)
        if hit is not None and _well_formed(name, hit):
            return hit
        raw = self.shipped_files().get(name)
        if raw is not None:
            try:
                value = json.loads(raw)
            except ValueError:  # (the header hashed these bytes: only a snapshot built wrong)
                value = None
            if value is not None and _well_formed(name, value):
                _write_bytes(path, raw)  # as shipped: not encoded again
                return value
        value = read(self.database)
        _write_json(path, value)  # a read-only cache only costs the next process the DuckDB reads
        return value

    def shipped_files(self) -> dict[str, bytes]:
        """The reads of the snapshot shipped with the database (data/<gpu>/snapshot.json.gz), when it was built
        from these very files by this very code (its fingerprint is this database's); else nothing, and every
        read is derived from the database. Loaded once, on the first read the cache lacks."""
        if self._shipped is None:
            self._shipped = read_shipped(self._base / SHIPPED_NAME, self.fingerprint) or {}
        return self._shipped

    def derived_files(self) -> dict[str, Any]:
        """Every read this process has made or found in its cache (memos apart), by name: what a shipped
        snapshot holds."""
        if self._dir is None:
            return {}
        out = {}
        for p in sorted(self._dir.glob("*.json")):
            if not p.name.startswith("memo-"):
                value = _read_json(p)
                if value is not None:
                    out[p.stem] = value
        return out

    # -- memos of what was derived from this database (same fingerprint, same answers) --------------
    def memo_load(self, name: str) -> dict[str, Any]:
        """A memo written by an earlier process for this very database (empty without one)."""
        if self._dir is None:
            return {}
        value = _read_json(self._dir / f"memo-{name}.json")
        return value if isinstance(value, dict) else {}

    def memo_store(self, name: str, value: dict[str, Any]) -> None:
        if self._dir is not None:
            _write_json(self._dir / f"memo-{name}.json", value)

    # -- what the engine reads ----------------------------------------------------------------
    def exact_all(self) -> dict[str, tuple[float, float | None]]:
        raw = self._get("exact", lambda db: {k: list(v) for k, v in db.exact_all().items()})
        return {k: (v[0], v[1]) for k, v in raw.items()}

    def family_rows(self, family: str, columns: list[str]) -> list[dict[str, Any]]:
        tag = hashlib.blake2b(",".join(columns).encode(), digest_size=6).hexdigest()
        return self._get(f"family-{family}-{tag}",  # type: ignore[no-any-return]
                         lambda db: db.family_rows(family, columns))

    def software_versions(self) -> list[dict[str, Any]]:
        return self._get("versions", lambda db: db.software_versions())  # type: ignore[no-any-return]

    def optional_table(self, view: str) -> list[dict[str, Any]]:
        """A whole view (comm, overlap, framework), or nothing when the database has none."""
        def read(db: Any) -> list[dict[str, Any]]:
            if view not in db.tables:  # no files of it: the engine prices without them (and says so)
                return []
            # a read error of files that exist is a damaged database, never an empty table (nor cached as one)
            from .db import DatabaseError

            try:
                return db.sql(f"SELECT * FROM {view}").to_pylist()  # type: ignore[no-any-return]
            except DatabaseError as e:
                raise DatabaseError(f"the {view} table of {db.base} cannot be read (a damaged file): "
                                    f"{str(e).removeprefix('SQL error: ')}") from None

        return self._get(f"table-{view}", read)  # type: ignore[no-any-return]

    # -- everything else goes to the database itself ------------------------------------------
    def sql(self, query: str, params: Sequence[Any] | None = None) -> Any:
        return self.database.sql(query, params)

    def info(self) -> Any:
        return self.database.info()

    def has_campaign(self, name: str) -> bool:
        return self.database.has_campaign(name)  # type: ignore[no-any-return]


def _well_formed(name: str, value: Any) -> bool:
    """A cached read of the shape its reader returns (the exact table a dict of [cold, warm] pairs, every other a
    list of rows): anything else is a damaged cache file, read again from the database rather than crashing."""
    if name == "exact":
        return isinstance(value, dict) and all(isinstance(v, list) and len(v) == 2 for v in value.values())
    return isinstance(value, list) and all(isinstance(r, dict) for r in value)
