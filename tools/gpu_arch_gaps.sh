#!/usr/bin/env bash
# One device call on an H200: held-out iterations of four model types never run before, predicted before they ran
# (data/experiments/new-types-s44/predicted.json); the calls of Gemma-4 and gpt-oss the grid covered only by
# extrapolation or a far blend (data/h200/campaigns/arch-gaps.jsonl, resumable; tools/arch_gap_sigs.py writes it);
# then per-operator profiles of the Gemma-4 case in bf16 and amp_bf16 and of ERNIE-4.5-MoE in bf16
# (data/validation/profiles/, to attribute their gaps). One tarball back.
set -u
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
# H200 only: the profiles below would otherwise be another GPU's, filed beside the H200's (a call for nvidia-h200
# may run on an H100)
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in *H200*) ;; *) echo "not an H200"; exit 3 ;; esac
timeout ${VALIDATE_S:-200} python3 -m tp_query.collector validate --gpu h200 \
  --only "${ONLY:-cwm-default-L4,ernie4_5_moe-default-L4,glm4_moe_lite-default-L4,youtu-default-L4}" \
  --budget-s $(( ${VALIDATE_S:-200} - 15 )) 2>&1 | tail -20
ship arch-gaps-validation || true  # what validated, back even if a later step outlives the call's limit
timeout ${COLLECT_S:-240} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops \
  --sigs data/h200/campaigns/arch-gaps.jsonl --budget-s $(( ${COLLECT_S:-240} - 30 )) --quiet 2>&1 | tail -8
timeout ${PROFILE_S:-100} python3 tools/hf_op_profile.py data/validation/profiles \
  gemma4_text-default-L6-mb1-s4096-bf16 gemma4_text-default-L6-mb1-s4096-amp_bf16 \
  ernie4_5_moe-default-L4-mb1-s4096-bf16 2>&1 | grep -v Warning | tail -4
ship arch-gaps
