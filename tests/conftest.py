"""Shared fixtures. CI has no GPU: tests marked `gpu` skip there (with the reason shown); everything else
runs for real on the CPU. Engine tests read a database the real collector writes with closed-form
latencies (deterministic under any load); the collector's own tests time real CPU kernels but assert
only on what timing cannot change (rows, keys, files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 344, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
              "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024}
TINY_GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 128, "n_layer": 3, "n_head": 4,
             "vocab_size": 512, "n_positions": 512}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for it in items:
        if "gpu" in it.keywords:
            it.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["TP_QUERY_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny_llama_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("models") / "tiny-llama.json"
    p.write_text(json.dumps(TINY_LLAMA))
    return p


def trace_hf_causal_lm(hf_config: object, vocab: int, setting: object, mb: int, seq: int) -> object:
    """transformers' own CausalLM training step (forward with labels, backward, AdamW) traced as a user's
    module: the reference the graph builders are compared with."""
    import torch
    from tp_query.engine.trace.capture import trace_module
    from transformers import AutoModelForCausalLM

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")

        def forward(self, ids):  # type: ignore[no-untyped-def]
            return self.m(input_ids=ids, labels=ids, use_cache=False).loss

    return trace_module(Wrap, lambda m: (torch.randint(0, vocab, (mb, seq)),), setting)  # type: ignore[arg-type]


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tp_query.engine.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=600)


def run_collector(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tp_query.collector", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=900)


@pytest.fixture(scope="session")
def cpu_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real database written by the collector (tiny grid plus the exact calls of a tiny model) with
    closed-form latencies: the same numbers on an idle or a loaded machine."""
    root = tmp_path_factory.mktemp("db")
    sigs = root / "tiny.jsonl"
    model = root / "tiny.json"
    model.write_text(json.dumps(TINY_LLAMA))
    r = run_cli("sigs", str(model), "--out", str(sigs), "--seq-len", "64", "--micro-batch", "1",
                "--precision", "amp_bf16", "--precision", "fp32")
    assert r.returncode == 0, r.stderr
    r = run_collector("collect", "--gpu", "cpu", "--grid", "--tiny", "1", "--sigs", str(sigs),
                      "--out", str(root / "cpu" / "ops"), "--quiet", "--timer", "closed-form")
    assert r.returncode == 0, r.stderr
    return root

# One tiny config.json per family of the spec registry (built by transformers in the fidelity tests):
# sliding windows shorter than the test sequence so that their masks are real, two layer types where the
# family alternates them, routed experts with shared ones.
_DEC = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 4, "vocab_size": 512, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}
TINY_FAMILIES: dict[str, dict] = {
    "mistral-sw": {**_DEC, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 16},
    "qwen2-sw": {**_DEC, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
                 "sliding_window": 16, "max_window_layers": 2},
    "qwen3": {**_DEC, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64},
    "gemma2": {**_DEC, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 32,
               "sliding_window": 16, "query_pre_attn_scalar": 32, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0},
    "gemma3": {**_DEC, "num_hidden_layers": 6, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
               "head_dim": 32, "sliding_window": 16, "query_pre_attn_scalar": 32, "rope_local_base_freq": 10000.0},
    "phi3": {**_DEC, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "sliding_window": 16, "pad_token_id": 0,
             "num_key_value_heads": 4},
    "gpt-neox": {**_DEC, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
                 "num_key_value_heads": 4, "rotary_pct": 0.25, "layer_norm_eps": 1e-5, "hidden_act": "gelu"},
    "mixtral": {**_DEC, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen2-moe": {**_DEC, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128},
    "qwen3-moe": {**_DEC, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 32, "norm_topk_prob": True},
}
