#!/usr/bin/env bash
# One device call: the eager attention with sinks of gpt-oss (data/h200/campaigns/sink-attention.jsonl, resumable;
# tools/sink_attention_sigs.py writes it). New files come back as one tarball.
set -u
source tools/gpu_common.sh
timeout ${COLLECT_S:-480} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops \
  --sigs data/h200/campaigns/sink-attention.jsonl --budget-s $(( ${COLLECT_S:-480} - 30 )) --quiet 2>&1 | tail -8
ship sink-attention
