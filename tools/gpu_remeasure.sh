#!/usr/bin/env bash
# One device call: operators whose input generation was fixed, measured again over their old rows; failed
# points of the families campaign retried. Changed and new files come back as one tarball.
set -u
source tools/gpu_common.sh
python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --sigs data/h200/campaigns/*.jsonl \
  --remeasure-ops aten.index.Tensor,aten.index_put.default,aten.index_put_.default,aten.scatter.src --quiet 2>&1 | tail -6
python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --sigs data/h200/campaigns/families.jsonl \
  --retry-errors --quiet 2>&1 | tail -3
ship remeasure
