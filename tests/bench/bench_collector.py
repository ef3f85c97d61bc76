"""Collector targets from the shipped database (figures of the campaign that built it):
points per second, GPU time, database size, repeat-measurement agreement and spread."""

from __future__ import annotations

from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[2]


def main(gpu: str = "h200") -> int:
    """Prints each figure with its verdict; 1 when a target is missed."""
    ops = ROOT / "data" / gpu / "ops"
    glob = str(ops / "*.parquet")
    con = duckdb.connect()
    con.execute(f"CREATE VIEW ops AS SELECT * FROM read_parquet('{glob}', union_by_name=true)")
    # Chunks are written every ~20 s: a campaign's device time is the sum of its sessions' spans (gaps under a
    # minute), per campaign: `make collect` is the grid campaign; the others are later campaigns of their own
    per = con.execute("""
        WITH t AS (SELECT campaign, measured_at,
                          measured_at - lag(measured_at) OVER (PARTITION BY campaign ORDER BY measured_at) AS gap
                   FROM ops)
        SELECT campaign, count(*), sum(CASE WHEN gap < INTERVAL 60 SECOND THEN epoch(gap) ELSE 0 END)
        FROM t GROUP BY campaign ORDER BY 2 DESC""").fetchall()
    size = sum(p.stat().st_size for p in ops.glob("*.parquet"))
    rep = con.execute("""SELECT count(*), median(abs(b.latency_us / a.latency_us - 1)),
                                quantile_cont(abs(b.latency_us / a.latency_us - 1), 0.9)
                         FROM ops a JOIN ops b ON a.key = b.key AND a.run = 1 AND b.run = 2
                         WHERE a.status = 'ok' AND b.status = 'ok'""").fetchone()
    spread = con.execute("SELECT median(p80_us / p20_us), quantile_cont(p80_us / p20_us, 0.9) FROM ops "
                         "WHERE status = 'ok'").fetchone()
    fails = con.execute("SELECT status, count(*) FROM ops GROUP BY status ORDER BY status").fetchall()
    missed = 0

    def verdict(ok: bool) -> str:
        nonlocal missed
        missed += not ok
        return "ok" if ok else "MISSED"

    grid = next(((n, s) for c, n, s in per if c == "grid"), (0, 0.0))
    points, busy_s = sum(n for _, n, _ in per), sum(s for _, _, s in per)
    print(f"points measured                 {points} in {len(per)} campaigns, {busy_s / 60:.1f} min of device time")
    print(f"grid campaign (make collect)    {grid[0]} points in {grid[1] / 60:.1f} min (target <= 20 min)   "
          f"{verdict(0 < grid[1] <= 20 * 60)}")
    print(f"  points per second             {grid[0] / max(grid[1], 1):.1f}")
    for c, n, s in per:
        if c != "grid":
            print(f"  campaign {c:22} {n} points in {s / 60:.1f} min")
    print(f"database size                   {size / 2**20:.1f} MiB (target <= 50 MB)   {verdict(size <= 50e6)}")
    print(f"status counts                   {dict(fails)}")
    print(f"median p80/p20 spread           {spread[0]:.4f} (p90 {spread[1]:.4f})")
    if rep[0]:
        print(f"repeat measurements             {rep[0]} points: median |diff| {100 * rep[1]:.2f}%, "
              f"p90 {100 * rep[2]:.2f}% (target: median within 3%)   {verdict(rep[1] <= 0.03)}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
