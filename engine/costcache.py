"""Costed graphs on disk: a graph's operator arrays as one database prices them (a Segment per phase and section:
cold and warm latency, collectives, tensor counts, syncs, sources, FLOPs), kept with the graph's parameters,
memory profile and optimizer step. A planner's later processes (and a user's next prediction) read these instead
of instantiating the graph, describing each call and looking it up: the same arrays, so the same answers.

An entry is named by everything its arrays depend on: the database's fingerprint (every file's hash), the GPU's
system spec, the software stack whose rows answer, the bytes of the code that describes, composes and prices
calls, and the graph's own identity (the request's model and trace fields, the trace cache key with its torch and
project versions, and the bytes of the template file that builds it). Anything else is a different file. A file
that does not read back exactly (truncated, foreign, another format) is ignored and written again. Graphs whose
layers differ in kind (their stage sections depend on the stage's mix of kinds) are not kept."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import struct
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .graph import Graph, Phase, Section
from .segments import Segment

if TYPE_CHECKING:
    from .engine import Engine
    from .request import PredictRequest

MAGIC = b"tp-query-costed/2\n"  # /2: a digest of everything after it (a flipped bit is a miss, not an answer)
_DIGEST = 16
_FLOATS = ("cold", "warm", "comm_us", "tensors")
_SMALL = ("is_comm", "phase", "sync", "src")  # small non-negative integers and flags, one byte each
# the modules whose code decides what a costed graph holds (besides the database and the graph itself)
_CODE = ("compose.py", "segments.py", "comm.py", "graph.py", "template.py", "graphcache.py", "costcache.py",
         "lookup.py")
_SCHEMA = ("ops.py", "signature.py", "precision.py", "model_config.py", "gpus.py", "system.py")

Sections = dict[tuple[Phase, Section], Segment]


@functools.cache
def code_digest() -> str:
    here = Path(__file__).resolve().parent
    h = hashlib.blake2b(digest_size=12)
    for f in [here / n for n in _CODE] + [here.parent / "schema" / n for n in _SCHEMA]:
        try:
            h.update(f.read_bytes())
        except OSError:
            h.update(str(f).encode())
    return h.hexdigest()


def cache_root() -> Path:
    return Path(os.environ.get("TP_QUERY_CACHE", Path.home() / ".cache" / "tp-query")) / "costed"


class CostedGraphs:
    """One engine's costed graphs: its database, system spec and stack (None: a database without a fingerprint,
    such as one in object storage, keeps none)."""

    def __init__(self, eng: Engine) -> None:
        fp = eng.db.fingerprint
        self.dir: Path | None = None
        self._pruned = False
        if fp is not None:
            h = hashlib.blake2b(digest_size=12)
            for part in (fp, json.dumps(asdict(eng.system) if eng.system else None, sort_keys=True),
                         str(eng.torch_version), code_digest()):
                h.update(part.encode())
                h.update(b"|")
            self.dir = cache_root() / h.hexdigest()

    def path(self, req: PredictRequest, graph_key: str) -> Path | None:
        """Where a request's costed graph lives (None: not kept, as for graph files and unparseable configs)."""
        if self.dir is None:
            return None
        from .graphcache import graph_identity

        ident = graph_identity(req)
        if ident is None:
            return None
        name = hashlib.blake2b((graph_key + "|" + ident).encode(), digest_size=16).hexdigest()
        return self.dir / f"{name}.bin"

    @staticmethod
    def load(path: Path) -> tuple[Graph, Sections] | None:
        """The graph (its optimizer step as its only operators) and its costed sections; None when the file is
        missing or does not read back exactly."""
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        try:
            return _decode(raw)
        except (ValueError, KeyError, TypeError, IndexError, struct.error, json.JSONDecodeError):
            return None

    def store(self, path: Path, g: Graph, sections: Sections) -> None:
        """Atomically (a temporary of this process, then a rename); an unwritable cache only costs the next process
        the work again. The first store of a process keeps the cache within CAP_BYTES (`prune`)."""
        try:
            body = _encode(g, sections)
            if not self._pruned:
                self._pruned = True
                prune(path.parent.parent, keep=path.parent.name)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                tmp.write_bytes(body)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)  # (a full disk leaves no partial file behind)
        except OSError:
            pass


CAP_BYTES = 1 << 30  # the costed-graph cache's size (an 8B search over every precision keeps about 20 MB)


def prune(root: Path, keep: str, cap_bytes: int = CAP_BYTES) -> list[str]:
    """Keep the costed graphs under `root` within cap_bytes: whole context folders other than `keep` first, least
    recently written first, then the oldest files of `keep` itself; the names removed (a context's name, or
    keep/file)."""
    try:
        entries = [d for d in os.scandir(root) if d.is_dir()]
    except OSError:
        return []
    contexts: list[tuple[float, str, int]] = []
    own: list[tuple[float, str, int]] = []
    total = 0
    for d in entries:
        n, newest = 0, 0.0
        for f in os.scandir(d.path):
            with contextlib.suppress(OSError):
                st = f.stat()
                n += st.st_size
                newest = max(newest, st.st_mtime)
                if d.name == keep:
                    own.append((st.st_mtime, f.name, st.st_size))
        if d.name != keep:
            contexts.append((newest, d.name, n))
        total += n
    removed = []
    for _, name, n in sorted(contexts):
        if total <= cap_bytes:
            break
        for f in os.scandir(root / name):
            with contextlib.suppress(OSError):
                os.unlink(f.path)
        with contextlib.suppress(OSError):
            os.rmdir(root / name)
        total -= n
        removed.append(name)
    for _, name, n in sorted(own):
        if total <= cap_bytes:
            break
        with contextlib.suppress(OSError):
            os.unlink(root / keep / name)
        total -= n
        removed.append(f"{keep}/{name}")
    return removed


def _encode(g: Graph, sections: Sections) -> bytes:
    lite = Graph(g.meta, tuple(o for o in g.ops if o.phase == Phase.OPT), g.params, g.memory)
    blobs: list[bytes] = []
    index = []
    for (ph, sec), seg in sorted(sections.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value)):
        n = len(seg.cold)
        for name in _FLOATS:
            blobs.append(np.ascontiguousarray(getattr(seg, name), dtype="<f8").tobytes())
        for name in _SMALL:
            a = np.asarray(getattr(seg, name))
            if a.size and (a.min() < 0 or a.max() > 255):
                raise ValueError(f"{name} out of one byte")
            blobs.append(a.astype(np.uint8).tobytes())
        if seg.weight is not None:
            blobs.append(np.ascontiguousarray(seg.weight, dtype="<f8").tobytes())
        if seg.ep_comm is not None:
            blobs.append(np.asarray(seg.ep_comm).astype(np.uint8).tobytes())
        if seg.flops is None:
            raise ValueError("a costed section needs its FLOPs")
        index.append([ph.value, sec.value, n, seg.flops, seg.weight is not None, seg.ep_comm is not None])
    body = b"".join(blobs)
    header = json.dumps({"graph": lite.to_json(), "sections": index, "bytes": len(body)},
                        separators=(",", ":")).encode()
    rest = struct.pack("<Q", len(header)) + header + body
    return MAGIC + hashlib.blake2b(rest, digest_size=_DIGEST).digest() + rest


def _decode(raw: bytes) -> tuple[Graph, Sections]:
    if not raw.startswith(MAGIC):
        raise ValueError("not a costed graph")
    at = len(MAGIC) + _DIGEST
    if hashlib.blake2b(memoryview(raw)[at:], digest_size=_DIGEST).digest() != raw[len(MAGIC):at]:
        raise ValueError("a costed graph whose bytes changed after it was written")
    (hlen,) = struct.unpack_from("<Q", raw, at)
    at += 8
    header = json.loads(raw[at:at + hlen])
    at += hlen
    body = memoryview(raw)[at:]
    if len(body) != header["bytes"]:
        raise ValueError("truncated costed graph")
    g = Graph.from_json(header["graph"])
    phases, secs = {p.value: p for p in Phase}, {s.value: s for s in Section}
    out: Sections = {}
    pos = 0

    def take(n: int, dtype: str) -> np.ndarray:
        nonlocal pos
        size = n * np.dtype(dtype).itemsize
        if pos + size > len(body):
            raise ValueError("truncated costed graph")
        a = np.frombuffer(body[pos:pos + size], dtype=dtype)
        pos += size
        return a

    for ph, sec, n, flops, weighted, with_ep in header["sections"]:
        n = int(n)
        cold, warm, comm_us, tensors = (take(n, "<f8").astype(np.float64) for _ in _FLOATS)
        is_comm, phase, sync, src = (take(n, "u1") for _ in _SMALL)
        weight = take(n, "<f8").astype(np.float64) if weighted else None
        ep = take(n, "u1").astype(bool) if with_ep else None
        out[(phases[ph], secs[sec])] = Segment(
            cold, warm, comm_us, is_comm.astype(bool), phase.astype(np.int64), tensors, sync.astype(bool),
            src.astype(np.int64), None, None, weight, ep, flops=float(flops))
    if pos != len(body):
        raise ValueError("costed graph with bytes left over")
    return g, out

