#!/usr/bin/env bash
# One device call on 2 GPUs: this machine instance as another sample of the kind for host-bound work.
# The framework host probe ($KINDS) and the distributed cases ($CASES, case-id substrings) measured on the
# same instance, each kept beside the other instances' rows (collector.device.machine_id). Resumable: a
# rerun on the same instance replaces its own rows; the case loop stops at $CASES_S seconds. $ONE_GPU:
# one-GPU validation cases (case-id substrings) measured on the same instance.
set -u
[ "${FRAMEWORKS:-torch}" = megatron ] && WHEELS=.whl  # Megatron-Core from the carried wheel
source tools/gpu_common.sh
python3 -c 'from tp_query.collector.device import machine_id, cpu_model; print("machine", machine_id(), cpu_model())'

if [ "${PROBE_S:-240}" != "0" ]; then  # PROBE_S=0: this instance's host probe is already in (a second call)
  timeout ${PROBE_S:-240} torchrun --nproc-per-node 2 -m tp_query.collector dist-probe --gpu h200 --what host \
    --host-kinds "${KINDS:-plain,tp,tp_sp}" 2>&1 | grep "\[host\]" | grep -v " L[0-9]" | tail -60
fi
# FRAMEWORKS=megatron: Megatron-Core from the carried wheel (.whl), one device connection as it requires
[ "${FRAMEWORKS:-torch}" = megatron ] && export CUDA_DEVICE_MAX_CONNECTIONS=1
timeout ${CASES_S:-300} torchrun --nproc-per-node 2 -m tp_query.collector dist-validate --gpu h200 \
  --frameworks "${FRAMEWORKS:-torch}" --only "${CASES:-torch-tp}" --machine-sample --max-iters ${MAX_ITERS:-60} \
  --budget-s $(( ${CASES_S:-300} - 40 )) 2>&1 | grep "dist-validate\]" | tail -20
if [ -n "${ONE_GPU:-}" ]; then  # one-GPU cases (case-id substrings) on GPU 0
  CUDA_VISIBLE_DEVICES=0 timeout ${ONE_GPU_S:-150} python3 -m tp_query.collector validate --gpu h200 \
    --only "$ONE_GPU" --machine-sample --budget-s $(( ${ONE_GPU_S:-150} - 20 )) 2>&1 | grep -v -i warn | tail -12
fi
ship machine-sample
