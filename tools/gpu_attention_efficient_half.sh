#!/usr/bin/env bash
# One device call: first the held-out iterations of the model types added on 2026-12-06 (tools/gpu_new_types.sh's
# cases: Gemma-4's text model and AFMoE, predicted before they ran), then memory-efficient attention's forward in
# bf16 and fp16 (its backward grid had them; the forward was priced from fp32's CUDA-core efficiency, 4x fast at
# head size 512) with the time left, resumable. New files come back as one tarball.
set -u
source tools/gpu_common.sh
T0=$SECONDS
timeout ${VALIDATE_S:-170} python3 -m tp_query.collector validate --gpu h200 \
  --only "gemma4_text-default-L6,afmoe-default-L4" --budget-s $(( ${VALIDATE_S:-170} - 15 )) 2>&1 | tail -10
LEFT=$(( ${COLLECT_S:-420} - (SECONDS - T0) ))
if [ "$LEFT" -gt 60 ]; then
  timeout $LEFT python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --grid \
    --kinds attn_efficient_fwd --precisions bf16,fp16 --budget-s $(( LEFT - 30 )) --quiet 2>&1 | tail -6
fi
ship attention-efficient-half
