"""What each kernel class draws at full clock, and how its time answers the clock: the constants of a step
clock model (docs/validation-notes.md section 16). For each class, from an idle GPU:
  - a back-to-back train (1.2 s): every call timed by its own CUDA events, NVML's SM clock sampled beside it,
    the energy counter over the train: time and clock of the first 40 ms (full clock) and of the last half
    (settled under the 700 W cap), and the average power;
  - a diluted train: each call followed by fp32 copies of 3x its time (the copies' own power measured alone),
    short enough that the class stays at full clock: its draw at full clock is
    (energy - copy power x copy time) / the class's time.
    python3 tools/kernel_power_probe.py OUT [CLASS,...]      (on a GPU; writes OUT/kernel-power.json)"""
from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TRAIN_S = 1.2
IDLE_S = 1.5
DILUTION = 3.0  # copy time per unit of class time in the diluted train


def _nvml() -> Any:
    import pynvml

    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)


def energy_mj() -> int:
    """The GPU's energy counter since driver load (mJ): exact average power over any interval, unlike the
    power samples NVML averages over its own window."""
    nv, h = _nvml()
    return int(nv.nvmlDeviceGetTotalEnergyConsumption(h))


class Sampler(threading.Thread):
    """NVML SM clock (MHz) and power (W) every ~2 ms, with perf_counter timestamps."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.nv, self.h = _nvml()
        self.rows: list[tuple[float, int, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        nv, h = self.nv, self.h
        while not self.stop.is_set():
            self.rows.append((time.perf_counter(), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                              nv.nvmlDeviceGetPowerUsage(h) / 1e3))
            time.sleep(0.002)

    def clock_between(self, a: float, b: float) -> float | None:
        v = sorted(c for t, c, _ in self.rows if a <= t <= b)
        return float(v[len(v) // 2]) if v else None


def classes() -> dict[str, Callable[[], Callable[[], None]]]:
    """name -> builder of one call (inputs allocated once, outside the timing)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")

    def gemm(m: int, n: int, k: int, dt: torch.dtype, tf32: bool = False) -> Callable[[], None]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(m, k, device=dev, dtype=dt) * 0.02
        b = torch.randn(k, n, device=dev, dtype=dt) * 0.02
        c = torch.empty(m, n, device=dev, dtype=dt)

        def call() -> None:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.mm(a, b, out=c)
        return call

    def fp8() -> Callable[[], None]:
        a = (torch.randn(4096, 4096, device=dev) * 0.1).to(torch.float8_e4m3fn)
        b = (torch.randn(14336, 4096, device=dev) * 0.1).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev)

        def call() -> None:
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return call

    def attention(dt: torch.dtype, s: int, backend: Any, heads: int = 32, kv: int = 8) -> Callable[[], None]:
        q = torch.randn(1, heads, s, 128, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(1, kv, s, 128, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(1, kv, s, 128, device=dev, dtype=dt, requires_grad=True)
        g = torch.randn(1, heads, s, 128, device=dev, dtype=dt)

        def call() -> None:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o.backward(g)
        return call

    def unary(fn: Callable[[Any], Any], numel: int, dt: torch.dtype) -> Callable[[], None]:
        x = torch.randn(numel, device=dev, dtype=dt)

        def call() -> None:
            fn(x)
        return call

    return {
        "gemm_bf16_layer": lambda: gemm(4096, 14336, 4096, torch.bfloat16),
        "gemm_bf16_small": lambda: gemm(6144, 3072, 768, torch.bfloat16),
        "gemm_bf16_head": lambda: gemm(4096, 128256, 4096, torch.bfloat16),
        "gemm_fp16_layer": lambda: gemm(4096, 14336, 4096, torch.float16),
        "gemm_fp16_small": lambda: gemm(6144, 3072, 768, torch.float16),
        "gemm_tf32_layer": lambda: gemm(4096, 14336, 4096, torch.float32, tf32=True),
        "gemm_fp32_layer": lambda: gemm(4096, 4096, 4096, torch.float32),
        "gemm_fp8_layer": fp8,
        "attn_bf16_cudnn": lambda: attention(torch.bfloat16, 4096, SDPBackend.CUDNN_ATTENTION),
        "attn_bf16_flash": lambda: attention(torch.bfloat16, 4096, SDPBackend.FLASH_ATTENTION, kv=32),
        "attn_fp32_efficient": lambda: attention(torch.float32, 2048, SDPBackend.EFFICIENT_ATTENTION, kv=32),
        "ew_bf16_mul": lambda: unary(lambda x: x.mul(1.5), 1 << 28, torch.bfloat16),
        "ew_fp32_softmax": lambda: unary(lambda x: torch.log_softmax(x.view(4096, -1), -1), 4096 * 32768,
                                         torch.float32),
    }


def timed_train(call: Callable[[], None], seconds: float, after: Callable[[], None] | None,
                per_call_ms: float) -> dict[str, Any]:
    import torch

    n = max(int(seconds * 1e3 / per_call_ms), 8)
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(2 * n)]
    torch.cuda.synchronize()
    e0, start = energy_mj(), time.perf_counter()
    for i in range(n):
        evs[2 * i].record()
        call()
        evs[2 * i + 1].record()
        if after is not None:
            after()
    torch.cuda.synchronize()
    joules, wall = (energy_mj() - e0) / 1e3, time.perf_counter() - start
    us = [evs[2 * i].elapsed_time(evs[2 * i + 1]) * 1e3 for i in range(n)]
    at = [evs[0].elapsed_time(evs[2 * i]) * 1e3 for i in range(n)]
    return {"calls": n, "us": us, "at_us": at, "energy_j": joules, "wall_s": wall, "start": start}


def main(out: Path, only: list[str] | None) -> None:
    import torch
    from tp_query.collector.timing import events_us

    sampler = Sampler()
    sampler.start()
    torch.cuda.init()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "classes": {}}
    e0 = energy_mj()
    time.sleep(2.0)
    res["idle_w"] = (energy_mj() - e0) / 2e3
    src = torch.empty(2**28, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
    for _ in range(3):
        copy()
    torch.cuda.synchronize()
    time.sleep(IDLE_S)
    ct = timed_train(copy, TRAIN_S, None, 0.6)
    copy_ms = sorted(ct["us"])[len(ct["us"]) // 2] / 1e3
    res["copy"] = {"us_median": copy_ms * 1e3, "watts": ct["energy_j"] / ct["wall_s"]}
    print(f"copies: {copy_ms:.3f} ms each, {res['copy']['watts']:.0f} W", flush=True)
    for name, build in classes().items():
        if only and name not in only:
            continue
        try:
            call = build()
            ms = events_us(call, 1, warmup=3)[0] / 1e3
            time.sleep(IDLE_S)
            b2b = timed_train(call, TRAIN_S, None, ms)
            reps = max(1, round(DILUTION * ms / copy_ms))
            time.sleep(IDLE_S)

            def copies(r: int = reps) -> None:
                for _ in range(r):
                    copy()
            dil = timed_train(call, TRAIN_S, copies, ms + reps * copy_ms)
        except Exception as e:  # a class this machine's torch cannot run: say so, keep the others
            res["classes"][name] = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
            print(f"{name}: {res['classes'][name]['error']}", flush=True)
            continue
        us, at = b2b["us"], b2b["at_us"]
        first = sorted(u for u, t in zip(us, at, strict=True) if t < 40e3) or us[:3]
        settled = sorted(us[len(us) // 2:])
        t0 = b2b["start"]
        f_first = sampler.clock_between(t0, t0 + 0.04)
        f_settled = sampler.clock_between(t0 + b2b["wall_s"] / 2, t0 + b2b["wall_s"])
        class_s = sum(dil["us"]) / 1e6
        copies_s = max(dil["wall_s"] - class_s, 0.0)
        full_w = (dil["energy_j"] - res["copy"]["watts"] * copies_s) / class_s if class_s > 0 else None
        dus = sorted(dil["us"])
        row = {"first_us": first[len(first) // 2], "settled_us": settled[len(settled) // 2],
               "diluted_us": dus[len(dus) // 2], "clock_first_mhz": f_first, "clock_settled_mhz": f_settled,
               "b2b_w": b2b["energy_j"] / b2b["wall_s"], "full_clock_w": full_w, "copies_per_call": reps,
               "b2b_calls": b2b["calls"], "diluted_calls": dil["calls"]}
        res["classes"][name] = row
        print(f"{name}: first {row['first_us']:.0f} us @ {f_first}, settled {row['settled_us']:.0f} us @ "
              f"{f_settled}, diluted {row['diluted_us']:.0f} us; back to back {row['b2b_w']:.0f} W, "
              f"full clock {full_w:.0f} W", flush=True)
        del call
        torch.cuda.empty_cache()
    sampler.stop.set()
    sampler.join()
    (out / "kernel-power.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    o = Path(sys.argv[1])
    o.mkdir(parents=True, exist_ok=True)
    main(o, sys.argv[2].split(",") if len(sys.argv) > 2 else None)
