"""The manifest of a GPU's database: every file under data/<gpu>/ with its SHA-256, size and what it holds.

The collector updates it whenever it writes a file (atomically, under the folder's lock); the engine
verifies it whenever it opens a database. A file that is missing, extra, changed by one bit or written
for another GPU or schema is named and refused: corrupt or foreign data is never averaged in.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .messages import TpQueryError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "tp-query-manifest/1"
TABLE_DIRS = ("ops", "comm", "overlap", "framework")  # the Parquet tables of a GPU's database
TOP_FILES = ("calibration.json",)


class ManifestError(TpQueryError):
    """The database does not match its manifest (one line naming the file)."""


@dataclass(frozen=True)
class Entry:
    sha256: str
    bytes: int


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """The file's checksum; a FIFO or a device under a data file's name is refused, not read (it hung)."""
    if not path.is_file():
        raise ManifestError(f"{path}: not a regular file")
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tracked_files(root: Path) -> list[str]:
    """The files of a database root that the manifest covers, as relative POSIX paths (names sorted as strings:
    sorting thousands of Path objects took half a second of a 100-stack database's predict)."""
    out: list[str] = []
    for d in TABLE_DIRS:
        try:
            with os.scandir(root / d) as it:
                names = sorted(e.name for e in it if e.name.endswith(".parquet"))
        except (FileNotFoundError, NotADirectoryError):
            continue
        out += [f"{d}/{n}" for n in names]
    out += [n for n in TOP_FILES if (root / n).is_file()]
    return out


def load(root: Path) -> dict[str, Any]:
    p = root / MANIFEST_NAME
    if not p.is_file():
        raise ManifestError(f"{p} is missing: a database without a manifest cannot be verified "
                            "(`tp-query db manifest --adopt` records the files as they are)")
    try:
        m = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"{p} is unreadable: {e}") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), dict):
        raise ManifestError(f"{p} is not a {MANIFEST_FORMAT} manifest")
    return m


def readable_mode() -> int:
    """The mode a new file gets under this process's umask (mkstemp makes 0600: a shared database's files would be
    unreadable to its other users)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _write(root: Path, m: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".manifest-", suffix=".tmp", dir=root)
    os.fchmod(fd, readable_mode())
    with os.fdopen(fd, "w") as f:
        json.dump(m, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST_NAME)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """The manifest's read-modify-write under a lock of the database root: collectors of two tables (an ops
    campaign and a comm sweep) each hold only their own folder's lock, and one's update was lost to the other's."""
    with (root / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def record(root: Path, rel_paths: list[str], gpu: str) -> None:
    """Add or refresh entries (the caller holds the folder lock); entries of deleted files are dropped."""
    p = root / MANIFEST_NAME
    with _locked(root):
        m: dict[str, Any] = load(root) if p.is_file() else {"format": MANIFEST_FORMAT, "gpu": gpu, "files": {}}
        if m.get("gpu") != gpu:  # another GPU's rows would be recorded as this database's own
            raise ManifestError(f"{p} describes GPU {m.get('gpu')!r}; files measured on {gpu!r} are not recorded "
                                "in it")
        for rel in rel_paths:
            f = root / rel
            if f.is_file():
                m["files"][rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
            else:
                m["files"].pop(rel, None)
        _write(root, m)


def adopt(root: Path, gpu: str) -> int:
    """Record every tracked file as it is now (for a database that predates manifests)."""
    m: dict[str, Any] = {"format": MANIFEST_FORMAT, "gpu": gpu, "files": {}}
    with _locked(root):
        for rel in tracked_files(root):
            f = root / rel
            m["files"][rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
        _write(root, m)
    return len(m["files"])


def verify(root: Path, gpu: str) -> int:
    """Every tracked file is in the manifest with its size and checksum, and nothing listed is missing."""
    return verify_stamped(root, gpu, {})[0]


def verify_stamped(root: Path, gpu: str, before: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """verify, skipping the hash of a file whose (size, mtime, ctime, inode) equal its stamp in `before`
    (what an earlier passed check returned) - the test git and make use for "unchanged"; returns the file
    count and the stamps of this check (a database of thousands of files verifies in milliseconds)."""
    m = load(root)
    if m.get("gpu") != gpu:
        raise ManifestError(f"{root / MANIFEST_NAME} describes GPU {m.get('gpu')!r}, not {gpu!r}")
    files: dict[str, Any] = m["files"]
    present = tracked_files(root)
    after: dict[str, Any] = {}
    base = str(root)
    for rel in present:
        e = files.get(rel)
        if e is None:
            raise ManifestError(f"{root / rel}: not in the manifest (a foreign or unrecorded file)")
        st = os.stat(os.path.join(base, rel))  # (a string path: a Path per file cost more than the stat)
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, e.get("sha256")]
        if before.get(rel) != stamp or st.st_size != e.get("bytes"):
            if st.st_size != e.get("bytes") or sha256_file(root / rel) != e.get("sha256"):
                raise ManifestError(f"{root / rel}: checksum mismatch (the file changed since it was recorded)")
        after[rel] = stamp
    missing = sorted(set(files) - set(present))
    if missing:
        raise ManifestError(f"{root / missing[0]}: listed in the manifest but missing")
    return len(present), after


def verify_remote(files: dict[str, bytes], manifest: dict[str, Any], where: str) -> None:
    """The same checks for a database in object storage, on the fetched bytes."""
    listed: dict[str, Any] = manifest["files"]
    for rel, data in files.items():
        e = listed.get(rel)
        if e is None:
            raise ManifestError(f"{where}/{rel}: not in the manifest (a foreign or unrecorded file)")
        if len(data) != e.get("bytes") or sha256_bytes(data) != e.get("sha256"):
            raise ManifestError(f"{where}/{rel}: checksum mismatch (the file changed since it was recorded)")
    missing = sorted(set(listed) - set(files))
    if missing:
        raise ManifestError(f"{where}/{missing[0]}: listed in the manifest but missing")
