"""Softmax backward as eager autograd runs it on score-sized tensors, against the bare aten call the collector
times: per kernel (torch.profiler) and per call (CUDA events), for attention-score shapes in fp32 and bf16.
    python3 tools/softmax_bwd_real.py          (on a GPU; prints one line per case and kernel)"""
import torch
from torch.profiler import ProfilerActivity, profile


def events_us(fn, n=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def kernels(fn):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    out = []
    for ev in p.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out.append((ev.name[:70], round(ev.device_time, 1)))
    return out


for dt in (torch.float32, torch.bfloat16):
    for shape in ((1, 32, 4096, 4096), (1, 71, 4096, 4096)):
        x = torch.randn(shape, device="cuda", dtype=dt)
        x.masked_fill_(torch.ones(shape[-2:], dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        y = torch.softmax(x, -1)
        g = torch.randn_like(y)
        bare = lambda: torch.ops.aten._softmax_backward_data(g, y, -1, dt)
        print("bare", dt, shape, round(events_us(bare), 1), kernels(bare), flush=True)
        xr = x.clone().requires_grad_(True)

        def auto():
            yy = torch.softmax(xr, -1)
            yy.backward(g)
        print("autograd fwd+bwd", dt, shape, round(events_us(auto), 1), kernels(auto), flush=True)

        def auto_safe():
            yy = torch.ops.aten._safe_softmax(xr, -1)
            yy.backward(g)
        print("safe fwd+bwd", dt, shape, round(events_us(auto_safe), 1), kernels(auto_safe), flush=True)
        sdpa_in = [torch.randn(1, shape[1], 4096, 64, device="cuda", dtype=dt, requires_grad=True) for _ in range(3)]
        mask = torch.ones(4096, 4096, dtype=torch.bool, device="cuda").tril()

        def math():
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.MATH):
                o = torch.nn.functional.scaled_dot_product_attention(*sdpa_in, attn_mask=mask)
            o.sum().backward()
        print("sdpa-math fwd+bwd", dt, shape, round(events_us(math, 5), 1), kernels(math), flush=True)
        del x, y, g, xr, sdpa_in
        torch.cuda.empty_cache()
