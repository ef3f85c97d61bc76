"""Why transformers' Llama-4 experts ran at ~890 TFLOP/s in a real step while the database's batched GEMMs of the
same shapes ran at 660-695 (one H200): the same bmm, [16, 4096, 5120] x [16, 5120, 16384] bf16, timed back to back
with random operands, with the rows a top-1 router zeroes (15 of every 16 experts' rows zero, as
`hidden.repeat(E, 1) * router_scores` makes them), and with weights drawn as models initialise them; the SM clock
and power from NVML beside each train. Prints one line per variant.
    python3 tools/zero_rows_probe.py          (on a GPU)"""
import time

import torch


def main() -> None:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    e, t, k, n = 16, 4096, 5120, 16384
    flops = 2.0 * e * t * k * n
    dev = torch.device("cuda")
    w_rand = torch.randn(e, k, n, device=dev, dtype=torch.bfloat16)
    w_init = (torch.randn(e, k, n, device=dev) * 0.02).to(torch.bfloat16)
    x_rand = torch.randn(e, t, k, device=dev, dtype=torch.bfloat16)
    keep = torch.zeros(e, t, 1, device=dev, dtype=torch.bfloat16)
    owner = torch.randint(0, e, (t,), device=dev)  # each token's one expert
    keep[owner, torch.arange(t, device=dev), 0] = 1.0
    x_routed = x_rand * keep
    for name, x, w in (("random x random", x_rand, w_rand), ("routed rows x random", x_routed, w_rand),
                       ("random x init 0.02", x_rand, w_init), ("routed rows x init 0.02", x_routed, w_init),
                       ("random x random (again)", x_rand, w_rand)):
        time.sleep(1.5)  # from idle, as each database point starts
        for _ in range(3):
            torch.bmm(x, w)
        torch.cuda.synchronize()
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
        clocks, watts = [], []
        for a, b in evs:
            a.record()
            torch.bmm(x, w)
            b.record()
        for _, b in evs:
            while not b.query():
                clocks.append(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
                watts.append(pynvml.nvmlDeviceGetPowerUsage(h) / 1000)
                time.sleep(0.002)
        torch.cuda.synchronize()
        ms = sorted(a.elapsed_time(b) for a, b in evs)
        med = ms[len(ms) // 2]
        print(f"{name:26s} median {med:7.2f} ms  {flops / med / 1e9:6.0f} TFLOP/s  first {ms[0]:6.2f}  "
              f"SM clock {min(clocks or [0])}-{max(clocks or [0])} MHz  power {max(watts or [0]):.0f} W", flush=True)


if __name__ == "__main__":
    main()
