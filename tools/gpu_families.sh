#!/usr/bin/env bash
# One device call: profile the spec registry families' operator calls (data/h200/campaigns/families.jsonl,
# resumable), then time their real HF training iterations (resumable). New files come back as one tarball.
set -u
source tools/gpu_common.sh
git ls-files -o --exclude-standard data > /tmp/before.txt 2>/dev/null || true
python3 - <<'PY' 2>&1 | tail -5
import torch
a = torch.randn(256, 128, device="cuda"); b = torch.randn(4, 128, 64, device="cuda")
offs = torch.tensor([64, 128, 192, 256], dtype=torch.int32, device="cuda")
for dt in (torch.bfloat16, torch.float32):
    try:
        torch._grouped_mm(a.to(dt), b.to(dt), offs=offs); print("grouped_mm", dt, "ok")
    except Exception as e:
        print("grouped_mm", dt, "fails:", str(e).splitlines()[0])
q = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
m = torch.ones(4096, 4096, dtype=torch.bool, device="cuda").tril()[None, None]
from torch.profiler import profile
with profile() as p:
    torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=m)
    torch.cuda.synchronize()
print("masked sdpa kernels:", sorted({e.name[:60] for e in p.events() if "attention" in e.name.lower() or "cudnn" in e.name.lower() or "fmha" in e.name.lower()})[:6])
PY
timeout ${COLLECT_S:-330} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops \
  --sigs data/h200/campaigns/families.jsonl --budget-s $(( ${COLLECT_S:-330} - 30 )) --quiet 2>&1 | tail -5
timeout ${VALIDATE_S:-220} python3 -m tp_query.collector validate --gpu h200 --only "${ONLY:-qwen3-8b-L4,mistral-7b-sw,gemma2-9b-L4,gemma3-4b-L6,phi3-mini-L4,pythia-1.4b-L24,mixtral-8x7b-L2,qwen3-30b-a3b-L4,qwen1.5-moe}" \
  --budget-s $(( ${VALIDATE_S:-220} - 20 )) 2>&1 | tail -12
ship families
