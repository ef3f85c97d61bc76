#!/usr/bin/env bash
# One device call on 2 GPUs (resumable): ($OPLOG) Megatron-Core MoE op log (tiny Mixtral, ep 1 and 2), the operator
# calls of the Megatron MoE graph (data/h200/campaigns/megatron-moe.jsonl), the Megatron MoE / EP iterations,
# then ($REMEASURE: case-id substrings) distributed cases timed again with noise-based stopping.
set -u
WHEELS=.whl source tools/gpu_common.sh
if [ -n "${OPLOG:-}" ]; then
  CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 120 torchrun --nproc-per-node 2 tools/mcore_moe_oplog.py "$OUT" 2>&1 | grep -v Warning | tail -8
fi
timeout ${COLLECT_S:-150} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops \
  --sigs data/h200/campaigns/megatron-moe.jsonl --budget-s $(( ${COLLECT_S:-150} - 20 )) --quiet 2>&1 | tail -3
# each MoE case in its own processes (as a user runs one job): Megatron keeps state across builds in one
# process (measured: each later case's peak grew by the previous model's size)
for cid in $(python3 -c "from tp_query.collector.dist_validate import dist_cases
print(' '.join(c.case_id for c in dist_cases(2) if 'mcore_moe' in c.case_id))"); do
  CUDA_DEVICE_MAX_CONNECTIONS=1 timeout ${CASE_S:-90} torchrun --nproc-per-node 2 -m tp_query.collector \
    dist-validate --gpu h200 --frameworks megatron --only "$cid" ${MOE_REMEASURE:+--remeasure} 2>&1 \
    | grep "dist-validate\]" | tail -2
done
if [ -n "${REMEASURE:-}" ]; then
  timeout ${REMEASURE_S:-150} torchrun --nproc-per-node 2 -m tp_query.collector dist-validate --gpu h200 \
    --frameworks torch --only "$REMEASURE" --remeasure --budget-s $(( ${REMEASURE_S:-150} - 30 )) 2>&1 \
    | grep -v -i warn | tail -8
fi
ship campaign
