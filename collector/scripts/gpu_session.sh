#!/usr/bin/env bash
# One device-machine session: probe, validation runs, op logs, then the compute campaign with the
# time that is left. Everything resumable; results packed into $OUT/results.tgz.
# usage: collector/scripts/gpu_session.sh <total-seconds> <validate-seconds> [collect args...]
set -u
TOTAL=${1:-560}; VAL=${2:-200}; shift 2 || true
START=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/ns/tp_query && for d in schema engine collector; do ln -sfn "$PWD/$d" /tmp/ns/tp_query/$d; done
export PYTHONPATH=/tmp/ns${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
left() { echo $(( TOTAL - $(date +%s) + START )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> "$LOG" 2>&1
if [ "${PROBE:-1}" = 1 ]; then python3 -m tp_query.collector probe --out data/h200-probe.json >> "$LOG" 2>&1; fi
if [ "$VAL" -gt 0 ]; then timeout $(( VAL + 60 )) python3 -m tp_query.collector validate --gpu h200 --budget-s "$VAL" ${VALARGS:-} >> "$LOG" 2>&1; fi
if [ -n "${MEMTRACE:-}" ]; then timeout 120 python3 -m tp_query.collector memtrace --cases "$MEMTRACE" --out data/validation/memtrace-h200.json >> "$LOG" 2>&1; fi
if [ "${OPLOG:-1}" = 1 ]; then timeout 120 python3 -m tp_query.collector oplog --out data/validation/oplog-h200.parquet >> "$LOG" 2>&1; fi
R=$(left)
if [ "$R" -gt 40 ] && [ $# -gt 0 ]; then timeout $(( R - 15 )) python3 -m tp_query.collector collect --gpu h200 --budget-s $(( R - 35 )) "$@" >> "$LOG" 2>&1; fi
tar czf "$OUT/results.tgz" data
echo "elapsed $(( $(date +%s) - START ))s"; grep -v "^\[collect\] [0-9]" "$LOG" | tail -60
