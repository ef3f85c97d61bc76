#!/usr/bin/env bash
# One short device call on an H200 or an H100: the gated-delta fallback's operator calls that the grid does not
# bracket, at other lengths than the validation cases' (data/h200/campaigns/linear-attention.jsonl; written by
# tools/linear_attention_sigs.py), into this GPU's database (resumable: a rerun measures what is left). One tarball.
set -u
source tools/gpu_common.sh
GPU=$(gpu_kind) || exit 3
timeout ${COLLECT_S:-200} python3 -m tp_query.collector collect --gpu $GPU --out data/$GPU/ops \
  --sigs data/h200/campaigns/linear-attention.jsonl --budget-s $(( ${COLLECT_S:-200} - 25 )) --quiet 2>&1 | tail -8
ship la-collect-$GPU
