#!/usr/bin/env bash
# One device call on an H200: held-out training iterations of model types added to the engine on 2026-12-06,
# predicted before they ran (docs/validation-notes.md section 40): Gemma-4's text model (per-layer head sizes and
# input embeddings, six layers) and AFMoE (Arcee Trinity: a dense first layer, then 64 experts), in four settings.
set -u
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout ${VALIDATE_S:-280} python3 -m tp_query.collector validate --gpu h200 \
  --only "${ONLY:-gemma4_text-default-L6,afmoe-default-L4}" --budget-s $(( ${VALIDATE_S:-280} - 20 )) 2>&1 | tail -12
ship new-types
