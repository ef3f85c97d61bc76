#!/usr/bin/env bash
# One device call on an H200 or an H100: held-out iterations of the four gated-delta-rule model types (Qwen3-Next,
# Qwen3.5 dense and MoE, OLMo-Hybrid; default configs cut to 4 layers: three linear-attention layers and a full one),
# as transformers runs them without flash-linear-attention, predicted before they ran
# (data/experiments/linear-attention-s45/predicted.json for the H200, predicted-h100.json for the H100). Settings whose
# predicted peak does not fit the card are left out (Qwen3-Next's fp32-parameter settings: 134 GiB; on the H100 also
# Qwen3.5-MoE's: 82 GiB). Then, on an H200, the fallback's unbracketed calls (COLLECT_S > 0) and a per-operator
# profile of Qwen3.5's bf16 step. One tarball back.
set -u
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
GPU=$(gpu_kind) || exit 3
python3 -c "import importlib.util as u; print('fla:', u.find_spec('fla'), 'causal_conv1d:', u.find_spec('causal_conv1d'))"
S="mb1-s4096"
ONLY="qwen3_5_text-default-L4-$S-bf16,olmo_hybrid-default-L4-$S-bf16,qwen3_5_moe_text-default-L4-$S-bf16"
ONLY="$ONLY,qwen3_next-default-L4-$S-bf16,qwen3_5_text-default-L4-$S-amp_bf16,olmo_hybrid-default-L4-$S-amp_bf16"
ONLY="$ONLY,qwen3_5_text-default-L4-$S-tf32,olmo_hybrid-default-L4-$S-tf32"
ONLY="$ONLY,qwen3_5_text-default-L4-$S-amp_fp16,olmo_hybrid-default-L4-$S-amp_fp16"
[ "$GPU" = h200 ] && ONLY="$ONLY,qwen3_5_moe_text-default-L4-$S-amp_bf16,qwen3_5_moe_text-default-L4-$S-tf32"
[ "$GPU" = h200 ] && ONLY="$ONLY,qwen3_5_moe_text-default-L4-$S-amp_fp16"
timeout ${VALIDATE_S:-360} python3 -m tp_query.collector validate --gpu $GPU --only "$ONLY" \
  --budget-s $(( ${VALIDATE_S:-360} - 15 )) 2>&1 | tail -20
ship linear-attention-validation || true  # what validated, back even if a later step outlives the call's limit
# after the held-out runs (their predictions were registered first): the fallback's calls the grid does not bracket,
# at other lengths than the cases' 4,096 (tools/linear_attention_sigs.py; resumable)
if [ "$GPU" = h200 ] && [ "${COLLECT_S:-0}" -gt 0 ]; then
  timeout $COLLECT_S python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops \
    --sigs data/h200/campaigns/linear-attention.jsonl --budget-s $(( COLLECT_S - 30 )) --quiet 2>&1 | tail -8
fi
if [ "$GPU" = h200 ] && [ "${PROFILE_S:-90}" -gt 0 ]; then
  timeout ${PROFILE_S:-90} python3 tools/hf_op_profile.py data/validation/profiles \
    qwen3_5_text-default-L4-$S-bf16 2>&1 | grep -v Warning | tail -4
fi
ship linear-attention
