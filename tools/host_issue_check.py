"""The host model against measured host issue time. For every validation run that recorded how long its host
takes to issue one step from an idle GPU (`host_ms`: distributed runs per rank; one-GPU runs since session 35),
the model's host time for that step (the per-operator host costs of its instance, the framework's extras,
GradScaler, the per-iteration constant), and the step predicted twice: as the report does, and with every host
cost scaled so that the model's host time equals the measured one ("oracle"). Where the oracle's error is small,
the run's miss is its host speed, not the GPU side or the two-queue composition. (A step with a synchronising
call, like DDP's, includes GPU time in its issue time: its ratio is no host measurement.)
    .venv/bin/python tools/host_issue_check.py [CASE_SUBSTRING ...]"""
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from tp_query.engine import segments
from tp_query.engine.hostsim import HostModel
from tp_query.engine.predict import Engine
from tp_query.engine.validation import Study, load_rows

_SCALE = [1.0]  # every operator's host cost times this (the oracle's evaluation)
_times = segments.Segment.times


def _scaled_times(self, host):  # type: ignore[no-untyped-def]
    g, h = _times(self, host)
    return g, h * _SCALE[0]


segments.Segment.times = _scaled_times  # a diagnostic's patch: this process only


def model_host_ms(asm, host: HostModel) -> float:  # type: ignore[no-untyped-def]
    """The critical stage's host issue time of one step under the model (ms)."""
    h = asm.host_model(host)
    _, _, _, crit = asm.evaluate(host)
    raw, extra = asm.raw[crit], asm.extras[crit]
    m = asm.par.micro_batches
    fb = sum(float(seg.times(h)[1].sum()) * n for ph in ("fwd_parts", "bwd_parts") for seg, n in raw[ph])
    opt = float(raw["opt"].times(h)[1].sum())
    return (m * (fb + extra[0] + extra[1]) + opt + extra[2] + h.per_iteration_us) / 1e3


def scaled_ms(asm, host: HostModel, s: float) -> float:  # type: ignore[no-untyped-def]
    """The step with every host cost times s (a distinct host model, so no cached summary is reused)."""
    kept = asm.extras
    _SCALE[0] = s
    asm.extras = [tuple(x * s for x in e) for e in kept]
    try:
        return asm.evaluate(replace(host, per_iteration_us=host.per_iteration_us * s + 1e-9 * s))[0] / 1e3
    finally:
        _SCALE[0] = 1.0
        asm.extras = kept


def main() -> None:
    want = sys.argv[1:]
    eng = Engine("h200")
    rows = [r for r in load_rows(Path("data/validation"), "h200")
            if not want or any(w in r["case_id"] for w in want)]
    study = Study(eng, rows, with_baselines=False)
    host = HostModel.load(Path("data/h200/calibration.json"))
    print(f"{'case':62} {'meas':>6} {'host':>5} {'model':>5} {'error':>6} {'oracle':>6}")
    base, oracle = [], []
    for c in study.cases:
        asm = study.assembled.get(c.case_id)
        if asm is None or not c.host_ms or not c.measured_ms:
            continue
        hm = model_host_ms(asm, host)
        e0 = 100 * (asm.evaluate(host)[0] / 1e3 / c.measured_ms - 1)
        e1 = 100 * (scaled_ms(asm, host, c.host_ms / hm) / c.measured_ms - 1)
        base.append(abs(e0))
        oracle.append(abs(e1))
        print(f"{c.case_id[:62]:62} {c.measured_ms:6.1f} {c.host_ms:5.1f} {hm:5.1f} {e0:+5.1f}% {e1:+5.1f}%")
    if base:
        print(f"{len(base)} runs: MAPE {statistics.mean(base):.2f}% (max {max(base):.1f}%); with each run's measured "
              f"host time {statistics.mean(oracle):.2f}% (max {max(oracle):.1f}%)")


if __name__ == "__main__":
    main()
