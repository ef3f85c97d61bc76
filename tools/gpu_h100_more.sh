#!/usr/bin/env bash
# One device call on an H100 (SXM, 80 GB HBM3), after tools/gpu_h100_start.sh: `make collect GPU=h100`'s generic grid
# continued (resumable: it measures only the points not yet in data/h100/ops), then held-out training iterations in
# the precisions the first call left out (their own folder, data/validation/h100/). One tarball back.
set -u
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout ${COLLECT_S:-420} python3 -m tp_query.collector collect --gpu h100 --out data/h100/ops --grid \
  --repeat-fraction 0.03 --budget-s $(( ${COLLECT_S:-420} - 30 )) --quiet 2>&1 | tail -6
timeout ${VALIDATE_S:-140} python3 -m tp_query.collector validate --gpu h100 \
  --only "${ONLY:-gpt2-mb12-s512-fp16,gpt2-mb12-s512-amp_bf16,qwen2-7b-L3-mb1-s2048-fp16,qwen2-7b-L3-mb1-s2048-fp32,qwen3-8b-L4-mb1-s4096-bf16,mistral-7b-L4-mb2-s3072-amp_fp16,llama3-8b-L4-mb1-s4096-fp16}" \
  --budget-s $(( ${VALIDATE_S:-140} - 15 )) 2>&1 | tail -10
ship h100-more
