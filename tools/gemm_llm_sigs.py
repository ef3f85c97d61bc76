"""The GEMM calls of the LLM-width grid (schema/ops.py GEMM_LLM_WIDTHS) that the database does not hold yet,
as a signature campaign (data/h200/campaigns/gemm-llm.jsonl), so that one device call measures only them.
`make collect` measures the same calls as part of the grid on any other GPU.
Run on the CPU: `.venv/bin/python tools/gemm_llm_sigs.py [name.jsonl]` (a grid extended later, such as its
fp16 calls, goes to a campaign file of its own: gemm-llm-fp16.jsonl)."""

import sys
from pathlib import Path

from tp_query.collector.plan import make_point, write_signature_file
from tp_query.collector.store import stored_keys
from tp_query.schema.ops import GEMM_LLM_PRECISIONS, _gemm_llm_grid

ROOT = Path(__file__).resolve().parent.parent

have = stored_keys(ROOT / "data" / "h200" / "ops")
entries = []
for p in GEMM_LLM_PRECISIONS:
    tf32 = p.value == "tf32"
    for call in _gemm_llm_grid(p):
        if make_point(call, tf32, "x").key not in have:
            entries.append((call.op, call.to_json_str(), tf32))
name = sys.argv[1] if len(sys.argv) > 1 else "gemm-llm.jsonl"
n = write_signature_file(ROOT / "data" / "h200" / "campaigns" / name, entries)
print(f"{name}: {n} calls")
