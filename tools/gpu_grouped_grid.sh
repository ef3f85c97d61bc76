#!/usr/bin/env bash
# One device call on one H200: grid points of $KINDS (default the grouped-GEMM grid: fp32 and tf32 first, then bf16; resumable, budget
# $COLLECT_S), then the held-out cases of $CASES on the same instance. New files come back as one tarball.
set -u
source tools/gpu_common.sh
python3 -c 'from tp_query.collector.device import machine_id; print("machine", machine_id())'
timeout ${COLLECT_S:-380} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --grid \
  --kinds "${KINDS:-grouped_mm}" --precisions "${PRECISIONS:-fp32,tf32,bf16}" --budget-s $(( ${COLLECT_S:-380} - 20 )) --quiet 2>&1 | tail -4
timeout ${CASES_S:-170} python3 -m tp_query.collector validate --gpu h200 --only "${CASES:-dots1,olmoe}" \
  --machine-sample --budget-s $(( ${CASES_S:-170} - 15 )) 2>&1 | grep -v -i warn | tail -10
ship "${SHIP:-grouped-grid}"
