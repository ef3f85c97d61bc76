#!/usr/bin/env bash
# One device call: memory-efficient attention's forward in bf16 and fp16 (its backward grid had them; the forward
# was priced from fp32's CUDA-core efficiency, 4x fast at head size 512), resumable. New files come back as one
# tarball.
set -u
source tools/gpu_common.sh
timeout ${COLLECT_S:-420} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --grid \
  --kinds attn_efficient_fwd --precisions bf16,fp16 --budget-s $(( ${COLLECT_S:-420} - 30 )) --quiet 2>&1 | tail -6
ship attention-efficient-half
