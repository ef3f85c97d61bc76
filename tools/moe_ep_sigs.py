"""The signature campaign of the Megatron-Core MoE cases (data/h200/campaigns/megatron-moe.jsonl): every
operator call of the Mixtral-shaped Megatron graph, experts replicated and split over 2 ranks, traced at
half and twice the cases' sequence (4096), so the cases' own shapes are never measured; calls the
database already holds are left out. Run on the CPU: `.venv/bin/python tools/moe_ep_sigs.py`."""

from pathlib import Path

from tp_query.collector.plan import make_point, write_signature_file
from tp_query.collector.store import stored_keys
from tp_query.collector.validate import MIXTRAL_8X7B, layers_of
from tp_query.engine.tracecli import signature_entries
from tp_query.schema.precision import Setting
from tp_query.schema.signature import OpCall

ROOT = Path(__file__).resolve().parent.parent
SEQ = 4096

entries = []
for ep in (1, 2):
    entries += list(signature_entries([layers_of(MIXTRAL_8X7B, 2)], [Setting("mp_bf16"), Setting("tf32")],
                                      [SEQ // 2, SEQ * 2], [1], [1], None, framework="megatron", ep=ep))
have = stored_keys(ROOT / "data" / "h200" / "ops")
entries = [e for e in entries if make_point(OpCall.from_json_str(e[0], e[1]), e[2], "x").key not in have]
n = write_signature_file(ROOT / "data" / "h200" / "campaigns" / "megatron-moe.jsonl", entries)
print(f"megatron-moe.jsonl: {n} distinct calls")
