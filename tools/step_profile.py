"""Where an eager step (torchao float8, bf16 or pure fp16) spends its time on the GPU: kernel busy time (union of kernel
intervals) against the iteration, and the top kernels, for bf16 and fp8 on the same model."""
import functools
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from tp_query.collector.timing import events_us
from tp_query.collector.validate import (
    MODELS,
    _hf_model,
    _iteration,
    layers_of,
    make_optimizer,
)
from tp_query.engine.trace.fp8 import convert_fp8

# usage: step_profile.py SETTING [SETTING ...] [--model NAME --mb N --seq N] (NAME from validate.MODELS)
args = sys.argv[1:]
opts = {"--model": "llama3-8b", "--mb": "1", "--seq": "4096", "--layers": "4"}
for k in list(opts):
    if k in args:
        i = args.index(k)
        opts[k] = args[i + 1]
        del args[i:i + 2]
CFG = layers_of(MODELS[opts["--model"]], int(opts["--layers"])) if opts["--layers"] != "0" else MODELS[opts["--model"]]
DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}
for setting in args or ["bf16", "fp8_tensorwise"]:
    torch.backends.cuda.matmul.allow_tf32 = setting == "tf32"
    model = _hf_model(CFG, DTYPES.get(setting, torch.bfloat16), torch.device("cuda"))
    if setting.startswith("fp8"):
        convert_fp8(model, setting.split("_")[1])
    opt = make_optimizer("adamw", model)
    ids = torch.randint(0, int(CFG["vocab_size"]), (int(opts["--mb"]), int(opts["--seq"])), device="cuda")
    step = functools.partial(_iteration, model, opt, None, ids, None)
    iteration_ms = events_us(step, 1, warmup=4)[0] / 1e3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    iv, by, n = [], defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            iv.append((ev.time_range.start, ev.time_range.end))
            by[ev.name[:70]] += (ev.time_range.end - ev.time_range.start) / 1000
            n[ev.name[:70]] += 1
    iv.sort()
    busy, cur_s, cur_e = 0.0, *iv[0]
    for s, e in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    print(f"{setting}: iteration {iteration_ms:.1f} ms, kernels {len(iv)}, busy {busy / 1000:.1f} ms, "
          f"span {(iv[-1][1] - iv[0][0]) / 1000:.1f} ms")
    for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:12]:
        print(f"   {v:7.2f} ms {n[k]:5d}x {k}")
    # GPU time per aten operator (the kernels each launched), to set against the engine's per-operator rows
    ops = [(e.key, e.self_device_time_total / 1000, e.count) for e in prof.key_averages()
           if e.key.startswith("aten::") and e.self_device_time_total > 0]
    for key, ms, cnt in sorted(ops, key=lambda x: -x[1])[:18]:
        print(f"   op {ms:7.2f} ms {cnt:5d}x {key}")
    # the same per input shape, for the operators whose time the engine misses most (device time with
    # children: a max over a transposed view counts the copy it makes)
    for e in sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.device_time_total):
        if e.key in ("aten::mm", "aten::addmm", "aten::embedding_dense_backward", "aten::_log_softmax",
                     "aten::_log_softmax_backward_data", "aten::nll_loss_forward", "aten::add_", "aten::max", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::abs", "aten::mul",
                     "aten::clamp", "aten::reciprocal", "aten::t", "aten::copy_") and e.device_time_total > 300:
            print(f"   shape {e.device_time_total / 1000:7.2f} ms {e.count:5d}x {e.key} {str(e.input_shapes)[:90]}")
    del model, opt, step
    torch.cuda.empty_cache()
