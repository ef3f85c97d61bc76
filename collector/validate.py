"""Real training iterations on the GPU: the measuring stick for the engine.

HuggingFace models built from their configs with random weights, trained in plain PyTorch eager
the way users run them: forward with labels, loss, backward, optimizer step, zero_grad; GradScaler
under amp_fp16. Median iteration time over iterations after warm-up (CUDA events at iteration
boundaries, no extra synchronisation), peak allocated memory, or the OOM. Resumable like the
compute campaign; rows go to data/validation/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import gc
import itertools
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tp_query.engine.trace.fp8 import convert_fp8
from tp_query.engine.trace.torchargs import encode_call, torch_dtype
from tp_query.schema.messages import first_line
from tp_query.schema.precision import SETTINGS, Setting
from tp_query.schema.tables import OPLOG_SCHEMA, VALIDATION_SCHEMA

from .device import Device, cpu_model, machine_id
from .hf_stages import PipeStage
from .store import ChunkedStore, write_table
from .timing import quantile

# the one-GPU campaign: the six plain-PyTorch settings (fp32 master weights need FSDP2 or Megatron-Core)
ALL_SETTINGS = [s.value for s in Setting if not SETTINGS[s].master_weights and not SETTINGS[s].fp8_recipe]


@dataclass(frozen=True)
class Case:
    case_id: str
    model: str
    config: dict[str, Any]
    setting: str
    micro_batch: int
    seq_len: int
    split: str  # calibration | holdout
    optimizer: str = "adamw"
    tp_shard: int = 1
    profile: bool = False
    accum: int = 1  # micro-batches per optimizer step (gradient accumulation)
    pp_stage: str = ""  # "first" | "middle" | "last": one pipeline stage of a PP split, on one GPU
    pp: int = 1

    @property
    def layers(self) -> int:
        return int(self.config.get("num_hidden_layers", self.config.get("n_layer", 0)))


# -- model configs (HF config.json contents; slices of big models keep their layer shapes) -------
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu"}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
GPT2_MEDIUM = {**GPT2, "n_embd": 1024, "n_layer": 24, "n_head": 16}
QWEN2_1_5B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
              "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2, "num_hidden_layers": 28,
              "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
              "tie_word_embeddings": True, "hidden_act": "silu"}
QWEN2_0_5B = {**QWEN2_1_5B, "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
              "num_key_value_heads": 2, "num_hidden_layers": 24}
QWEN2_7B = {**QWEN2_1_5B, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
            "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064, "tie_word_embeddings": False}
LLAMA2_13B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 5120,
              "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 40, "num_hidden_layers": 40,
              "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, "hidden_act": "silu"}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
              "vocab_size": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
              "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu"}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
              "num_key_value_heads": 8, "num_hidden_layers": 80}

# -- the spec registry's other families (config.json of the released models, layers sliced) ----------
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "num_hidden_layers": 36, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False}
MISTRAL_7B_SW = {**MISTRAL_7B, "sliding_window": 2048}
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
             "intermediate_size": 14336, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
             "num_hidden_layers": 42, "vocab_size": 256000, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 8192, "sliding_window": 4096, "query_pre_attn_scalar": 256,
             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
             "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0}
GEMMA3_4B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 2560,
             "intermediate_size": 10240, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
             "num_hidden_layers": 34, "vocab_size": 262208, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
             "rope_local_base_freq": 10000.0, "max_position_embeddings": 131072, "sliding_window": 1024,
             "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0}
PHI3_MINI = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
             "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32,
             "vocab_size": 32064, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
             "sliding_window": 2047, "hidden_act": "silu", "pad_token_id": 32000, "tie_word_embeddings": False}
PYTHIA_1_4B = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 2048,
               "intermediate_size": 8192, "num_attention_heads": 16, "num_hidden_layers": 24, "vocab_size": 50304,
               "rotary_pct": 0.25, "rotary_emb_base": 10000, "layer_norm_eps": 1e-5, "hidden_act": "gelu",
               "max_position_embeddings": 2048, "use_parallel_residual": True, "tie_word_embeddings": False}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_hidden_layers": 32, "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2,
                "hidden_act": "silu", "tie_word_embeddings": False, "router_jitter_noise": 0.0}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48, "vocab_size": 151936,
                 "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "max_position_embeddings": 40960, "hidden_act": "silu",
                 "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
QWEN15_MOE_A27B = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
                   "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                   "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 24,
                   "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 8192,
                   "hidden_act": "silu", "tie_word_embeddings": False, "decoder_sparse_step": 1,
                   "mlp_only_layers": []}
# name -> (config, layers kept, micro-batch, sequence): every case held out of every fitted constant, and
# of the operator database's exact shapes too (families.jsonl profiles their calls at other sequences)
FAMILY_CASES: dict[str, tuple[dict[str, Any], int, int, int]] = {
    "qwen3-8b": (QWEN3_8B, 4, 1, 4096),
    "mistral-7b-sw2048": (MISTRAL_7B_SW, 4, 1, 8192),
    "gemma2-9b": (GEMMA2_9B, 4, 1, 8192),
    "gemma3-4b": (GEMMA3_4B, 6, 1, 4096),
    "phi3-mini": (PHI3_MINI, 4, 1, 4096),
    "pythia-1.4b": (PYTHIA_1_4B, 24, 2, 2048),
    "mixtral-8x7b": (MIXTRAL_8X7B, 2, 1, 4096),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, 4, 1, 4096),
    "qwen1.5-moe-a2.7b": (QWEN15_MOE_A27B, 4, 1, 4096),
}
FAMILY_SETTINGS = ("amp_bf16", "bf16", "tf32")

# Model types the engine knows only through transformers (ArchFamily.TRANSFORMERS): their public configs, cut to a
# few layers; no signature campaign of their shapes (the grid alone prices them).
OLMO2_7B = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 4096,
            "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32,
            "vocab_size": 100352, "rms_norm_eps": 1e-6, "rope_theta": 500000, "max_position_embeddings": 4096,
            "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu", "pad_token_id": 100277}
GRANITE3_8B = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "hidden_size": 4096,
               "intermediate_size": 12800, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 40,
               "vocab_size": 49155, "rms_norm_eps": 1e-5, "rope_theta": 10000000.0, "max_position_embeddings": 131072,
               "embedding_multiplier": 12.0, "logits_scaling": 16.0, "residual_multiplier": 0.22,
               "attention_multiplier": 0.0078125, "attention_bias": False, "mlp_bias": False,
               "tie_word_embeddings": True, "hidden_act": "silu", "pad_token_id": 0}
GEMMA_7B = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_size": 3072,
            "intermediate_size": 24576, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
            "num_hidden_layers": 28, "vocab_size": 256000, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0}
GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
               "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
               "num_hidden_layers": 24, "vocab_size": 201088, "num_local_experts": 32, "num_experts_per_tok": 4,
               "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
               "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "original_max_position_embeddings": 4096},
               "swiglu_limit": 7.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
               "attention_bias": True, "tie_word_embeddings": False, "router_aux_loss_coef": 0.9}
STARCODER2_7B = {"architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "hidden_size": 4608,
                 "intermediate_size": 18432, "num_attention_heads": 36, "num_key_value_heads": 4, "num_hidden_layers": 32,
                 "vocab_size": 49152, "sliding_window": 4096, "hidden_act": "gelu_pytorch_tanh", "norm_epsilon": 1e-5,
                 "use_bias": True, "rope_theta": 1000000.0, "max_position_embeddings": 16384,
                 "bos_token_id": 0, "eos_token_id": 0}
# Layers that differ along the depth beyond attention type (added 2026-12-01, predicted before they ran): GLM-4.5-Air
# (its first layer dense, the rest 128-expert MoE) and SmolLM3 (every fourth layer without RoPE), as published
GLM45_AIR = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096,
             "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_attention_heads": 96,
             "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 46, "vocab_size": 151552,
             "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
             "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
             "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False, "rms_norm_eps": 1e-5,
             "rope_theta": 1000000, "max_position_embeddings": 131072, "hidden_act": "silu",
             "tie_word_embeddings": False, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338]}
SMOLLM3_3B = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 2048,
              "intermediate_size": 11008, "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 36,
              "vocab_size": 128256, "no_rope_layer_interval": 4,
              "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)], "use_sliding_window": False,
              "sliding_window": None, "max_window_layers": 28, "rope_theta": 5000000.0, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 65536, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
              "tie_word_embeddings": True, "pad_token_id": 128004, "eos_token_id": 128012}
# Two more MoE model types (added with the grouped-GEMM grid, predicted from it before their runs were read):
# dots.llm1 (first layer dense, 128 experts, 2 shared) and OLMoE (64 experts in every layer), as published
DOTS1 = {"architectures": ["Dots1ForCausalLM"], "model_type": "dots1", "hidden_size": 4096, "intermediate_size": 10944,
         "moe_intermediate_size": 1408, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
         "num_hidden_layers": 62, "vocab_size": 152064, "n_routed_experts": 128, "n_shared_experts": 2,
         "num_experts_per_tok": 6, "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
         "n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000000, "max_position_embeddings": 32768,
         "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False}
OLMOE_1B_7B = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024,
               "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 16, "vocab_size": 50304,
               "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "rms_norm_eps": 1e-5,
               "rope_theta": 10000, "max_position_embeddings": 4096, "hidden_act": "silu", "tie_word_embeddings": False,
               "pad_token_id": 1}
# Multi-head latent attention (DeepSeek-V2's and V3's model types), first layer dense, 64 experts: DeepSeek-V2-Lite and
# Moonlight-16B-A3B, as published (their YaRN rope scaling left out)
DEEPSEEK_V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
                    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "num_hidden_layers": 27, "vocab_size": 102400, "n_routed_experts": 64,
                    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "head_dim": 64, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000,
                    "max_position_embeddings": 163840, "hidden_act": "silu", "tie_word_embeddings": False,
                    "attention_bias": False, "bos_token_id": 100000, "eos_token_id": 100001}
MOONLIGHT_16B = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 2048,
                 "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_attention_heads": 16,
                 "num_key_value_heads": 16, "num_hidden_layers": 27, "vocab_size": 163840, "n_routed_experts": 64,
                 "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512,
                 "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                 "head_dim": 64, "norm_topk_prob": True, "routed_scaling_factor": 2.446, "n_group": 1, "topk_group": 1,
                 "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 8192, "hidden_act": "silu",
                 "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 163584, "eos_token_id": 163585}
# Llama-4 Scout's language model (16 experts top-1 and a shared expert in every layer, RoPE layers attending within
# 8192-token chunks, every fourth layer without RoPE), and the same with MoE in every other layer as Maverick has it;
# bf16 only: their fp32 master weights do not fit one H200 at 4 layers
LLAMA4_SCOUT = {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "hidden_size": 5120,
                "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_attention_heads": 40,
                "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 48, "vocab_size": 202048,
                "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "no_rope_layers": [],
                "use_qk_norm": True, "attention_chunk_size": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 10485760, "hidden_act": "silu", "tie_word_embeddings": False,
                "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "pad_token_id": 200018,
                "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008]}
LLAMA4_INTERLEAVED = {**LLAMA4_SCOUT, "interleave_moe_layer_step": 2}
GENERIC_CASES: dict[str, tuple[dict[str, Any], int, int, int]] = {
    "olmo2-7b": (OLMO2_7B, 4, 1, 4096),
    "granite3-8b": (GRANITE3_8B, 4, 1, 4096),
    "gemma-7b": (GEMMA_7B, 4, 1, 4096),
    "gpt-oss-20b": (GPT_OSS_20B, 4, 1, 4096),
    "starcoder2-7b": (STARCODER2_7B, 4, 1, 4096),
    "glm4.5-air": (GLM45_AIR, 3, 1, 4096),
    "smollm3-3b": (SMOLLM3_3B, 4, 1, 4096),
    "dots1": (DOTS1, 3, 1, 4096),
    "olmoe-1b-7b": (OLMOE_1B_7B, 4, 1, 4096),
    "deepseek-v2-lite": (DEEPSEEK_V2_LITE, 4, 1, 4096),
    "moonlight-16b": (MOONLIGHT_16B, 4, 1, 4096),
}
GENERIC_SETTINGS = ("amp_bf16", "bf16", "tf32", "amp_fp16")


# torchao float8 training (eager), two families, both recipes; its operator calls profiled at other sequences
FP8_CASES: dict[str, tuple[dict[str, Any], int, int, int]] = {
    "llama3-8b": (LLAMA3_8B, 4, 1, 4096),
    "qwen3-8b": (QWEN3_8B, 4, 1, 4096),
    "mistral-7b": (MISTRAL_7B, 4, 2, 2048),
    # added later, predicted before they ran: two more shapes held out of everything
    "qwen2-7b": (QWEN2_7B, 4, 1, 4096),
    "llama2-13b": (LLAMA2_13B, 3, 1, 4096),
}
FP8_SETTINGS = ("fp8_tensorwise", "fp8_rowwise")


def held_out_cases(table: dict[str, tuple[dict[str, Any], int, int, int]], settings: tuple[str, ...]) -> list[Case]:
    """name -> (config, layers kept, micro-batch, sequence), in each setting: held-out cases."""
    out = []
    for name, (cfg, layers, mb, seq) in table.items():
        model = f"{name}-L{layers}"
        for s in settings:
            out.append(Case(f"{model}-mb{mb}-s{seq}-{s}", model, layers_of(cfg, layers), s, mb, seq, "holdout"))
    return out


def fp8_cases() -> list[Case]:
    return held_out_cases(FP8_CASES, FP8_SETTINGS)


BF16_ONLY_CASES: dict[str, tuple[dict[str, Any], int, int, int]] = {
    "llama4-scout": (LLAMA4_SCOUT, 4, 1, 4096),
    "llama4-interleaved": (LLAMA4_INTERLEAVED, 4, 1, 4096),
}


# Six model types known only to transformers (2026-12-02, predicted before they ran): the configs transformers
# 5.17 builds by default for them (their flagship sizes), cut to 4 layers: GLM-4, EXAONE-4 (three sliding-window
# layers of 4096 tokens to one global), Seed-OSS, Apertus (xIELU activation), Arcee AFM (ReLU^2, no gate), ERNIE-4.5;
# tf32 and amp_fp16 added after the first two settings ran (predicted before they ran too); later Gemma-4's text model
# (per-layer overrides and input embeddings, six layers: its first full one is the sixth) and AFMoE (2026-12-06)
DEFAULT_TYPE_CONFIGS = Path(__file__).resolve().parent.parent / "data" / "validation" / "configs" / \
    "transformers-default-types.json"


def default_type_cases() -> list[Case]:
    if not DEFAULT_TYPE_CONFIGS.exists():
        return []
    table = {f"{mt}-default": (cfg, layers_to_keep(cfg), 1, 4096)
             for mt, cfg in json.loads(DEFAULT_TYPE_CONFIGS.read_text()).items()}
    return held_out_cases(table, GENERIC_SETTINGS)


def family_cases() -> list[Case]:
    return held_out_cases(FAMILY_CASES, FAMILY_SETTINGS) + held_out_cases(GENERIC_CASES, GENERIC_SETTINGS) + \
        held_out_cases(BF16_ONLY_CASES, ("bf16",)) + default_type_cases()


MODELS: dict[str, dict[str, Any]] = {
    "llama3-8b": LLAMA3_8B, "gpt2": GPT2, "gpt2-medium": GPT2_MEDIUM, "qwen2-1.5b": QWEN2_1_5B,
    "qwen2-0.5b": QWEN2_0_5B, "qwen2-7b": QWEN2_7B, "llama2-13b": LLAMA2_13B, "mistral-7b": MISTRAL_7B,
    "llama3-70b": LLAMA3_70B,
}


def layers_of(cfg: dict[str, Any], n: int) -> dict[str, Any]:
    key = "n_layer" if "n_layer" in cfg else "num_hidden_layers"
    out = {**cfg, key: n}
    for k in ("layer_types", "mlp_layer_types", "no_rope_layers"):  # per-layer lists: one entry per layer kept
        if isinstance(cfg.get(k), list):
            out[k] = cfg[k][:n]
    if isinstance(cfg.get("per_layer_config"), dict):  # per-layer overrides (Gemma-4): of the layers kept
        out["per_layer_config"] = {k: v for k, v in cfg["per_layer_config"].items() if int(k) < n}
    return out


def layers_to_keep(cfg: dict[str, Any], at_least: int = 4) -> int:
    """The layers a held-out cut keeps: `at_least`, or up to the first layer of each attention type (Gemma-4's
    first full-attention layer is its sixth)."""
    types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else []
    return max(at_least, *(types.index(t) + 1 for t in set(types))) if types else at_least


def tp_shard_config(cfg: dict[str, Any], tp: int) -> dict[str, Any]:
    """The model one GPU runs under Megatron TP=tp, as a plain HF config (head_dim kept)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return {**cfg, "num_attention_heads": heads // tp, "num_key_value_heads": cfg["num_key_value_heads"] // tp,
            "head_dim": cfg.get("head_dim", h // heads), "intermediate_size": cfg["intermediate_size"] // tp,
            "vocab_size": cfg["vocab_size"] // tp}


def default_cases() -> list[Case]:
    """Calibration cases have their exact operator signatures in the database; holdout cases never
    contribute to any calibration and use only the generic grid (different shapes everywhere)."""
    cases: list[Case] = []

    def add(model: str, cfg: dict[str, Any], mb: int, seq: int, split: str, settings: list[str] | None = None,
            tp: int = 1, profile_settings: tuple[str, ...] = ()) -> None:
        for s in settings or ALL_SETTINGS:
            cid = f"{model}-mb{mb}-s{seq}" + (f"-tp{tp}" if tp > 1 else "") + f"-{s}"
            cases.append(Case(cid, model, cfg, s, mb, seq, split, tp_shard=tp, profile=s in profile_settings))

    add("llama3-8b-L4", layers_of(LLAMA3_8B, 4), 1, 4096, "calibration", profile_settings=("amp_bf16", "fp32"))
    add("gpt2", GPT2, 8, 1024, "calibration", profile_settings=("amp_fp16",))
    add("qwen2-1.5b", QWEN2_1_5B, 2, 2048, "calibration")
    add("llama3-8b-L4", layers_of(LLAMA3_8B, 4), 2, 2048, "calibration", settings=["amp_bf16", "bf16", "tf32"])
    add("llama3-8b-L8-tp4", tp_shard_config(layers_of(LLAMA3_8B, 8), 4), 1, 4096, "calibration",
        settings=["amp_bf16", "bf16"], tp=4)
    # holdout: other shapes, other families
    add("qwen2-7b-L3", layers_of(QWEN2_7B, 3), 1, 2048, "holdout")
    add("llama2-13b-L3", layers_of(LLAMA2_13B, 3), 1, 4096, "holdout", profile_settings=("amp_bf16",))
    add("gpt2-medium", GPT2_MEDIUM, 4, 1024, "holdout")
    add("qwen2-0.5b", QWEN2_0_5B, 4, 2048, "holdout")
    add("mistral-7b-L4", layers_of(MISTRAL_7B, 4), 2, 3072, "holdout", settings=["amp_bf16", "amp_fp16", "bf16", "fp32"])
    add("llama3-70b-L2", layers_of(LLAMA3_70B, 2), 1, 4096, "holdout", settings=["amp_bf16", "bf16", "fp32"])
    add("qwen2-7b-L2", layers_of(QWEN2_7B, 2), 2, 4096, "holdout")
    for s in ("amp_bf16", "bf16"):
        cases.append(Case(f"llama3-8b-L2-mb1-s8192-{s}", "llama3-8b-L2", layers_of(LLAMA3_8B, 2), s, 1, 8192,
                          "holdout"))
    for opt in ("adamw_fused", "sgd"):
        cases.append(Case(f"llama3-8b-L4-mb1-s4096-{opt}-amp_bf16", "llama3-8b-L4", layers_of(LLAMA3_8B, 4),
                          "amp_bf16", 1, 4096, "holdout", optimizer=opt))
    for s in ("amp_bf16", "fp32"):
        cases.append(Case(f"gpt2-medium-mb4-s1024-accum4-{s}", "gpt2-medium", GPT2_MEDIUM, s, 4, 1024, "holdout",
                          accum=4))
    add("gpt2", GPT2, 12, 512, "holdout")
    # pipeline stages of LLaMA-3-8B cut to 8 layers, PP=4 (2 layers a stage), run alone on one GPU
    for s in ("amp_bf16", "bf16"):
        for stage in ("first", "middle", "last"):
            cases.append(Case(f"llama3-8b-L8-pp4-{stage}-mb1-s4096-{s}", "llama3-8b-L8", layers_of(LLAMA3_8B, 8), s,
                              1, 4096, "holdout", pp_stage=stage, pp=4))
    # does not fit: full LLaMA-3-8B under AMP (16 bytes/parameter of state) and a 70B slice too deep
    add("llama3-8b-full", LLAMA3_8B, 1, 4096, "holdout", settings=["amp_bf16", "bf16"])
    # more whole models (held out): a whole model's dense stretch of layers is longer than any cut's
    add("qwen2-7b-full", QWEN2_7B, 1, 4096, "holdout", settings=["bf16"])
    add("mistral-7b-full", MISTRAL_7B, 1, 4096, "holdout", settings=["bf16"])
    add("qwen3-8b-full", QWEN3_8B, 1, 4096, "holdout", settings=["bf16"])
    add("llama3-70b-L12", layers_of(LLAMA3_70B, 12), 1, 4096, "holdout", settings=["amp_bf16"])
    # one stage each of GLM-4.5-Air cut to 4 layers (1 dense + 3 with 128 experts) split PP=2, run alone: the
    # first stage holds the dense layer, the last only MoE layers (2026-12-01, predicted before they ran)
    for s in ("amp_bf16", "bf16"):
        for stage in ("first", "last"):
            cases.append(Case(f"glm4.5-air-L4-pp2-{stage}-mb1-s4096-{s}", "glm4.5-air-L4", layers_of(GLM45_AIR, 4), s,
                              1, 4096, "holdout", pp_stage=stage, pp=2))
    # whole models whose layers differ along the depth (2026-12-01, predicted before they ran): SmolLM3-3B (9 of 36
    # layers without RoPE) and OLMoE-1B-7B (16 MoE layers)
    add("smollm3-3b-full", SMOLLM3_3B, 1, 4096, "holdout", settings=["amp_bf16", "bf16"])
    add("olmoe-1b-7b-full", OLMOE_1B_7B, 1, 4096, "holdout", settings=["bf16"])
    return cases + family_cases() + fp8_cases()


# ---------------------------------------------------------------------------------------------

def _hf_model(cfg: dict[str, Any], dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from tp_query.engine.trace.hf_models import attention_implementation
    from transformers import AutoConfig, AutoModelForCausalLM

    hcfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with device:  # SDPA, or eager where the model type has no SDPA path (as the engine's trace builds it)
        model = AutoModelForCausalLM.from_config(hcfg, dtype=dtype, attn_implementation=attention_implementation(hcfg))
    model.train()
    return model


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.phase = "fwd"
        self.counts: Counter[tuple[str, str, str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if any(t not in (torch.Tensor, torch.nn.Parameter) for t in types):
            return NotImplemented  # a tensor subclass (torchao float8): log the plain ops it runs
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if name.startswith("aten."):
            call = encode_call(func, args, kwargs)
            self.counts[(self.phase, call.op, call.to_json_str())] += 1
        return out


def _iteration(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: Any, ids: torch.Tensor,
               autocast_dtype: torch.dtype | None, counter: _OpCounter | None = None, accum: int = 1) -> None:
    for _ in range(accum - 1):  # gradient accumulation: all but the last micro-batch
        with torch.autocast("cuda", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        (scaler.scale(loss) if scaler is not None else loss).backward()
    ctx = torch.autocast("cuda", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    if counter:
        counter.phase = "fwd"
    with ctx:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    if counter:
        counter.phase = "bwd"
    if scaler is not None:
        scaler.scale(loss).backward()
        if counter:
            counter.phase = "opt"
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        if counter:
            counter.phase = "opt"
        opt.step()
    opt.zero_grad(set_to_none=True)


_KERNEL_CLASSES = (
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas", "splitk", "splitK")),
    ("attention", ("fmha", "flash", "attention", "cudnn", "sdpa", "mha")),
    ("optimizer", ("multi_tensor", "foreach", "adam", "fused_adam")),
    ("norm", ("norm", "rms")),
    ("softmax_loss", ("softmax", "nll", "cross_entropy", "log_softmax")),
    ("embedding", ("embedding", "indexSelect", "index_select")),
    ("copy_cast", ("copy", "cat", "CatArray", "to_copy", "unrolled_elementwise_kernel")),
    ("elementwise", ("elementwise", "vectorized", "reduce")),
)


def _classify(name: str) -> str:
    low = name.lower()
    for cls, pats in _KERNEL_CLASSES:
        if any(p.lower() in low for p in pats):
            return cls
    return "other"


def _profile_iteration(model: Any, opt: Any, scaler: Any, ids: torch.Tensor, ac: torch.dtype | None
                       ) -> tuple[float, dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        _iteration(model, opt, scaler, ids, ac)
        torch.cuda.synchronize()
    by: dict[str, float] = {}
    count = 0
    t_first, t_last = float("inf"), 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            by[_classify(ev.name)] = by.get(_classify(ev.name), 0.0) + us / 1000.0
            count += 1
            t_first = min(t_first, ev.time_range.start)
            t_last = max(t_last, ev.time_range.end)
    total = sum(by.values())
    span = (t_last - t_first) / 1000.0 if count else 0.0
    return total, {"kernel_ms_by_class": by, "kernels": count, "gpu_span_ms": span}


class _Stage(PipeStage):
    """One stage of a PP split (first, middle or last of `pp` equal layer ranges) with the loss on the last,
    run alone on one GPU."""

    def __init__(self, model: Any, stage: str, pp: int, setting: str) -> None:
        n = len(model.model.layers)
        per = n // pp
        lo = {"first": 0, "middle": per, "last": n - per}[stage]
        super().__init__(model, lo, lo + per, stage == "first", stage == "last", setting)
        self.stage = stage
        self.loss_function = model.loss_function
        self.vocab = model.config.vocab_size

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = super().forward(x)
        if self.lm_head is None:
            return h
        return self.loss_function(logits=h, labels=labels, vocab_size=self.vocab)


def run_stage_case(case: Case, device: Device, iters: int = 8) -> dict[str, Any]:
    st = SETTINGS[Setting(case.setting)]
    dev = device.torch_device
    torch.backends.cuda.matmul.allow_tf32 = st.allow_tf32
    ac = torch_dtype(st.autocast_dtype) if st.autocast_dtype else None
    model = _hf_model(case.config, torch_dtype(st.param_dtype), dev)
    stage = _Stage(model, case.pp_stage, case.pp, case.setting)
    del model
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-4)
    hidden = int(case.config["hidden_size"])
    ids = torch.randint(0, int(case.config["vocab_size"]), (case.micro_batch, case.seq_len), device=dev)
    act_dtype = torch.float32 if ac is not None or st.param_dtype.value == "fp32" else torch_dtype(st.param_dtype)
    x = ids if case.pp_stage == "first" else torch.randn(case.micro_batch, case.seq_len, hidden, device=dev,
                                                          dtype=act_dtype, requires_grad=True)
    grad = torch.randn(case.micro_batch, case.seq_len, hidden, device=dev, dtype=act_dtype)

    def step() -> None:
        with torch.autocast("cuda", dtype=ac) if ac else contextlib.nullcontext():
            out = stage(x, ids)
        if case.pp_stage == "last":
            out.backward()
        else:
            out.backward(grad.to(out.dtype))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {**_EMPTY_ROW, **_time_steps(step, iters, iters, float("inf"))}


_EMPTY_ROW: dict[str, Any] = {"status": "ok", "reason": "", "iteration_ms": None, "p20_ms": None, "p80_ms": None,
                              "iterations": 0, "samples_ms": [], "peak_allocated_bytes": None,
                              "peak_reserved_bytes": None, "kernel_ms": None, "kernel_breakdown_json": None,
                              "rank_json": None}


def _time_steps(step: Any, min_iters: int, max_iters: int, time_budget_s: float) -> dict[str, Any]:
    """Three warm-up steps, then CUDA events at step boundaries (no extra synchronisation inside a
    round): median, p20/p80 and every sample, plus the peak memory of the timed steps."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events = [torch.cuda.Event(enable_timing=True)]
    events[0].record()
    t0 = time.perf_counter()
    n = 0
    while n < max_iters:
        step()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append(e)
        n += 1
        if n >= min_iters and time.perf_counter() - t0 > time_budget_s:
            break
        if n >= min_iters and n % min_iters == 0:
            torch.cuda.synchronize()
            if time.perf_counter() - t0 > time_budget_s:
                break
    torch.cuda.synchronize()
    samples = [a.elapsed_time(b) for a, b in itertools.pairwise(events)]
    peak, reserved = int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())
    # how long the host takes to issue one step from an idle GPU (about the step when host-bound), as the
    # distributed harness records per rank: a miss then splits into GPU and host by measurement
    host: list[float] = []
    for _ in range(HOST_STEPS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        host.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return {"iteration_ms": statistics.median(samples), "p20_ms": quantile(samples, 0.2),
            "p80_ms": quantile(samples, 0.8), "iterations": len(samples), "samples_ms": samples,
            "peak_allocated_bytes": peak, "peak_reserved_bytes": reserved,
            "rank_json": json.dumps([{"rank": 0, "host_ms": statistics.median(host)}])}


HOST_STEPS = 3  # steps issued from an idle GPU after the timed ones


def _failed_row(e: BaseException) -> dict[str, Any]:
    """A case that failed is a row with its reason (out of memory is a result, not an error)."""
    if isinstance(e, torch.OutOfMemoryError):
        return {**_EMPTY_ROW, "status": "oom", "reason": first_line(e)[:300],
                "peak_allocated_bytes": int(torch.cuda.max_memory_allocated())}
    return {**_EMPTY_ROW, "status": "error", "reason": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """What a user writes: torch's defaults (foreach on CUDA) unless fused is asked for."""
    if kind == "adamw_fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


@dataclass(frozen=True)
class CaseStep:
    """One case's training iteration as the campaign runs it: the HF model in its setting's dtype (FP8 Linear
    layers converted), its optimizer, GradScaler where the setting has one, and the input ids."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    scaler: Any
    ids: torch.Tensor
    autocast: torch.dtype | None
    step: Any  # one iteration: step()


def build_case_step(case: Case, dev: torch.device) -> CaseStep:
    """Also sets TF32 matmuls as the setting says (the caller resets it when the case is done)."""
    st = SETTINGS[Setting(case.setting)]
    torch.backends.cuda.matmul.allow_tf32 = st.allow_tf32
    ac = torch_dtype(st.autocast_dtype) if st.autocast_dtype else None
    model = _hf_model(case.config, torch_dtype(st.param_dtype), dev)
    if st.fp8_recipe:
        convert_fp8(model, st.fp8_recipe)
    opt = make_optimizer(case.optimizer, model)
    scaler = torch.amp.GradScaler("cuda") if st.grad_scaler else None
    ids = torch.randint(0, int(case.config["vocab_size"]), (case.micro_batch, case.seq_len), device=dev)
    return CaseStep(model, opt, scaler, ids, ac,
                    functools.partial(_iteration, model, opt, scaler, ids, ac, accum=case.accum))


def run_case(case: Case, device: Device, *, min_iters: int = 6, max_iters: int = 30, time_budget_s: float = 6.0
             ) -> dict[str, Any]:
    row: dict[str, Any] = dict(_EMPTY_ROW)
    cs = None
    try:
        cs = build_case_step(case, device.torch_device)
        row.update(_time_steps(cs.step, min_iters, max_iters, time_budget_s))
        if case.profile:
            try:
                kms, info = _profile_iteration(cs.model, cs.opt, cs.scaler, cs.ids, cs.autocast)
                row.update(kernel_ms=kms, kernel_breakdown_json=json.dumps(info))
            except Exception as e:  # the timing above stands without the profile
                row.update(kernel_breakdown_json=json.dumps({"error": str(e)[:300]}))
    except Exception as e:
        row = _failed_row(e)
    finally:
        del cs  # the step closure holds the model too: free both before the next case
        gc.collect()
        torch.cuda.empty_cache()
        torch.backends.cuda.matmul.allow_tf32 = False
    return row


def run_validation(cases: list[Case], folder: Path, device: Device, budget_s: float | None = None) -> int:
    prov = device.provenance()
    store = ChunkedStore(folder, "validation", VALIDATION_SCHEMA, prov, key_columns=("case_id",))
    done = {k[0] for k in store.done_keys()}
    t0 = time.perf_counter()
    n = 0
    for i, c in enumerate(cases):
        if c.case_id in done:
            continue
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            break
        clk = device.clocks()
        if c.pp_stage:
            try:
                res = run_stage_case(c, device)
            except Exception as e:
                res = _failed_row(e)
            finally:
                gc.collect()
                torch.cuda.empty_cache()
        else:
            res = run_case(c, device)
        row = {"case_id": c.case_id, "model": c.model, "config_json": json.dumps(c.config, sort_keys=True),
               "layers": c.layers, "setting": c.setting, "micro_batch": c.micro_batch, "seq_len": c.seq_len,
               "optimizer": c.optimizer, "tp_shard": c.tp_shard, "split": c.split, "accum": c.accum,
               "pp": c.pp if c.pp_stage else None, "pp_stage": c.pp_stage or None, **res,
               "sm_clock_mhz": clk.sm_mhz, "measured_at": dt.datetime.now(dt.UTC).replace(microsecond=0),
               **dataclasses.asdict(prov), "machine": machine_id(), "cpu": cpu_model()}
        store.append(row)
        store.flush()
        n += 1
        ms = f"{res['iteration_ms']:.2f} ms" if res["iteration_ms"] else res["status"]
        print(f"[validate] {i + 1}/{len(cases)} {c.case_id}: {ms}", flush=True)
    return n


def run_oplog(cases: list[Case], path: Path, device: Device) -> int:
    """Log the aten operators one real iteration dispatches, for the graph-fidelity test."""
    prov = device.provenance()
    rows: list[dict[str, Any]] = []
    for c in cases:
        st = SETTINGS[Setting(c.setting)]
        torch.backends.cuda.matmul.allow_tf32 = st.allow_tf32
        ac = torch_dtype(st.autocast_dtype) if st.autocast_dtype else None
        try:
            model = _hf_model(c.config, torch_dtype(st.param_dtype), device.torch_device)
            if st.fp8_recipe:
                convert_fp8(model, st.fp8_recipe)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            scaler = torch.amp.GradScaler("cuda") if st.grad_scaler else None
            ids = torch.randint(0, int(c.config["vocab_size"]), (c.micro_batch, c.seq_len), device=device.torch_device)
            _iteration(model, opt, scaler, ids, ac)
            counter = _OpCounter()
            with counter:
                _iteration(model, opt, scaler, ids, ac, counter)
            torch.cuda.synchronize()
            for (phase, op, sig), cnt in counter.counts.items():
                rows.append({"case_id": c.case_id, "setting": c.setting, "phase": phase, "op": op, "signature": sig,
                             "count": cnt, **dataclasses.asdict(prov)})
            print(f"[oplog] {c.case_id}: {sum(counter.counts.values())} ops", flush=True)
        finally:
            model = opt = scaler = None  # type: ignore[assignment]
            gc.collect()
            torch.cuda.empty_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_table(path, rows, OPLOG_SCHEMA, prov)
    return len(rows)


class _MemTimeline(TorchDispatchMode):
    """memory_allocated() after every aten op of one real iteration (where does the peak happen?)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "fwd"
        self.rows: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name.startswith("aten."):
            self.rows.append((self.phase, name, int(torch.cuda.memory_allocated())))
        return out


def run_memtrace(case_ids: list[str], path: Path, device: Device) -> None:
    """Per-op allocated memory of one iteration of each case, after warm-up (a diagnostic)."""
    out: dict[str, Any] = {}
    for c in [c for c in default_cases() if c.case_id in case_ids]:
        st = SETTINGS[Setting(c.setting)]
        torch.backends.cuda.matmul.allow_tf32 = st.allow_tf32
        ac = torch_dtype(st.autocast_dtype) if st.autocast_dtype else None
        model = _hf_model(c.config, torch_dtype(st.param_dtype), device.torch_device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cuda") if st.grad_scaler else None
        ids = torch.randint(0, int(c.config["vocab_size"]), (c.micro_batch, c.seq_len), device=device.torch_device)
        for _ in range(2):
            _iteration(model, opt, scaler, ids, ac)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        tl = _MemTimeline()
        with tl:
            _iteration(model, opt, scaler, ids, ac, tl)  # type: ignore[arg-type]
        torch.cuda.synchronize()
        out[c.case_id] = {"base": base, "peak": torch.cuda.max_memory_allocated(), "ops": tl.rows}
        del model, opt, scaler
        gc.collect()
        torch.cuda.empty_cache()
        print(f"[memtrace] {c.case_id}: base {base / 2**30:.2f} GiB, peak {out[c.case_id]['peak'] / 2**30:.2f} GiB",
              flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))


def oplog_cases() -> list[Case]:
    small_llama = {**LLAMA3_8B, "hidden_size": 1024, "intermediate_size": 3584, "num_attention_heads": 16,
                   "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 32000}
    out = []
    for model, cfg, mb, seq in (("llama-small", small_llama, 2, 512), ("gpt2-L2", layers_of(GPT2, 2), 2, 512),
                                ("qwen2-small", {**layers_of(QWEN2_0_5B, 2), "vocab_size": 32000}, 2, 512)):
        for s in ALL_SETTINGS:
            out.append(Case(f"oplog-{model}-{s}", model, cfg, s, mb, seq, "oplog"))
    for s in FP8_SETTINGS:
        out.append(Case(f"oplog-llama-small-{s}", "llama-small", small_llama, s, 2, 512, "oplog"))
    # the spec registry's families built from transformers' modules: windows shorter than the sequence,
    # alternating layer types, routed and shared experts
    small: dict[str, Any] = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 32000}
    fams: dict[str, dict[str, Any]] = {"qwen3-small": {**QWEN3_8B, **small},
            "gemma2-small": {**GEMMA2_9B, **small, "sliding_window": 256, "query_pre_attn_scalar": 64},
            "phi3-small": {**PHI3_MINI, **small, "num_key_value_heads": 8, "sliding_window": 255, "pad_token_id": 0},
            "mixtral-small": {**MIXTRAL_8X7B, **small, "num_local_experts": 4},
            "qwen2moe-small": {**QWEN15_MOE_A27B, **small, "num_experts": 8, "moe_intermediate_size": 256,
                               "shared_expert_intermediate_size": 512}}
    for model, fcfg in fams.items():
        for s in ("amp_bf16", "bf16"):
            out.append(Case(f"oplog-{model}-{s}", model, fcfg, s, 2, 512, "oplog"))
    return out
