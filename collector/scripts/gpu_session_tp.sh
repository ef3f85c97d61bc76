#!/usr/bin/env bash
# Distributed TP runs only (after a comm + DP session): collector/scripts/gpu_session_tp.sh <ngpu>
set -u
N=${1:-2}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/ns/tp_query && for d in schema engine collector; do ln -sfn "$PWD/$d" /tmp/ns/tp_query/$d; done
export PYTHONPATH=/tmp/ns PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for prec in amp_bf16 bf16; do
  timeout 150 python3 -m torch.distributed.run --nproc-per-node "$N" -m tp_query.collector dist-validate --gpu h200 \
    --model data/validation/configs/llama3-8b-L4.json --dp 1 --tp "$N" --seq-len 4096 --precision "$prec" \
    --out data/validation >> "$OUT/log.txt" 2>&1
done
tar czf "$OUT/results.tgz" data/validation/validation-dist-*.parquet
grep -E "\[dist-validate\]|rror" "$OUT/log.txt" | tail -8
