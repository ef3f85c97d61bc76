"""Re-derive the description columns of stored operator rows (kind, family, features, FLOPs, bytes) from their
signatures with the current registry, leaving every measurement as it is: after a change to how the registry
*describes* a call (a new category such as the `/ua` pattern), not to how the collector replays it (that needs
the rows measured again: `collect --remeasure-ops`). Files are rewritten atomically and the manifest updated;
rows that already agree are untouched, so a rerun changes nothing. tests/test_factories.py checks that every
shipped row agrees.
    .venv/bin/python tools/rederive_features.py [GPU]            (default h200; --dry-run to count only)"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tp_query.collector.store import _atomic_write
from tp_query.schema import manifest
from tp_query.schema.ops import FEATURE_COLUMNS, Operands, describe, with_operands
from tp_query.schema.signature import OpCall

ROOT = Path(__file__).resolve().parent.parent


def derived(row: dict) -> dict:
    info = describe(OpCall.from_json_str(row["op"], row["signature"]), row["math_mode"] == "tf32")
    if str(row["key"]).endswith("|" + Operands.NAN.value):
        info = with_operands(row["key"], info, Operands.NAN)[1]
    out = {"kind": info.kind, "family": str(info.family), "flops": info.flops, "bytes": info.bytes}
    for c in FEATURE_COLUMNS:
        v = info.features.get(c)
        if v is not None or row.get(c) is not None:
            # a stored NULL that the registry derives as its default (attention's `masked`) stays NULL
            if not (v is False and row.get(c) is None and c == "masked"):
                out[c] = v
    return out


def same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
    return a == b


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dry = "--dry-run" in sys.argv
    gpu = args[0] if args else "h200"
    root = ROOT / "data" / gpu
    changed_files, changed_rows = [], 0
    for f in sorted((root / "ops").glob("*.parquet")):
        t = pq.read_table(f)
        rows = t.to_pylist()
        n = 0
        for r in rows:
            new = derived(r)
            diff = {k: v for k, v in new.items() if not same(r.get(k), v)}
            if diff:
                r.update(diff)
                n += 1
        if not n:
            continue
        changed_rows += n
        changed_files.append(f)
        print(f"{f.name}: {n} rows re-derived")
        if not dry:
            table = pa.Table.from_pylist(rows, schema=t.schema).replace_schema_metadata(t.schema.metadata)
            _atomic_write(f, table)
    if changed_files and not dry:
        manifest.record(root, [f"ops/{f.name}" for f in changed_files], gpu)
    print(f"{changed_rows} rows in {len(changed_files)} files{' (dry run)' if dry else ''}")


if __name__ == "__main__":
    main()
