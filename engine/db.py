"""The DuckDB edge: the profile database as SQL views over Parquet files, read in place.

`data/<gpu>/ops/*.parquet` becomes the view `ops` (every row) and `ops_ok` (first measurements that
succeeded); `comm`, `validation` and `oplog` likewise when present. The same views serve the engine's
lookups and users' ad-hoc SQL (`tp-query sql`). Only this module imports duckdb.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from tp_query.schema.gpus import GPUS
from tp_query.schema.tables import METADATA_KEY


class DatabaseError(RuntimeError):
    """Missing or unusable profile data (one line for the user)."""


def default_root() -> Path:
    """data/ of the checkout (or the installed package's shipped data)."""
    here = Path(__file__).resolve().parent.parent
    return here / "data"


def available_gpus(root: Path) -> list[str]:
    if str(root).startswith(("s3://", "http://", "https://")):
        return sorted(GPUS)
    return sorted(p.name for p in root.iterdir() if (p / "ops").is_dir()) if root.is_dir() else []


@dataclass(frozen=True)
class DbInfo:
    gpu: str
    files: int
    rows: int
    ok_rows: int
    provenance: dict[str, Any]
    by_kind: list[tuple[str, str, str, int]]


def _check_files(files: list[str]) -> None:
    for f in files:
        try:
            pq.read_metadata(f)
        except Exception as e:
            raise DatabaseError(f"corrupt Parquet file {f}: {str(e).splitlines()[0]}") from None


def _arrow(con: duckdb.DuckDBPyConnection, query: str, params: Sequence[Any] | None = None) -> pa.Table:
    """A query's result as an Arrow table, fully materialised (DuckDB 1.x and 2.x spellings)."""
    rel = con.sql(query, params=list(params) if params else None)
    if rel is None:
        return pa.table({})
    if hasattr(rel, "to_arrow_table"):
        return rel.to_arrow_table()
    return rel.arrow()


class Database:
    """Views over one GPU's profile data (a local folder or an s3:// / https:// prefix)."""

    def __init__(self, gpu: str, root: Path | str | None = None, validate: bool = True) -> None:
        self.gpu = gpu
        self.root = str(root) if root is not None else str(default_root())
        self.con = duckdb.connect(":memory:")
        remote = self.root.startswith(("s3://", "http://", "https://"))
        if remote:
            self._setup_remote()
            base = f"{self.root.rstrip('/')}/{gpu}"
            self.ops_glob = f"{base}/ops/*.parquet"
            self.files = [self.ops_glob]
        else:
            base_p = Path(self.root) / gpu
            if not (base_p / "ops").is_dir():
                have = available_gpus(Path(self.root))
                raise DatabaseError(f"no profile database for GPU {gpu!r} under {self.root} "
                                    f"(available: {', '.join(have) or 'none'})")
            self.files = sorted(glob.glob(str(base_p / "ops" / "*.parquet")))
            if not self.files:
                raise DatabaseError(f"the database for {gpu!r} has no Parquet files under {base_p / 'ops'}")
            if validate:
                _check_files(self.files)
            self.ops_glob = str(base_p / "ops" / "*.parquet")
            base = str(base_p)
        self._create_views(base, remote)

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
                    raise DatabaseError(f"cannot load DuckDB's httpfs for {self.root}: {str(e).splitlines()[0]} "
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

    def _create_views(self, base: str, remote: bool) -> None:
        try:
            self.con.execute(f"CREATE VIEW ops AS SELECT * FROM read_parquet('{self.ops_glob}', union_by_name=true)")
            self.con.execute("CREATE VIEW ops_ok AS SELECT * FROM ops WHERE status = 'ok' AND run = 1")
            self.con.execute("""CREATE VIEW op_summary AS
                SELECT family, kind, op, precision, count(*) AS points, median(latency_us) AS median_us,
                       min(latency_us) AS min_us, max(latency_us) AS max_us
                FROM ops_ok GROUP BY ALL""")
            self.con.execute("""CREATE VIEW repeatability AS
                SELECT a.key, a.kind, a.precision, a.latency_us AS first_us, b.latency_us AS second_us,
                       abs(b.latency_us / a.latency_us - 1) AS rel_diff, a.p80_us / a.p20_us AS spread
                FROM ops_ok a JOIN ops b ON a.key = b.key AND b.run = 2 AND b.status = 'ok'""")
        except duckdb.Error as e:
            raise DatabaseError(f"cannot read the profile database at {base}: {str(e).splitlines()[0]}") from None
        optional = {"comm": f"{base}/comm/*.parquet",
                    "overlap": f"{base}/overlap/*.parquet",
                    "framework": f"{base}/framework/*.parquet",
                    "validation": f"{base}/../validation/validation-*.parquet",
                    "oplog": f"{base}/../validation/oplog-*.parquet"}
        for name, pattern in optional.items():
            if not remote and not glob.glob(pattern):
                continue
            try:
                self.con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{pattern}', union_by_name=true)")
            except duckdb.Error:
                continue

    # -- queries ------------------------------------------------------------------------------
    def sql(self, query: str, params: Sequence[Any] | None = None) -> pa.Table:
        try:
            return _arrow(self.con, query, params)
        except duckdb.Error as e:
            raise DatabaseError(f"SQL error: {str(e).splitlines()[0]}") from None

    def exact_all(self) -> dict[str, tuple[float, float | None]]:
        """key -> (cold median us, warm median us) of every measured call, in one query."""
        rows = self.con.execute(
            "SELECT key, median(latency_us), median(latency_warm_us) FROM ops_ok GROUP BY key").fetchall()
        return {k: (float(c), float(w) if w is not None else None) for k, c, w in rows}

    def family_rows(self, family: str, columns: list[str]) -> list[dict[str, Any]]:
        """Every measured point of one operator family (one query per family)."""
        cols = ", ".join(columns)
        return _arrow(self.con, f"SELECT {cols} FROM ops_ok WHERE family = ?", [family]).to_pylist()

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
