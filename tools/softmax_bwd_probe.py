"""Why the database's softmax backward looked twice as slow as the same call inside a real step (one H200):
the call timed as the collector times it (its inputs: N(0,1) for both tensors) and with the operands a step
gives it (output = a causal softmax, gradient = N(0,1)), CUDA events, median of 20 after warm-up; with
`--kernels`, the kernels it launches alone and inside SDPA's math path (torch.profiler): two, a multiply and
cunn_SoftMaxBackwardSmem, and the profiler books the first to a nested `mul`."""
from __future__ import annotations

import functools
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from tp_query.collector.timing import events_us


def timed(fn, n: int = 20) -> float:
    return statistics.median(events_us(fn, n, warmup=3))


def main() -> None:
    dev = torch.device("cuda")
    for shape, dt in (((1, 16, 4096, 4096), torch.float32), ((1, 32, 4096, 4096), torch.float32),
                      ((1, 32, 4096, 4096), torch.bfloat16), ((4096, 4096), torch.float32)):
        g = torch.randn(shape, device=dev, dtype=dt)
        o_rand = torch.randn(shape, device=dev, dtype=dt)
        x = torch.randn(shape, device=dev, dtype=torch.float32)
        mask = torch.ones(shape[-2:], device=dev, dtype=torch.bool).triu(1)
        o_causal = torch.softmax(x.masked_fill(mask, float("-inf")), -1).to(dt)
        o_dense = torch.softmax(x, -1).to(dt)
        del x
        res = {}
        for name, o in (("randn", o_rand), ("softmax_causal", o_causal), ("softmax_dense", o_dense)):
            res[name] = timed(functools.partial(torch.ops.aten._softmax_backward_data, g, o, -1, dt))
        g0 = torch.zeros_like(g)
        res["causal_zero_grad"] = timed(functools.partial(torch.ops.aten._softmax_backward_data, g0, o_causal, -1, dt))
        gm = g.masked_fill(mask, 0)
        res["causal_masked_grad"] = timed(functools.partial(torch.ops.aten._softmax_backward_data, gm, o_causal, -1,
                                                            dt))
        from tp_query.collector.timing import Timer  # the collector's own timing of the collector's inputs

        res["collector_timer"] = Timer(dev).measure(
            functools.partial(torch.ops.aten._softmax_backward_data, g, o_rand, -1, dt)).median_us
        print(shape, dt, {k: round(v, 1) for k, v in res.items()}, flush=True)
        del g, o_rand, o_causal, o_dense, g0, gm
        torch.cuda.empty_cache()


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


def kernels_main() -> None:
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
    kernels_main() if "--kernels" in sys.argv else main()
