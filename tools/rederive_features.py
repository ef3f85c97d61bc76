"""Re-derive the description columns of stored operator rows (kind, family, features, FLOPs, bytes) from their
signatures with the current registry, leaving every measurement as it is: after a change to how the registry
*describes* a call (a new category such as the `/ua` pattern), not to how the collector replays it (that needs
the rows measured again: `collect --remeasure-ops`). Files are rewritten atomically and the manifest updated;
rows that already agree are untouched, so a rerun changes nothing. tests/test_op_features.py checks that every
shipped row agrees.
    .venv/bin/python tools/rederive_features.py [GPU]            (default h200; --dry-run to count only)"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tp_query.collector.store import _atomic_write
from tp_query.schema import manifest
from tp_query.schema.ops import description_mismatches

ROOT = Path(__file__).resolve().parent.parent


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
            diff = description_mismatches(r)
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
