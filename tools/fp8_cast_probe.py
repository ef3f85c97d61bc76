"""Does a cast to float8 depend on the values cast? Time x.to(float8_e4m3fn) for one shape with inputs
as the collector draws them (N(0,1)) and as torchao's scaling produces them (amax mapped to 448)."""
import torch
from tp_query.collector.timing import Timer

t = Timer(torch.device("cuda"), l2_bytes=60 * 2**20)
for shape in ((4096, 14336), (4096, 4096)):
    base = torch.randn(*shape, device="cuda")
    for name, x in (("N(0,1)", base), ("x448/amax", base * (448.0 / base.abs().max())),
                    ("clamped x448/amax", (base * (448.0 / base.abs().max())).clamp(-448, 448)),
                    ("x1e-3", base * 1e-3), ("zeros", torch.zeros_like(base)),
                    ("N(0,1) bf16", base.bfloat16()), ("x448/amax bf16", (base * (448.0 / base.abs().max())).bfloat16())):
        m = t.measure(lambda x=x: x.to(torch.float8_e4m3fn))
        print(f"{shape} {name:20s} cold {m.median_us:8.1f} us  warm {m.warm_median_us or 0:8.1f} us", flush=True)
