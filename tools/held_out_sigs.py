"""The signature campaigns of the held-out family and FP8 cases (data/h200/campaigns/families.jsonl and
fp8.jsonl): every operator call of each case's model traced at half and twice the case's sequence, so the
cases' own shapes are never measured. Run on the CPU: `.venv/bin/python tools/held_out_sigs.py`.
The committed families.jsonl (what was measured) was written before three graph-fidelity fixes; a run
today differs by exactly those calls (the window mask's conversion to the query's dtype, the MoE
histogram's int32 input), which `make collect` would add."""

from pathlib import Path

from tp_query.collector.plan import write_signature_file
from tp_query.collector.validate import FAMILY_CASES, FAMILY_SETTINGS, FP8_CASES, FP8_SETTINGS, layers_of
from tp_query.engine.tracecli import signature_entries
from tp_query.schema.precision import Setting

ROOT = Path(__file__).resolve().parent.parent

for out, table, settings in (("families.jsonl", FAMILY_CASES, FAMILY_SETTINGS), ("fp8.jsonl", FP8_CASES, FP8_SETTINGS)):
    entries = []
    for _name, (cfg, layers, mb, seq) in table.items():
        entries += list(signature_entries([layers_of(cfg, layers)], [Setting(s) for s in settings],
                                          [seq // 2, seq * 2], [mb], [1], None))
    n = write_signature_file(ROOT / "data" / "h200" / "campaigns" / out, entries)
    print(f"{out}: {n} distinct calls")
