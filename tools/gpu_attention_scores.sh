#!/usr/bin/env bash
# One device call: the attention-score calls of eager attention (data/h200/campaigns/attention-scores.jsonl;
# tools/score_grid_sigs.py writes it) and the grid of the row-wise safe softmax kind, resumable. New files come back
# as one tarball.
set -u
source tools/gpu_common.sh
timeout ${COLLECT_S:-300} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops \
  --sigs data/h200/campaigns/attention-scores.jsonl --budget-s $(( ${COLLECT_S:-300} - 30 )) --quiet 2>&1 | tail -6
timeout ${GRID_S:-150} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --grid \
  --kinds safe_softmax_fwd --budget-s $(( ${GRID_S:-150} - 20 )) --quiet 2>&1 | tail -6
ship attention-scores
