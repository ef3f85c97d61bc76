"""The SM clock and board power real training steps hold: one-GPU validation cases exactly as the campaign runs
them (collector/validate.py), warmed up, then back-to-back iterations for a few seconds, each timed by CUDA
events, with NVML's SM clock sampled every ~2 ms and the energy counter over the run. Evidence for (or against)
a step clock model (docs/validation-notes.md section 16).
    python3 tools/step_clock_probe.py OUT CASE_ID [CASE_ID ...]      (on a GPU; writes OUT/step-clock.json)"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from kernel_power_probe import Sampler, energy_mj

RUN_S = 4.0


def main(out: Path, case_ids: list[str]) -> None:
    import torch
    from tp_query.collector.validate import build_case_step, default_cases, family_cases

    sampler = Sampler()
    sampler.start()
    cases = {c.case_id: c for c in default_cases() + family_cases()}
    res: dict[str, object] = {}
    for cid in case_ids:
        try:
            step = build_case_step(cases[cid], torch.device("cuda")).step
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            time.sleep(1.5)  # idle: every case starts from the same cool state
            evs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
            e0, t0 = energy_mj(), time.perf_counter()
            while time.perf_counter() - t0 < RUN_S or len(evs) < 5:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step()
                b.record()
                evs.append((a, b))
                if len(evs) % 4 == 0:
                    b.synchronize()
            torch.cuda.synchronize()
            wall, joules = time.perf_counter() - t0, (energy_mj() - e0) / 1e3
            ms = [a.elapsed_time(b) for a, b in evs]
            at = [evs[0][0].elapsed_time(a) for a, _ in evs]
            half = len(ms) // 2
            row = {"steps": len(ms), "ms": ms, "at_ms": at, "watts": joules / wall,
                   "first_ms": ms[0], "median_second_half_ms": statistics.median(ms[half:]),
                   "clock_first_100ms": sampler.clock_between(t0, t0 + 0.1),
                   "clock_second_half": sampler.clock_between(t0 + wall / 2, t0 + wall),
                   # NVML's SM clock (MHz) and board power (W) every ~2 ms: ms since the run's start (the first
                   # step's start event is recorded then), the clock, the power
                   "samples": [[round((t - t0) * 1e3, 2), c, round(w, 1)] for t, c, w in sampler.rows
                               if t0 <= t <= t0 + wall]}
            res[cid] = row
            print(f"{cid}: {len(ms)} steps, first {ms[0]:.1f} ms, second-half median {row['median_second_half_ms']:.1f}"
                  f" ms, {row['watts']:.0f} W, clock {row['clock_first_100ms']} -> {row['clock_second_half']}",
                  flush=True)
            del step
        except Exception as e:  # one case failing (memory, say) keeps the others
            res[cid] = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
            print(f"{cid}: {res[cid]}", flush=True)
        torch.cuda.empty_cache()
    sampler.stop.set()
    sampler.join()
    (out / os.environ.get("STEP_CLOCK_FILE", "step-clock.json")).write_text(json.dumps(res))


if __name__ == "__main__":
    o = Path(sys.argv[1])
    o.mkdir(parents=True, exist_ok=True)
    main(o, sys.argv[2:])
