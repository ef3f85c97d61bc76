"""A synthetic database of N software stacks for `make bench` (issue: planner speed with 100 versions): the
shipped H200 database's operator files copied once per stack, each copy's torch version set to
2.<i>.0+synthetic and its latencies scaled by 1 + i/100 (so that a blend of stacks would show), with the
shipped communication, overlap and framework tables and a manifest.
Usage: `.venv/bin/python tools/versions_db.py OUT [N]` (writes OUT/h200)."""

import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tp_query.schema import manifest
from tp_query.schema.tables import METADATA_KEY

ROOT = Path(__file__).resolve().parent.parent


def main(out: Path, n: int) -> None:
    src = ROOT / "data" / "h200"
    dst = out / "h200"
    if dst.exists():
        shutil.rmtree(dst)
    (dst / "ops").mkdir(parents=True)
    for d in ("comm", "overlap", "framework"):
        shutil.copytree(src / d, dst / d)
    shutil.copy(src / "calibration.json", dst / "calibration.json")
    tables = [(p.stem, pq.read_table(p)) for p in sorted((src / "ops").glob("*.parquet"))]
    for i in range(n):
        version = f"2.{i}.0+synthetic"
        for stem, t in tables:
            scale = 1.0 + i / 100
            cols = {"torch": pa.array([version] * t.num_rows, pa.string()),
                    "latency_us": pc.multiply(t["latency_us"], scale),
                    "latency_warm_us": pc.multiply(t["latency_warm_us"], scale)}
            for name, col in cols.items():
                t = t.set_column(t.schema.get_field_index(name), name, col)
            md = dict(t.schema.metadata or {})
            prov = json.loads(md[METADATA_KEY])
            prov["torch"] = version
            md[METADATA_KEY] = json.dumps(prov, sort_keys=True).encode()
            pq.write_table(t.replace_schema_metadata(md), dst / "ops" / f"{stem}-v{i:03d}.parquet",
                           compression="zstd", compression_level=1)
    print(f"{out}/h200: {manifest.adopt(dst, 'h200')} files, {n} stacks")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 100)
