"""How a lookup should answer beyond a category's measured range, chosen by leave-one-out over the database's own
points: each point that leaves its category's per-axis range when removed is estimated from the rest by (a) the
nearest point's efficiency held (the rule before 2026-12-01) and (b) the efficiency at the range's nearest boundary
point (the query clamped onto each axis's measured range, then interpolated as inside), held there. Prints the
median and mean absolute error of the cold latency per family and rule.
Usage: `.venv/bin/python tools/extrapolation_loo.py`"""

import math
import statistics
from collections import defaultdict
from pathlib import Path

from tp_query.engine.lookup import Category, _FamilyPoints
from tp_query.engine.predict import Engine
from tp_query.schema.ops import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
eng = Engine("h200", str(ROOT / "data"))
db = eng.latency.db
errs: dict[tuple[str, str], list[float]] = defaultdict(list)


def boundary(cat: Category, q: tuple[float, ...], roof: float) -> float:
    """Rule (b): the cold latency from the efficiency at q clamped onto each axis's measured range."""
    qc = tuple(min(max(x, vals[0]), vals[-1]) for x, vals in zip(q, cat.values, strict=True))
    local = cat.local_linear(qc) if cat.log_space else None
    if local is not None:
        return roof / local[0]
    near = cat.nearest(qc, 4)
    if near[0][0] == 0.0:
        return roof / near[0][1].eff_cold
    ws = [1.0 / (d * d) for d, _ in near]
    return roof / (sum(w * p.eff_cold for w, (_, p) in zip(ws, near, strict=True)) / sum(ws))


for fam in FAMILIES:
    fp = _FamilyPoints(db, fam, eng.gpu)
    for pts in fp.strict.values():
        cat = Category(pts, FAMILIES[fam].log_space)
        if len(cat.points) < 6:
            continue
        for p in cat.points:
            rest = Category([x for x in cat.points if x.axes != p.axes], cat.log_space)
            if rest.inside(p.axes):
                continue
            c, _, _, _ = rest.estimate(p.axes, p.roofline_us)  # rule (a), the lookup's own
            errs[(str(fam), "nearest")].append(abs(math.log(c / p.cold_us)))
            errs[(str(fam), "boundary")].append(abs(math.log(boundary(rest, p.axes, p.roofline_us) / p.cold_us)))
for (fam, rule), e in sorted(errs.items()):
    print(f"{fam:12s} {rule:9s} n={len(e):5d} median {math.expm1(statistics.median(e)):6.1%} "
          f"mean {math.expm1(statistics.fmean(e)):6.1%}")
