#!/usr/bin/env bash
# One device call on an H100 (SXM, 80 GB HBM3): the H100 user's path end to end. A few real training iterations
# first (held out: no campaign of their exact calls on this GPU), then `make collect GPU=h100`'s generic grid for the
# rest of the time (resumable: a later call continues it). New files come back as one tarball.
set -u
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout ${VALIDATE_S:-150} python3 -m tp_query.collector validate --gpu h100 \
  --only "${ONLY:-llama3-8b-L4-mb1-s4096-bf16,llama3-8b-L4-mb1-s4096-amp_bf16,llama3-8b-L4-mb1-s4096-tf32,qwen2-7b-L2-mb2-s4096-amp_bf16}" \
  --budget-s $(( ${VALIDATE_S:-150} - 20 )) 2>&1 | tail -8
timeout ${COLLECT_S:-380} python3 -m tp_query.collector collect --gpu h100 --out data/h100/ops --grid \
  --repeat-fraction 0.03 --budget-s $(( ${COLLECT_S:-380} - 30 )) --quiet 2>&1 | tail -12
ship h100-start
