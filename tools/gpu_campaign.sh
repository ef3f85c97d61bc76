#!/usr/bin/env bash
# One device call: profile the operator calls of signature files ($SIGS, resumable), then time real
# training iterations ($ONLY: case-id substrings, resumable); wheels in $WHEELS are installed first.
# Changed and new files under data/ come back as one tarball.
set -u
source tools/gpu_common.sh
if [ -n "${SIGS:-}" ]; then
  timeout ${COLLECT_S:-300} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --sigs $SIGS \
    --budget-s $(( ${COLLECT_S:-300} - 30 )) --quiet 2>&1 | tail -5
fi
if [ -n "${ONLY:-}" ]; then
  timeout ${VALIDATE_S:-200} python3 -m tp_query.collector validate --gpu h200 --only "$ONLY" \
    --budget-s $(( ${VALIDATE_S:-200} - 20 )) 2>&1 | tail -15
fi
ship campaign
