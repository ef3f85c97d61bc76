"""Fuzz the model-file parser: any JSON value is either a ModelSpec or a one-line ConfigError. Derandomized: the same
examples on every run (a random draw once found a newline in a refusal; tests/test_fuzz_config.py now keeps it)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tp_query.schema.model_config import ConfigError, parse_config

from .conftest import TINY_GPT2, TINY_LLAMA

CASES = {"n": 0}
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                           max_leaves=8)


def _check(obj: object) -> None:
    CASES["n"] += 1
    try:
        spec = parse_config(obj)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert spec.hidden_size > 0 and spec.num_layers > 0 and spec.vocab_size > 0
    assert spec.num_heads % spec.num_kv_heads == 0


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None, derandomize=True)
@given(json_values)
def test_arbitrary_json(obj: object) -> None:
    _check(obj)


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow], deadline=None, derandomize=True)
@given(st.sampled_from([TINY_LLAMA, TINY_GPT2]), st.dictionaries(
    st.sampled_from(["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size",
                     "intermediate_size", "head_dim", "n_embd", "n_head", "n_layer", "n_inner", "rope_theta",
                     "rope_parameters", "architectures", "model_type", "rms_norm_eps", "hidden_act",
                     "tie_word_embeddings", "sliding_window", "attn_pdrop"]),
    json_values, max_size=4))
def test_mutated_real_configs(base: dict, changes: dict) -> None:
    _check({**base, **changes})
    _check(json.loads(json.dumps({**base, **changes})))


def test_a_thousand_fixed_mutations() -> None:
    """Standalone and deterministic: 1,000 seeded mutations of real configs, each a spec or one line."""
    import random

    rng = random.Random(0)
    keys = ["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size",
            "intermediate_size", "head_dim", "n_embd", "n_head", "n_layer", "rope_theta", "tie_word_embeddings"]
    values: list[object] = [None, True, False, 0, -1, 1, 3, 7, 64, 2**40, 1.5, float("nan"), "8", "false", [], {}]
    before = CASES["n"]
    for _ in range(1000):
        base = dict(rng.choice([TINY_LLAMA, TINY_GPT2]))
        for k in rng.sample(keys, rng.randint(1, 3)):
            base[k] = rng.choice(values)
        _check(base)
    assert CASES["n"] - before == 1000


def test_family_configs_mutated() -> None:
    """The spec registry's families (sliding windows, layer types, experts, shared experts, Gemma-3's
    multimodal wrapper): 3,000 seeded mutations, each a spec or one line, never another exception."""
    import random

    from .conftest import TINY_FAMILIES

    rng = random.Random(1)
    keys = ["sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "sliding_window_pattern",
            "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "text_config",
            "query_pre_attn_scalar", "rotary_pct", "hidden_activation", "head_dim", "num_hidden_layers",
            "attention_bias", "pad_token_id", "vocab_size", "intermediate_size"]
    values: list[object] = [None, True, False, 0, -1, 1, 2, 3, 16, 2**40, 1.5, float("nan"), "8", "full_attention",
                            [], {}, ["sliding_attention"] * 4, [1], {"hidden_size": 64}]
    bases = list(TINY_FAMILIES.values()) + [{"architectures": ["Gemma3ForConditionalGeneration"],
                                            "model_type": "gemma3", "text_config": TINY_FAMILIES["gemma3"]}]
    for _ in range(3000):
        base = json.loads(json.dumps(rng.choice(bases)))
        for k in rng.sample(keys, rng.randint(1, 3)):
            base[k] = rng.choice(values)
        _check(base)
        spec = None
        try:
            spec = parse_config(base)
        except ConfigError:
            continue
        assert len(spec.layer_types) in (0, spec.num_layers)
        assert spec.experts_per_token <= spec.num_experts or not spec.num_experts


def test_a_refusal_quoting_a_value_with_a_newline_stays_one_line() -> None:
    """The case a random draw found: GPT-2's n_embd and hidden_size name one setting; two values are refused, and
    a value holding a newline is quoted, not printed raw."""
    _check({**TINY_GPT2, "hidden_size": "\n"})
