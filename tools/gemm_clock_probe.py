"""How an H200's clock answers sustained GEMM work: each GEMM of a long train timed on its own (CUDA events
around every call), from an idle GPU, then trains that alternate the GEMM with memory-bound copies of a given
share of its length, with NVML's SM clock and power sampled beside them, and the energy counter over each train. Evidence for a clock model of a
step (docs/validation-notes.md section 14: dense steps run layer GEMMs slower, and single long GEMMs faster,
than a campaign point timed back to back).
    python3 tools/gemm_clock_probe.py OUT [DTYPES]   (on a GPU; writes OUT/gemm-clock.json; DTYPES e.g. fp32,tf32)"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kernel_power_probe import Sampler, energy_mj  # a sibling script of tools/

SHAPES = (  # (m, n, k, dtype): an LM head, a layer GEMM, a large fp16 FFN GEMM, a TF32 and an fp32 (SIMT) one
    (4096, 128256, 4096, "bfloat16"),
    (4096, 14336, 4096, "bfloat16"),
    (8192, 18944, 3584, "float16"),
    (4096, 14336, 4096, "tf32"),
    (4096, 4096, 4096, "fp32"),
)
TRAIN_S = 1.5
DUTIES = (0.25, 1.0, 3.0)  # memory-bound copy time per unit of GEMM time between GEMMs (-1: copies alone)


def main(out: Path) -> None:
    import torch

    dev = torch.device("cuda")
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    res: dict[str, list] = {"shapes": [], "samples": []}
    torch.cuda.init()
    e0 = energy_mj()
    time.sleep(2.0)
    res["idle_w"] = [(energy_mj() - e0) / 2e3]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None  # dtypes to run (default all)
    for m, n, k, name in SHAPES:
        if only and name not in only:
            continue
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        dt = torch.float32 if name in ("tf32", "fp32") else getattr(torch, name)
        a = torch.randn(m, k, device=dev, dtype=dt) * 0.02
        b = torch.randn(k, n, device=dev, dtype=dt) * 0.02
        c = torch.empty(m, n, device=dev, dtype=dt)
        src = torch.empty(2**28, device=dev, dtype=torch.float32)  # 1 GiB: copies that stay in HBM
        dst = torch.empty_like(src)
        for _ in range(3):
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        torch.mm(a, b, out=c)
        ev1.record()
        torch.cuda.synchronize()
        gemm_ms = ev0.elapsed_time(ev1)
        ev0.record()
        dst.copy_(src)
        ev1.record()
        torch.cuda.synchronize()
        copy_ms = ev0.elapsed_time(ev1)
        for duty in (0.0, *DUTIES, -1.0):  # -1: the copies alone (the memory-bound kernels' own power)
            time.sleep(2.0)  # idle: the clock recovers
            copies = round(abs(duty) * gemm_ms / copy_ms) if duty else 0
            calls = max(int(TRAIN_S * 1e3 / (gemm_ms * (1 + abs(duty)))), 8)
            evs = [torch.cuda.Event(enable_timing=True) for _ in range(2 * calls)]
            torch.cuda.synchronize()
            e0, start = energy_mj(), time.perf_counter()
            for i in range(calls):
                evs[2 * i].record()
                if duty >= 0:
                    torch.mm(a, b, out=c)
                evs[2 * i + 1].record()
                for _ in range(copies):
                    dst.copy_(src)
            torch.cuda.synchronize()
            joules, secs = (energy_mj() - e0) / 1e3, time.perf_counter() - start
            gemm_us = [evs[2 * i].elapsed_time(evs[2 * i + 1]) * 1e3 for i in range(calls)]
            at_us = [evs[0].elapsed_time(evs[2 * i]) * 1e3 for i in range(calls)]
            res["shapes"].append({"m": m, "n": n, "k": k, "dtype": name, "duty": duty, "copies_per_gemm": copies,
                                  "copy_ms": copy_ms, "start_s": start - t0, "gemm_us": gemm_us, "at_us": at_us,
                                  "energy_j": joules, "wall_s": secs})
            tail = sorted(gemm_us[len(gemm_us) // 2:])
            print(f"{m}x{n}x{k} {name} duty {duty}: first {gemm_us[0]:.0f} us, median of the second half "
                  f"{tail[len(tail) // 2]:.0f} us over {calls} calls, {joules / secs:.0f} W average", flush=True)
        del a, b, c, src, dst
        torch.cuda.empty_cache()
    sampler.stop.set()
    sampler.join()
    res["samples"] = [(t - t0, clk, w) for t, clk, w in sampler.rows]
    (out / "gemm-clock.json").write_text(json.dumps(res))


if __name__ == "__main__":
    o = Path(sys.argv[1])
    o.mkdir(parents=True, exist_ok=True)
    main(o)
