"""Every query of docs/sql-cookbook.md runs against the shipped H200 database and returns rows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tp_query.engine.db import Database

ROOT = Path(__file__).resolve().parent.parent
QUERIES = re.findall(r"```sql\n(.*?)```", (ROOT / "docs" / "sql-cookbook.md").read_text(), re.S)


@pytest.fixture(scope="module")
def db() -> Database:
    if not (ROOT / "data" / "h200" / "ops").is_dir():
        pytest.skip("no shipped H200 database")
    return Database("h200")


@pytest.fixture(scope="module")
def ops_json() -> Path:
    p = Path("/tmp/ops.json")
    r = subprocess.run([sys.executable, "-m", "tp_query.engine.cli", "ops", "examples/llama3.1-8b.json", "--tp", "4",
                        "--top", "0", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    p.write_text(r.stdout)
    return p


def test_cookbook_has_queries() -> None:
    assert len(QUERIES) >= 8


@pytest.mark.parametrize("query", QUERIES, ids=[f"q{i}" for i in range(len(QUERIES))])
def test_query_runs(db: Database, ops_json: Path, query: str) -> None:
    t = db.sql(query)
    assert t.num_columns >= 1, query
    if "NOT IN" in query or "IS NULL" in query:
        # holes may legitimately be empty: the count must agree with the same query counted by DuckDB
        n = db.sql(f"SELECT count(*) AS n FROM ({query.strip().rstrip(';')})").to_pylist()[0]["n"]
        assert n == t.num_rows, query
    else:
        assert t.num_rows > 0, query
