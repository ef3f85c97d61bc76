#!/usr/bin/env bash
# One device call on 2 GPUs: allocator traces at the peak of DTensor TP steps (tools/torch_memory_probe.py) and
# per-aten-op GPU profiles of DTensor TP steps (tools/torch_pp_op_profile.py); profiles come back in prof.tgz.
set -u
source tools/gpu_common.sh
mkdir -p "$OUT/prof"
timeout 200 torchrun --nproc-per-node 2 tools/torch_memory_probe.py torch-tp_sp-llama3-8b-L4-dp1-tp2-pp1-m1-amp_bf16 torch-tp-llama3-8b-L4-dp1-tp2-pp1-m1-bf16 torch-tp-qwen2-7b-L4-dp1-tp2-pp1-m1-tf32 2>&1 | grep "^rank0" | head -60
cd tools && timeout 200 torchrun --nproc-per-node 2 torch_pp_op_profile.py "$OUT/prof" torch-tp-llama3-8b-L4-dp1-tp2-pp1-m1-tf32 torch-tp-llama3-8b-L4-dp1-tp2-pp1-m1-bf16 torch-tp_sp-llama3-8b-L4-dp1-tp2-pp1-m1-tf32 2>&1 | grep -v -i warn | tail -5
cd "$OUT/prof" && tar czf ../prof.tgz . && ls -la ..
