"""A real Megatron-Core (0.19.2) training iteration for a HuggingFace Llama/Qwen2 config, for timing.

The step is Megatron's own, not a re-implementation: GPTModel with the local (no Transformer Engine)
layer spec, Float16Module for --bf16/--fp16, Megatron's DistributedDataParallel with a contiguous grad
buffer, get_megatron_optimizer (mixed-precision or distributed Adam) and get_forward_backward_func
(no pipelining, or non-interleaved 1F1B for pp > 1), wired as megatron/training/training.py does
(get_model, setup of config.grad_scale_func / finalize_model_grads_func, train_step).

Run under torchrun, one process per GPU: the caller initialises torch.distributed (NCCL) and sets
CUDA_DEVICE_MAX_CONNECTIONS=1 before CUDA starts (Megatron relies on it to queue the TP all-reduce of
the input gradient ahead of the weight-gradient GEMM). Megatron is imported inside the functions, so
importing this module needs only torch.

    python collector/dist_megatron.py --cpu-check                      # translation + model build, CPU
    torchrun --nproc-per-node 2 collector/dist_megatron.py --smoke     # a few real steps per case
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

SETTINGS = ("bf16", "fp16", "fp32", "tf32")
SEED = 1234
# fp16's dynamic loss scaler starts here instead of Megatron's 2**32: from 2**32 every update of the
# first ~20 iterations overflows and is skipped (no clip, no Adam: measured 15% faster on an 8B-shaped
# model), while timing wants the steady state, where updates succeed. 2**16 overflowed on none of
# the measured first steps. Window 1000, hysteresis 2 and min scale 1 stay Megatron's.
FP16_INITIAL_LOSS_SCALE = 2.0**16
# training.py get_model builds DDP on a side stream; its AccumulateGrad nodes then live on that stream
# (PyTorch warns of the stream mismatch once). Kept, as that is what Megatron-LM runs.
DDP_INIT_SIDE_STREAM = True


def _check_setting(setting: str) -> str:
    if setting not in SETTINGS:
        raise ValueError(f"Megatron setting must be one of {', '.join(SETTINGS)}, got {setting!r} "
                         "(bf16/fp16 are Megatron's --bf16/--fp16: half params, fp32 main params)")
    return str(setting)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The output layer and the embedding are split over TP by vocabulary: round up to a multiple of tp."""
    return -(-int(vocab_size) // tp) * tp


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _qkv_bias(cfg: dict[str, Any]) -> bool:
    # Qwen2 always has q/k/v biases and its config has no attention_bias key; Qwen3/Llama say it.
    return bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2"))


def _qk_norm(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") in ("qwen3", "qwen3_moe")


def hf_param_count(cfg: dict[str, Any]) -> int:
    """Parameters of the HF model (unpadded vocabulary), to check the Megatron model against."""
    keys = ("hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers")
    h, v, f, n = (int(cfg[k]) for k in keys)
    heads, hd = int(cfg["num_attention_heads"]), _head_dim(cfg)
    kv = int(cfg.get("num_key_value_heads") or heads)
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    attn += (heads + 2 * kv) * hd if _qkv_bias(cfg) else 0
    attn += 2 * hd if _qk_norm(cfg) else 0
    layer = attn + 3 * h * f + 2 * h
    tied = bool(cfg.get("tie_word_embeddings", False))
    return v * h + n * layer + h + (0 if tied else v * h)


def _moe(cfg: dict[str, Any]) -> tuple[int, int]:
    """(routed experts, experts per token) of a Mixtral- or Qwen3-MoE-shaped config; (0, 0) for a dense one."""
    e = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    return (e, int(cfg.get("num_experts_per_tok") or 2)) if e else (0, 0)


def transformer_config_kwargs(cfg: dict[str, Any], setting: str, *, tp: int, pp: int,
                              ep: int = 1) -> dict[str, Any]:
    """TransformerConfig fields for a Llama-shaped HF config; raises ValueError on what Megatron refuses.

    Fusions that need Transformer Engine, apex or Megatron's compiled softmax are off (the machine has
    none), and so are the torch.compile'd ones (bias-SwiGLU, bias-dropout-add): plain PyTorch ops only.
    """
    import torch.nn.functional as F

    setting = _check_setting(setting)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    layers = int(cfg["num_hidden_layers"])
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"only SwiGLU (hidden_act='silu') is built, got {act!r}")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True has no Megatron equivalent without biases on every linear")
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
    if heads % tp:
        raise ValueError(f"num_attention_heads={heads} is not divisible by tp={tp}")
    if kv % tp and tp % kv:
        raise ValueError(f"num_key_value_heads={kv} must be a multiple or a divisor of tp={tp}")
    if layers % pp:
        raise ValueError(f"num_hidden_layers={layers} is not divisible by pp={pp} (even split only)")
    experts, topk = _moe(cfg)
    if experts and cfg.get("model_type") not in ("mixtral", "qwen3_moe"):
        raise ValueError(f"MoE is built for Mixtral and Qwen3-MoE configs, got model_type {cfg.get('model_type')!r}")
    if experts and cfg.get("model_type") == "qwen3_moe" and not cfg.get("norm_topk_prob", True):
        raise ValueError("Qwen3-MoE without norm_topk_prob has no Megatron router equivalent here")
    if ep > 1 and not experts:
        raise ValueError("expert parallelism needs a mixture-of-experts config")
    if experts and experts % ep:
        raise ValueError(f"num_local_experts={experts} is not divisible by ep={ep}")
    if experts and tp > 1:
        raise ValueError("MoE with tp > 1 needs sequence parallelism in Megatron, which the local spec refuses")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setting, torch.float32)
    # MoELayer as Mixtral recipes run it: dropless top-k routing (softmax over the top-k logits), the
    # load-balancing aux loss, the all-to-all dispatcher, SequentialMLP experts (no TE: no grouped GEMM)
    moe_ffn = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    moe = {"num_moe_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": moe_ffn,
           "moe_token_dispatcher_type": "alltoall", "moe_router_load_balancing_type": "aux_loss",
           "moe_aux_loss_coeff": 1e-2, "moe_grouped_gemm": False, "expert_model_parallel_size": ep} if experts else {}
    return {**moe,
        "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "num_query_groups": kv,
        "ffn_hidden_size": int(cfg["intermediate_size"]), "kv_channels": _head_dim(cfg),
        "normalization": "RMSNorm", "layernorm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "gated_linear_unit": True, "activation_func": F.silu,
        "add_bias_linear": False, "add_qkv_bias": _qkv_bias(cfg), "qk_layernorm": _qk_norm(cfg),
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "init_method_std": float(cfg.get("initializer_range", 0.02)),
        "bf16": setting == "bf16", "fp16": setting == "fp16", "params_dtype": dtype,
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "sequence_parallel": False,
        # What megatron/training/argument_utils.py core_transformer_config_from_args sets for PP.
        "pipeline_dtype": dtype, "deallocate_pipeline_outputs": True, "batch_p2p_comm": True,
        "bias_activation_fusion": False, "bias_dropout_fusion": False, "masked_softmax_fusion": False,
        "gradient_accumulation_fusion": False, "persist_layer_norm": False, "apply_rope_fusion": False,
        "cross_entropy_loss_fusion": False,
    }


def _rope_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    theta = float(cfg.get("rope_theta", 10000.0))
    kw: dict[str, Any] = {"position_embedding_type": "rope", "rotary_percent": 1.0,
                          "rotary_base": int(theta) if theta.is_integer() else theta}
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":  # Llama 3.1 frequency scaling
        kw.update(rope_scaling=True, rope_scaling_factor=float(scaling.get("factor", 8.0)))
    return kw


def _build_gpt(cfg: dict[str, Any], setting: str, *, tp: int, pp: int, ep: int = 1,
               cpu_init: bool = False) -> tuple[Any, Any]:
    """(TransformerConfig, GPTModel) for this rank's pipeline stage, as pretrain_gpt's model provider."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = transformer_config_kwargs(cfg, setting, tp=tp, pp=pp, ep=ep)
    config = TransformerConfig(**kw, use_cpu_initialization=cpu_init)
    spec = get_gpt_layer_local_spec(num_experts=kw.get("num_moe_experts") or None, moe_grouped_gemm=False,
                                    normalization="RMSNorm", qk_layernorm=kw["qk_layernorm"])
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=padded_vocab_size(cfg["vocab_size"], tp),
                     max_sequence_length=int(cfg.get("max_position_embeddings", 4096)),
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     parallel_output=True,
                     share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
                     **_rope_kwargs(cfg))
    # get_model does this so that the optimizer and grad-norm see every parameter's TP attributes.
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    return config, model


def _set_matmul_flags(setting: str) -> None:
    """TF32 only for "tf32"; Megatron leaves these to PyTorch, so set them both ways to be explicit."""
    tf32 = setting == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[Any, Any, dict[str, Any]]:
    """pretrain_gpt.loss_func: summed token loss and token count; the schedule divides by both."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def _forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
    """pretrain_gpt.forward_step: every stage draws its micro-batch; GPTModel returns per-token loss."""
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"],
                loss_mask=b["loss_mask"])
    return out, partial(_loss_func, b["loss_mask"])


def _destroy_megatron_groups(ps: Any) -> int:
    """Destroy the process groups initialize_model_parallel created, before destroy_model_parallel
    forgets them: it frees only the gloo data-parallel ones, and every case of a campaign would
    otherwise leave its NCCL communicators (and their GPU buffers) behind. Same order on every rank."""
    import torch.distributed as dist

    pg_map = dist.distributed_c10d._world.pg_map
    seen: set[int] = set()
    n = 0
    for g in list(getattr(ps, "_global_process_group_list", None) or []):
        if not isinstance(g, dist.ProcessGroup) or g is dist.GroupMember.WORLD or id(g) in seen:
            continue
        seen.add(id(g))
        if g in pg_map:
            dist.destroy_process_group(g)
            n += 1
    return n


def build_megatron_step(cfg: dict, setting: str, *, tp: int, pp: int, micro_batch: int, seq_len: int,
                        micro_batches: int, distributed_optimizer: bool, device: torch.device,
                        ep: int = 1) -> tuple[Callable[[], None], Callable[[], None], dict]:
    """Returns (step, cleanup, info). step() runs one full training iteration: forward+backward over
    `micro_batches` micro-batches via get_forward_backward_func (1F1B when pp>1), DDP grad reduction
    (finish_grad_sync), optimizer.step(), zero_grad. cleanup() frees the model/optimizer and calls
    parallel_state.destroy_model_parallel(). info: {"params_per_rank": int, ...} anything useful."""
    import torch.distributed as dist

    setting = _check_setting(setting)
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised (NCCL, one process per GPU) by the caller")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp * pp}")
    if min(micro_batch, seq_len, micro_batches) < 1:
        raise ValueError("micro_batch, seq_len and micro_batches must be >= 1")
    if device.type != "cuda":
        raise ValueError(f"Megatron-Core's GPT training path needs a CUDA device, got {device}")
    kw = transformer_config_kwargs(cfg, setting, tp=tp, pp=pp, ep=ep)  # refuse before creating any group
    half = setting in ("bf16", "fp16")
    torch.cuda.set_device(device)
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        warnings.warn("CUDA_DEVICE_MAX_CONNECTIONS is not 1: Megatron's TP dgrad all-reduce may not be "
                      "queued ahead of the wgrad GEMM (set it before CUDA initialises)", stacklevel=2)
    _set_matmul_flags(setting)

    import megatron.core
    import megatron.core.optimizer as mopt
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    if ps.model_parallel_is_initialized():  # a case before this one died without its cleanup
        _destroy_megatron_groups(ps)
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    try:
        model_parallel_cuda_manual_seed(SEED)
        config, gpt = _build_gpt(cfg, setting, tp=tp, pp=pp, ep=ep)
        params_per_rank = sum(p.numel() for p in gpt.parameters())
        gpt.cuda(device)  # torch RMSNorm weights are created on the CPU; get_model moves the module
        module = Float16Module(config, gpt) if half else gpt
        # Grads accumulate and reduce in fp32 for both halves (the project's mp_* settings); Megatron-LM
        # does so for --bf16 by default, for --fp16 only with --accumulate-allreduce-grads-in-fp32.
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=half, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=distributed_optimizer)
        # get_model builds DDP (its grad-accumulation hooks) on a side stream, then joins it.
        ddp_stream = torch.cuda.Stream(device) if DDP_INIT_SIDE_STREAM else torch.cuda.current_stream(device)
        ddp_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(ddp_stream):
            model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
        torch.cuda.current_stream(device).wait_stream(ddp_stream)
        opt_config = mopt.OptimizerConfig(
            optimizer="adam", lr=1e-4, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
            clip_grad=1.0, bf16=setting == "bf16", fp16=setting == "fp16", params_dtype=kw["params_dtype"],
            use_distributed_optimizer=distributed_optimizer, initial_loss_scale=FP16_INITIAL_LOSS_SCALE)
        optimizer = mopt.get_megatron_optimizer(opt_config, [model])
    except BaseException:
        _destroy_megatron_groups(ps)
        ps.destroy_model_parallel()
        raise
    # training.py, before the loop: loss scaling in backward_step, and DP / tied-embedding grad
    # reduction (finish_grad_sync) at the end of forward_backward_func.
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()

    # Random tokens, built once (no host work in the step); the same on the ranks of a TP group, as
    # Megatron's get_batch broadcasts them. The causal mask is the [1, 1, s, s] boolean one that
    # Megatron-LM's GPT dataset makes by default (True = masked), shared by every micro-batch.
    gen = torch.Generator(device=device).manual_seed(SEED + ps.get_data_parallel_rank())
    vocab = int(cfg["vocab_size"])
    position_ids = torch.arange(seq_len, device=device).unsqueeze(0).expand(micro_batch, -1)
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)
    batches = []
    for _ in range(micro_batches):
        tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), device=device, generator=gen)
        batches.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                        "loss_mask": torch.ones(micro_batch, seq_len, device=device),
                        "position_ids": position_ids, "attention_mask": mask.view(1, 1, seq_len, seq_len)})

    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "config": config}
    last: dict[str, Any] = {}

    def step() -> None:
        if not state:
            raise RuntimeError("step() after cleanup()")
        chunk, opt = state["model"], state["optimizer"]
        # train_step: zero the grad buffer and the optimizer, forward/backward (finalize_model_grads
        # runs inside), optimizer step (copy to main grads, unscale / inf check for fp16, clip, Adam,
        # copy back; the distributed optimizer all-gathers the updated params).
        chunk.zero_grad_buffer()
        opt.zero_grad()
        losses = forward_backward(forward_step_func=_forward_step, data_iterator=iter(batches),
                                  model=[chunk], num_microbatches=micro_batches, seq_length=seq_len,
                                  micro_batch_size=micro_batch, decoder_seq_length=None, forward_only=False)
        ok, grad_norm, _ = opt.step()
        last.update(update_successful=ok, grad_norm=grad_norm, losses_reduced=losses,
                    loss_scale=opt.get_loss_scale())

    def cleanup() -> None:
        if not state:
            return
        torch.cuda.synchronize(device)
        cfg_obj = state["config"]
        cfg_obj.grad_scale_func = cfg_obj.finalize_model_grads_func = None
        state.clear()
        batches.clear()
        last.clear()
        gc.collect()
        info["groups_destroyed"] = _destroy_megatron_groups(ps)
        ps.destroy_model_parallel()
        torch.cuda.empty_cache()

    parts = getattr(optimizer, "chained_optimizers", [optimizer])  # 0.19 always returns a ChainedOptimizer
    inner = getattr(parts[0], "optimizer", None) if parts else None
    info: dict[str, Any] = {
        "params_per_rank": params_per_rank,
        "params_hf": hf_param_count(cfg),
        "dp": world // (tp * pp), "tp": tp, "pp": pp,
        "pp_rank": ps.get_pipeline_model_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "pre_process": gpt.pre_process, "post_process": gpt.post_process,
        "layers_this_stage": len(gpt.decoder.layers),
        "vocab_size_padded": padded_vocab_size(vocab, tp),
        "param_dtype": str(kw["params_dtype"]).removeprefix("torch."),
        "grad_reduce_in_fp32": half,
        "grad_buffer_bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for b in model.buffers),
        "schedule": forward_backward.__name__,
        "optimizer_wrapper": f"{type(optimizer).__name__}[{', '.join(type(o).__name__ for o in parts)}]",
        "optimizer_impl": None if inner is None else f"{type(inner).__module__}.{type(inner).__qualname__}",
        "optimizer_torch_fallback": bool(getattr(mopt, "USING_PYTORCH_OPTIMIZER", False)),
        "optimizer_foreach": inner.defaults.get("foreach") if inner is not None else None,
        "fp16_initial_loss_scale": FP16_INITIAL_LOSS_SCALE if setting == "fp16" else None,
        "attention": "local DotProductAttention (baddbmm, masked softmax in fp32, bmm), mask [1,1,s,s] bool",
        "megatron_core_version": megatron.core.__version__,
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "memory_allocated_after_build": torch.cuda.memory_allocated(device),
        "last_step": last,
    }
    return step, cleanup, info


# --- self-checks -------------------------------------------------------------------------------

_TINY_LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
               "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 1000, "rms_norm_eps": 1e-5,
               "rope_theta": 500000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
               "hidden_act": "silu"}
_TINY_QWEN2 = {**_TINY_LLAMA, "model_type": "qwen2", "tie_word_embeddings": True, "rope_theta": 1000000.0,
               "rms_norm_eps": 1e-6}


def _cpu_check() -> None:
    """What runs without a GPU: the config translation, its refusals, and (where megatron-core imports)
    the model build on the CPU with gloo, its parameter count against the HF formula."""
    import importlib.util
    import sys
    import types

    kw = transformer_config_kwargs(_TINY_QWEN2, "bf16", tp=2, pp=2)
    assert kw["add_qkv_bias"] and kw["params_dtype"] == torch.bfloat16 and kw["num_query_groups"] == 2
    for setting, tp, pp in (("amp_bf16", 1, 1), ("bf16", 3, 1), ("bf16", 1, 3)):
        try:
            transformer_config_kwargs(_TINY_LLAMA, setting, tp=tp, pp=pp)
        except ValueError as e:
            print("refused as expected:", e)
        else:
            raise AssertionError(f"{setting} tp={tp} pp={pp} was not refused")
    assert padded_vocab_size(151655, 2) == 151656 and padded_vocab_size(128256, 2) == 128256
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        print("megatron-core is not importable here: model build not checked")
        return
    if importlib.util.find_spec("triton") is None:
        # schedules imports an MoE Triton kernel module at top level; on a CPU box without Triton
        # stand in an empty module for it (never reached by the dense GPT path).
        name = "megatron.core.transformer.moe.ops.paged_stash"
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__dict__.update(GLOBAL_BLOCK_SIZE=1024, paged_stash_copy_kernel=None,
                                          paged_stash_pop_kernel=None)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29731", rank=0, world_size=1)
    try:
        for cfg in (_TINY_LLAMA, _TINY_QWEN2):
            for setting in SETTINGS:
                ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
                try:
                    _, gpt = _build_gpt(cfg, setting, tp=1, pp=1, cpu_init=True)
                    n = sum(p.numel() for p in gpt.parameters())
                    dtypes = sorted({str(p.dtype) for p in gpt.parameters()})
                    assert n == hf_param_count(cfg), (n, hf_param_count(cfg))
                    print(f"{cfg['model_type']:6} {setting}: {n} params (= HF), dtypes before "
                          f"Float16Module {dtypes}")
                finally:
                    _destroy_megatron_groups(ps)
                    ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    print("cpu check passed")


def _smoke(a: Any) -> None:
    """Under torchrun: a few steps of each (setting, tp x pp, distributed optimizer) case, their times,
    loss and update flags, and the memory left after cleanup (rank 0 and the last stage print)."""
    import json

    import torch.distributed as dist

    global FP16_INITIAL_LOSS_SCALE, DDP_INIT_SIDE_STREAM
    FP16_INITIAL_LOSS_SCALE, DDP_INIT_SIDE_STREAM = a.fp16_scale, not a.no_side_stream
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    if a.cfg:
        with open(a.cfg) as f:
            cfg = json.load(f)
    else:
        cfg = {**_TINY_LLAMA, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
               "num_key_value_heads": 4, "vocab_size": 32000}
    base = torch.cuda.memory_allocated(device)
    for setting in a.settings.split(","):
        for split in a.splits.split(","):
            tp, pp = (int(x) for x in split.split("x"))
            for distopt in (int(x) for x in a.distopt.split(",")):
                step, cleanup, info = build_megatron_step(
                    cfg, setting, tp=tp, pp=pp, micro_batch=a.mb, seq_len=a.seq, micro_batches=a.nmb,
                    distributed_optimizer=bool(distopt), device=device)
                times, oks = [], []
                for _ in range(a.steps):
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0.record()
                    step()
                    t1.record()
                    torch.cuda.synchronize()
                    times.append(round(t0.elapsed_time(t1), 1))
                    oks.append(int(info["last_step"]["update_successful"]))
                last = info["last_step"]
                loss = None
                if last["losses_reduced"]:
                    t = torch.stack([x["lm loss"] for x in last["losses_reduced"]]).sum(0)
                    loss = round((t[0] / t[1]).item(), 4)
                line = (f"rank{rank} {setting} tp{tp} pp{pp} distopt={distopt} ms={times} loss={loss} "
                        f"ok={oks} scale={float(last['loss_scale'])} params={info['params_per_rank']} "
                        f"peak={torch.cuda.max_memory_allocated(device) / 2**30:.2f}GiB {info['schedule']} "
                        f"{info['optimizer_wrapper']} {info['optimizer_impl']}")
                cleanup()
                torch.cuda.reset_peak_memory_stats(device)
                left = (torch.cuda.memory_allocated(device) - base) / 2**20
                if rank == 0 or info["post_process"]:
                    print(line, f"left={left:.1f}MiB groups={info['groups_destroyed']}", flush=True)
    dist.destroy_process_group()


def _main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--cfg", help="HF config.json for --smoke (default: a small Llama)")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--splits", default="1x1,2x1,1x2", help="tp x pp per case; dp = world / (tp*pp)")
    ap.add_argument("--distopt", default="0,1")
    ap.add_argument("--mb", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--nmb", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--fp16-scale", type=float, default=FP16_INITIAL_LOSS_SCALE)
    ap.add_argument("--no-side-stream", action="store_true")
    a = ap.parse_args()
    if a.cpu_check:
        _cpu_check()
    if a.smoke:
        _smoke(a)


if __name__ == "__main__":
    _main()
