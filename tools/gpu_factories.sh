#!/usr/bin/env bash
# One device call: factories (zeros/ones/full/arange/new_*) and slice_backward measured again over their old rows,
# now on the device (collector 0.2.0: the trace records no device for a factory, and replayed without one torch built
# it on the host), plus the grid's new factory sweep. Changed and new files come back as one tarball.
set -u
source tools/gpu_common.sh
OPS=aten.zeros.default,aten.ones.default,aten.full.default,aten.arange.default,aten.arange.start,aten.arange.start_step
OPS=$OPS,aten.scalar_tensor.default,aten.new_zeros.default,aten.new_ones.default,aten.new_full.default
OPS=$OPS,aten.slice_backward.default,aten.select_backward.default
timeout ${COLLECT_S:-480} python3 -m tp_query.collector collect --gpu h200 --out data/h200/ops --grid \
  --sigs data/h200/campaigns/*.jsonl --remeasure-ops $OPS --budget-s $(( ${COLLECT_S:-480} - 30 )) --quiet 2>&1 | tail -12
ship factories
