"""Calls of two held-out architectures that the grid covered only by extrapolation or by a far blend
(data/h200/campaigns/arch-gaps.jsonl), found by comparing gpt-oss-20B's profiled step with the engine's operator rows
(docs/validation-notes.md section 41):
- Gemma-4's attention: its full layers (head size 512, 8 heads) run memory-efficient attention (cuDNN and
  flash stop at 256), and the half-precision grid stopped at head size 192.
- gpt-oss's routed experts: `_grouped_mm` over 32 experts at hidden and FFN 2880 (gate-up 5760), between the grid's
  N/K points of 2048 and 4096; torch runs the fp32 ones as one `mm` per expert.
- eager attention under autocast: half-precision scores plus the fp32 causal mask broadcast over heads (a
  mixed-dtype add producing fp32), which the grid measured only on contiguous operands.
- the sink column's `sub` (scores minus each row's max, broadcast) and `max.dim` over rows of seq + 1 elements.
- AFMoE's attention: memory-efficient attention under its sliding-window mask (every setting), extrapolated beyond the
  grid; once ERNIE-4.5-MoE's and AFMoE's optimizer lists were rebuilt for every layer (notes section 42), AFMoE was
  over-predicted by 2-9%, its largest item this extrapolated attention backward.
- the experts' bias gradients: an accumulating index_put of every routed row onto 32 experts (hundreds of indices per
  destination row, whose atomic adds serialise: schema/ops.py `_accumulate_contention`).
Every call at 1,024, 2,048, 3,072, 6,144 and 8,192 tokens: not at the held-out cases' 4,096, which stay held out
(their calls interpolate between these). Run on the CPU: `.venv/bin/python tools/arch_gap_sigs.py`."""

import json
import re
from collections import Counter
from pathlib import Path

from tp_query.collector.plan import write_signature_file
from tp_query.collector.validate import DEFAULT_TYPE_CONFIGS, GENERIC_CASES, layers_of, layers_to_keep
from tp_query.engine.tracecli import signature_entries
from tp_query.schema.ops import describe
from tp_query.schema.precision import Setting
from tp_query.schema.signature import OpCall

ROOT = Path(__file__).resolve().parent.parent
SEQS = [1024, 2048, 3072, 6144, 8192]
HALF = [Setting.BF16, Setting.FP16, Setting.AMP_BF16, Setting.AMP_FP16]

gemma4 = json.loads(DEFAULT_TYPE_CONFIGS.read_text())["gemma4_text"]
gemma4 = layers_of(gemma4, layers_to_keep(gemma4))
oss = layers_of(GENERIC_CASES["gpt-oss-20b"][0], 2)  # one sliding and one full-attention layer
afmoe = json.loads(DEFAULT_TYPE_CONFIGS.read_text())["afmoe"]
afmoe = layers_of(afmoe, layers_to_keep(afmoe))

entries: list[tuple[str, str, bool]] = []
for op, sig, tf32 in signature_entries([gemma4], HALF, SEQS, [1], [1], None):
    if "attention" in op:  # its sliding (head size 256) and full (512) layers' attention
        entries.append((op, sig, tf32))
for op, sig, tf32 in signature_entries([afmoe], [*HALF, Setting.TF32], SEQS, [1], [1], None):
    if "attention" in op:  # its sliding and full layers' attention, masked
        entries.append((op, sig, tf32))
for op, sig, tf32 in signature_entries([oss], [*HALF, Setting.TF32], SEQS, [1], [1], None):
    if op.startswith("aten._grouped_mm") or "/x" in str(describe(OpCall.from_json_str(op, sig), tf32).features.get(
            "pattern", "")):
        entries.append((op, sig, tf32))
        continue
    seq = re.search(r"\[1, ?64, ?(\d+), ?(\d+)\]", sig)
    if seq is None or int(seq.group(2)) not in (int(seq.group(1)), int(seq.group(1)) + 1):
        continue  # not the (heads, seq, seq[+1]) scores
    mixed = op in ("aten.add.Tensor", "aten.add_.Tensor") and '"fp32"' in sig and ('"bf16"' in sig or '"fp16"' in sig)
    if mixed or op in ("aten.sub.Tensor", "aten.max.dim"):
        entries.append((op, sig, tf32))
print(Counter(op for op, _, _ in entries))
n = write_signature_file(ROOT / "data" / "h200" / "campaigns" / "arch-gaps.jsonl", entries)
print(f"arch-gaps.jsonl: {n} distinct calls")
