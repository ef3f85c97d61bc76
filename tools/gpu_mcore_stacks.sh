#!/usr/bin/env bash
# One device call on 2 GPUs: where in Megatron-Core the operators a profile found mistimed or missing are
# called (tools/mcore_op_profile.py with STACKS=1, the dense Llama-8B-L4 case in TF32).
set -u
WHEELS=.whl source tools/gpu_common.sh
cd tools
STACKS=1 CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 200 torchrun --nproc-per-node 2 mcore_op_profile.py "$OUT" tf32 2>&1 | grep "^STACK" | head -40
