"""Collector targets from the shipped database (figures of the campaign that built it):
points per second, GPU time, database size, repeat-measurement agreement and spread."""

from __future__ import annotations

from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[2]


def main(gpu: str = "h200") -> None:
    ops = ROOT / "data" / gpu / "ops"
    glob = str(ops / "*.parquet")
    con = duckdb.connect()
    con.execute(f"CREATE VIEW ops AS SELECT * FROM read_parquet('{glob}', union_by_name=true)")
    # Chunks are written every ~20 s: a campaign's device time is the sum of each session's span.
    spans = con.execute("""
        WITH t AS (SELECT campaign, run, measured_at,
                          measured_at - lag(measured_at) OVER (ORDER BY measured_at) AS gap FROM ops)
        SELECT count(*), sum(CASE WHEN gap < INTERVAL 60 SECOND THEN epoch(gap) ELSE 0 END) FROM t""").fetchone()
    points, busy_s = spans
    size = sum(p.stat().st_size for p in ops.glob("*.parquet"))
    rep = con.execute("""SELECT count(*), median(abs(b.latency_us / a.latency_us - 1)),
                                quantile_cont(abs(b.latency_us / a.latency_us - 1), 0.9)
                         FROM ops a JOIN ops b ON a.key = b.key AND a.run = 1 AND b.run = 2
                         WHERE a.status = 'ok' AND b.status = 'ok'""").fetchone()
    spread = con.execute("SELECT median(p80_us / p20_us), quantile_cont(p80_us / p20_us, 0.9) FROM ops "
                         "WHERE status = 'ok'").fetchone()
    fails = con.execute("SELECT status, count(*) FROM ops GROUP BY status ORDER BY status").fetchall()
    print(f"points measured                 {points}")
    print(f"campaign device time            {busy_s / 60:.1f} min   (target <= 20 min)")
    print(f"points per second               {points / max(busy_s, 1):.1f}")
    print(f"database size                   {size / 2**20:.1f} MiB (target <= 50 MB)")
    print(f"status counts                   {dict(fails)}")
    print(f"median p80/p20 spread           {spread[0]:.4f} (p90 {spread[1]:.4f})")
    if rep[0]:
        print(f"repeat measurements             {rep[0]} points: median |diff| {100 * rep[1]:.2f}%, "
              f"p90 {100 * rep[2]:.2f}% (target: median within 3%)")


if __name__ == "__main__":
    main()
