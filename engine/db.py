"""The DuckDB edge: the profile database as SQL views over Parquet files, read in place.

`data/<gpu>/ops/*.parquet` becomes the view `ops` (every row) and `ops_ok` (first measurements that
succeeded); `comm`, `validation` and `oplog` likewise when present. The same views serve the engine's
lookups and users' ad-hoc SQL (`tp-query sql`). Only this module imports duckdb.
"""

from __future__ import annotations

import glob
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from tp_query.schema import manifest
from tp_query.schema.gpus import GPUS
from tp_query.schema.messages import first_line
from tp_query.schema.tables import METADATA_KEY, SCHEMA_VERSION, schema_refusal

from .dbcache import DB_ENV, DatabaseError, default_root, is_remote  # noqa: F401 - part of this module's interface

# No single operator call or collective of a training step runs 100 s (the slowest measured: 0.32 s): a latency
# beyond it is a damaged or hand-edited row, which one median would not absorb
MAX_LATENCY_US = 1e8
# the columns that hold a time measured on the GPU (ops, comm and overlap tables): positive and finite; a
# framework's value_us is a fitted host term and may be negative
_MEASURED_TIMES = frozenset({"latency_us", "latency_warm_us", "p20_us", "p80_us", "min_us", "compute_alone_us",
                             "compute_concurrent_us", "comm_alone_us", "comm_concurrent_us"})
USER_SQL_MEMORY_MB = 2048  # what one ad-hoc query may hold (DuckDB's memory_limit)
USER_SQL_TIMEOUT_S = float(os.environ.get("TP_QUERY_SQL_TIMEOUT_S", "60"))  # then the query is interrupted
USER_SQL_RESULT_MB = 256  # the rows one ad-hoc query may hand back (Arrow bytes); more is refused, not printed
_SQL_BATCH_ROWS = 65_536


def available_gpus(root: Path) -> list[str]:
    if is_remote(root):
        return sorted(GPUS)
    return sorted(p.name for p in root.iterdir() if (p / "ops").is_dir()) if root.is_dir() else []


# What one measurement of each non-operator table is (its rows per measurement: one)
NATURAL_KEYS: dict[str, tuple[str, ...]] = {
    "comm": ("collective", "bytes", "ranks", "dtype", "link", "torch", "cuda"),
    "overlap": ("compute", "compute_dtype", "collective", "bytes", "ranks", "torch", "cuda"),
    "framework": ("framework", "kind", "setting", "phase", "quantity", "ranks", "machine", "torch", "cuda"),
}


def missing_database(root: str, gpu: str) -> str:
    """Why a database folder holds no database of this GPU, with the likely fix."""
    if not root.strip():
        return "--db is empty: give the folder that holds one database folder per GPU (such as data)"
    r = Path(root)
    if (r / "ops").is_dir():  # the GPU's own folder given instead of its parent
        return (f"{root} is one GPU's database ({r.name}); --db names the folder above it: --db "
                f"{r.parent} --gpu {r.name}")
    have = available_gpus(r)
    return f"no profile database for GPU {gpu!r} under {root} (available: {', '.join(have) or 'none'})"


@dataclass(frozen=True)
class DbInfo:
    gpu: str
    files: int
    rows: int
    ok_rows: int
    provenance: dict[str, Any]
    by_kind: list[tuple[str, str, str, int]]


def _check_files(files: list[str], gpu: str, table: str) -> None:
    """Each file is readable Parquet written for this GPU by a schema this engine reads, with its table's columns
    (a missing column would be read as null for every row: a status filtered away, a stack unknown)."""
    for f in files:
        try:
            pf = pq.ParquetFile(f)
            md = pf.metadata.metadata or {}
            why = schema_refusal(table, pf.schema_arrow)
        except Exception as e:
            raise DatabaseError(f"corrupt Parquet file {f}: {first_line(e)}") from None
        if why:
            raise DatabaseError(f"{f}: not a {table} file of this schema: {why}")
        if METADATA_KEY not in md:
            raise DatabaseError(f"{f}: no tp-query provenance (a foreign file)")
        try:
            prov = json.loads(md[METADATA_KEY])
        except ValueError:
            raise DatabaseError(f"{f}: unreadable provenance") from None
        if prov.get("gpu") != gpu:
            raise DatabaseError(f"{f}: measured on {prov.get('gpu')!r}, not {gpu!r}")
        if prov.get("schema_version") != SCHEMA_VERSION:
            raise DatabaseError(f"{f}: schema version {prov.get('schema_version')!r}, this engine reads "
                                f"{SCHEMA_VERSION}")



def _arrow(con: duckdb.DuckDBPyConnection, query: str, params: Sequence[Any] | None = None) -> pa.Table:
    """A query's result as an Arrow table, fully materialised (DuckDB 1.x and 2.x spellings)."""
    rel = con.sql(query, params=list(params) if params else None)
    if rel is None:
        return pa.table({})
    if hasattr(rel, "to_arrow_table"):
        return rel.to_arrow_table()
    return rel.arrow()


def version_key(v: Any) -> tuple[int, ...]:
    """A version string's numeric parts, for ordering ("2.10.0+cu130" after "2.9.1")."""
    import re

    return tuple(int(x) for x in re.findall(r"\d+", str(v).split("+")[0])) or (0,)


class Database:
    """Views over one GPU's profile data (a local folder or an s3:// / https:// prefix), verified against
    the database's manifest (checksums) and its files' provenance before anything reads them."""

    def __init__(self, gpu: str, root: Path | str | None = None, validate: bool = True,
                 torch_version: str | None = None) -> None:
        """torch_version: answer from the operator rows measured under that torch (its public version, or
        the full one); by default from the database's primary stack (the one with the most rows). Rows of
        different software stacks are never blended into one median."""
        self.gpu = gpu
        self.torch_request = torch_version
        self.root = str(root) if root is not None else str(default_root())
        self.con = duckdb.connect(":memory:", config={"autoinstall_known_extensions": False})
        self.remote = is_remote(self.root)
        self.tables: dict[str, list[str]] = {}
        self._locked = False
        if self.remote:
            self._setup_remote()
            base = f"{self.root.rstrip('/')}/{gpu}"
            self._open_remote(base, validate)
        else:
            base_p = Path(self.root) / gpu
            if any(ch in str(base_p.resolve()) for ch in "*?[]{}"):
                # DuckDB's read_parquet reads every file name as a pattern: 'db[1]' was checked as itself and read
                # from a sibling 'db1'
                raise DatabaseError(f"the database path {base_p} holds one of * ? [ ] {{ }}, which DuckDB reads as "
                                    "a file pattern: move or link it to a path without them")
            if not (base_p / "ops").is_dir():
                raise DatabaseError(missing_database(self.root, gpu))
            if validate:
                try:
                    manifest.verify(base_p, gpu)
                except manifest.ManifestError as e:
                    raise DatabaseError(str(e)) from None
            for d in manifest.TABLE_DIRS:
                fs = sorted(glob.glob(str(base_p / d / "*.parquet")))
                if fs:
                    self.tables[d] = fs
            if not self.tables.get("ops"):
                raise DatabaseError(f"the database for {gpu!r} has no Parquet files under {base_p / 'ops'}")
            if validate:
                for table, fs in self.tables.items():
                    _check_files(fs, gpu, table)
            base = str(base_p)
        self.files = self.tables["ops"]
        self.base = base
        self._create_views(base)
        if validate:
            self._check_keys()
            self._check_values()
            self._check_rows()

    def _open_remote(self, base: str, validate: bool) -> None:
        """Object storage: the manifest names the files; each is fetched once and verified by checksum."""
        url = f"{base}/{manifest.MANIFEST_NAME}"
        try:
            text = self.con.execute("SELECT content FROM read_text(?)", [url]).fetchone()
            m = json.loads(text[0]) if text else None
            files = m["files"] if isinstance(m, dict) else None
        except (duckdb.Error, ValueError, KeyError, TypeError) as e:
            raise DatabaseError(f"cannot read the manifest {url}: {first_line(e)}") from None
        if not isinstance(files, dict):
            raise DatabaseError(f"{url} is not a manifest")
        rels = sorted(r for r in files if r.split("/", 1)[0] in manifest.TABLE_DIRS)
        if validate:
            blobs = {}
            for rel in [*rels, *(r for r in files if r in manifest.TOP_FILES)]:
                try:
                    row = self.con.execute("SELECT content FROM read_blob(?)", [f"{base}/{rel}"]).fetchone()
                except duckdb.Error as e:
                    raise DatabaseError(f"cannot read {base}/{rel}: {first_line(e)}") from None
                blobs[rel] = bytes(row[0]) if row else b""
            try:
                manifest.verify_remote(blobs, m, base)
            except manifest.ManifestError as e:
                raise DatabaseError(str(e)) from None
        for rel in rels:
            self.tables.setdefault(rel.split("/", 1)[0], []).append(f"{base}/{rel}")
        if not self.tables.get("ops"):
            raise DatabaseError(f"the database at {base} lists no operator files")

    def _setup_remote(self) -> None:
        try:
            self.con.execute("LOAD httpfs;")
        except duckdb.Error:
            try:  # the extension shipped as a Python package (pip install 'tp-query[s3]'), no download needed
                from duckdb_extensions import import_extension

                import_extension("httpfs", con=self.con)
                self.con.execute("LOAD httpfs;")
            except Exception:
                try:
                    self.con.execute("INSTALL httpfs; LOAD httpfs;")
                except duckdb.Error as e:
                    raise DatabaseError(f"cannot load DuckDB's httpfs for {self.root}: {first_line(e)} "
                                        "(pip install 'tp-query[s3]')") from None
        import os

        ep = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("TP_QUERY_S3_ENDPOINT")
        parts = ["TYPE S3"]
        for env, key in (("AWS_ACCESS_KEY_ID", "KEY_ID"), ("AWS_SECRET_ACCESS_KEY", "SECRET"),
                         ("AWS_DEFAULT_REGION", "REGION")):
            if os.environ.get(env):
                parts.append(f"{key} '{os.environ[env]}'")
        if ep:
            host = ep.split("://", 1)[-1].rstrip("/")
            parts.append(f"ENDPOINT '{host}'")
            parts.append("URL_STYLE 'path'")
            parts.append(f"USE_SSL {'true' if ep.startswith('https') else 'false'}")
        self.con.execute(f"CREATE OR REPLACE SECRET tpq_s3 ({', '.join(parts)})")

    def _create_views(self, base: str) -> None:
        """Views over the verified files; paths travel as values, never inside SQL text."""
        try:
            for name, files in self.tables.items():
                self.con.read_parquet(files, union_by_name=True).create_view(name, replace=True)
            self.stack = self._choose_stack()
            ok = self.con.table("ops").filter("status = 'ok' AND run = 1")
            # a factory (a call with no tensor argument) measured before collector 0.2.0 ran on the host: its
            # row timed an idle GPU and is never read
            ok = ok.filter("NOT (coalesce(collector_version, '0.1.0') = '0.1.0' AND signature NOT LIKE '%\"T\":%')")
            for col in ("torch", "cuda", "cudnn"):  # values as expressions, never inside SQL text
                ok = ok.filter(duckdb.ColumnExpression(col) == duckdb.ConstantExpression(self.stack[col]))
            ok.create_view("ops_ok", replace=True)
            self.con.execute("""CREATE VIEW op_summary AS
                SELECT family, kind, op, precision, count(*) AS points, median(latency_us) AS median_us,
                       min(latency_us) AS min_us, max(latency_us) AS max_us
                FROM ops_ok GROUP BY ALL""")
            self.con.execute("""CREATE VIEW repeatability AS
                SELECT a.key, a.kind, a.precision, a.latency_us AS first_us, b.latency_us AS second_us,
                       abs(b.latency_us / a.latency_us - 1) AS rel_diff, a.p80_us / a.p20_us AS spread
                FROM ops_ok a JOIN ops b ON a.key = b.key AND b.run = 2 AND b.status = 'ok'""")
        except duckdb.Error as e:
            raise DatabaseError(f"cannot read the profile database at {base}: {first_line(e)}") from None
        if not self.remote:  # measured iterations beside the database (report, SQL)
            val = Path(base).parent / "validation"
            for name, pattern in (("validation", "validation-*.parquet"), ("oplog", "oplog-*.parquet")):
                fs = sorted(glob.glob(str(val / pattern)))
                if fs:
                    try:
                        self.con.read_parquet(fs, union_by_name=True).create_view(name, replace=True)
                    except duckdb.Error:
                        continue

    def software_versions(self) -> list[dict[str, Any]]:
        """The software stacks the operator rows were measured under (torch, CUDA, cuDNN), most rows first
        and then newest first; `used` marks the one this database answers from."""
        rows = _arrow(self.con, "SELECT torch, cuda, cudnn, count(*) AS rows FROM ops GROUP BY ALL").to_pylist()
        rows.sort(key=lambda r: (-r["rows"], *(tuple(-x for x in version_key(r[c]))
                                               for c in ("torch", "cuda", "cudnn"))))
        chosen = getattr(self, "stack", None)
        for r in rows:
            r["used"] = chosen is not None and all(r[c] == chosen[c] for c in ("torch", "cuda", "cudnn"))
        return rows

    def _choose_stack(self) -> dict[str, Any]:
        """The requested torch's stack (its newest CUDA/cuDNN when several), else the primary one."""
        stacks = self.software_versions()
        if not stacks:
            raise DatabaseError(f"the database at {self.base} has no operator rows")
        want = self.torch_request
        if want is None:
            return stacks[0]
        match = [s for s in stacks if str(s["torch"]) == want or str(s["torch"]).split("+")[0] == want]
        if not match:
            have = ", ".join(sorted({str(s["torch"]) for s in stacks}))
            raise DatabaseError(f"no operator measurements under torch {want} in {self.base} (measured: {have})")
        return match[0]  # the most rows, then the newest CUDA and cuDNN

    def _check_keys(self) -> None:
        """One row per measurement: per (key, run) within a software stack for the operators, per natural key for
        the other tables. A duplicate means a file was copied in or a campaign misbehaved; its rows would be
        blended into one median."""
        row = self.con.execute("SELECT key, run, torch, count(*) FROM ops GROUP BY key, run, torch, cuda, cudnn "
                               "HAVING count(*) > 1 LIMIT 1").fetchone()
        if row:
            raise DatabaseError(f"duplicate measurements of one operator call (key {row[0]}, run {row[1]}, "
                                f"torch {row[2]}, {row[3]} rows) in {self.base}/ops")
        for table, cols in NATURAL_KEYS.items():
            if table not in self.tables:
                continue
            have = {c.lower() for c in self.con.table(table).columns}
            key = ", ".join(f'"{c}"' for c in cols if c in have)
            try:
                row = self.con.execute(f"SELECT {key}, count(*) FROM {table} WHERE status = 'ok' GROUP BY ALL "
                                       "HAVING count(*) > 1 LIMIT 1").fetchone()
            except duckdb.Error as e:
                raise DatabaseError(f"the {table} table of {self.base} cannot be read (a damaged file): "
                                    f"{first_line(e)}") from None
            if row:
                raise DatabaseError(f"{self.base}/{table}: {row[-1]} rows of one measurement "
                                    f"({', '.join(map(str, row[:-1]))[:160]}): a file copied in, or a campaign run "
                                    "twice")
        if "comm" in self.tables:
            links = [r[0] for r in self.con.execute("SELECT DISTINCT link FROM comm ORDER BY 1").fetchall()]
            if len(links) > 1:  # one node's link per database: another link's tables would be blended in
                raise DatabaseError(f"{self.base}/comm: collectives measured over {' and '.join(map(str, links))} "
                                    "(one link per database: a file of another machine copied in?)")

    def _check_values(self) -> None:
        """Every measured number finite, every measured time positive and below MAX_LATENCY_US, every count and
        size not negative, and a collective's message and group real (bytes > 0, ranks >= 2): a zero, negative,
        huge or NaN value is a damaged or hand-edited file, never averaged into a median (a NaN host cost or overlap
        time would never end a timeline; a negative message size priced gradient traffic at nothing). One scan per
        table tests every column; the first column found bad is read again for its value."""
        for table in self.tables:
            rel = self.con.table(table)
            ok = "status = 'ok' AND " if "status" in {c.lower() for c in rel.columns} else ""
            collective = table in ("comm", "overlap")
            checks: list[tuple[str, str, str]] = []  # (column, its bad rows' condition, the rule it breaks)
            for col, typ in zip(rel.columns, rel.types, strict=True):
                name = col.lower()
                integer = str(typ) in ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT",
                                       "USMALLINT", "UINTEGER", "UBIGINT")
                if str(typ) not in ("DOUBLE", "FLOAT") and not integer:
                    continue
                if integer:  # shape keys, counts, clocks, sizes: never below zero; a collective's message and group
                    low = (1 if name == "bytes" else 2 if name == "ranks" else 0) if collective else 0
                    bad, rule = f'"{col}" < {low}', f"{col} is at least {low}"
                elif name in _MEASURED_TIMES:  # each a time measured on the GPU (the ratios' denominators too)
                    bad = f'NOT (isfinite("{col}") AND "{col}" > 0 AND "{col}" < {MAX_LATENCY_US:.0f})'
                    rule = f"every measured time is a positive finite number below {MAX_LATENCY_US:.0e} us"
                elif name in ("flops", "bytes", "bus_bw_gbps"):  # a count or rate: the roofline divides by it
                    bad, rule = f'NOT (isfinite("{col}") AND "{col}" >= 0)', "counts and rates are finite, not negative"
                else:
                    bad, rule = f'NOT isfinite("{col}")', "every measured number is finite"
                # a successful row's latency must be there (the warm one may be: a cold-only measurement)
                where = f'({bad} OR "{col}" IS NULL)' if ok and name == "latency_us" else f'("{col}" IS NOT NULL AND {bad})'
                checks.append((col, where, rule))
            if not checks:
                continue
            flags = self.con.execute(f"SELECT {', '.join(f'coalesce(bool_or({w}), false)' for _, w, _ in checks)} "
                                     f"FROM {table}" + (f" WHERE {ok[:-5]}" if ok else "")).fetchone()
            for (col, where, rule), flagged in zip(checks, flags or (), strict=True):
                if flagged:
                    row = self.con.execute(f'SELECT "{col}" FROM {table} WHERE {ok}{where} LIMIT 1').fetchone()
                    raise DatabaseError(f"{self.base}/{table}: a measured {col} of {row[0] if row else None!r} (a "
                                        f"damaged or edited file: {rule})")

    def _check_rows(self) -> None:
        """Each row's own provenance as its file's: this GPU and schema (a file's metadata can say h200 over rows
        measured elsewhere), and one software stack per communication, overlap and framework table (rows of two
        torch versions would be blended into one median)."""
        for table in self.tables:
            cols = {c.lower() for c in self.con.table(table).columns}
            if "gpu" in cols:
                row = self.con.execute(f"SELECT gpu FROM {table} WHERE gpu IS DISTINCT FROM ? LIMIT 1",
                                       [self.gpu]).fetchone()
                if row:
                    raise DatabaseError(f"{self.base}/{table}: rows measured on {row[0]!r}, not {self.gpu!r} (a foreign "
                                        "file)")
            if "schema_version" in cols:
                row = self.con.execute(f"SELECT schema_version FROM {table} WHERE schema_version IS DISTINCT FROM ? "
                                       "LIMIT 1", [SCHEMA_VERSION]).fetchone()
                if row:
                    raise DatabaseError(f"{self.base}/{table}: rows of schema version {row[0]!r}, this engine reads "
                                        f"{SCHEMA_VERSION}")
            if table != "ops" and "torch" in cols:
                stacks = [r[0] for r in self.con.execute(f"SELECT DISTINCT torch FROM {table} ORDER BY 1").fetchall()]
                if len(stacks) > 1:
                    raise DatabaseError(f"{self.base}/{table}: rows measured under torch {' and '.join(map(str, stacks))} "
                                        "(one software stack per table: a file copied in from another database?)")

    # -- queries ------------------------------------------------------------------------------
    def user_sql(self, query: str) -> pa.Table:
        """A user's ad-hoc query: exactly one SELECT (or WITH ... SELECT) statement, on a connection that can
        read only this database's folders, load no extension and change no setting."""
        return self.user_sql_rows(query)[0]

    def user_sql_rows(self, query: str, keep_rows: int | None = None) -> tuple[pa.Table, int]:
        """A user's ad-hoc query (as `user_sql`), streamed: its first `keep_rows` rows (every row when None) and
        how many it returned. The rows kept are bounded by USER_SQL_RESULT_MB, the query by DuckDB's memory limit
        and USER_SQL_TIMEOUT_S; past a bound it is refused with the reason."""
        try:
            query.encode("utf-8")
        except UnicodeEncodeError:
            raise DatabaseError("SQL error: the query is not valid UTF-8 text") from None
        if self.remote:
            # reading s3:// or http(s):// needs DuckDB's external access, which would let a query read any file
            # or address too: ad-hoc SQL runs on a local copy only
            raise DatabaseError(f"ad-hoc SQL runs on a local database folder, not {self.root} (reading a remote one "
                                "leaves DuckDB's external access on); copy it locally and pass --db FOLDER")
        # parsed on the locked connection: DuckDB's default one may install and load extensions or read files
        # while it parses (PRAGMA create_fts_index, IMPORT DATABASE)
        self.lock_down()
        try:
            stmts = self.con.extract_statements(query)
        except duckdb.Error as e:
            raise DatabaseError(f"SQL error: {first_line(e)}") from None
        if len(stmts) != 1 or stmts[0].type != duckdb.StatementType.SELECT:
            # named by the statement's own first word (DuckDB files INSTALL under LOAD)
            kinds = ", ".join((s.query.split(None, 1) or [str(s.type).split(".")[-1]])[0].upper()[:20]
                              for s in stmts) or "nothing"
            raise DatabaseError(f"only one SELECT (or WITH ... SELECT) statement is allowed, got {kinds}")
        # a query that runs past its time is interrupted (DuckDB has no statement timeout of its own)
        timer = threading.Timer(USER_SQL_TIMEOUT_S, self.con.interrupt)
        timer.daemon = True
        timer.start()
        try:
            table, rows = _streamed(self.con, query, keep_rows)
            return _unique_names(table), rows
        except DatabaseError as e:
            if not timer.is_alive() and "interrupt" in str(e).lower():
                raise DatabaseError(f"the query ran past {USER_SQL_TIMEOUT_S:g} s and was stopped") from None
            raise
        finally:
            timer.cancel()
            timer.join()  # gone before the connection can be closed (DuckDB aborts on a live waiter at exit)

    def lock_down(self) -> None:
        """DuckDB's 'Securing DuckDB': no file access outside the database, no extensions, settings locked."""
        if self._locked:
            return
        try:
            if not self.remote:
                base = Path(self.base).resolve()
                roots = [f"{base}/", f"{(base.parent / 'validation').resolve()}/"]
                self.con.execute("SET allowed_directories = ?", [roots])
                self.con.execute("SET enable_external_access = false")
            self.con.execute("SET autoload_known_extensions = false")
            # a query's memory bounded (and nothing spilled to disk), set before the configuration is locked
            self.con.execute("SET memory_limit = ?", [f"{USER_SQL_MEMORY_MB}MB"])
            self.con.execute("SET max_temp_directory_size = '0B'")
            self.con.execute("SET lock_configuration = true")
        except duckdb.Error as e:
            raise DatabaseError(f"cannot lock the SQL connection down: {first_line(e)}") from None
        self._locked = True

    def sql(self, query: str, params: Sequence[Any] | None = None) -> pa.Table:

        try:
            return _arrow(self.con, query, params)
        except duckdb.Error as e:
            raise DatabaseError(f"SQL error: {first_line(e)}") from None

    def exact_all(self) -> dict[str, tuple[float, float | None]]:
        """key -> (cold median us, warm median us) of every measured call, in one query."""
        rows = self.con.execute(
            "SELECT key, median(latency_us), median(latency_warm_us) FROM ops_ok GROUP BY key").fetchall()
        return {k: (float(c), float(w) if w is not None else None) for k, c, w in rows}

    def family_rows(self, family: str, columns: list[str]) -> list[dict[str, Any]]:
        """Every measured point of one operator family (one query per family)."""
        cols = ", ".join(columns)
        return _arrow(self.con, f"SELECT {cols} FROM ops_ok WHERE family = ?", [family]).to_pylist()

    def has_campaign(self, name: str) -> bool:
        """Whether any point was measured by the named campaign (CALIBRATION_CAMPAIGN: the calibration cases' own
        calls; another GPU's database may hold gap-filling campaigns without it, and then no case of its runs is a
        calibration shape)."""
        row = self.con.execute("SELECT count(*) FROM ops_ok WHERE campaign = ?", [name]).fetchone()
        return bool(row and row[0])

    def info(self) -> DbInfo:
        n, ok = self.con.execute("SELECT count(*), count(*) FILTER (WHERE status = 'ok') FROM ops").fetchone() or (0, 0)
        by = self.con.execute(
            "SELECT family, kind, precision, count(*) FROM ops WHERE run = 1 GROUP BY ALL ORDER BY ALL").fetchall()
        prov: dict[str, Any] = {}
        if self.files and not self.files[0].startswith(("s3://", "http")):
            md = pq.read_metadata(self.files[0]).metadata or {}
            if METADATA_KEY in md:
                prov = json.loads(md[METADATA_KEY])
        return DbInfo(self.gpu, len(self.files), int(n), int(ok), prov, [tuple(r) for r in by])  # type: ignore[misc]

    def close(self) -> None:
        self.con.close()


def _streamed(con: duckdb.DuckDBPyConnection, query: str, keep_rows: int | None) -> tuple[pa.Table, int]:
    """A query's first rows as Arrow, read batch by batch (the rest counted, not held), and its row count."""
    cap = USER_SQL_RESULT_MB << 20
    kept: list[pa.RecordBatch] = []
    held = rows = 0
    try:
        res = con.execute(query)
        reader = res.to_arrow_reader(_SQL_BATCH_ROWS) if hasattr(res, "to_arrow_reader") else \
            res.fetch_record_batch(_SQL_BATCH_ROWS)
        schema = reader.schema
        for batch in reader:
            want = batch.num_rows if keep_rows is None else min(batch.num_rows, max(0, keep_rows - rows))
            rows += batch.num_rows
            if want:
                part = batch.slice(0, want)
                held += part.nbytes
                if held > cap:
                    raise DatabaseError(f"the result holds over {USER_SQL_RESULT_MB} MB ({rows} rows read): add a "
                                        "LIMIT, select fewer columns, or aggregate")
                kept.append(part)
    except (duckdb.Error, pa.ArrowException, OSError) as e:  # DuckDB's error, also as Arrow's stream raises it
        raise DatabaseError(f"SQL error: {first_line(e)}") from None
    return pa.Table.from_batches(kept, schema=schema), rows


def _unique_names(t: pa.Table) -> pa.Table:
    """A result's columns under names of their own: a self-join's two latency_us columns would otherwise be one
    key of a row's dict, and the table or JSON would show one value twice (the second becomes latency_us_2)."""
    names = t.column_names
    if len(set(names)) == len(names):
        return t
    taken = set(names)
    out: list[str] = []
    for n in names:
        if n in out:  # a later column of a name: the first free name_2, name_3, ...
            k = 2
            while f"{n}_{k}" in taken:
                k += 1
            n = f"{n}_{k}"
            taken.add(n)
        out.append(n)
    return t.rename_columns(out)
