#!/usr/bin/env bash
# One device call on 2 GPUs: softmax backward as the collector times it against the operands of a real step
# (tools/softmax_bwd_probe.py), and NCCL collectives timed alone against queued (tools/comm_queue_probe.py).
set -u
source tools/gpu_common.sh
python3 -c "from tp_query.collector.device import machine_id; print('machine', machine_id())"
timeout 200 python3 tools/softmax_bwd_probe.py 2>&1 | grep -v -i warn
timeout 200 torchrun --nproc-per-node 2 tools/comm_queue_probe.py 2>&1 | grep -v -i "warn\|\*\*\*\*\|OMP"
