#!/usr/bin/env bash
# One device call on 2 GPUs: per-aten-op profiles of Megatron-Core's MoE step (Mixtral-8x7B shape, 2 layers,
# tf32; experts replicated and EP=2), one process per case (Megatron keeps state across builds).
set -u
WHEELS=.whl source tools/gpu_common.sh
cd tools
for ep in 1 2; do
  MOE=1 EP=$ep CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 200 torchrun --nproc-per-node 2 mcore_op_profile.py "$OUT" \
    ${SETTINGS:-tf32} 2>&1 | grep -v -i warn | tail -3
done
