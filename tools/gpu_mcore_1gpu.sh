#!/usr/bin/env bash
# One device call on 1 GPU: Megatron-Core's one-GPU step (collector/dist_validate.py, world 1: --bf16, --fp16 and
# tf32; one micro-batch and four accumulated) on this instance, beside this instance's one-rank host probe
# (plain eager per-operator costs). Resumable: a rerun on the same instance skips the cases it has; the case
# loop stops at $CASES_S seconds. Carry .whl (the megatron-core wheel).
set -u
WHEELS=.whl source tools/gpu_common.sh
python3 -c 'from tp_query.collector.device import machine_id, cpu_model; print("machine", machine_id(), cpu_model())'
if [ "${PROBE_S:-150}" != "0" ]; then
  timeout ${PROBE_S:-150} torchrun --nproc-per-node 1 -m tp_query.collector dist-probe --gpu h200 --what host \
    --host-kinds plain 2>&1 | grep "\[host\]" | grep -v " L[0-9]" | tail -12
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
timeout ${CASES_S:-400} torchrun --nproc-per-node 1 -m tp_query.collector dist-validate --gpu h200 \
  --frameworks megatron --machine-sample --max-iters ${MAX_ITERS:-40} \
  --budget-s $(( ${CASES_S:-400} - 40 )) 2>&1 | grep -v -i "warn" | tail -30
ship mcore-1gpu
