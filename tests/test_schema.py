"""The contract both sides read: operator registry, signatures, precisions, model configs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tp_query.schema import ops
from tp_query.schema.model_config import ArchFamily, ConfigError, parse_config
from tp_query.schema.ops import Family, OpKind, Registry, describe, grid_calls
from tp_query.schema.precision import DType, Precision
from tp_query.schema.signature import OpCall, TensorSpec, call_key

from .conftest import TINY_GPT2, TINY_LLAMA


def test_duplicate_registration_raises() -> None:
    reg = Registry()
    k = OpKind("a", ("aten.x.default",), Family.ELEMENTWISE, lambda c: {})
    reg.register(k)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register(k)
    with pytest.raises(ValueError, match="already registered"):
        reg.register(OpKind("b", ("aten.x.default",), Family.ELEMENTWISE, lambda c: {}))


def test_every_grid_call_describes_and_keys() -> None:
    seen = set()
    n = 0
    for kind, p, call in grid_calls():
        info = describe(call, p == Precision.TF32)
        assert info.kind == kind.name
        assert info.bytes > 0
        if info.family == Family.GEMM:
            f = info.features
            # a grouped GEMM's rows (or shared dimension) are the total over its groups
            per = 1 if str(f.get("layout", "")).startswith("grouped:2d") else f["batch"]
            assert info.flops == 2 * per * f["m"] * f["n"] * f["k"]
        if "_v_head_dim" in info.features:  # SDPA: scores over the query/key head, P @ V over the value head
            f = info.features
            dq, dv = call.arg_tensor(0).shape[-1], f["_v_head_dim"]
            assert f.get("layout", "") == ("" if dq == dv else f"dv{dv}")
            assert info.precision == p
        key = call_key(call.op, call.to_json_str(), info.math_mode)
        seen.add(key)
        n += 1
    assert len(seen) > 0.9 * n  # the grid has few duplicates


def test_precision_keys() -> None:
    a = TensorSpec((64, 32), DType.FP32)
    b = TensorSpec((32, 16), DType.FP32)
    mm = OpCall("aten.mm.default", (a, b))
    assert describe(mm, False).precision == Precision.FP32
    assert describe(mm, True).precision == Precision.TF32
    assert describe(mm, True).math_mode == "tf32"
    add = OpCall("aten.add.Tensor", (a, a))
    assert describe(add, True).precision == Precision.FP32  # TF32 only touches matrix math
    assert describe(add, True).math_mode == ""
    # attention backward keeps logsumexp in fp32 but runs in the query's precision
    bwd = ops.attention_bwd_call(ops._CUDNN, 1, 8, 2, 128, 64, DType.BF16, True)
    assert describe(bwd, False).precision == Precision.BF16


def test_signature_roundtrip_and_layout() -> None:
    call = ops.gemm_layout_call(256, 512, 128, "tn", DType.BF16)
    again = OpCall.from_json_str(call.op, call.to_json_str())
    assert again == call
    f = describe(again, False).features
    assert (f["m"], f["n"], f["k"], f["layout"]) == (256, 512, 128, "tn")


def test_parse_configs() -> None:
    s = parse_config(TINY_LLAMA)
    assert s.family == ArchFamily.LLAMA and s.head_dim == 32 and s.num_kv_heads == 2
    g = parse_config(TINY_GPT2)
    assert g.family == ArchFamily.GPT2 and g.intermediate_size == 512 and g.tie_word_embeddings
    new = {**TINY_LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}
    new.pop("rope_theta")
    assert parse_config(new).rope_theta == 5e5 and parse_config(new).rope_type == "llama3"
    q = parse_config({**TINY_LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert q.qkv_bias and not q.o_bias
    assert parse_config({**TINY_LLAMA, "architectures": None, "model_type": "mistral"}).model_type == "mistral"


@pytest.mark.parametrize("bad, msg", [
    ({**TINY_LLAMA, "architectures": ["BertModel"], "model_type": "bert"}, "unsupported architecture"),
    ({**TINY_LLAMA, "hidden_size": -4}, "positive integer"),
    ({**TINY_LLAMA, "num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({**TINY_LLAMA, "vocab_size": None}, "missing vocab_size"),  # left out, it is the class default
    ([1, 2], "JSON object"),
])
def test_bad_configs(bad: object, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        parse_config(bad)


def test_param_count_llama8b() -> None:
    from tp_query.collector.validate import LLAMA3_8B

    assert abs(parse_config(LLAMA3_8B).param_count() - 8.03e9) / 8.03e9 < 0.01


def test_import_hygiene() -> None:
    """The engine (prediction from cached graphs, SQL) and the schema import without torch/pynvml."""
    code = ("import sys; import tp_query.schema.ops, tp_query.schema.tables, tp_query.engine.predict, "
            "tp_query.engine.cli, tp_query.engine.db; "
            "bad = [m for m in ('torch', 'pynvml') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_call_text_is_the_canonical_json() -> None:
    """A call's text is built from each tensor spec's cached text: it equals the sorted, compact JSON of its
    arguments for tensors (strided, offset, host), lists of them, scalars, non-finite floats and kwargs given in
    any order."""
    import json

    from tp_query.schema.signature import SameAs, Scalar, _encode

    t = TensorSpec((4, 8), DType.BF16)
    v = TensorSpec((8, 4), DType.FP32, strides=(1, 8), offset=3)
    h = TensorSpec((), DType.I64, host=True)
    call = OpCall("aten._foreach_addcdiv_.ScalarList", ([t, v, t], [v, t], h, [1.0, float("nan"), -float("inf")],
                                                     SameAs(0), Scalar("dtype", "bf16"), None, True, 3, "x"),
                  (("scale", 0.125), ("alpha", float("inf")), ("dtype", Scalar("dtype", "fp32"))))
    body = {"a": _encode(list(call.args)), "k": {k: _encode(x) for k, x in call.kwargs}}
    assert call.to_json_str() == json.dumps(body, sort_keys=True, separators=(",", ":"))
    again = OpCall.from_json_str(call.op, call.to_json_str())
    assert OpCall(again.op, again.args, again.kwargs).to_json_str() == call.to_json_str()
    # scalars' text is cached: equal values of another type or another sign of zero keep their own text
    for args in ((0.0, -0.0, 1, True, 1.0, 0, False), (-0.0, 0.0, True, 1, 1.0, False, 0)):
        c = OpCall("aten.add.Tensor", (t, *args))
        assert c.to_json_str() == json.dumps({"a": _encode(list(c.args))}, sort_keys=True, separators=(",", ":"))
    assert hash(TensorSpec((4, 8), DType.BF16)) == hash(t) and TensorSpec((4, 8), DType.BF16) == t
    assert TensorSpec((4, 8), DType.FP16) != t and {t: 1}.get(TensorSpec((4, 8), DType.BF16)) == 1
    import pickle

    assert "_hash" not in pickle.loads(pickle.dumps(t)).__dict__ and pickle.loads(pickle.dumps(v)) == v
    # lists joined in C (all specs; plain finite numbers) give the same text as element by element, and a list
    # with a non-finite, boolean or nested element takes the general path
    for lst in ([t, t, v, h], [1.0, 2.5e-7, -0.0, 3, 10**30], [1.0, float("nan")], [True, 1], [0.5, [1.0]],
                [1e308 * 10, 1.0], [t, 1.0], (2.0, 1)):
        c = OpCall("aten._foreach_add_.ScalarList", (lst,))
        assert c.to_json_str() == json.dumps({"a": _encode(list(c.args))}, sort_keys=True, separators=(",", ":"))


def test_a_calls_dtypes_are_its_device_tensors_dtypes_in_order() -> None:
    """dtypes_key and the precision read the device tensors' distinct dtypes in argument order (found from the
    call's distinct spec objects: equal specs given as separate objects count once)."""
    a, b = TensorSpec((4,), DType.FP32), TensorSpec((4,), DType.BF16)
    host = TensorSpec((), DType.I64, host=True)
    c = OpCall("aten._foreach_add_.List", ([TensorSpec((4,), DType.FP32), b, a, host], [b, TensorSpec((2,), DType.FP16)]))
    assert c.device_dtypes() == (DType.FP32, DType.BF16, DType.FP16)
    assert ops.dtypes_key(c) == "fp32,bf16,fp16" and ops.float_dtypes(c) == [DType.FP32, DType.BF16, DType.FP16]
    assert OpCall("aten._foreach_add_.List", ([host],)).device_dtypes() == ()


def test_safe_softmax_is_row_wise_by_row_length() -> None:
    """SDPA's math-path softmax costs per element by its row length, like softmax: scores of 71 heads x 4,096
    queries x 4,096 keys are 290,816 rows of 4,096, never blended with rows of another length by element count."""
    call = OpCall("aten._safe_softmax.default", (TensorSpec((1, 71, 4096, 4096), DType.FP32), -1))
    info = describe(call, False)
    assert info.kind == "safe_softmax_fwd" and info.family == Family.ROWWISE
    assert info.features["rows"] == 71 * 4096 and info.features["cols"] == 4096
    assert info.bytes == 2 * 4 * 71 * 4096 * 4096
    kinds = {kind.name for kind, _, c in grid_calls() if c.op == "aten._safe_softmax.default"}
    assert kinds == {"safe_softmax_fwd"}
