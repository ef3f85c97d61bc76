#!/usr/bin/env bash
# One device call (an H200: the Qwen3.5-MoE amp runs need more than an 80 GB H100): this instance's interleaved host
# chain probe (the tight-loop slopes the forward host model needs; no H200 probe so far qualifies), the gated-delta runs
# whose only H200 sample is noisy, GPT-2 small in half precision (issue 13's GPT-2-small-shaped misses: host or GPU?),
# then a per-operator profile of Qwen3.5-MoE's bf16 step. Each step ships its tarball as it ends.
set -u
source tools/gpu_common.sh
GPU=$(gpu_kind) || exit 3
HOST_S=${HOST_S:-170} bash tools/gpu_host_chains.sh
# the gated-delta runs whose only H200 sample (an unrecorded host) is the noisiest (Qwen3.5-MoE amp_fp16 650 ms against
# 551 in amp_bf16; OLMo-hybrid amp_bf16 403 against 306 in amp_fp16; its amp runs do not fit an 80 GB H100), then
# GPT-2 small in half precision
CASES="qwen3_5_moe_text-default-L4-mb1-s4096-bf16,qwen3_5_moe_text-default-L4-mb1-s4096-amp_bf16"
CASES="$CASES,qwen3_5_moe_text-default-L4-mb1-s4096-amp_fp16,olmo_hybrid-default-L4-mb1-s4096-amp_bf16"
CASES="$CASES,olmo_hybrid-default-L4-mb1-s4096-bf16,qwen3_5_text-default-L4-mb1-s4096-amp_bf16"
timeout ${VALIDATE_S:-200} python3 -m tp_query.collector validate --gpu $GPU --machine-sample --only "$CASES" \
  --budget-s $(( ${VALIDATE_S:-200} - 15 )) 2>&1 | tail -8
ship gated-delta-sample-$GPU || true
GPT2="gpt2-mb12-s512-fp16,gpt2-mb12-s512-amp_fp16,gpt2-mb12-s512-bf16,gpt2-mb12-s512-amp_bf16"
timeout ${GPT2_S:-70} python3 -m tp_query.collector validate --gpu $GPU --machine-sample --only "$GPT2" \
  --budget-s $(( ${GPT2_S:-70} - 10 )) 2>&1 | tail -5
ship gpt2-sample-$GPU || true
if [ "$GPU" = h200 ]; then
  timeout ${QPROFILE_S:-60} python3 tools/hf_op_profile.py data/validation/profiles \
    qwen3_5_moe_text-default-L4-mb1-s4096-bf16 2>&1 \
    | grep -v Warning | tail -3
  ship qwen-moe-profile
fi
