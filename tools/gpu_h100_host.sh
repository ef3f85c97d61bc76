#!/usr/bin/env bash
# One device call on an H100: this host's per-operator host costs (plain eager PyTorch at 1-8 layers, one rank: what
# `make validate-dist` measures on the H200 hosts as kind `plain`; the engine has none for an H100 host otherwise),
# then the generic grid's remaining points (resumable). One tarball back.
set -u
source tools/gpu_common.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout ${HOST_S:-150} torchrun --nproc-per-node 1 -m tp_query.collector dist-probe --gpu h100 --what host \
  --host-kinds plain 2>&1 | grep -v Warning | tail -12
timeout ${COLLECT_S:-360} python3 -m tp_query.collector collect --gpu h100 --out data/h100/ops --grid \
  --repeat-fraction 0.03 --budget-s $(( ${COLLECT_S:-360} - 30 )) --quiet 2>&1 | tail -6
ship h100-host
