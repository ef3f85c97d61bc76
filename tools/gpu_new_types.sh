#!/usr/bin/env bash
# One device call on whichever GPU comes (H200 or H100): held-out training iterations of the model types added on
# 2026-12-06, predicted before they ran (docs/validation-notes.md section 40): Gemma-4's text model (per-layer head
# sizes and input embeddings, six layers) and AFMoE (a dense first layer, then 64 experts), four settings each.
# On an H200, memory-efficient attention's half-precision forward grid with the time left (resumable).
set -u
source tools/gpu_common.sh
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$NAME" in *H200*) GPU=h200 ;; *H100*) GPU=h100 ;; *) echo "unknown GPU $NAME"; exit 1 ;; esac
echo "$NAME -> $GPU"
T0=$SECONDS
timeout ${VALIDATE_S:-200} python3 -m tp_query.collector validate --gpu $GPU \
  --only "${ONLY:-gemma4_text-default-L6,afmoe-default-L4}" --budget-s $(( ${VALIDATE_S:-200} - 15 )) 2>&1 | tail -10
LEFT=$(( ${TOTAL_S:-300} - (SECONDS - T0) ))
if [ "$GPU" = h200 ] && [ "$LEFT" -gt 60 ]; then
  timeout $LEFT python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --grid \
    --kinds attn_efficient_fwd --precisions bf16,fp16 --budget-s $(( LEFT - 30 )) --quiet 2>&1 | tail -6
fi
ship new-types
