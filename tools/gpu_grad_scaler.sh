#!/usr/bin/env bash
# One device call on 1 GPU: this instance's one-rank host probe (plain model: bf16, amp_bf16 and amp_fp16 with
# GradScaler), then one-GPU validation cases ($ONE_GPU: case-id substrings) on the same instance, as machine
# samples. Resumable (a rerun on the same instance replaces its own rows).
set -u
source tools/gpu_common.sh
python3 -c 'from tp_query.collector.device import machine_id, cpu_model; print("machine", machine_id(), cpu_model())'
timeout ${PROBE_S:-200} torchrun --nproc-per-node 1 -m tp_query.collector dist-probe --gpu h200 --what host \
  --host-kinds plain 2>&1 | grep "\[host\]" | grep "opt.*fixed\|per_op" | tail -12
timeout ${ONE_GPU_S:-200} python3 -m tp_query.collector validate --gpu h200 --only "$ONE_GPU" --machine-sample \
  --budget-s $(( ${ONE_GPU_S:-200} - 20 )) 2>&1 | grep -v -i warn | tail -10
ship grad-scaler
