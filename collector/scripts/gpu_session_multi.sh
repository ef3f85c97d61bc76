#!/usr/bin/env bash
# One multi-GPU session: NCCL collectives, then distributed training iterations (DP and TP).
# usage: collector/scripts/gpu_session_multi.sh <ngpu> <comm-seconds>
set -u
N=${1:-2}; COMM=${2:-150}
START=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/ns/tp_query && for d in schema engine collector; do ln -sfn "$PWD/$d" /tmp/ns/tp_query/$d; done
export PYTHONPATH=/tmp/ns${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG=$OUT/log.txt
nvidia-smi topo -m >> "$LOG" 2>&1
timeout $(( COMM + 60 )) python3 -m torch.distributed.run --nproc-per-node "$N" -m tp_query.collector comm --gpu h200 \
  --out data/h200/comm --budget-s "$COMM" >> "$LOG" 2>&1
for prec in amp_bf16 bf16; do
  for split in "$N 1" "1 $N"; do
    set -- $split
    timeout 120 python3 -m torch.distributed.run --nproc-per-node "$N" -m tp_query.collector dist-validate --gpu h200 \
      --model data/validation/configs/llama3-8b-L4.json --dp "$1" --tp "$2" --seq-len 4096 --precision "$prec" \
      --out data/validation >> "$LOG" 2>&1
  done
done
tar czf "$OUT/results.tgz" data/h200/comm data/validation
echo "elapsed $(( $(date +%s) - START ))s"; grep -E "\[comm\]|\[dist-validate\]|rror" "$LOG" | tail -30
