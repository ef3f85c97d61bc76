#!/usr/bin/env bash
# One device call on 2 GPUs: kernel timelines of distributed steps on every rank (NCCL kernel time, the part of
# it no compute kernel hides, GPU idle) beside the per-aten-op profile (tools/torch_pp_op_profile.py).
# $CASES: case ids (space-separated); the default is the DTensor TP set the per-Linear all-reduces came from.
# The pipelining timelines of the notes: CASES="torch-pp_1f1b-llama3-8b-L4-dp1-tp1-pp2-m4-bf16 ...".
set -u
source tools/gpu_common.sh
mkdir -p "$OUT/prof"
python3 -c "from tp_query.collector.device import machine_id, cpu_model; print('machine', machine_id(), cpu_model())"
CASES=${CASES:-"torch-tp-llama3-8b-L4-dp1-tp2-pp1-m1-tf32 torch-tp_sp-llama3-8b-L4-dp1-tp2-pp1-m1-tf32
  torch-tp-llama3-8b-L4-dp1-tp2-pp1-m1-bf16 torch-tp_sp-llama3-8b-L4-dp1-tp2-pp1-m1-bf16
  torch-tp-qwen2-7b-L4-dp1-tp2-pp1-m1-amp_bf16"}
# shellcheck disable=SC2086
cd tools && timeout 400 torchrun --nproc-per-node 2 torch_pp_op_profile.py "$OUT/prof" $CASES 2>&1 \
  | grep -v -i warn | tail -40
cd "$OUT/prof" && tar czf ../prof.tgz . && ls -la ..
