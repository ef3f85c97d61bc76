"""Issue 11's check "predictions equal to the traced path (within 0.1%) on every validation case": every measured
validation run (one GPU and distributed) predicted twice, in two processes with their own empty caches: once as
`predict` answers (a graph template where one covers the request), once with templates off (every graph traced).
Prints each case a template served with both predictions, and exits 1 when any differs by more than 0.1% in time
or memory.
    .venv/bin/python tools/template_vs_trace.py [--gpu h200]"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def child(mode: str, gpu: str, out: str) -> None:
    os.environ["TP_QUERY_CACHE"] = tempfile.mkdtemp(prefix=f"tpq-tvt-{mode}-")
    from tp_query.engine import graphcache
    from tp_query.engine.predict import Engine
    from tp_query.engine.validation import Study, load_rows
    from tp_query.schema.gpus import validation_folder

    served: set[str] = set()
    original = graphcache._from_template

    def spy(spec, req):  # type: ignore[no-untyped-def]
        g = None if mode == "trace" else original(spec, req)
        if g is not None:
            served.add(graphcache.graph_fields_key(req))
        return g

    graphcache._from_template = spy
    eng = Engine(gpu)
    rows = [r for r in load_rows(Path(validation_folder(gpu)), gpu) if r["status"] == "ok"]
    study = Study(eng, rows, with_baselines=False)
    res = {}
    for c in study.cases:
        asm = study.assembled.get(c.case_id)
        if asm is None:
            res[c.case_id] = {"error": c.error}
            continue
        keyed = graphcache.graph_fields_key(asm.req) in served
        res[c.case_id] = {"ms": study._time(asm, c, eng.host), "peak": asm.plan_numbers()[2].peak_bytes,
                          "template": keyed}
    with open(out, "w") as f:
        json.dump(res, f)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--child", choices=("template", "trace"))
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.gpu, a.out)
        return 0
    outs = {}
    for mode in ("template", "trace"):
        out = tempfile.mktemp(suffix=f"-{mode}.json")
        subprocess.run([sys.executable, __file__, "--child", mode, "--gpu", a.gpu, "--out", out], check=True)
        outs[mode] = json.load(open(out))
    tpl, trc = outs["template"], outs["trace"]
    served = [k for k, v in tpl.items() if v.get("template")]
    worst, bad = 0.0, []
    for k in sorted(tpl):
        a_, b_ = tpl[k], trc.get(k, {})
        if "ms" not in a_ or "ms" not in b_:
            if a_.get("error") != b_.get("error"):
                bad.append(f"{k}: template path {a_.get('error') or 'predicts'}; traced path {b_.get('error') or 'predicts'}")
            continue
        dt = abs(a_["ms"] / b_["ms"] - 1)
        dm = abs(a_["peak"] / b_["peak"] - 1) if b_["peak"] else 0.0
        worst = max(worst, dt, dm)
        if dt > 1e-3 or dm > 1e-3:
            bad.append(f"{k}: {a_['ms']:.3f} ms vs traced {b_['ms']:.3f} ms; peak {a_['peak']} vs {b_['peak']}")
    print(f"{len(tpl)} validation cases, {len(served)} served by a template; largest difference in time or peak "
          f"memory {100 * worst:.4f}%; {len(bad)} over 0.1%")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
