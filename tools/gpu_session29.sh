#!/usr/bin/env bash
# One device call on 1 GPU (session 29): the dense experts' batched GEMMs with a top-1 router's zero rows
# (collect --operands routed, resumable), the attention-shaped bmm grid to 256, then where Megatron-Core's one-GPU step spends GPU time in tf32 and
# --fp16 (tools/mcore_op_profile.py on one rank: data/validation/profiles/mcore-ops-1gpu-*.json). Carry .whl.
set -u
WHEELS=.whl source tools/gpu_common.sh
timeout ${COLLECT_S:-240} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --operands routed \
  --budget-s $(( ${COLLECT_S:-240} - 30 )) --quiet 2>&1 | tail -3
# attention's math-path batched GEMMs to 256 batch x heads (schema.ops.BMM_ATTENTION_BATCHES; resumable)
timeout ${COLLECT_S:-240} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --grid --kinds bmm \
  --budget-s $(( ${COLLECT_S:-240} - 30 )) --quiet 2>&1 | tail -3
if [ "${PROFILE_S:-240}" != "0" ]; then
  (cd tools && CUDA_DEVICE_MAX_CONNECTIONS=1 timeout ${PROFILE_S:-240} torchrun --nproc-per-node 1 mcore_op_profile.py \
    ../data/validation/profiles tf32 fp16 2>&1 | grep -v -i "warn\|deprecat" | tail -4)
fi
ship s29
