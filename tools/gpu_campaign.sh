#!/usr/bin/env bash
# One device call: profile the operator calls of signature files ($SIGS, resumable), then time real
# training iterations ($ONLY: case-id substrings, resumable); wheels in $WHEELS are installed first.
# Changed and new files under data/ come back as one tarball.
set -u
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
mkdir -p .ns/tp_query && for d in schema engine collector; do ln -sfn "$PWD/$d" .ns/tp_query/$d; done
export PYTHONPATH=$PWD/.ns${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ -n "${SIGS:-}" ]; then
  timeout ${COLLECT_S:-300} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --sigs $SIGS \
    --budget-s $(( ${COLLECT_S:-300} - 30 )) --quiet 2>&1 | tail -5
fi
if [ -n "${ONLY:-}" ]; then
  timeout ${VALIDATE_S:-200} python3 -m tp_query.collector validate --gpu h200 --only "$ONLY" \
    --budget-s $(( ${VALIDATE_S:-200} - 20 )) 2>&1 | tail -15
fi
rm -f data/h200/ops/.lock data/validation/.lock
{ git ls-files -o --exclude-standard data; git diff --name-only -- data; } | sort -u > /tmp/ship.txt
tar czf "$OUT/campaign.tgz" -T /tmp/ship.txt && wc -l < /tmp/ship.txt
