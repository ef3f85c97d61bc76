"""Run a campaign: measure every point not yet in the database, resumably, with a progress bar.

Stops cleanly on SIGINT/SIGTERM or when its time budget is spent (so a 10-minute machine slot can
run it in chunks); every finished point is already in the journal, so even SIGKILL loses nothing.
Failures (unsupported dtype, out of memory) are rows with a reason, never silent gaps.
"""

from __future__ import annotations

import datetime as dt
import gc
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tp_query.schema.messages import first_line
from tp_query.schema.ops import FEATURE_COLUMNS, Family
from tp_query.schema.tables import OPS_SCHEMA, Provenance

from . import replay
from .device import Device
from .plan import Point
from .store import ChunkedStore
from .timing import ClosedFormTimer, Timer


@dataclass(frozen=True)
class CampaignResult:
    measured: int
    skipped_done: int
    remaining: int
    failed: int
    seconds: float

    @property
    def points_per_s(self) -> float:
        return self.measured / self.seconds if self.seconds > 0 else 0.0


class _Stop:
    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.requested = True


def _row(p: Point, prov: Provenance, run: int, status: str, reason: str, m: Any, clocks: tuple[int, int, int]
         ) -> dict[str, Any]:
    row: dict[str, Any] = {
        "key": p.key, "op": p.call.op, "kind": p.info.kind, "family": str(p.info.family),
        "precision": str(p.info.precision), "math_mode": p.info.math_mode, "dtypes": p.info.dtypes,
        "signature": p.call.to_json_str(), "flops": p.info.flops, "bytes": p.info.bytes,
        "status": status, "reason": reason, "campaign": p.campaign, "run": run,
        "measured_at": dt.datetime.now(dt.UTC).replace(microsecond=0),
        "sm_clock_mhz": clocks[0], "mem_clock_mhz": clocks[1], "throttle": clocks[2],
        **prov.__dict__,
    }
    for name in FEATURE_COLUMNS:
        row[name] = p.info.features.get(name)
    if m is not None:
        row.update(latency_us=m.median_us, p20_us=m.p20_us, p80_us=m.p80_us, min_us=m.min_us,
                   samples=len(m.samples_us), latency_warm_us=m.warm_median_us, warm_samples=m.warm_samples,
                   method=m.method)
    else:
        row.update(latency_us=None, p20_us=None, p80_us=None, min_us=None, samples=0, latency_warm_us=None,
                   warm_samples=0, method=None)
    return row


class CampaignAbort(RuntimeError):
    """The CUDA context is unusable (a sticky error): stop without recording the point."""


RANDOM_OPS = ("dropout", "bernoulli", "rand", "normal_", "uniform_", "multinomial", "exponential_")


def uses_rng(p: Point) -> bool:
    """Random operators must not be captured in CUDA graphs (their generator state would leak)."""
    if any(r in p.call.op for r in RANDOM_OPS):
        return True
    return p.info.family == Family.ATTENTION and bool(p.info.features.get("dropout"))


def _check_healthy() -> None:
    try:
        torch.cuda.synchronize()
        (torch.ones(8, device="cuda") * 2).sum().item()
        torch.randn(8, device="cuda").sum().item()  # the default generator is usable too
    except Exception as e:
        raise CampaignAbort(f"CUDA context unusable after an operator error: {first_line(e)}") from None


def measure_point(p: Point, device: Device, timer: Timer | ClosedFormTimer, run: int, prov: Provenance
                  ) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = p.allow_tf32
    torch.backends.cudnn.allow_tf32 = p.allow_tf32
    fn = None
    c0 = device.clocks()
    try:
        fn = replay.build(p.call, device.torch_device, p.operands)  # what cannot run here fails here
        if isinstance(timer, ClosedFormTimer):
            fn()  # run once: an operator this device cannot run fails as it would when measured
            m = timer.estimate(p.info.flops, p.info.bytes, str(p.info.precision))
        else:
            m = timer.measure(fn, graph=p.info.family != Family.ATTENTION and not uses_rng(p))
        c1 = device.clocks()
        clocks = (min(c0.sm_mhz, c1.sm_mhz), min(c0.mem_mhz, c1.mem_mhz), c0.throttle | c1.throttle)
        return _row(p, prov, run, "ok", "", m, clocks)
    except torch.OutOfMemoryError:
        return _row(p, prov, run, "oom", "out of memory", None, (0, 0, 0))
    except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError, AttributeError) as e:
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        status = "unsupported" if (isinstance(e, NotImplementedError) or "not implemented" in msg.lower() or "not supported" in msg.lower()
                                   or "no kernel" in msg.lower()) else "error"
        if device.torch_device.type == "cuda":
            _check_healthy()
        return _row(p, prov, run, status, f"{type(e).__name__}: {msg}", None, (0, 0, 0))
    finally:
        del fn
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True


def run_campaign(points: list[Point], folder: Path, device: Device, *, budget_s: float | None = None,
                 run: int = 1, chunk_points: int = 400, chunk_s: float = 20.0, progress: bool = True,
                 timer: Timer | ClosedFormTimer | None = None, retry_errors: bool = False,
                 remeasure: bool = False) -> CampaignResult:
    """remeasure: measure every point again, its new row replacing the old one wherever that is (after a
    fix to how an operator's inputs are made)."""
    prov = device.provenance()
    campaign = points[0].campaign if points else "empty"
    store = ChunkedStore(folder, f"{campaign}-run{run}" if run > 1 else campaign, OPS_SCHEMA, prov,
                         remeasure=remeasure, per_stack=True)
    done = set() if remeasure else store.done_keys(ok_only=retry_errors)  # a retried failure replaces its row
    # each point once (two sigs files, or a grid and a sigs file, can plan one call twice: its second row made the
    # database refused as a duplicate measurement)
    todo = list({p.key: p for p in points if (p.key, run) not in done}.values())
    skipped = len(points) - len(todo)
    timer = timer or Timer(device.torch_device)
    stop = _Stop()
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.perf_counter()
    last_flush = t0
    measured = failed = 0
    bar = _Progress(len(todo), enabled=progress)
    try:
        for i, p in enumerate(todo):
            if stop.requested or (budget_s is not None and i > 0 and time.perf_counter() - t0 > budget_s):
                break
            row = measure_point(p, device, timer, run, prov)
            store.append(row)
            measured += 1
            failed += row["status"] != "ok"
            bar.advance(p, i + 1)
            now = time.perf_counter()
            if len(store.buffer) >= chunk_points or now - last_flush > chunk_s:
                store.flush()
                last_flush = now
            if device.torch_device.type == "cuda" and i % 200 == 199:
                gc.collect()
                torch.cuda.empty_cache()
    finally:
        store.flush()
        bar.close()
        for s, h in old.items():
            signal.signal(s, h)
    secs = time.perf_counter() - t0
    return CampaignResult(measured, skipped, len(todo) - measured, failed, secs)


class _Progress:
    """A rich progress bar with ETA on a terminal; a line every 30 s otherwise (logs, CI)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled and total > 0
        self.t0 = time.perf_counter()
        self.last = self.t0
        self._bar: Any = None
        if self.enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), transient=False)
            self._bar.start()
            self._task = self._bar.add_task("measuring", total=total)

    def advance(self, p: Point, done: int) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=done, description=f"{p.info.kind:>18} {p.info.precision}")
            return
        now = time.perf_counter()
        if now - self.last > 30 or done == self.total:
            rate = done / (now - self.t0)
            eta = (self.total - done) / rate if rate > 0 else float("inf")
            print(f"[collect] {done}/{self.total} points, {rate:.1f}/s, ETA {eta:.0f}s ({p.info.kind})",
                  file=sys.stderr, flush=True)
            self.last = now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
