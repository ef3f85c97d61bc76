#!/usr/bin/env bash
# One device call: attention behind a mask without dropout (data/h200/campaigns/attention-mask.jsonl;
# tools/attention_dropout_sigs.py --masked writes it), resumable. New files come back as one tarball.
set -u
source tools/gpu_common.sh
timeout ${COLLECT_S:-420} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops \
  --sigs data/h200/campaigns/attention-mask.jsonl --budget-s $(( ${COLLECT_S:-420} - 30 )) --quiet 2>&1 | tail -6
ship attention-mask
