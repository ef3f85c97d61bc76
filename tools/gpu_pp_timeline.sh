#!/usr/bin/env bash
# One device call on 2 GPUs: kernel timelines (every rank) of torch.distributed.pipelining steps, beside
# the per-aten-op profile of the last stage (tools/torch_pp_op_profile.py).
set -u
source tools/gpu_common.sh
mkdir -p "$OUT/prof"
python3 -c "from tp_query.collector.device import machine_id; print('machine', machine_id())"
cd tools && timeout 400 torchrun --nproc-per-node 2 torch_pp_op_profile.py "$OUT/prof" \
  torch-pp_1f1b-llama3-8b-L4-dp1-tp1-pp2-m4-amp_bf16 torch-pp_1f1b-llama3-8b-L4-dp1-tp1-pp2-m4-bf16 \
  torch-pp_gpipe-llama3-8b-L4-dp1-tp1-pp2-m4-bf16 torch-pp_interleaved-llama3-8b-L4-dp1-tp1-pp2-m4-bf16 torch-pp_1f1b-llama3-8b-L4-dp1-tp1-pp2-m4-tf32 2>&1 \
  | grep -v -i warn | tail -40
cd "$OUT/prof" && tar czf ../prof.tgz . && ls -la ..
