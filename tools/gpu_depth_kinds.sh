#!/usr/bin/env bash
# One device call on one H200: this instance's plain host probe, then the held-out cases of $CASES (case-id
# substrings, one-GPU validation, resumable) on the same instance; what SDPA runs for MLA-shaped attention
# (query/key head 192, value 128) printed for the record. New files come back as one tarball.
set -u
source tools/gpu_common.sh
python3 -c 'from tp_query.collector.device import machine_id, cpu_model; print("machine", machine_id(), cpu_model())'
if [ "${PROBE_S:-120}" != "0" ]; then
  timeout ${PROBE_S:-120} torchrun --nproc-per-node 1 -m tp_query.collector dist-probe --gpu h200 --what host \
    --host-kinds plain 2>&1 | grep "\[host\]" | grep -v " L[0-9]" | tail -20
fi
timeout ${CASES_S:-330} python3 -m tp_query.collector validate --gpu h200 --only "${CASES:-glm4.5-air,smollm3-3b}" \
  --machine-sample --budget-s $(( ${CASES_S:-330} - 20 )) 2>&1 | grep -v -i warn | tail -14
python3 - <<'PY' 2>&1 | tail -8
import torch
from torch.profiler import profile
for dt in (torch.bfloat16, torch.float32):
    q = torch.randn(1, 16, 4096, 192, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(1, 16, 4096, 192, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(1, 16, 4096, 128, device="cuda", dtype=dt, requires_grad=True)
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for _ in range(3):
        f().sum().backward()
    torch.cuda.synchronize()
    with profile() as p:
        f().sum().backward(); torch.cuda.synchronize()
    ev = [e for e in p.key_averages() if e.key.startswith("aten::_scaled_dot")]
    print(dt, [(e.key, round(e.device_time_total / max(e.count, 1))) for e in ev])
PY
ship depth-kinds
