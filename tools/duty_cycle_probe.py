"""How a large GEMM's time depends on what runs around it (the GPU's power-capped clock): the same call timed
back to back (as a campaign times it), with an idle gap as long as itself after each call, and between
memory-bound kernels of about its length (as a training step runs it). Prints median us and the SM clock.
    python3 tools/duty_cycle_probe.py        (on a GPU)"""
import statistics

import pynvml
import torch

pynvml.nvmlInit()
H = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())


def clock() -> int:
    return int(pynvml.nvmlDeviceGetClockInfo(H, pynvml.NVML_CLOCK_SM))


def run(m: int, n: int, k: int, dt: torch.dtype, mode: str, reps: int = 300) -> tuple[float, float]:
    a = torch.randn(m, k, device="cuda", dtype=dt)
    b = torch.randn(n, k, device="cuda", dtype=dt).t()  # nt: the forward of a Linear
    x = torch.randn(256 * 2**20, device="cuda")  # 1 GiB: a memory-bound copy of ~0.5 ms
    y = torch.empty_like(x)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.mm(a, b)
    torch.cuda.synchronize()
    t_one = None
    clocks = []
    for i, (e0, e1) in enumerate(ev):
        e0.record()
        torch.mm(a, b)
        e1.record()
        if mode == "gap":
            if t_one is None:
                torch.cuda.synchronize()
                t_one = e0.elapsed_time(e1)
            torch.cuda._sleep(int(t_one * 1e-3 * 1.98e9))  # about as long as the GEMM
        elif mode == "memory":
            reps_copy = 2
            for _ in range(reps_copy):
                y.copy_(x)
        if i % 50 == 49:
            torch.cuda.synchronize()
            clocks.append(clock())
    torch.cuda.synchronize()
    ts = [e0.elapsed_time(e1) * 1e3 for e0, e1 in ev[reps // 3:]]
    return statistics.median(ts), statistics.median(clocks)


for m, n, k, dt in ((8192, 18944, 3584, torch.float16), (8192, 18944, 3584, torch.bfloat16),
                    (4096, 14336, 4096, torch.float16), (4096, 4096, 14336, torch.bfloat16)):
    for mode in ("back-to-back", "gap", "memory", "back-to-back"):
        us, mhz = run(m, n, k, dt, mode)
        print(f"{m}x{n}x{k} {str(dt)[6:]:9s} {mode:13s} {us:8.1f} us  SM {mhz:.0f} MHz", flush=True)
