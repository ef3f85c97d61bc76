"""Calls of the gated-delta-rule models (Qwen3-Next, Qwen3.5 dense and MoE, OLMo-Hybrid; their default configs) that the
database prices only by extrapolation or with no comparable measurement (data/h200/campaigns/linear-attention.jsonl):
the torch fallback's chunk loop (batched GEMMs of 64-token chunks, cumulative sums, triangular masks, the per-row
`select_backward`), the causal convolution, and whatever else of these models the grid does not bracket. Every call at
1,024, 2,048, 3,072, 6,144 and 8,192 tokens: not at the held-out cases' 4,096, which stay held out (registered in
data/experiments/linear-attention-s45/ before any run). Run on the CPU: `.venv/bin/python tools/linear_attention_sigs.py`."""

import json
from collections import Counter
from pathlib import Path

from tp_query.collector.plan import write_signature_file
from tp_query.collector.validate import DEFAULT_TYPE_CONFIGS, layers_of, layers_to_keep
from tp_query.engine.lookup import Query, Source
from tp_query.engine.predict import Engine
from tp_query.engine.tracecli import signature_entries
from tp_query.schema.ops import describe
from tp_query.schema.precision import Setting
from tp_query.schema.signature import OpCall

ROOT = Path(__file__).resolve().parent.parent
SEQS = [1024, 2048, 3072, 6144, 8192]
SETTINGS = [Setting.BF16, Setting.AMP_BF16, Setting.AMP_FP16, Setting.TF32]
TYPES = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "olmo_hybrid"]

table = json.loads(DEFAULT_TYPE_CONFIGS.read_text())
eng = Engine("h200")
entries: list[tuple[str, str, bool]] = []
seen: set[tuple[str, str, bool]] = set()
for mt in TYPES:
    cfg = layers_of(table[mt], layers_to_keep(table[mt]))
    for op, sig, tf32 in signature_entries([cfg], SETTINGS, SEQS, [1], [1], None):
        if (op, sig, tf32) in seen:
            continue
        seen.add((op, sig, tf32))
        info = describe(OpCall.from_json_str(op, sig), tf32)
        if info.family.value == "host":
            continue
        q = Query(f"{op}|{sig}|{tf32}", op, info)
        if eng.latency.estimate([q])[q.key].source in (Source.EXTRAPOLATED, Source.MISS):
            entries.append((op, sig, tf32))
# The per-row loop makes calls of every row length (1..63) per chunk shape, tens of thousands in all: at most PER_OP
# calls of each operator and TF32 mode are kept, evenly spaced over their bytes (the family's axes interpolate the rest)
PER_OP = 120
by_op: dict[tuple[str, bool], list[tuple[float, tuple[str, str, bool]]]] = {}
for e in entries:
    by_op.setdefault((e[0], e[2]), []).append((describe(OpCall.from_json_str(e[0], e[1]), e[2]).bytes, e))
entries = []
for calls in by_op.values():
    calls.sort(key=lambda t: t[0])
    step = max(1, len(calls) / PER_OP)
    entries += [calls[int(i * step)][1] for i in range(min(PER_OP, len(calls)))]
print(Counter(op for op, _, _ in entries).most_common(30))
n = write_signature_file(ROOT / "data" / "h200" / "campaigns" / "linear-attention.jsonl", entries)
print(f"linear-attention.jsonl: {n} distinct calls")
