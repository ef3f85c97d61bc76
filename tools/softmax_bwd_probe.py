"""Why the database's softmax backward is slower than the same call inside a real step: one H200, the call
timed as the collector times it (its inputs: N(0,1) for both tensors) and with the operands a step gives it
(output = a causal softmax, gradient = N(0,1)); CUDA events, median of 20 after warm-up."""
from __future__ import annotations

import functools
import statistics

import torch


def timed(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) * 1e3)
    return statistics.median(out)


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


if __name__ == "__main__":
    main()
