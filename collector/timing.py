"""Timing GPU work the way triton's do_bench and nvbench do.

Cold latency: a blocking sleep kernel first lets the host queue every sample, then each sample is
an L2 flush followed by the operator between two CUDA events, so neither launch overhead nor a warm
cache leaks into the number. Warm latency: the operator K times back to back in a CUDA graph (the
state of an operator that consumes what the previous one just wrote). Samples are added in rounds
until the p20-p80 spread is small; every sample is kept. Never a host timer around GPU work.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

SM_HZ_GUESS = 1.98e9  # cycles per second for torch.cuda._sleep sizing (H100/H200 boost clock)


@dataclass(frozen=True)
class Measurement:
    median_us: float
    p20_us: float
    p80_us: float
    min_us: float
    samples_us: tuple[float, ...]
    warm_median_us: float | None
    warm_samples: int
    method: str
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def spread(self) -> float:
        return self.p80_us / self.p20_us if self.p20_us > 0 else float("inf")


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def events_us(fn: Callable[[], object], n: int, queued: int = 1, warmup: int = 1,
              before: Callable[[], object] | None = None) -> list[float]:
    """`n` samples of one call's device time (us): `queued` calls back to back between two CUDA events per
    sample (queued > 1 hides the host's launch, as a busy step does), after `warmup` calls; `before` runs
    ahead of each sample (a barrier). For probes; campaign points go through Timer."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        if before is not None:
            before()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(queued):
            fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) * 1e3 / queued)
    return out


class Timer:
    """One per device: owns the L2 flush buffer and the policy knobs."""

    # step duty cycle: points of at least this long get memory-bound work of their own length after each
    # sample, as a training step runs a GEMM between memory-bound kernels (tools/duty_cycle_probe.py: back to
    # back, the power cap holds a large GEMM 7-23% slower than between memory-bound kernels)
    DUTY_MIN_US: ClassVar[float] = 100.0

    def __init__(self, device: torch.device, l2_bytes: int = 60 * 2**20, target_spread: float = 1.03,
                 min_samples: int = 5, max_samples: int = 60, max_point_s: float = 1.5, duty: bool = False) -> None:
        self.device = device
        self.duty = duty
        self._flush_us = 0.0
        self.cuda = device.type == "cuda"
        self.target_spread = target_spread
        self.min_samples = min_samples
        self.max_samples = max_samples
        self.max_point_s = max_point_s
        self.l2_bytes = l2_bytes
        self._flush = torch.empty(int(2 * l2_bytes) // 4, dtype=torch.int32, device=device) if self.cuda else None

    def flush(self) -> None:
        if self._flush is not None:
            self._flush.zero_()

    # -- cold ---------------------------------------------------------------------------------
    def _cold_round(self, fn: Callable[[], object], n: int, host_us: float, filler_us: float = 0.0) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        fills = max(0, round(filler_us / self._flush_us)) if filler_us and self._flush_us else 0
        # Keep the GPU busy while the host queues n samples (host cost per sample ~ host_us + flushes).
        torch.cuda._sleep(int(min(n * (host_us + 15.0 * (1 + fills)) * 1e-6 * SM_HZ_GUESS, 2e8)))
        for i in range(n):
            self.flush()
            starts[i].record()
            fn()
            ends[i].record()
            for _ in range(fills):  # memory-bound work of the operator's own length (step duty cycle)
                self.flush()
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends, strict=True)]

    def _time_flush(self) -> float:
        """One L2 flush (a memory-bound zero of 2 x L2), in us: the unit of the duty-cycle filler."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.flush()
        a.record()
        for _ in range(20):
            self.flush()
        b.record()
        torch.cuda.synchronize(self.device)
        return a.elapsed_time(b) * 1000.0 / 20

    def _host_us(self, fn: Callable[[], object]) -> float:
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        torch.cuda._sleep(int(2e6))  # ~1 ms: the host call below must not wait on the GPU
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        del t0
        return (t2 - t1) * 1e6

    def measure(self, fn: Callable[[], object], warm: bool = True, graph: bool = True) -> Measurement:
        if not self.cuda:
            return self._measure_cpu(fn)
        fn()  # warm-up: plans, handles, autotuning
        torch.cuda.synchronize(self.device)
        host_us = self._host_us(fn)
        probe = self._cold_round(fn, 3, host_us)
        est = statistics.median(probe)
        duty = self.duty and est >= self.DUTY_MIN_US
        if duty:
            self._flush_us = self._flush_us or self._time_flush()
            probe = self._cold_round(fn, 3, host_us, est)  # the probe again, in the duty cycle
        samples = list(probe)
        deadline = time.perf_counter() + self.max_point_s
        per_round = max(5, min(20, int(20_000 / max(est, 1.0))))
        while len(samples) < self.max_samples and time.perf_counter() < deadline:
            samples.extend(self._cold_round(fn, per_round, host_us, est if duty else 0.0))
            if len(samples) >= self.min_samples and quantile(samples, 0.8) / quantile(samples, 0.2) <= self.target_spread:
                break
        warm_med, warm_n = (None, 0)
        if duty:  # back-to-back replays would undo the duty cycle: the cold samples are the measurement
            return Measurement(statistics.median(samples), quantile(samples, 0.2), quantile(samples, 0.8),
                               min(samples), tuple(samples), None, 0, "events-duty",
                               {"host_us": host_us, "filler_us": est})
        if warm and est < 2000.0:
            k = int(max(1, min(50, 300.0 / max(est, 0.5))))
            warm_med, warm_n = self._warm(fn, est) if graph else self._warm_eager(fn, k)
        return Measurement(statistics.median(samples), quantile(samples, 0.2), quantile(samples, 0.8), min(samples),
                           tuple(samples), warm_med, warm_n, "events", {"host_us": host_us})

    # -- warm ---------------------------------------------------------------------------------
    def _warm(self, fn: Callable[[], object], est_us: float) -> tuple[float | None, int]:
        k = int(max(1, min(50, 300.0 / max(est_us, 0.5))))
        stream = torch.cuda.Stream(self.device)
        try:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(k):
                    fn()
            graph.replay()
            torch.cuda.synchronize(self.device)
        except Exception:
            torch.cuda.synchronize(self.device)
            return self._warm_eager(fn, k)
        reps = 10
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        torch.cuda._sleep(int(2e5))
        for i in range(reps):
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize(self.device)
        per = [s.elapsed_time(e) * 1000.0 / k for s, e in zip(starts, ends, strict=True)]
        del graph
        return statistics.median(per), reps * k

    def _warm_eager(self, fn: Callable[[], object], k: int) -> tuple[float | None, int]:
        reps = 5
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        torch.cuda._sleep(int(min(reps * k * 40e-6 * SM_HZ_GUESS, 2e8)))
        for i in range(reps):
            starts[i].record()
            for _ in range(k):
                fn()
            ends[i].record()
        torch.cuda.synchronize(self.device)
        per = [s.elapsed_time(e) * 1000.0 / k for s, e in zip(starts, ends, strict=True)]
        return statistics.median(per), reps * k

    # -- CPU mode -----------------------------------------------------------------------------
    def _measure_cpu(self, fn: Callable[[], object]) -> Measurement:
        fn()
        samples: list[float] = []
        deadline = time.perf_counter() + min(self.max_point_s, 0.2)
        while len(samples) < self.min_samples or (time.perf_counter() < deadline and len(samples) < self.max_samples):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
            if len(samples) >= self.min_samples and quantile(samples, 0.8) / max(quantile(samples, 0.2), 1e-9) <= self.target_spread:
                break
        return Measurement(statistics.median(samples), quantile(samples, 0.2), quantile(samples, 0.8), min(samples),
                           tuple(samples), statistics.median(samples), len(samples), "cpu-wall")


class ClosedFormTimer:
    """A deterministic stand-in for measurement (tests, CI): latency from the registry's FLOP and byte
    formulas on a fixed synthetic machine, so a test database is the same on an idle or a loaded CPU.
    The operator is not run. Rates are per precision (half precision twice TF32, TF32 twice FP32)."""

    LAUNCH_US = 4.0
    BYTES_PER_US = 20_000.0  # 20 GB/s
    FLOPS_PER_US: ClassVar[dict[str, float]] = {"fp32": 5e4, "tf32": 1e5, "fp16": 2e5, "bf16": 2e5, "fp8": 4e5, "int": 5e4}
    WARM_SHARE = 0.8  # back-to-back latency relative to the cold one

    def latency_us(self, flops: float, nbytes: float, precision: str) -> float:
        return self.LAUNCH_US + flops / self.FLOPS_PER_US.get(precision, 5e4) + nbytes / self.BYTES_PER_US

    def estimate(self, flops: float, nbytes: float, precision: str) -> Measurement:
        us = self.latency_us(flops, nbytes, precision)
        return Measurement(us, us, us, us, (us,) * 5, us * self.WARM_SHARE, 5, "closed-form")
