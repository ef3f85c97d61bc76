"""A campaign's calls priced before they run, then checked against what they measured: `predict` writes each
call's lookup (cold latency, source) from the database as it is, `check` reads the campaign's measured rows and
prints the error per operator and source. For new data whose cost an earlier rule borrowed (attention dropout
behind masks: engine/lookup.py `_transferred`), this says how right the rule was.
    .venv/bin/python tools/campaign_check.py predict CAMPAIGN.jsonl OUT.json   (before the data lands)
    .venv/bin/python tools/campaign_check.py check OUT.json CAMPAIGN_NAME       (after: rows of that campaign)"""
import collections
import json
import statistics
import sys
from pathlib import Path

from tp_query.engine.compose import make_item
from tp_query.engine.graph import Phase
from tp_query.engine.lookup import Query
from tp_query.engine.predict import Engine


def predict(campaign: Path, out: Path) -> None:
    eng = Engine("h200")
    rows = []
    for line in campaign.read_text().splitlines():
        e = json.loads(line)
        it = make_item(e["op"], e["sig"], Phase.FWD, bool(e.get("tf32")))
        est = eng.latency.estimate([Query(it.key, it.call.op, it.info)])[it.key]
        rows.append({"key": it.key, "op": e["op"], "sig": e["sig"], "cold_us": est.cold_us, "source": est.source.value})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=0) + "\n")
    print(f"{len(rows)} calls priced -> {out}")


def check(before: Path, campaign: str) -> None:
    import duckdb

    pred = {r["key"]: r for r in json.loads(before.read_text())}
    con = duckdb.connect()
    got = con.execute("SELECT key, median(latency_us) FROM read_parquet('data/h200/ops/*.parquet', union_by_name=true) "
                      "WHERE campaign = ? AND status = 'ok' GROUP BY key", [campaign]).fetchall()
    by: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for key, us in got:
        p = pred.get(key)
        if p is not None:
            by[(p["op"].split(".")[1], p["source"])].append(100 * (p["cold_us"] / us - 1))
    print(f"{sum(map(len, by.values()))} of {len(pred)} calls measured")
    for (op, src), errs in sorted(by.items()):
        print(f"{op:48} {src:13} n={len(errs):3}  mean {statistics.mean(errs):+6.1f}%  "
              f"MAPE {statistics.mean(map(abs, errs)):5.1f}%  max {max(errs, key=abs):+6.1f}%")


if __name__ == "__main__":
    {"predict": lambda: predict(Path(sys.argv[2]), Path(sys.argv[3])),
     "check": lambda: check(Path(sys.argv[2]), sys.argv[3])}[sys.argv[1]]()
