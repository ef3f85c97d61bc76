"""Our graph builders against HuggingFace transformers itself (the version the GPU runs), traced the
same way on the CPU. transformers under fake tensors skips one host check (it treats fake tensors
as tracing), which the real GPU run performs and our builder therefore records: that is the only
allowed difference."""

from __future__ import annotations

from collections import Counter

import pytest
from tp_query.engine.trace.capture import TraceRequest, trace_config
from tp_query.schema.model_config import parse_config
from tp_query.schema.precision import Setting

from .conftest import TINY_GPT2, TINY_LLAMA, trace_hf_causal_lm

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# find_packed_sequence_indices' ops and its .all() check, skipped by transformers under fake tensors
PACKED_CHECK = {"aten.expand.default", "aten.slice.Tensor", "aten.sub.Tensor", "aten.cat.default", "aten.ne.Scalar",
                "aten.cumsum.default", "aten.select.int", "aten.eq.Scalar", "aten.all.default",
                "aten._local_scalar_dense.default"}


def _hf_graph(cfg: dict, setting: Setting, mb: int, seq: int):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig
    from transformers.masking_utils import AttentionMaskInterface

    # no masks while this reference is traced (restored after: other tests trace real sliding-window masks)
    saved = AttentionMaskInterface._global_mapping["sdpa"]
    AttentionMaskInterface.register("sdpa", lambda *a, **k: None)
    try:
        hcfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
        return trace_hf_causal_lm(hcfg, cfg["vocab_size"], setting, mb, seq)
    finally:
        AttentionMaskInterface.register("sdpa", saved)


@pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_GPT2,
                                 {**TINY_LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}],
                         ids=["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("setting", [Setting.AMP_BF16, Setting.FP32, Setting.AMP_FP16])
def test_builder_matches_transformers(cfg: dict, setting: Setting) -> None:
    spec = parse_config(cfg)
    ours = trace_config(TraceRequest(spec, setting, 2, 64, traced_layers=spec.num_layers))
    theirs = _hf_graph(cfg, setting, 2, 64)
    for phase in ("fwd", "bwd", "opt"):
        a = Counter((o.op, o.sig) for o in ours.ops if o.phase.value == phase)
        b = Counter((o.op, o.sig) for o in theirs.ops if o.phase.value == phase)
        extra = {k: v for k, v in (a - b).items() if not (phase == "fwd" and k[0] in PACKED_CHECK)}
        missing = {k: v for k, v in (b - a).items()}
        assert not extra and not missing, (phase, list(extra)[:3], list(missing)[:3])
