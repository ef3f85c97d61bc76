"""Check on the GPU what the CPU tracer assumes: the SDPA backend choice, the autocast policy, the
ops a fused RMSNorm or dropout dispatch, and the software versions. Writes one JSON report."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from tp_query.engine.trace import cuda_composites as sdpa
from tp_query.engine.trace.autocast_cuda import load_policy
from tp_query.schema.messages import first_line

from .device import Device


class _Names(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


_BACKEND_OF = {
    "aten._scaled_dot_product_cudnn_attention.default": "cudnn",
    "aten._scaled_dot_product_flash_attention.default": "flash",
    "aten._scaled_dot_product_efficient_attention.default": "efficient",
}


def sdpa_checks(dev: torch.device) -> list[dict[str, Any]]:
    out = []
    for dtype, d, gqa, masked, p in itertools.product((torch.float16, torch.bfloat16, torch.float32),
                                                      (64, 128, 80, 12), (False, True), (False, True), (0.0, 0.1)):
        q = torch.randn(1, 8, 128, d, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(1, 2 if gqa else 8, 128, d, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(1, 2 if gqa else 8, 128, d, device=dev, dtype=dtype, requires_grad=True)
        mask = torch.ones(128, 128, device=dev, dtype=torch.bool).tril() if masked else None
        log = _Names()
        try:
            with log:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=not masked,
                                                   enable_gqa=gqa)
                o.sum().backward()
            ran = [n for n in log.names if n in _BACKEND_OF]
            got = _BACKEND_OF[ran[0]] if ran else "math"
            err = ""
        except Exception as e:
            got, err = "error", first_line(e)[:200]
        want = sdpa.choose_backend(q.detach().to("meta"), k.detach().to("meta"), v.detach().to("meta"),
                                   mask.to("meta") if mask is not None else None, p, not masked, gqa)
        out.append({"dtype": str(dtype), "head_dim": d, "gqa": gqa, "masked": masked, "dropout": p, "gpu": got,
                    "emulated": want, "match": got == want, "error": err,
                    "ops": sorted(Counter(n for n in log.names if "attention" in n or "pad" in n).items())})
    return out


def autocast_ops() -> dict[str, Any]:
    names = torch._C._dispatch_get_all_op_names()
    cuda = sorted(n.removeprefix("aten::") for n in names
                  if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA"))
    pol = load_policy()["AutocastCUDA"]
    ours = {x.split(".")[0] for k in ("lower_precision", "fp32", "fp32_set_opt_dtype", "promote", "banned",
                                      "unclassified") for x in pol.get(k, [])}
    have = {x.split(".")[0] for x in cuda}
    return {"cuda_autocast_ops": cuda, "missing_from_policy": sorted(have - ours),
            "policy_not_on_gpu": sorted(ours - have)}


def misc_ops(dev: torch.device) -> dict[str, Any]:
    res: dict[str, Any] = {}
    x = torch.randn(4, 64, device=dev, requires_grad=True)
    w = torch.ones(64, device=dev, requires_grad=True)
    for name, fn in (("rms_norm", lambda: F.rms_norm(x, (64,), w)), ("dropout", lambda: F.dropout(x, 0.1)),
                     ("layer_norm", lambda: F.layer_norm(x, (64,), w)), ("gelu_tanh", lambda: F.gelu(x, approximate="tanh"))):
        log = _Names()
        with log:
            fn().sum().backward()
        res[name] = [n for n in log.names if not n.startswith("prim.")]
    return res


def run_probe(device: Device, path: Path) -> dict[str, Any]:
    dev = device.torch_device
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = "absent"
    report: dict[str, Any] = {
        "provenance": device.provenance().__dict__, "transformers": tf_version,
        "sdpa_policy_id": sdpa.POLICY_ID,
        "sdp_priority_order": [int(x) for x in torch._C._get_sdp_priority_order()] if hasattr(
            torch._C, "_get_sdp_priority_order") else None,
    }
    if not device.cpu:
        checks = sdpa_checks(dev)
        report["sdpa"] = checks
        report["sdpa_mismatches"] = [c for c in checks if not c["match"]]
        report["misc_ops"] = misc_ops(dev)
    report["autocast"] = autocast_ops()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    return report
