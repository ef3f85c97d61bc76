"""Capture the training graph CUDA would run, on a CPU, with fake tensors.

FakeTensorMode on CPU tensors (no memory), the stock autograd engine, CUDA's autocast policy
(autocast_cuda.py), CUDA's SDPA and dropout choices (cuda_composites.py), and a TorchDispatchMode that records
every aten operator with its arguments, its phase and its section (embed / layer i / head / optim).
Backward operators are attributed through the autograd node that runs them: its sequence number
maps back to the forward section that created it. The recorder also tracks live storage bytes the
way the caching allocator counts them, which gives the memory profile of the step.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from tp_query.engine.graph import (
    Graph,
    GraphMeta,
    MemoryProfile,
    OpRecord,
    ParamRecord,
    Phase,
    Section,
    layer_templates,
    memory_profile_from,
    sequence_parallel_norm,
)
from tp_query.engine.request import OPTIMIZERS
from tp_query.schema.messages import TpQueryError
from tp_query.schema.model_config import ArchFamily, Builder, ModelSpec
from tp_query.schema.precision import SETTINGS, Setting
from tp_query.schema.signature import OpCall, TensorSpec

from . import autocast_cuda
from . import cuda_composites as sdpa
from .fp8 import convert_fp8
from .models import COMM_SINK, Shard, build_model, section_modules
from .torchargs import dtype_of, encode_call, resolve_op, torch_dtype

# a meta kernel that fails logs its traceback at ERROR before it raises; the failure reaches the user as one line
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

_ACC_GRAD_SEQ = 2**64 - 1
BLOCK = 512  # the caching allocator rounds every block to 512 bytes


# a template build (engine/trace/template_build.py) asks for each operator's new storages in raw bytes, before the
# allocator's rounding (meta.extra "alloc_parts"): each is a monomial of the dimensions, their rounded sum is not
RECORD_ALLOC_PARTS = False


def rounded(nbytes: int) -> int:
    return max(BLOCK, math.ceil(nbytes / BLOCK) * BLOCK) if nbytes > 0 else 0


class TraceError(TpQueryError):
    """The model cannot be traced as asked (one line for the user)."""


@dataclass(frozen=True)
class TraceRequest:
    spec: ModelSpec
    setting: Setting
    micro_batch: int
    seq_len: int
    tp: int = 1
    sequence_parallel: bool = False
    recompute: bool = False
    optimizer: str = "adamw"
    traced_layers: int = 2
    framework: str = "torch"  # torch: the HuggingFace modules; megatron: Megatron-Core's local GPT spec
    ep: int = 1  # expert parallelism (Megatron-Core MoE): routed experts per rank = num_experts / ep
    moe_imbalance: float = 1.0  # the busiest expert's routed rows over the mean (Megatron-Core MoE)


# the precision modes Megatron-Core has (no torch autocast, no half parameters without fp32 main ones)
MEGATRON_SETTINGS = ("mp_bf16", "mp_fp16", "fp32", "tf32")


class MegatronOptimizer:
    """Megatron-Core's DDP gradient buffer and optimizer as a build without TE or apex runs them: every
    gradient is added into an fp32 main_grad buffer as backward produces it (DDP's post-hook), the step
    computes the global gradient norm for clipping (a norm per tensor, each read on the host), steps AdamW
    on fp32 main parameters (the half parameters' fp32 copies under --bf16/--fp16) and copies them back:
    `dst.copy_(src)` under --bf16, `dst.copy_(src * 1.0)` under --fp16 (Float16OptimizerWithFloat16Params
    passes its overflow buffer to the multi-tensor scale only for fp16; without apex or TE that is
    megatron.core.utils.local_multi_tensor_scale; the distributed optimizer copies its shards plainly in both,
    which a traced mp_fp16 step over-counts by that multiply); under --fp16 the main grads are unscaled with an
    inf check first, its flag read on the host; zero_grad clears the buffer. Clipping itself (a
    scale of every gradient) runs only when the norm exceeds the threshold: modelled as not taken, the steady
    state of training."""

    def __init__(self, kind: str, params: list[torch.nn.Parameter], master: bool, scaled_copy: bool = False) -> None:
        self.params = params
        self.scaled_copy = scaled_copy
        self.main_grads = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
        for p, g in zip(params, self.main_grads, strict=True):
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulate, g))
        self.master: list[torch.nn.Parameter] = \
            [torch.nn.Parameter(p.detach().float()) for p in params] if master else list(params)
        self.inner = make_optimizer(kind, self.master)
        self.extra_state: list[torch.Tensor] = [*self.main_grads, *(self.master if master else [])]
        self.half = master
        # --fp16's dynamic loss scaling (MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan): the
        # main grads unscaled with an inf check into found_inf, read on the host (`found_inf.item() > 0`)
        self.found_inf = torch.zeros(1) if scaled_copy else None
        self.inv_scale = torch.ones(1) if scaled_copy else None

    @staticmethod
    def _accumulate(main_grad: torch.Tensor, p: torch.Tensor) -> None:
        assert p.grad is not None
        main_grad.add_(p.grad)
        p.grad = None

    @property
    def state(self) -> Any:
        return self.inner.state

    def step(self) -> None:
        from .models import emit_sync

        for m, g in zip(self.master, self.main_grads, strict=True):
            m.grad = g
        if self.found_inf is not None and self.inv_scale is not None:
            self.found_inf.fill_(0.0)
            torch._amp_foreach_non_finite_check_and_unscale_(self.main_grads, self.found_inf, self.inv_scale)
            emit_sync(self.found_inf)
        norms = [torch.norm(g) for g in self.main_grads]
        for n in norms:  # torch.tensor(list of CUDA scalars) reads each one on the host
            emit_sync(n)
        self.inner.step()
        if self.half:
            with torch.no_grad():
                for p, m in zip(self.params, self.master, strict=True):
                    p.copy_(m * 1.0 if self.scaled_copy else m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.main_grads:
            g.zero_()
        for m in self.master:
            m.grad = None


class MasterWeightsOptimizer:
    """Half-precision parameters with fp32 master weights (Megatron's --bf16, FSDP2's MixedPrecisionPolicy):
    gradients cast to fp32, the optimizer steps the fp32 copies, the half parameters are refreshed from them."""

    def __init__(self, kind: str, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.master = [torch.nn.Parameter(p.detach().float()) for p in params]
        self.inner = make_optimizer(kind, self.master)
        self._cast = False

    @property
    def state(self) -> Any:
        return self.inner.state

    def cast_grads(self) -> torch.optim.Optimizer:
        """The fp32 gradients on the master copies (FSDP2: its fp32 reduce-scatter's output), once per step; the
        optimizer over them is what a grad scaler unscales (FSDP2 in fp16 with torch.amp.GradScaler)."""
        if not self._cast:
            for p, m in zip(self.params, self.master, strict=True):
                m.grad = p.grad.float() if p.grad is not None else None
            self._cast = True
        return self.inner

    def step(self) -> None:
        self.cast_grads()
        self._cast = False
        self.inner.step()
        with torch.no_grad():
            torch._foreach_copy_(list[torch.Tensor](self.params), list[torch.Tensor](self.master))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)


def make_optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer a CUDA user gets: AdamW/SGD default to the foreach implementation on CUDA."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=True)
    raise TraceError(f"unknown optimizer {kind!r}; choose from {', '.join(OPTIMIZERS)}")


_HALF = (torch.float16, torch.bfloat16)


def _cuda_layer_norm_stats(args: tuple[Any, ...], out: Any) -> Any:
    """CUDA's layer norm keeps mean/rstd in fp32 for half inputs; a fake CPU tensor would not."""
    if args[0].dtype in _HALF:
        return (out[0], out[1].float(), out[2].float())
    return out


# Outputs that live on the host in a real CUDA run (philox seeds of the efficient kernel,
# constants lifted from torch.tensor(...) with no device).
HOST_OUTPUTS: dict[str, tuple[int, ...]] = {
    "aten._scaled_dot_product_efficient_attention.default": (2, 3),
    "aten.lift_fresh.default": (0,),
}

# Where a CPU fake kernel's outputs differ from what the CUDA kernel returns.
CUDA_OUTPUT_FIXUPS: dict[str, Callable[[tuple[Any, ...], Any], Any]] = {
    "aten.native_layer_norm.default": _cuda_layer_norm_stats,
}


def _softmax_backward_tmp(args: tuple[Any, ...]) -> int:
    """softmax_backward_cuda_out (aten/src/ATen/native/cuda/SoftMax.cu) computes `tmp = grad * output` before its
    kernel: one more gradient-sized tensor live beside the output (a Megatron --bf16 step peaks there: +4 GiB
    during the op, +2 after it, per-operator allocator counts on an H200, tools/mcore_op_memory.py)."""
    grad, output = args[0], args[1]
    dtype = torch.promote_types(grad.dtype, output.dtype)
    return rounded(grad.numel() * dtype.itemsize)


# Memory a CUDA kernel allocates and frees inside one operator (no aten call of its own reaches the dispatcher
# on fake tensors): bytes live beside the operator's outputs at its peak.
CUDA_IN_OP_TEMPORARIES: dict[str, Callable[[tuple[Any, ...]], int]] = {
    "aten._softmax_backward_data.default": _softmax_backward_tmp,
}

_PLAIN_TYPES = (torch.Tensor, FakeTensor, torch.nn.Parameter)


@dataclass(frozen=True)
class EagerInPlace:
    """An autograd formula's eager branch. Under any dispatch mode (this tracer's, and the GPU op log's) a tensor
    counts as subclass-like (ATen's isTensorSubclassLike: `dispatch_mode_enabled()`), and formulas such as
    value_selecting_reduction_backward (max.dim, topk, sort) or index_backward take their out-of-place branch on
    the fresh zeros they build; a plain eager step updates those zeros in place and skips copying them (gpt-oss's
    max over its scores with a sink: a 2 GiB copy per layer the GPU never makes)."""

    op: str  # the eager operator
    extra: tuple[Any, ...] = ()  # arguments the eager call adds after the traced ones
    needs: Callable[[tuple[Any, ...], dict[str, Any]], bool] = lambda a, k: True


_ZEROS_OPS = ("aten.zeros.default", "aten.new_zeros.default", "aten.zeros_like.default")
EAGER_IN_PLACE: dict[str, EagerInPlace] = {
    "aten.scatter.src": EagerInPlace("aten.scatter_.src"),  # value_selecting_reduction_backward
    "aten.scatter_add.default": EagerInPlace("aten.scatter_add_.default"),  # gather_backward, cummax/cummin
    "aten.index_add.default": EagerInPlace("aten.index_add_.default"),  # index_select_backward
    "aten.masked_scatter.default": EagerInPlace("aten.masked_scatter_.default"),  # masked_select_backward
    "aten.put.default": EagerInPlace("aten.put_.default"),  # take_backward
    # index_backward: at::_index_put_impl_(zeros, indices, grad, accumulate=true, unsafe=true)
    "aten.index_put.default": EagerInPlace("aten._index_put_impl_.default", (True,),
                                           lambda a, k: len(a) > 3 and a[3] is True and not k),
}


class _Recorder(TorchDispatchMode):
    def __init__(self, cap: _Capture | None) -> None:
        super().__init__()
        self.cap = cap
        self._fresh: weakref.ref[torch.Tensor] | None = None  # the last zeros a backward formula built

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if any(t not in _PLAIN_TYPES for t in types):
            # a tensor subclass (torchao's float8 tensors): let it decompose; its inner calls on plain
            # tensors come back through this mode and are what the GPU runs
            return NotImplemented
        kwargs = kwargs or {}
        name = str(func)
        eager = EAGER_IN_PLACE.get(name) if self.cap is not None and self.cap.phase == Phase.BWD else None
        fresh = self._fresh() if self._fresh is not None else None
        if eager is not None and fresh is not None and args and args[0] is fresh and eager.needs(args, kwargs):
            func = resolve_op(eager.op)
            args = (*args, *eager.extra)
            name = eager.op
        elif fresh is not None and any(a is fresh for a in tree_leaves((args, kwargs))):
            self._fresh = None  # read by anything else: no longer the formula's fresh buffer
        out = func(*args, **kwargs)
        fix = CUDA_OUTPUT_FIXUPS.get(name)
        if fix is not None:
            out = fix(args, out)
        if self.cap is None:
            return out
        if name in _ZEROS_OPS and self.cap.phase == Phase.BWD and isinstance(out, torch.Tensor):
            self._fresh = weakref.ref(out)
        if self.cap.active and name.startswith("aten."):
            self.cap.on_op(func, args, kwargs, out)
        return out


class _HostSet:
    """Tensors that live on the host in a real run, by identity (ids are reused after a free)."""

    def __init__(self, tensors: list[torch.Tensor] = ()) -> None:  # type: ignore[assignment]
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}
        for t in tensors:
            self.add(t)

    def add(self, t: torch.Tensor) -> None:
        self._refs[id(t)] = weakref.ref(t)

    def __contains__(self, t: object) -> bool:
        r = self._refs.get(id(t))
        return r is not None and r() is t


class _Capture:
    """State of one recording: ops, sections, live bytes."""

    def __init__(self, host_ids: _HostSet, param_section: dict[int, tuple[Section, int]]) -> None:
        self.active = False
        self.phase = Phase.FWD
        self.section = Section.EMBED
        self.layer = -1
        self.host_ids = host_ids
        self.param_section = param_section
        # DTensor sequence parallelism: gradients left Partial over the TP ranks (graph.sequence_parallel_norm);
        # every optimizer call that reads one all-reduces it first, each time (kernel timelines: 3 per weight
        # under foreach AdamW). A master-weight optimizer's fp32 copies are not followed.
        self.partial_params: list[torch.nn.Parameter] = []
        self.partial_grads = _HostSet()
        self.records: list[OpRecord] = []
        self.alloc_parts: list[tuple[int, ...]] = []  # per record: the raw bytes of each new storage
        self._parts: list[int] = []
        self.seq_marks: list[int] = []
        self.seq_sections: list[tuple[Section, int]] = []
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self.marks: dict[str, int] = {}
        self._keep: list[Any] = []  # pre-existing storages, held so their ids stay theirs
        self.window_peak: dict[str, int] = {}
        self._windows: set[str] = set()
        # a template build's memory events (RECORD_ALLOC_PARTS): ("a",) an allocation (the next of alloc_parts),
        # ("f", i) the i-th allocation freed, ("t", bytes) a transient, ("m" | "o" | "c", name) a mark, a window
        # opened, closed, ("mo", name, k) a mark below the last k allocations (an operator's own); engine/template.py replays them at other dimensions
        self.events: list[tuple[Any, ...]] = []
        self._alloc_of: dict[int, int] = {}
        self._n_allocs = 0

    # -- sections ----------------------------------------------------------------------------
    def enter(self, section: Section, layer: int = -1) -> None:
        if self.phase != Phase.FWD:
            return  # recomputation during backward re-runs forward hooks: keep backward attribution
        self.section, self.layer = section, layer
        self.seq_marks.append(torch._C._autograd._get_sequence_nr())
        self.seq_sections.append((section, layer))

    def enter_head(self) -> None:
        self.enter(Section.HEAD)
        self.open_window("head")

    def _backward_section(self) -> tuple[Section, int]:
        node = torch._C._current_autograd_node()
        if node is None:
            return Section.HEAD, -1
        seq = node._sequence_nr()
        if seq == _ACC_GRAD_SEQ:
            var = getattr(node, "variable", None)
            if var is not None and id(var) in self.param_section:
                return self.param_section[id(var)]
            return Section.HEAD, -1
        i = bisect.bisect_right(self.seq_marks, seq) - 1
        return self.seq_sections[i] if i >= 0 else (Section.EMBED, -1)

    # -- memory -------------------------------------------------------------------------------
    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        if key in self._alloc_of:
            self.events.append(("f", self._alloc_of.pop(key)))

    def track(self, t: torch.Tensor) -> int:
        if t in self.host_ids:
            return 0
        st = t.untyped_storage()
        key = id(st)
        if key in self._sizes:
            return 0
        self._parts.append(int(st.nbytes()))
        if RECORD_ALLOC_PARTS:
            self._alloc_of[key] = self._n_allocs
            self._n_allocs += 1
            self.events.append(("a",))
        n = rounded(st.nbytes())
        self._sizes[key] = n
        weakref.finalize(st, self._free, key)
        self.live += n
        if self.live > self.peak:
            self.peak = self.live
        for w in self._windows:
            self.window_peak[w] = max(self.window_peak.get(w, 0), self.live)
        return n

    def transient(self, n: int) -> None:
        """Bytes live for the duration of one operator only: they raise the peaks, not the live count."""
        if RECORD_ALLOC_PARTS:
            self.events.append(("t", int(n)))
        top = self.live + n
        self.peak = max(self.peak, top)
        for w in self._windows:
            self.window_peak[w] = max(self.window_peak.get(w, 0), top)

    def known(self, tensors: list[torch.Tensor]) -> None:
        """Storages that exist before recording (weights, optimizer state, inputs, buffers): their views
        are not allocations."""
        for t in tensors:
            st = t.untyped_storage()
            self._sizes.setdefault(id(st), 0)
            self._keep.append(st)

    def mark(self, name: str) -> None:
        if RECORD_ALLOC_PARTS:
            self.events.append(("m", name))
        self.marks[name] = self.live

    def open_window(self, name: str) -> None:
        if RECORD_ALLOC_PARTS:
            self.events.append(("o", name))
        self._windows.add(name)
        self.window_peak[name] = self.live

    def close_window(self, name: str) -> None:
        if RECORD_ALLOC_PARTS:
            self.events.append(("c", name))
        self._windows.discard(name)

    # -- ops ----------------------------------------------------------------------------------
    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self.phase == Phase.BWD:
            section, layer = self._backward_section()
        elif self.phase == Phase.OPT:
            section, layer = Section.OPTIM, -1
        else:
            section, layer = self.section, self.layer
        name = str(func)
        if name == "aten.lift_fresh.default":
            self.host_ids.add(args[0])
        if self.phase == Phase.OPT and self.partial_params:
            for a in args:
                for t in (a if isinstance(a, list | tuple) else (a,)):
                    if isinstance(t, torch.Tensor) and t in self.partial_grads:
                        self.comm("all_reduce", t, "tp")
        call = encode_call(func, args, kwargs, lambda t: t in self.host_ids)
        if name == "aten.new_zeros.default" and not kwargs:
            # torch 2.13's topk backward allocates with new_zeros(grad, size); the GPU's torch 2.11 (and
            # every other new_zeros it logs) passes dtype and layout: zeros(size, dtype, layout), as logged
            t = args[0]
            call = encode_call(torch.ops.aten.zeros.default, (list(args[1]),),
                               {"dtype": t.dtype, "layout": torch.strided})
        for i in HOST_OUTPUTS.get(name, ()):
            outs = out if isinstance(out, tuple | list) else (out,)
            if i < len(outs) and isinstance(outs[i], torch.Tensor):
                self.host_ids.add(outs[i])
        alloc = 0
        self._parts = []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                alloc += self.track(t)
        self.records.append(OpRecord(call.op, call.to_json_str(), self.phase, section, layer, alloc))
        self.alloc_parts.append(tuple(self._parts))
        if self.phase == Phase.BWD and section == Section.LAYER:
            key = f"bwd_layer{layer}"
            if key not in self.marks:
                if RECORD_ALLOC_PARTS:  # a mark below this operator's own allocations (the last len(_parts))
                    self.events.append(("mo", key, len(self._parts)))
                self.marks[key] = self.live - alloc
                self.open_window(key)
            for w in list(self._windows):
                if w.startswith("bwd_layer") and w != key:
                    self.close_window(w)
        tmp = CUDA_IN_OP_TEMPORARIES.get(name)
        if tmp is not None:
            self.transient(tmp(args))

    def comm(self, kind: str, t: torch.Tensor, group: str) -> None:
        if not self.active:
            return
        if kind == "sync":
            self.sync(self.section, torch.bool)
            return
        spec = TensorSpec(tuple(int(x) for x in t.shape), dtype_of(t.dtype))
        call = OpCall(f"comm.{kind}", (spec,), (("group", group),))
        section, layer = (self._backward_section() if self.phase == Phase.BWD else (self.section, self.layer))
        self.records.append(OpRecord(call.op, call.to_json_str(), self.phase, section, layer, 0))
        self.alloc_parts.append(())

    def sync(self, section: Section = Section.OPTIM, dtype: torch.dtype = torch.float32) -> None:
        """A host synchronisation the fake run cannot perform (GradScaler's found_inf.item(), HF's
        packed-sequence check)."""
        call = OpCall("aten._local_scalar_dense.default", (TensorSpec((), dtype_of(dtype)),))
        self.records.append(OpRecord(call.op, call.to_json_str(), self.phase, section, -1, 0))
        self.alloc_parts.append(())


def _construct(factory: Callable[[], torch.nn.Module], dtype: torch.dtype) -> torch.nn.Module:
    """Build under a default dtype, as transformers' from_config(dtype=...) does: parameters take
    the dtype, buffers computed in an explicit dtype (rotary inv_freq) keep theirs."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = factory()
    finally:
        torch.set_default_dtype(prev)
    model.train()
    return model


def _storage_parts(tensors: list[torch.Tensor]) -> list[int]:
    """The raw bytes of each distinct storage of `tensors`."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        st = t.untyped_storage()
        if id(st) not in seen:
            seen.add(id(st))
            out.append(int(st.nbytes()))
    return out


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(rounded(n) for n in _storage_parts(tensors))


def _validate(req: TraceRequest) -> None:
    s = req.spec
    if s.family == ArchFamily.TRANSFORMERS:
        from .hf_models import check_layer_kinds

        check_layer_kinds(s)
    if req.framework not in ("torch", "megatron"):
        raise TraceError(f"unknown framework {req.framework!r}: torch or megatron")
    if req.framework == "megatron" and req.setting.value not in MEGATRON_SETTINGS and \
            not SETTINGS[req.setting].fp8_recipe:
        raise TraceError(f"Megatron-Core trains with --bf16/--fp16 (half parameters, fp32 main parameters: "
                         f"mp_bf16/mp_fp16) or in fp32 (fp32/tf32); the precision setting is {req.setting.value} "
                         f"(a PyTorch setting{', the default' if req.setting == Setting.AMP_BF16 else ''}): "
                         f"give --precision mp_bf16")
    if req.framework == "megatron" and SETTINGS[req.setting].fp8_recipe:
        raise TraceError("the fp8 settings model torchao float8 training on PyTorch; Megatron-Core's FP8 needs "
                         "Transformer Engine, which is not modelled")
    if s.family == ArchFamily.TRANSFORMERS and req.tp > 1 and json.loads(s.hf_config or "{}").get(
            "output_router_logits") is True:  # its own loss (with the router's) runs at TP=1 only
        raise TraceError("output_router_logits true is modelled at TP=1 (transformers' own loss); under TP the "
                         "language-model loss is predicted alone: set it to false or use --tp 1")
    if req.ep < 1:
        raise TraceError("EP must be positive")
    if req.ep > 1 and s.family == ArchFamily.TRANSFORMERS:
        raise TraceError(f"--ep {req.ep}: expert parallelism is modelled for the listed MoE families under Megatron-Core, "
                         f"not for {s.model_type}")
    if req.ep > 1 and not s.is_moe:
        raise TraceError(f"--ep {req.ep} needs a mixture-of-experts model; {s.family.value} has no routed experts")
    if req.ep > 1 and req.framework != "megatron":
        raise TraceError("expert parallelism is modelled as Megatron-Core runs it (all-to-all token dispatcher): "
                         "use --framework megatron; PyTorch-native EP is not modelled")
    if req.moe_imbalance != 1.0:
        if s.family == ArchFamily.TRANSFORMERS:
            raise TraceError(f"--moe-imbalance is modelled for the listed MoE families, not for {s.model_type}")
        if not s.is_moe:
            raise TraceError("--moe-imbalance needs a mixture-of-experts model")
        top = s.num_experts / s.experts_per_token
        if not 1.0 <= req.moe_imbalance <= top:
            raise TraceError(f"--moe-imbalance must be within [1, experts / top-k = {top:g}] (an expert receives "
                             f"each token at most once), got {req.moe_imbalance:g}")
        if req.framework != "megatron":
            raise TraceError("--moe-imbalance is modelled for --framework megatron (its experts run one GEMM each); "
                             "transformers' grouped GEMMs are measured with equal groups only")
    if s.is_moe and s.num_experts % req.ep:
        raise TraceError(f"EP={req.ep} does not divide the {s.num_experts} routed experts")
    if req.framework == "megatron":
        from .megatron_local import MEGATRON_FAMILIES

        if s.family not in MEGATRON_FAMILIES:
            raise TraceError(f"--framework megatron models Megatron-Core's local GPT spec for Llama-family, Qwen3, "
                             f"Mixtral and Qwen3-MoE configs, not {s.model_type}")
        if s.layer_types and any(t != "full_attention" for t in s.layer_types):
            raise TraceError("--framework megatron: sliding-window attention is not in Megatron-Core's local spec")
        if s.shared_expert_intermediate_size:
            raise TraceError("--framework megatron: shared experts are not modelled for Megatron-Core")
        # the local spec as modelled (and as --emit megatron writes it): SwiGLU, bias on the QKV projection at
        # most (--disable-bias-linear, --add-qkv-bias), no dropout; a config asking otherwise is refused
        if not s.gated_mlp or s.hidden_act not in ("silu", "swish"):
            raise TraceError(f"--framework megatron models Megatron-Core's SwiGLU MLP (--swiglu); this config's "
                             f"activation is {s.hidden_act!r}: use --framework torch")
        if s.o_bias or s.mlp_bias:
            raise TraceError("--framework megatron models biases on the QKV projection only (--disable-bias-linear "
                             "--add-qkv-bias); this config has output-projection or MLP biases "
                             "(attention_bias / mlp_bias): use --framework torch")
        drops = {k: v for k, v in (("attention_dropout", s.attention_dropout), ("resid_pdrop", s.resid_dropout),
                                   ("embd_pdrop", s.embd_dropout)) if v}
        if drops:
            raise TraceError("--framework megatron is modelled without dropout (--attention-dropout 0 "
                             "--hidden-dropout 0); this config sets " +
                             ", ".join(f"{k} {v:g}" for k, v in drops.items()) + ": use --framework torch")
        if s.is_moe and req.tp > 1:
            raise TraceError("--framework megatron with MoE and TP > 1 (expert tensor parallelism, sequence "
                             "parallelism required by Megatron) is not modelled: use --tp 1 with --ep")
        if req.sequence_parallel and req.tp > 1:
            raise TraceError("Megatron-Core's local layer spec refuses sequence parallelism (it needs Transformer "
                             "Engine or apex norms); use --framework torch or drop --sequence-parallel")
    if s.builder.value == "hf":
        if req.framework == "megatron" and s.family.value not in ("mixtral", "qwen3", "qwen3_moe"):
            raise TraceError(f"--framework megatron models Megatron-Core's local GPT spec for Llama-family configs, "
                             f"not {s.model_type}")
    if req.micro_batch <= 0 or req.seq_len <= 0:
        raise TraceError("micro-batch and sequence length must be positive")
    if req.tp <= 0:
        raise TraceError("TP must be positive")
    why = s.split_refusal(req.tp, req.sequence_parallel)
    if why:
        raise TraceError(why)
    if req.sequence_parallel and req.seq_len % req.tp:
        raise TraceError(f"sequence parallelism needs seq-len ({req.seq_len}) divisible by TP={req.tp}")
    if req.seq_len > s.max_position_embeddings and s.family.value == "gpt2":
        raise TraceError(f"seq-len {req.seq_len} exceeds GPT-2's n_positions ({s.max_position_embeddings})")
    if req.optimizer not in OPTIMIZERS:
        raise TraceError(f"unknown optimizer {req.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")


def _train_step(forward: Callable[[], Any], opt: torch.optim.Optimizer, scaler: Any, ac_dtype: torch.dtype | None,
                cap: _Capture | None, section: Section) -> None:
    """One training step as users write it: forward under autocast, (scaled) backward, optimizer step
    (GradScaler: unscale, found_inf sync, step, update), zero_grad. `cap` marks the phases."""
    if cap:
        cap.phase = Phase.FWD
        cap.enter(section)
    with autocast_cuda.cuda_autocast(ac_dtype):
        out = forward()
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TraceError("the module's forward must return a scalar loss (or an object with .loss)")
    del out
    if cap:
        cap.mark("fwd_end")
        cap.phase = Phase.BWD
    (scaler.scale(loss) if scaler else loss).backward()
    del loss
    if cap:
        for w in list(cap._windows):
            cap.close_window(w)
        cap.mark("bwd_end")
        cap.phase = Phase.OPT
        cap.partial_grads = _HostSet([p.grad for p in cap.partial_params if p.grad is not None])
        cap.open_window("opt")
    if scaler:
        scaler.unscale_(_scaled_optimizer(opt))
        if cap:
            cap.sync()
        opt.step()
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    if cap:
        cap.close_window("opt")


def _scaled_optimizer(opt: Any) -> Any:
    """The optimizer whose gradients a GradScaler unscales: with fp32 master weights, the master copies' (cast
    first, as FSDP2's fp32 reduce-scatter leaves them)."""
    return opt.cast_grads() if isinstance(opt, MasterWeightsOptimizer) else opt


def _warm_state(params: list[torch.nn.Parameter], opt: Any, scaler: Any) -> None:
    """The state one training step leaves (optimizer moments and step counts, the grad scaler's scale and
    growth tracker), made by an optimizer step over zero gradients instead of a whole unrecorded step: the
    model's forward and backward were half of every trace."""
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    if scaler is not None:
        scaler.scale(torch.zeros((), device=params[0].device))
        scaler.unscale_(_scaled_optimizer(opt))
        opt.step()
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None


def trace_config(req: TraceRequest, *, full_warmup_step: bool = False) -> Graph:
    """Trace one micro-batch's forward+backward and one optimizer step of `req.traced_layers` layers.
    `full_warmup_step`: reach the steady state by a whole unrecorded step (the tests check both agree).
    A model type known only to transformers whose own module fails under the trace is refused in one line."""
    if req.spec.family != ArchFamily.TRANSFORMERS:
        return _trace_config(req, full_warmup_step)
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from tp_query.schema.messages import first_line
    from tp_query.schema.model_config import ConfigError

    from .hf_models import UnsupportedSplit

    try:
        return _trace_config(req, full_warmup_step)
    except (TraceError, ConfigError, UnsupportedSplit):
        raise
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise ConfigError(f"{req.spec.model_type}: its step depends on tensor values ({type(e).__name__}: "
                          f"{first_line(e)}), which a trace on fake tensors cannot follow; for this model use "
                          f"`tp-query trace`") from None
    except Exception as e:  # the model type's own module, as transformers builds it from this config
        if req.tp > 1:
            raise UnsupportedSplit(f"TP={req.tp}: {req.spec.model_type}'s module fails in a step built from its "
                                   f"divided config ({type(e).__name__}: {first_line(e)}); its tensor-parallel "
                                   f"layout is not modelled (use --tp 1)") from None
        raise ConfigError(f"{req.spec.model_type}: transformers' module fails in a training step built from this "
                          f"config ({type(e).__name__}: {first_line(e)}); for this model use `tp-query trace`") from None


def _depth_sized_inputs(spec: ModelSpec) -> bool:
    from .hf_models import depth_sized_inputs

    return depth_sized_inputs(spec)


def _trace_config(req: TraceRequest, full_warmup_step: bool) -> Graph:
    _validate(req)
    autocast_cuda.install()
    sdpa.install()
    st = SETTINGS[req.setting]
    t0 = time.perf_counter()
    if req.spec.builder == Builder.HF and _depth_sized_inputs(req.spec):
        spec_t = req.spec  # per-layer input tables sized by the depth: the whole model (its layers composed alike)
    elif len(set(req.spec.layer_kinds())) > 1 and req.traced_layers < req.spec.num_layers:
        # layers differ in kind (attention type, dense or sparse MLP, RoPE): a leading layer, then one template
        # of each kind
        spec_t = req.spec.cut(req.spec.traced_layer_indices())
    else:
        spec_t = req.spec.with_layers(min(req.traced_layers, req.spec.num_layers))  # (a 1-layer model)
    n_traced = spec_t.num_layers
    shard = Shard(req.tp, req.sequence_parallel and req.tp > 1, req.recompute, req.ep, req.moe_imbalance,
                  dtensor=req.framework == "torch")
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    with FakeTensorMode(allow_non_fake_inputs=False):
        model = _construct(lambda: build_model(spec_t, shard, req.framework), torch_dtype(st.param_dtype))
        fp8_kept: list[str] = []
        if st.fp8_recipe:
            try:
                converted, fp8_kept = convert_fp8(model, st.fp8_recipe)
            except ImportError:
                raise TraceError("the fp8 settings trace torchao's float8 training: pip install torchao==0.18.0"
                                 ) from None
            if not converted and fp8_kept:
                # (Falcon: every projection is a FalconLinear) the answer would be bf16's time, named fp8
                raise TraceError(f"{req.setting.value}: this model's Linear layers are subclasses of nn.Linear "
                                 f"({', '.join(fp8_kept)}), which tp-query leaves in bf16 (their own forward) while "
                                 "torchao's convert_to_float8_training converts them by default; not predicted")
            if not converted:
                # (GPT-2: its projections are transformers' Conv1D) torchao converts nothing: bf16's time, named fp8
                raise TraceError(f"{req.setting.value}: no layer of this model is an nn.Linear that torchao's "
                                 "convert_to_float8_training converts (GPT-2's projections are Conv1D), so the "
                                 "step would run in bf16; not predicted")
        params = [p for p in model.parameters()]
        opt: Any
        if req.framework == "megatron":
            opt = MegatronOptimizer(req.optimizer, params, st.master_weights,
                                    scaled_copy=req.setting.value == "mp_fp16")
        elif st.master_weights:
            opt = MasterWeightsOptimizer(req.optimizer, params)
        else:
            opt = make_optimizer(req.optimizer, params)
        # (Megatron's fp16 unscales in its own scaled copy; FSDP2 in fp16 takes torch.amp.GradScaler)
        scaler = torch.amp.GradScaler("cpu") if st.grad_scaler and req.framework != "megatron" else None
        ac_dtype = torch_dtype(st.autocast_dtype) if st.autocast_dtype else None
        input_ids = torch.randint(0, req.spec.vocab_size, (req.micro_batch, req.seq_len))
        labels = input_ids

        param_section: dict[int, tuple[Section, int]] = {}
        records_params: list[ParamRecord] = []
        for name, p in model.named_parameters():
            if name.startswith("layers."):
                sec, li = Section.LAYER, int(name.split(".")[1])
            elif name.startswith("embed."):
                sec, li = Section.EMBED, -1
            else:
                sec, li = Section.HEAD, -1
            param_section[id(p)] = (sec, li)
            records_params.append(ParamRecord(name, tuple(p.shape), str(dtype_of(p.dtype)), sec, li))

        def step(cap: _Capture | None) -> None:
            _train_step(lambda: model(input_ids, labels), opt, scaler, ac_dtype, cap, Section.EMBED)

        # Steady state before the recorded step: optimizer state and the grad scaler exist.
        with _Recorder(None):
            if full_warmup_step:
                step(None)
            else:
                _warm_state(params, opt, scaler)
        host_ids = _HostSet([s["step"] for s in opt.state.values()
                             if isinstance(s.get("step"), torch.Tensor) and req.optimizer != "adamw_fused"])
        cap = _Capture(host_ids, param_section)
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        state += list(getattr(opt, "extra_state", getattr(opt, "master", [])))
        static_parts = _storage_parts(params + [t for t in state if t not in host_ids])
        static = sum(rounded(n) for n in static_parts)
        cap.known(params + state + list(model.buffers()) + [input_ids])
        if scaler is not None:
            static += 2 * BLOCK

        embed_mod, layer_mods, head_mod = section_modules(model)
        hooks = [embed_mod.register_forward_pre_hook(lambda m, a: cap.enter(Section.EMBED)),
                 embed_mod.register_forward_hook(lambda m, a, o: cap.mark("embed_end")),
                 head_mod.register_forward_pre_hook(lambda m, a: cap.enter_head()),
                 ]
        for i, layer in enumerate(layer_mods):
            hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: cap.enter(Section.LAYER, i)))
            hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: cap.mark(f"layer{i}_end")))
        if shard.dtensor and shard.sequence_parallel and not st.master_weights:
            cap.partial_params = [p for n, p in model.named_parameters() if sequence_parallel_norm(n, tuple(p.shape))]
        COMM_SINK.append(cap.comm)
        torch.backends.cuda.matmul.allow_tf32 = st.allow_tf32
        try:
            cap.active = True
            with _Recorder(cap):
                step(cap)
            cap.active = False
        finally:
            COMM_SINK.remove(cap.comm)
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32
            for h in hooks:
                h.remove()

    # named_parameters() lists a tied LM head once, under the embedding
    grad_parts = [p.numel * torch_dtype(p.dtype).itemsize for p in records_params]
    grad_bytes = sum(rounded(n) for n in grad_parts)
    extra: dict[str, Any] = {"trace_s": round(time.perf_counter() - t0, 3), "framework": req.framework}
    if req.ep > 1:
        extra["ep"] = req.ep
    if req.moe_imbalance != 1.0:
        extra["moe_imbalance"] = req.moe_imbalance
    if req.spec.builder.value == "hf" and req.framework != "megatron":
        import transformers

        from .hf_models import MODELLED_TRANSFORMERS

        extra["transformers"] = transformers.__version__
        if transformers.__version__ != MODELLED_TRANSFORMERS:
            extra["warnings"] = [f"traced with transformers {transformers.__version__}; the database's families were "
                                 f"validated with {MODELLED_TRANSFORMERS} (other versions may dispatch other operators)"]
    if fp8_kept:
        extra.setdefault("warnings", []).append(
            f"{req.setting.value}: {', '.join(fp8_kept)} (nn.Linear subclasses with a forward of their own, such as MoE "
            "routers) stay in bf16, as torchtitan leaves routers; torchao's default filter would convert them")
    if spec_t.layer_types:
        extra["traced_layer_types"] = list(spec_t.layer_types)
    if len(set(req.spec.layer_kinds())) > 1:
        extra["traced_layer_kinds"] = list(spec_t.layer_kinds())
    if RECORD_ALLOC_PARTS:
        extra["alloc_parts"] = [list(p) for p in cap.alloc_parts]
        extra["mem_events"] = [list(e) for e in cap.events]
        extra["static_parts"] = static_parts
        extra["static_more"] = static - sum(rounded(n) for n in static_parts)
        extra["grad_parts"] = grad_parts
    meta = GraphMeta(
        source="config", model=req.spec.to_dict(), setting=req.setting.value, micro_batch=req.micro_batch,
        seq_len=req.seq_len, tp=req.tp, sequence_parallel=shard.sequence_parallel, recompute=req.recompute,
        optimizer=req.optimizer, traced_layers=n_traced, torch_version=torch.__version__,
        sdpa_policy=sdpa.POLICY_ID, extra=extra,
    )
    mem_templates = layer_templates(meta) or {n_traced - 1: 1.0}
    mem = _memory_profile(cap, static, grad_bytes, n_traced, mem_templates)
    if RECORD_ALLOC_PARTS:
        extra["mem_templates"] = [[k, v] for k, v in mem_templates.items()]
    return Graph(meta, tuple(cap.records), tuple(records_params), mem)


def _memory_profile(cap: _Capture, static: int, grad_bytes: int, n_layers: int,
                    templates: dict[int, float]) -> MemoryProfile:
    return memory_profile_from(cap.marks, cap.window_peak, cap.peak, static, grad_bytes, n_layers, templates)


def trace_module(factory: Callable[[], torch.nn.Module], make_inputs: Callable[[torch.nn.Module], tuple[Any, ...]],
                 setting: Setting, optimizer: str = "adamw", name: str = "module") -> Graph:
    """Trace a user's nn.Module whose forward returns a scalar loss (or an object with .loss)."""
    autocast_cuda.install()
    sdpa.install()
    st = SETTINGS[setting]
    with FakeTensorMode():
        model = _construct(factory, torch_dtype(st.param_dtype))
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise TraceError("the module has no trainable parameters")
        opt = make_optimizer(optimizer, params)
        scaler = torch.amp.GradScaler("cpu") if st.grad_scaler else None
        ac_dtype = torch_dtype(st.autocast_dtype) if st.autocast_dtype else None
        inputs = make_inputs(model)
        warnings: list[str] = []
        own = sorted({str(dtype_of(p.dtype)) for p in params})
        if own != [str(st.param_dtype)]:
            # transformers 5 builds a module in its config's dtype: what runs is what the graph holds
            warnings.append(f"the module's parameters are {'/'.join(own)}, not the {st.param_dtype} that {setting.value} "
                            "asks for: the graph is what the module runs")
        tokens = next((t for t in inputs if isinstance(t, torch.Tensor) and t.dim() == 2
                       and not t.is_floating_point()), None)
        param_section = {id(p): (Section.BODY, -1) for p in params}
        recs = [ParamRecord(n, tuple(p.shape), str(dtype_of(p.dtype)), Section.BODY) for n, p in model.named_parameters()
                if p.requires_grad]

        def step(cap: _Capture | None) -> None:
            _train_step(lambda: model(*inputs), opt, scaler, ac_dtype, cap, Section.BODY)

        with _Recorder(None):
            step(None)
        host_ids = _HostSet([s["step"] for s in opt.state.values()
                             if isinstance(s.get("step"), torch.Tensor) and optimizer != "adamw_fused"])
        cap = _Capture(host_ids, param_section)
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        static = _storage_bytes(params + [t for t in state if t not in host_ids])
        cap.known(params + state + list(model.buffers())
                  + [t for t in inputs if isinstance(t, torch.Tensor)])
        cap.active = True
        with _Recorder(cap):
            step(cap)
        cap.active = False
    grad_bytes = sum(rounded(p.numel * torch_dtype(p.dtype).itemsize) for p in recs)
    fwd_end = cap.marks.get("fwd_end", 0)
    mem = MemoryProfile(static_bytes=static, embed_act_bytes=fwd_end, layer_act_bytes=0, head_peak_bytes=0,
                        layer_bwd_transient_bytes=0, grad_bytes=grad_bytes,
                        opt_peak_bytes=max(cap.window_peak.get("opt", 0) - cap.marks.get("bwd_end", 0), 0),
                        traced_peak_bytes=static + cap.peak, fwd_end_bytes=fwd_end)
    # tokens per step from the first integer [batch, sequence] input (token ids), when there is one
    mb, seq = (int(tokens.shape[0]), int(tokens.shape[1])) if tokens is not None else (1, 0)
    if tokens is None:
        warnings.append("no [batch, sequence] integer input (token ids) among the module's inputs: tokens/s is "
                        "not defined")
    meta = GraphMeta(source="module", model={"name": name}, setting=setting.value, micro_batch=mb, seq_len=seq, tp=1,
                     sequence_parallel=False, recompute=False, optimizer=optimizer, traced_layers=0,
                     torch_version=torch.__version__, sdpa_policy=sdpa.POLICY_ID,
                     extra={"peak_bwd_bytes": static + cap.peak, "warnings": warnings,
                            "tokens_from": "first [batch, sequence] integer input" if tokens is not None else None})
    return Graph(meta, tuple(cap.records), tuple(recs), mem)
