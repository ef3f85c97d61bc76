#!/usr/bin/env bash
# One device call, whichever single GPU comes. H200: the arch-gaps campaign (four unrun types' held-out validation,
# the AFMoE/Gemma-4/gpt-oss calls the grid does not bracket, two profiles), then the gated-delta fallback's
# unbracketed calls. H100: those calls, then another H100 host's chain probe. Each step ships its tarball as it ends.
set -u
source tools/gpu_common.sh
GPU=$(gpu_kind) || exit 3
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
if [ "$GPU" = h200 ]; then
  VALIDATE_S=${VALIDATE_S:-200} COLLECT_S=${COLLECT_S:-170} PROFILE_S=${PROFILE_S:-90} bash tools/gpu_arch_gaps.sh
  COLLECT_S=${LA_S:-90} bash tools/gpu_la_collect.sh
else
  COLLECT_S=${LA_S:-180} bash tools/gpu_la_collect.sh
  HOST_S=${HOST_S:-240} bash tools/gpu_host_chains.sh
fi
