#!/usr/bin/env bash
# One device call: the calls of Gemma-4 and gpt-oss the grid covered only by extrapolation or a far blend
# (data/h200/campaigns/arch-gaps.jsonl, resumable; tools/arch_gap_sigs.py writes it), after per-operator profiles
# of the Gemma-4 case in bf16 and amp_bf16 (data/validation/profiles/, to attribute its gap). One tarball back.
set -u
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
timeout ${PROFILE_S:-150} python3 tools/hf_op_profile.py data/validation/profiles \
  gemma4_text-default-L6-mb1-s4096-bf16 gemma4_text-default-L6-mb1-s4096-amp_bf16 2>&1 | grep -v Warning | tail -4
timeout ${COLLECT_S:-400} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops \
  --sigs data/h200/campaigns/arch-gaps.jsonl --budget-s $(( ${COLLECT_S:-400} - 30 )) --quiet 2>&1 | tail -8
ship arch-gaps
