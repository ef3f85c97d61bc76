#!/usr/bin/env bash
# One device call on an H200 or an H100: what a kernel-launching operator costs the host beyond a view. The plain
# tiny Llama of the host probe, and the same model with 128 views or 128 launching pointwise operators added to each
# decoder layer (kinds chain_views, chain_launches; collector/dist_probe.py), at 1-8 layers, bf16 and amp_bf16, one
# rank, the variants timed in interleaved rounds; every operator counted and classed as the engine classes it. Then
# (H200) the pre-registered gated-delta-rule validation runs (LINEAR=1) or the arch-gaps campaign (ARCH=1: its
# VALIDATE_S, COLLECT_S, PROFILE_S), or (H100) the NaN-operand fp16 grid (COLLECT_S > 0). Tarballs back as each ends.
set -u
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
GPU=$(gpu_kind) || exit 3
lscpu | grep -E "Model name|^CPU\(s\)" | head -2
timeout ${HOST_S:-240} torchrun --nproc-per-node 1 -m tp_query.collector dist-probe --gpu $GPU --what host \
  --host-kinds plain,chain_views,chain_launches 2>&1 | grep -v Warning | grep -E "chain|plain .*per_(op|layer)|error|Error" | tail -40
ship host-chains-$GPU || true
if [ "$GPU" = h200 ] && [ "${LINEAR:-0}" = 1 ]; then
  VALIDATE_S=${VALIDATE_S:-330} COLLECT_S=0 PROFILE_S=0 bash tools/gpu_linear_attention.sh
fi
if [ "$GPU" = h200 ] && [ "${ARCH:-0}" = 1 ]; then
  bash tools/gpu_arch_gaps.sh
fi
if [ "$GPU" = h100 ] && [ "${COLLECT_S:-0}" -gt 0 ]; then
  COLLECT_S=$COLLECT_S bash tools/gpu_h100_nan.sh
fi
