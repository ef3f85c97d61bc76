"""Do a real step's GEMMs run at the speed the collector measures them? Capture the operands of every
mm of one eager training step of a LLaMA-3-8B slice (pure fp16 or bf16, AdamW), then time each mm with
those operands, with the collector's random N(0,1) operands, and with the step's operands where only the
gradient side is replaced by random data. Per phase: the ratio of real-data to random-data time."""
import sys
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tp_query.collector.timing import Timer
from tp_query.collector.validate import LLAMA3_8B, _hf_model, layers_of, make_optimizer


class Grab(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.phase = "fwd"
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.mm.default:
            self.calls.append((self.phase, args[0].detach().clone(), args[1].detach().clone()))
        return func(*args, **(kwargs or {}))


def main() -> None:
    t = Timer(torch.device("cuda"), l2_bytes=60 * 2**20)
    for setting in sys.argv[1:] or ["fp16", "bf16"]:
        dt = torch.float16 if setting == "fp16" else torch.bfloat16
        model = _hf_model(layers_of(LLAMA3_8B, 4), dt, torch.device("cuda"))
        opt = make_optimizer("adamw", model)
        ids = torch.randint(0, 128256, (1, 4096), device="cuda")
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        g = Grab()
        with g:
            loss = model(input_ids=ids, labels=ids).loss
            g.phase = "bwd"
            loss.backward()
        opt.zero_grad(set_to_none=True)
        del opt, model
        torch.cuda.empty_cache()
        acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
        for phase, a, b in g.calls:
            if a.numel() * b.shape[1] < 2**30:  # the big GEMMs only
                continue
            real = t.measure(lambda a=a, b=b: torch.mm(a, b)).median_us
            ra = torch.randn_like(a, dtype=torch.float32).to(dt).as_strided(a.shape, a.stride())
            rb = torch.randn_like(b, dtype=torch.float32).to(dt).as_strided(b.shape, b.stride())
            rand = t.measure(lambda ra=ra, rb=rb: torch.mm(ra, rb)).median_us
            half = t.measure(lambda ra=ra, b=b: torch.mm(ra, b)).median_us  # operand a random, b real
            zeros_a = (a == 0).float().mean().item()
            s = acc[phase]
            s[0] += real
            s[1] += rand
            s[2] += half
            s[3] = max(s[3], zeros_a)
            print(f"{setting} {phase} {tuple(a.shape)}x{tuple(b.shape)} real {real:8.1f} rand {rand:8.1f} "
                  f"a-rand {half:8.1f} |a| {a.float().abs().mean().item():.2e} zeros(a) {zeros_a:.2f} "
                  f"|b| {b.float().abs().mean().item():.2e}", flush=True)
        for phase, (real, rand, half, _) in acc.items():
            print(f"== {setting} {phase}: real/random {real / rand:.3f}  (a random, b real)/random {half / rand:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
