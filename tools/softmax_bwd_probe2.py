"""The softmax backward kernel inside SDPA's math path (fp32, causal, [1,16,4096,4096] scores) against the same
aten call alone: kernel names and durations from torch.profiler."""
from __future__ import annotations

import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile


def kernels(fn) -> list[tuple[str, float]]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name[:90], round(e.time_range.elapsed_us(), 1)) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 50]


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()


def main() -> None:
    dev = torch.device("cuda")
    for dt in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, 16, 4096, 128, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        print("sdpa math", dt, flush=True)
        for n, t in kernels(functools.partial(step, q, k, v)):
            print("   ", n, t)
        g = torch.randn(1, 16, 4096, 4096, device=dev, dtype=dt)
        o = torch.softmax(torch.randn(1, 16, 4096, 4096, device=dev, dtype=dt), -1)
        print("alone", dt, kernels(functools.partial(torch.ops.aten._softmax_backward_data, g, o, -1, dt)))
        del q, k, v, g, o
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
