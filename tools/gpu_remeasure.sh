#!/usr/bin/env bash
# One device call: operators whose input generation was fixed, measured again over their old rows; failed
# points of the families campaign retried. Changed and new files come back as one tarball.
set -u
mkdir -p .ns/tp_query && for d in schema engine collector; do ln -sfn "$PWD/$d" .ns/tp_query/$d; done
export PYTHONPATH=$PWD/.ns PYTHONUNBUFFERED=1
python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --sigs data/h200/campaigns/*.jsonl \
  --remeasure-ops aten.index.Tensor,aten.index_put.default,aten.index_put_.default,aten.scatter.src --quiet 2>&1 | tail -6
python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --sigs data/h200/campaigns/families.jsonl \
  --retry-errors --quiet 2>&1 | tail -3
rm -f data/h200/ops/.lock
{ git ls-files -o --exclude-standard data; git diff --name-only -- data; } | sort -u > /tmp/ship.txt
git ls-files -d data > /tmp/gone.txt; cp /tmp/gone.txt "$OUT/gone.txt"
tar czf "$OUT/remeasure.tgz" -T /tmp/ship.txt && wc -l /tmp/ship.txt /tmp/gone.txt
