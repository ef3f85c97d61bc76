#!/usr/bin/env bash
# One device call on an H100: the fp16 GEMM grid timed on NaN operands (pure fp16 with Adam runs every GEMM on NaN
# from its second step; docs/validation-notes.md section 10), which the H200 database holds and the H100's lacks
# (its pure-fp16 LLaMA-3-8B run is over-predicted by 9%). Resumable; one tarball back.
set -u
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout ${COLLECT_S:-500} python3 -m tp_query.collector collect --gpu h100 --out data/h100/ops --grid \
  --operands nan --precisions fp16 --budget-s $(( ${COLLECT_S:-500} - 30 )) --quiet 2>&1 | tail -6
ship h100-nan
