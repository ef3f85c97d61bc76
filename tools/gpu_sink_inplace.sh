#!/usr/bin/env bash
# One device call: gpt-oss's attention with sinks (data/h200/campaigns/sink-attention.jsonl: its GEMMs and now its
# unaligned memory-bound calls) and the eager branch of autograd formulas (eager-inplace.jsonl), both resumable.
# New files come back as one tarball.
set -u
source tools/gpu_common.sh
timeout ${COLLECT_S:-480} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops \
  --sigs data/h200/campaigns/sink-attention.jsonl data/h200/campaigns/eager-inplace.jsonl \
  --budget-s $(( ${COLLECT_S:-480} - 30 )) --quiet 2>&1 | tail -8
ship sink-inplace
