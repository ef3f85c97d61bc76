"""Where Megatron-Core's step spends GPU time, per aten operator (launch with torchrun, one process per GPU):
the campaign's own Megatron build (LLaMA-3-8B shape, 4 layers, DP over the ranks), one profiled step after
warm-up; rank 0 writes OUT/mcore-ops-SETTING.json with {aten op: [device us, calls]}, the iteration and the
kernels' busy time. Compare offline with the engine's operator rows (`--compare OUT`).
    torchrun --nproc-per-node 2 tools/mcore_op_profile.py OUT tf32 bf16      (one GPU: OUT/mcore-ops-1gpu-SETTING.json)
With MOE=1 (and EP=1|2) the Mixtral-8x7B shape at 2 layers as the MoE campaign runs it (DP over the ranks,
experts over EP): OUT/mcore-ops-moe-ep<EP>-SETTING.json."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from gpu_profiles import aten_ops, kernel_busy, print_comparison, shaped_ops

CASE = {"layers": 4, "seq": 4096}
# operators whose call sites STACKS=1 prints (the ones a profile found mistimed or missing in the graph)
STACK_OPS = ("aten::copy_", "aten::fill_", "aten::zero_", "aten::mul", "aten::mul_", "aten::_softmax_backward_data",
             "aten::masked_fill_", "aten::masked_fill", "aten::_softmax")


def _case() -> tuple[dict, int, str]:
    """(config, EP, file tag) of the profiled case: the dense Llama one, or with MOE=1 the MoE one."""
    from tp_query.collector.validate import LLAMA3_8B, MIXTRAL_8X7B, layers_of

    if os.environ.get("MOE"):
        ep = int(os.environ.get("EP", "1"))
        return layers_of(MIXTRAL_8X7B, 2), ep, f"moe-ep{ep}-"
    return layers_of(LLAMA3_8B, CASE["layers"]), 1, ""


def record(out: Path, settings: list[str]) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from tp_query.collector.dist_megatron import build_megatron_step

    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    cfg, ep, tag = _case()
    world = dist.get_world_size()
    tag = f"{tag}{world}gpu-" if world != 2 else tag  # the 2-GPU files keep their names
    for s in settings:
        step, cleanup, _ = build_megatron_step(cfg, s, tp=1, pp=1, micro_batch=1, seq_len=CASE["seq"],
                                               micro_batches=1, distributed_optimizer=False, device=dev, ep=ep)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                     with_stack=bool(os.environ.get("STACKS"))) as prof:
            step()
            torch.cuda.synchronize()
        ops, shaped = aten_ops(prof), shaped_ops(prof, 200)
        if os.environ.get("STACKS") and rank == 0:
            for e in prof.key_averages(group_by_input_shape=True, group_by_stack_n=8):
                if e.key in STACK_OPS and e.self_device_time_total > 500:
                    print(f"STACK {s} {e.key} {e.input_shapes} {e.self_device_time_total / 1e3:.2f} ms x{e.count}: "
                          + " <- ".join(x.split("/")[-1] for x in e.stack[:8]), flush=True)
        busy, span = kernel_busy(prof)
        nccl = sum(ev.time_range.end - ev.time_range.start for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA and "nccl" in ev.name.lower())
        if rank == 0:
            (out / f"mcore-ops-{tag}{s}.json").write_text(json.dumps({"ops": ops, "shaped": shaped, "busy_us": busy,
                                                                 "nccl_us": nccl, "span_us": span,
                                                                 "world": world}))
            print(f"{s}: busy {busy / 1e3:.1f} ms, nccl {nccl / 1e3:.1f} ms, {len(ops)} ops", flush=True)
        cleanup()
    dist.destroy_process_group()


def compare(out: Path) -> None:
    from tp_query.collector.validate import LLAMA3_8B, MIXTRAL_8X7B, layers_of
    from tp_query.engine.api import predict

    for f in sorted(out.glob("mcore-ops-*.json")):
        s = f.stem.removeprefix("mcore-ops-")
        real = json.loads(f.read_text())
        cfg, ep = layers_of(LLAMA3_8B, CASE["layers"]), 1
        world = int(real.get("world", 2))
        s = s.removeprefix(f"{world}gpu-")
        if s.startswith("moe-ep"):
            ep, s = int(s[6]), s[8:]
            cfg = layers_of(MIXTRAL_8X7B, 2)
        p = predict(cfg, dp=world, ep=ep, framework="megatron", precision={"bf16": "mp_bf16", "fp16": "mp_fp16"}.get(s, s),
                    with_ops=True)
        print(f"== {s}: real busy {real['busy_us'] / 1e3:.1f} ms (nccl {real['nccl_us'] / 1e3:.1f}), "
              f"engine {p.iteration_ms:.1f} ms")
        print_comparison(real["ops"], p.ops, 28, by_size=True)

if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(Path(sys.argv[2]))
    else:
        record(Path(sys.argv[1]), sys.argv[2:])
