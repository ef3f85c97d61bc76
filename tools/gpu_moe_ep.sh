#!/usr/bin/env bash
# One device call on 2 GPUs (resumable): Megatron-Core MoE op log (tiny Mixtral, ep 1 and 2), the operator
# calls of the Megatron MoE graph (data/h200/campaigns/megatron-moe.jsonl), the Megatron MoE / EP iterations,
# then ($REMEASURE: case-id substrings) distributed cases timed again with noise-based stopping.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
mkdir -p .ns/tp_query && for d in schema engine collector; do ln -sfn "$PWD/$d" .ns/tp_query/$d; done
export PYTHONPATH=$PWD/.ns:/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ ! -f "$OUT/mcore-moe-oplog-ep2.json" ]; then
  CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 120 torchrun --nproc-per-node 2 tools/mcore_moe_oplog.py "$OUT" 2>&1 | grep -v Warning | tail -8
fi
timeout ${COLLECT_S:-150} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops \
  --sigs data/h200/campaigns/megatron-moe.jsonl --budget-s $(( ${COLLECT_S:-150} - 20 )) --quiet 2>&1 | tail -3
CUDA_DEVICE_MAX_CONNECTIONS=1 timeout ${VALIDATE_S:-200} torchrun --nproc-per-node 2 -m tp_query.collector \
  dist-validate --gpu h200 --frameworks megatron --only mcore_moe --budget-s $(( ${VALIDATE_S:-200} - 30 )) 2>&1 \
  | grep -v -i warn | tail -8
if [ -n "${REMEASURE:-}" ]; then
  timeout ${REMEASURE_S:-150} torchrun --nproc-per-node 2 -m tp_query.collector dist-validate --gpu h200 \
    --frameworks torch --only "$REMEASURE" --remeasure --budget-s $(( ${REMEASURE_S:-150} - 30 )) 2>&1 \
    | grep -v -i warn | tail -8
fi
rm -f data/h200/ops/.lock data/validation/.lock
{ git ls-files -o --exclude-standard data; git diff --name-only -- data; } | sort -u > /tmp/ship.txt
tar czf "$OUT/campaign.tgz" -T /tmp/ship.txt && wc -l < /tmp/ship.txt
