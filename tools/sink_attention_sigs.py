"""The eager attention with sinks of gpt-oss (data/h200/campaigns/sink-attention.jsonl): transformers' own module
concatenates a sink logit to every row of the scores, so the max, softmax and their backward run on rows of seq + 1
elements, and the probabilities enter the PV GEMM as a view whose row pitch is seq + 1 (an odd leading dimension:
cuBLAS's slower unaligned kernels, schema/ops.py `_gemm_layout`), and the cat, copies and softmax on those rows run
unvectorised (`/ua` patterns, unaligned rows). The grid had neither. Every batched GEMM of a gpt-oss-20B
layer whose operands hold the (seq, seq) or (seq, seq + 1) scores, at 1,024, 2,048, 3,072, 6,144 and 8,192 tokens: not at the
held-out case's 4,096, which stays held out (its calls interpolate between these). Run on the CPU:
`.venv/bin/python tools/sink_attention_sigs.py`."""

import re
from pathlib import Path

from tp_query.collector.plan import write_signature_file
from tp_query.collector.validate import GENERIC_CASES, layers_of
from tp_query.engine.tracecli import signature_entries
from tp_query.schema.ops import FAMILIES, Family, describe
from tp_query.schema.precision import Setting
from tp_query.schema.signature import OpCall

ROOT = Path(__file__).resolve().parent.parent
SEQS = (1024, 2048, 3072, 6144, 8192)
SETTINGS = [Setting.BF16, Setting.FP16, Setting.TF32, Setting.AMP_BF16, Setting.AMP_FP16]

cfg = layers_of(GENERIC_CASES["gpt-oss-20b"][0], 2)  # one sliding and one full-attention layer
entries = []
for seq in SEQS:
    scores = re.compile(rf"\b{seq},{seq}\b|\b{seq},{seq + 1}\b|\b{seq + 1}\]")
    for op, sig, tf32 in signature_entries([cfg], SETTINGS, [seq], [1], [1], None):
        info = describe(OpCall.from_json_str(op, sig), tf32)
        # the GEMMs, whose layout tells a padded view apart (`/ua`), and the memory-bound calls whose category
        # does: an elementwise call on misaligned rows (`/ua` pattern: the cat with the sink, the strided
        # gate/up halves) and a rowwise call on rows of no multiple of 8 (softmax over seq + 1). Calls on
        # contiguous rows of seq + 1 are left out: their features are those of any contiguous tensor, and
        # measured once they moved other models' calls (notes section 26)
        unaligned = (info.family == Family.ELEMENTWISE and "/ua" in str(info.features.get("pattern"))) or \
            (info.family == Family.ROWWISE and not FAMILIES[Family.ROWWISE].exact_key(info.features)[0])
        if (scores.search(sig) and op in ("aten.bmm.default", "aten.scatter_.src")) or unaligned:
            entries.append((op, sig, tf32))
n = write_signature_file(ROOT / "data" / "h200" / "campaigns" / "sink-attention.jsonl", entries)
print(f"sink-attention.jsonl: {n} distinct calls")
