"""The eager branch of autograd formulas (data/h200/campaigns/eager-inplace.jsonl): the tracer now records what a
plain eager step runs where a formula builds fresh zeros and updates them (engine/trace/capture.py EAGER_IN_PLACE:
value_selecting_reduction_backward's scatter_, index_backward's _index_put_impl_, ...), where earlier traces, and
every campaign signature file written from them, hold the out-of-place branch that dispatch modes take. Each such
call of every committed campaign file, in its eager form: the same shapes as the calls already measured (held-out
cases' own shapes stay out, as they are out of those files). Run on the CPU:
`.venv/bin/python tools/eager_inplace_sigs.py`."""

import json
from pathlib import Path

from tp_query.collector.plan import write_signature_file
from tp_query.engine.trace.capture import EAGER_IN_PLACE
from tp_query.schema.signature import OpCall

ROOT = Path(__file__).resolve().parent.parent
CAMPAIGNS = ROOT / "data" / "h200" / "campaigns"
OUT = CAMPAIGNS / "eager-inplace.jsonl"

entries = []
for f in sorted(CAMPAIGNS.glob("*.jsonl")):
    if f == OUT:
        continue
    for line in f.read_text().splitlines():
        e = json.loads(line)
        eager = EAGER_IN_PLACE.get(e["op"])
        if eager is None:
            continue
        call = OpCall.from_json_str(e["op"], e["sig"])
        if not eager.needs(call.args, dict(call.kwargs)):
            continue
        entries.append((eager.op, OpCall(eager.op, (*call.args, *eager.extra), call.kwargs).to_json_str(), e["tf32"]))
n = write_signature_file(OUT, entries)
print(f"{OUT.name}: {n} distinct calls")
