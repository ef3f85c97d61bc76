"""Graph templates: one structural type's graph with every number a function of the dimensions, fitted from real
traces, must equal a real trace at dimensions it was not fitted on (operators, parameters, allocations and the
memory profile), answer only inside its box and class, and be what a prediction uses without tracing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tp_query.engine import template
from tp_query.engine.graph import Graph
from tp_query.engine.graphcache import TRACE_VERSION, graph_for, trace_fields, trace_version
from tp_query.engine.parallel import ParallelConfig
from tp_query.engine.request import PredictRequest
from tp_query.engine.trace.capture import TraceRequest, trace_config
from tp_query.engine.trace.template_build import build_template
from tp_query.schema.model_config import ModelSpec, parse_config
from tp_query.schema.precision import Setting

from .conftest import TINY_LLAMA

SETTING = Setting.AMP_BF16


def _trace(spec: ModelSpec, d: dict[str, int], sp: bool = False) -> Graph:
    return trace_config(TraceRequest(spec, SETTING, d["mb"], d["seq"], d["tp"], sp and d["tp"] > 1, False, "adamw"))


def _fields(sp: bool = False) -> dict[str, object]:
    return {"setting": SETTING.value, "sp": sp, "rc": False, "opt": "adamw", "fw": "torch"}


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return parse_config(TINY_LLAMA, "tiny")


@pytest.fixture(scope="module")
def tpl_mb1(spec: ModelSpec) -> template.GraphTemplate:
    return build_template(spec, _fields(), ("mb",), TRACE_VERSION, _trace)


def _same(a: Graph, b: Graph) -> None:
    assert [(o.op, o.sig, o.phase, o.section, o.layer, o.alloc_bytes) for o in a.ops] == \
        [(o.op, o.sig, o.phase, o.section, o.layer, o.alloc_bytes) for o in b.ops]
    assert a.params == b.params
    assert a.memory == b.memory
    assert (a.meta.micro_batch, a.meta.seq_len, a.meta.tp, a.meta.traced_layers) == \
        (b.meta.micro_batch, b.meta.seq_len, b.meta.tp, b.meta.traced_layers)


# dimensions none of the build's traces had, vocabularies whose bytes are no multiple of the allocator's block
@pytest.mark.parametrize("heads,kv,hd,ffn,vocab,hidden,seq,tp", [
    (32, 8, 128, 14336, 128256, 4096, 4096, 4),
    (12, 4, 64, 3000, 32002, 768, 1000, 2),
    (48, 16, 96, 20480, 50258, 6144, 8192, 2),
    (16, 8, 128, 11008, 32000, 2048, 2048, 4),
])
def test_template_equals_real_traces(spec: ModelSpec, tpl_mb1: template.GraphTemplate, heads: int, kv: int, hd: int,
                                     ffn: int, vocab: int, hidden: int, seq: int, tp: int) -> None:
    s = dataclasses.replace(spec, num_heads=heads, num_kv_heads=kv, head_dim=hd, intermediate_size=ffn,
                            vocab_size=vocab, hidden_size=hidden)
    d = template.dims_of(s, 1, seq, tp)
    assert d is not None and template.ones_of(d) == ("mb",)
    g = tpl_mb1.instantiate(d, s.to_dict())
    assert g is not None
    _same(g, _trace(s, d))


def test_template_answers_only_in_its_class_and_box(spec: ModelSpec, tpl_mb1: template.GraphTemplate) -> None:
    d = template.dims_of(spec, 1, 1024, 1)
    assert d is not None
    d = {**d, "tp": 2}
    assert d is not None and tpl_mb1.instantiate(d, spec.to_dict()) is not None
    # micro-batch 2 is another class (size-1 dimensions change strides, so operators)
    assert tpl_mb1.instantiate({**d, "mb": 2}, spec.to_dict()) is None
    assert tpl_mb1.instantiate({**d, "kl": 1}, spec.to_dict()) is None
    # a sequence beyond every trace of the build
    assert tpl_mb1.instantiate({**d, "seq": tpl_mb1.box["seq"][1] * 2}, spec.to_dict()) is None


def test_size_one_dimensions_are_their_own_class(spec: ModelSpec) -> None:
    a = _trace(spec, {**template.dims_of(spec, 1, 512, 2)})  # type: ignore[dict-item]
    b = _trace(spec, {**template.dims_of(spec, 2, 512, 2)})  # type: ignore[dict-item]
    assert len(a.ops) != len(b.ops)  # why "mb" is part of the structural key


def test_structure_change_refuses_the_template(spec: ModelSpec) -> None:
    def flaky(s: ModelSpec, d: dict[str, int]) -> Graph:
        g = _trace(s, d)
        if d["seq"] > 2048:  # some build point dispatches one operator more
            g = dataclasses.replace(g, ops=g.ops + g.ops[-1:])
            g.meta.extra["alloc_parts"].append([])
        return g

    with pytest.raises(template.TemplateError, match="change with the dimensions"):
        build_template(spec, _fields(), ("mb",), TRACE_VERSION, flaky)


def test_numbers_are_found_outside_strings_only() -> None:
    text = '{"a":[{"T":[1,4096],"d":"i64","o":-3},2.5e-05,"x1"],"k":{"scale":0.125}}'
    chunks, nums = template.split_numbers(text)
    assert nums == [1, 4096, -3, 2.5e-05, 0.125]
    assert template._render(chunks, nums) == text


def test_prediction_from_the_template_equals_the_traced_one(spec: ModelSpec, tpl_mb1: template.GraphTemplate,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            cpu_db: Path) -> None:
    from tp_query.engine.predict import Engine

    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(template, "_LOADED", {})
    monkeypatch.setattr(template, "shipped_dir", lambda: tmp_path / "no-shipped")  # this tiny Llama's type is shipped
    model = {**TINY_LLAMA, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4}  # 2 KV heads a rank
    spec = parse_config(model, "tiny")
    req = PredictRequest(model=model, model_name="tiny", gpu="cpu", setting=SETTING,
                         parallel=ParallelConfig(dp=2, tp=2, micro_batch=1), seq_len=1024)
    traced = Engine("cpu", str(cpu_db)).predict(req)
    assert not (graph_for(req).meta.extra or {}).get("template")
    key = template.structure_key(spec, trace_fields(req), ("mb",), TRACE_VERSION)
    assert key == tpl_mb1.key
    tpl_mb1.save(template.user_dir() / f"{key}.json.gz")
    monkeypatch.setattr(template, "_LOADED", {})
    g = graph_for(req)
    assert g.meta.extra["template"] == key
    p = Engine("cpu", str(cpu_db)).predict(req)
    assert p.iteration_ms == pytest.approx(traced.iteration_ms, rel=1e-9)
    assert p.peak_memory_gib == pytest.approx(traced.peak_memory_gib, rel=1e-9)
    assert "template" in p.config["model_graph"]["graph"]
    # a damaged template file is not used: the request is traced again
    (template.user_dir() / f"{key}.json.gz").write_bytes(b"\x1f\x8bnot a template")
    monkeypatch.setattr(template, "_LOADED", {})
    assert not (graph_for(req).meta.extra or {}).get("template")


@pytest.mark.parametrize("setting, tp, sp, hd", [
    (Setting.MP_BF16, 1, False, 64), (Setting.MP_BF16, 2, True, 64), (Setting.MP_FP16, 2, False, 64),
    (Setting.FP8_TENSORWISE, 1, False, 64), (Setting.FP8_ROWWISE, 1, False, 64),
    # fp32/tf32: PyTorch's math attention for grouped heads (its q/k scale sqrt(hd ** -0.5), a float slot)
    (Setting.FP32, 1, False, 96), (Setting.TF32, 2, True, 80), (Setting.TF32, 2, False, 112),
])
def test_shipped_templates_equal_real_traces(setting: Setting, tp: int, sp: bool, hd: int) -> None:
    """The shipped templates of the search's other precisions (FSDP2's MixedPrecisionPolicy recipes, torchao
    float8 at TP=1) at dimensions none of their builds traced: the same graph as a real trace."""
    if setting.value.startswith("fp8"):
        pytest.importorskip("torchao", reason="the fp8 settings trace torchao's float8 training")
    _shipped_equals_real_trace("llama3.1-8b", setting, tp, sp, hd)


def _shipped_equals_real_trace(example: str, setting: Setting, tp: int, sp: bool, hd: int,
                               extra: dict[str, object] | None = None) -> None:
    """The example model cut to sizes no template build traced (head size `hd`), with `extra` config keys: the
    shipped template of its type instantiates to the graph a real trace of that config gives."""
    import json

    base = json.loads((Path(__file__).resolve().parents[1] / "examples" / f"{example}.json").read_text())
    cfg = {**base, "hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": hd,
           "intermediate_size": 3072, "vocab_size": 32002, **(extra or {})}
    spec = parse_config(cfg, "cut")
    assert template.templatable(spec, "torch", 1, 1.0)
    par = ParallelConfig(dp=2, tp=tp, micro_batch=2, sequence_parallel=sp)
    req = PredictRequest(model=cfg, model_name="cut", gpu="cpu", setting=setting, parallel=par, seq_len=1000)
    dims = template.dims_of(spec, par.micro_batch, req.seq_len, par.tp)
    assert dims is not None
    key = template.structure_key(spec, trace_fields(req), template.ones_of(dims),
                                 trace_version(setting.value, "torch"))
    t = template.find(key)
    assert t is not None and t.covers(dims), f"no shipped template {key} for {example} {setting.value} tp={tp} sp={sp}"
    g = t.instantiate(dims, spec.to_dict())
    assert g is not None
    real = trace_config(TraceRequest(spec, setting, par.micro_batch, req.seq_len, tp, sp, False, "adamw"))
    _same(g, real)


@pytest.mark.parametrize("setting, tp, sp, hd", [
    (Setting.AMP_BF16, 2, False, 96), (Setting.BF16, 2, True, 64), (Setting.AMP_FP16, 1, False, 80),
    (Setting.FP32, 1, False, 112),
])
def test_shipped_hf_builder_templates_equal_real_traces(setting: Setting, tp: int, sp: bool, hd: int) -> None:
    """Qwen3 is traced from transformers' own module, which reads its sizes from the config: a shipped template,
    built from Qwen3-8B's config with those keys rewritten per trace, equals a real trace of another Qwen3 config
    (sizes none of its builds traced) parsed as a user's would be."""
    _shipped_equals_real_trace("qwen3-8b", setting, tp, sp, hd)


# keys of real config.json files that the shipped examples spell otherwise or not at all (Llama-2's, Qwen3-14B's)
_OTHER_LLAMA = {"rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 4096, "bos_token_id": 1,
                "eos_token_id": 2, "torch_dtype": "float16", "transformers_version": "4.31.0.dev0",
                "initializer_range": 0.01}
_OTHER_QWEN3 = {"rope_theta": 500000.0, "max_position_embeddings": 32768, "bos_token_id": 151643,
                "eos_token_id": 151645, "initializer_range": 0.01, "attention_dropout": 0.0, "max_window_layers": 28,
                "use_sliding_window": False, "sliding_window": None, "rope_scaling": None, "torch_dtype": "bfloat16",
                "transformers_version": "4.51.0"}


@pytest.mark.parametrize("example, extra, setting, tp, sp", [
    ("llama3.1-8b", _OTHER_LLAMA, Setting.AMP_BF16, 2, True), ("llama3.1-8b", _OTHER_LLAMA, Setting.FP32, 1, False),
    ("qwen3-8b", _OTHER_QWEN3, Setting.BF16, 2, False), ("qwen3-8b", _OTHER_QWEN3, Setting.AMP_FP16, 1, False),
])
def test_a_users_own_config_finds_the_shipped_type(example: str, extra: dict[str, object], setting: Setting,
                                                   tp: int, sp: bool) -> None:
    """A config.json as published (token ids, initialisation, rope base and length, windows switched off) is the
    structural type of the shipped example it differs from in nothing the step reads: the same template, equal
    to a real trace of that config."""
    _shipped_equals_real_trace(example, setting, tp, sp, 128, extra)


@pytest.mark.parametrize("example, extra, tp", [
    ("llama2-7b", {"num_attention_heads": 8, "num_key_value_heads": 8}, 1),
    ("llama2-7b", {"num_attention_heads": 8, "num_key_value_heads": 8}, 2),
    ("llama3.2-3b", {}, 1), ("llama3.2-3b", {}, 2),
])
def test_shipped_multi_head_and_tied_types_equal_real_traces(example: str, extra: dict[str, object], tp: int) -> None:
    """Multi-head attention (one query head per KV head: Llama-2-7B) and tied embeddings (Llama-3.2-3B) are types
    of their own; their amp_bf16 types without SP are shipped (the other precisions are traced at first use)."""
    _shipped_equals_real_trace(example, Setting.AMP_BF16, tp, False, 128, extra)


@pytest.mark.parametrize("example, change", [
    ("qwen3-8b", {"attention_dropout": 0.1}), ("qwen3-8b", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
    ("qwen3-8b", {"pad_token_id": 3}), ("qwen3-8b", {"tie_word_embeddings": True}),
    ("qwen3-8b", {"rms_norm_eps": 1e-5}), ("llama3.1-8b", {"pad_token_id": 3}),
    ("llama3.1-8b", {"tie_word_embeddings": True}), ("llama3.1-8b", {"attention_bias": True}),
])
def test_what_the_step_reads_is_another_structural_type(example: str, change: dict[str, object]) -> None:
    """Dropout that is on, a rope scaling applied in the step, padding_idx, tied weights, a norm's epsilon (a
    scalar of the step's calls) and biases stay in the structural type."""
    import json

    base = json.loads((Path(__file__).resolve().parents[1] / "examples" / f"{example}.json").read_text())
    keys = {template.structure_key(parse_config(c, "m"), _fields(), (), TRACE_VERSION) for c in (base, {**base, **change})}
    assert len(keys) == 2


def test_a_size_key_left_out_of_the_config_is_not_templated() -> None:
    """A config that leaves a size to the model type's default (Qwen3's head size) cannot have it rewritten per
    trace, and one with windowed layers has per-layer kinds: both are traced."""
    import json

    base = json.loads((Path(__file__).resolve().parents[1] / "examples" / "qwen3-8b.json").read_text())
    assert template.templatable(parse_config(base, "q"), "torch", 1, 1.0)
    cut = {k: v for k, v in base.items() if k != "head_dim"}
    assert not template.templatable(parse_config(cut, "q"), "torch", 1, 1.0)
    windowed = {**base, "sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 2}
    assert not template.templatable(parse_config(windowed, "q"), "torch", 1, 1.0)


def test_fp8_with_a_linear_off_the_16_alignment_is_traced_not_templated() -> None:
    """The fp8 settings leave a Linear whose dimensions are not multiples of 16 in bf16 (torchao's _scaled_mm needs
    them): a template fitted on aligned sizes would price it as an fp8 GEMM, so such a request is traced."""
    import json

    from tp_query.engine.graphcache import _structural_type

    base = json.loads((Path(__file__).resolve().parents[1] / "examples" / "llama3.1-8b.json").read_text())

    def typed(cfg: dict[str, object], setting: Setting, tp: int = 1) -> bool:
        req = PredictRequest(model=cfg, model_name="m", gpu="h200", setting=setting, parallel=ParallelConfig(tp=tp),
                             seq_len=1024)
        return _structural_type(parse_config(cfg, "m"), req) is not None

    odd = {**base, "intermediate_size": 14328}  # 14328 = 8 x 1791
    assert typed(base, Setting.FP8_TENSORWISE) and typed(odd, Setting.BF16)
    assert not typed(odd, Setting.FP8_TENSORWISE) and not typed(odd, Setting.FP8_ROWWISE)
    assert template.fp8_aligned(parse_config(base, "m"), 1)
    assert not template.fp8_aligned(parse_config(base, "m"), 3 * 1024)  # a rank's share decides


def test_compiled_copy_and_vectorised_evaluation_equal_the_json_template(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A shipped template loaded through its compiled (marshal) copy is the template the JSON file holds, and the
    vectorised slot evaluation gives every number eval_form gives, at dimensions across its box (a slot that
    is no integer there refuses both)."""
    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path))
    path = sorted(template.shipped_dir().glob("*.json.gz"))[0]
    first = template.GraphTemplate.load(path)  # parses the JSON, writes the compiled copy
    assert list((tmp_path / "templates-compiled").iterdir())
    again = template.GraphTemplate.load(path)  # from the compiled copy
    assert again == first
    for copy in (tmp_path / "templates-compiled").iterdir():  # a damaged copy is ignored and written again
        copy.write_bytes(b"\x00garbage")
    assert template.GraphTemplate.load(path) == first
    lo = {k: a for k, (a, _) in first.box.items()}
    hi = {k: b for k, (_, b) in first.box.items()}
    for dims in (lo, hi, {k: (lo[k] + hi[k]) // 2 for k in lo}, {k: max(lo[k], min(hi[k], 3)) for k in lo}):
        dims = {k: (1 if k in first.ones else v) for k, v in {**dict.fromkeys(template.DIMS, 1), **dims}.items()}
        cache: dict[tuple[int, ...], object] = {}
        want = [template.eval_form(f, dims, cache) for f in first.forms]  # type: ignore[arg-type]
        got = first._plan.evaluate(dims)
        if any(v is None for v in want):
            assert got is None
        else:
            assert got == want and [type(v) for v in got] == [type(v) for v in want]


def test_the_plan_from_columns_equals_eval_form_on_every_kind_of_slot() -> None:
    """Slots of every stored kind, planned from the columns: int64 monomials, ratios (stored as text), integers
    beyond int64 and ones whose value overflows int64 at large dimensions, sums of monomials, float constants and
    powers; each value is eval_form's, and a slot that is no integer at the dimensions refuses the graph."""
    from fractions import Fraction

    one = (1, 0, 0, 0, 0, 0, 0, 0, 0)  # mb
    two = (0, 1, 0, 0, 0, 0, 0, 0, 1)  # seq * tp
    inv = (0, 0, 0, 0, 0, 0, 0, 0, -1)  # 1 / tp
    forms = (("m", 3, 7, one), ("m", Fraction(1, 2), 0, two), ("m", 2**70, 1, one), ("f", 1e-6),
             ("l", ((4, one), (Fraction(3, 2), two))), ("p", 1.0, "hd", -0.5), ("m", 2**40, -5, two),
             ("m", 6, 0, inv), ("m", -(2**51), 2**51 - 1, one), ("m", 5, 0, inv))
    t = template.GraphTemplate.of_forms(key="k", ones=(), box={}, skeleton={}, forms=forms, traces=3,
                                        torch_version="x")
    assert t.forms == forms  # the columns keep every form
    refused = 0
    for seq in (2, 4096, 2**30):  # 2**40 * 2**30 * tp overflows int64: evaluated exactly, one by one
        for tp in (1, 2, 3):
            dims = {**dict.fromkeys(template.DIMS, 1), "mb": 5, "seq": seq, "tp": tp, "hd": 128}
            cache: dict[tuple[int, ...], object] = {}
            want = [template.eval_form(f, dims, cache) for f in forms]  # type: ignore[arg-type]
            got = t._plan.evaluate(dims)
            if any(v is None for v in want):
                assert got is None and tp > 1  # 5 / tp is no integer
                refused += 1
            else:
                assert got == want and [type(v) for v in got] == [type(v) for v in want]
    assert refused == 6


def test_the_shipped_index_lists_every_shipped_template_with_its_box() -> None:
    """A planner decides what to trace from data/templates/index.json without loading templates: it must list
    exactly the shipped files, each with its template's size-1 dimensions and box (a sample is loaded to compare)."""
    import json as _json

    d = template.shipped_dir()
    idx = _json.loads((d / template.INDEX_NAME).read_text())
    assert idx["format"] == template.TEMPLATE_FORMAT
    files = sorted(p.name.split(".")[0] for p in d.glob("*.json.gz"))
    assert sorted(idx["templates"]) == files
    for key in files[:: max(1, len(files) // 12)]:
        t = template.GraphTemplate.load(d / f"{key}.json.gz")
        entry = idx["templates"][key]
        assert tuple(entry["ones"]) == t.ones and {k: tuple(v) for k, v in entry["box"].items()} == t.box
