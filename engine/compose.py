"""From a traced graph to what each GPU runs: layers replicated, pipeline stages cut, optimizer
ops rebuilt for each stage's (possibly ZeRO-sharded) parameters, and the extra work of gradient
accumulation and DDP.

Semantics (Megatron-LM style; see README "Parallelism semantics"):
- TP is already in the graph: the trace is of the TP shard, with comm.* records where Megatron
  communicates (column/row-parallel linears, vocab-parallel embedding and cross-entropy).
- PP cuts contiguous layer ranges; the first stage has the embedding, the last the final norm,
  LM head and loss; as even as possible, extra layers to the first stages.
- DP replicates; with ZeRO >= 1 the optimizer runs on 1/DP of every parameter.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from tp_query.schema.model_config import with_own_class_defaults
from tp_query.schema.ops import (
    DENSE_ROUTED_MODEL_TYPES,
    CallInfo,
    Operands,
    describe,
    routed_operands,
    step_operands,
    with_operands,
)
from tp_query.schema.precision import DType
from tp_query.schema.signature import OpCall, TensorSpec, call_key

from .graph import (
    Graph,
    OpRecord,
    ParamRecord,
    Phase,
    Section,
    layer_template_of,
    layer_templates,
    sequence_parallel_norm,
)
from .parallel import ParallelConfig, PlanError


@dataclass(frozen=True)
class Item:
    """One operator call of a stage, with what the registry derives from it."""

    key: str
    call: OpCall
    info: CallInfo
    phase: Phase


@dataclass(frozen=True)
class ParamSums:
    """A stage's parameter totals that memory and the data-parallel model read for every candidate: summed once
    per parameter list (a search asks them thousands of times of the same few lists)."""

    layer_numel: tuple[tuple[int, int], ...]  # (model layer, its parameters' elements), in layer order
    head_numel: int
    expert_numel: int  # routed experts' elements (".experts." in the name)
    section_bytes: dict[Section, tuple[int, ...]]  # each parameter's bytes, per section, in list order

    @staticmethod
    def of(params: list[ParamRecord]) -> ParamSums:
        per_layer: dict[int, int] = {}
        sizes: dict[Section, list[int]] = {}
        head = expert = 0
        for p in params:
            if p.section == Section.LAYER:
                per_layer[p.layer] = per_layer.get(p.layer, 0) + p.numel
            elif p.section == Section.HEAD:
                head += p.numel
            if ".experts." in p.name:
                expert += p.numel
            sizes.setdefault(p.section, []).append(p.numel * DType(p.dtype).itemsize)
        return ParamSums(tuple(sorted(per_layer.items())), head, expert, {k: tuple(v) for k, v in sizes.items()})


@dataclass
class StageWork:
    index: int
    first: bool
    last: bool
    layers: int
    fwd_parts: list[tuple[Section, int]]  # one micro-batch: sections and how often each repeats
    bwd_parts: list[tuple[Section, int]]
    opt: list[Item]  # once per step
    accum: list[Item]  # per micro-batch after the first (gradient accumulation)
    ddp: list[Item]  # once per step when DP > 1: PyTorch DDP's bucket work, Megatron's buffer scaling
    params: list[ParamRecord]
    composer: Composer
    param_numel: int
    param_bytes: int
    layer_param_bytes: tuple[int, ...]  # one decoder layer's parameters as the framework models take them
    sums: ParamSums  # the parameters' totals, summed once per parameter list
    # the stage's layers per traced template (layer kind), where kinds differ: its layer section weighs each
    # kind by its own count (None: the model-wide mix, or uniform layers)
    layer_mix: tuple[tuple[int, int], ...] | None = None

    @property
    def expert_numel(self) -> int:
        """This rank's routed-expert parameters (their gradients reduce over the expert-data-parallel group)."""
        return self.sums.expert_numel

    def _expand(self, phase: Phase, parts: list[tuple[Section, int]]) -> list[Item]:
        out: list[Item] = []
        for sec, n in parts:
            out += self.composer.part(phase, sec) * n
        return out

    @property
    def fwd(self) -> list[Item]:
        return self._expand(Phase.FWD, self.fwd_parts)

    @property
    def bwd(self) -> list[Item]:
        return self._expand(Phase.BWD, self.bwd_parts)


_ITEM_CACHE: dict[tuple[str, str, bool, Operands], Item] = {}


def make_item(op: str, sig: str, phase: Phase, allow_tf32: bool, call: OpCall | None = None,
              operands: Operands = Operands.RANDOM) -> Item:
    ck = (op, sig, allow_tf32, operands)
    it = _ITEM_CACHE.get(ck)
    if it is not None and it.phase == phase:
        return it
    c = call or OpCall.from_json_str(op, sig)
    info = describe(c, allow_tf32)
    key, info = with_operands(call_key(op, sig, info.math_mode), info, operands)
    it = Item(key, c, info, phase)
    if len(_ITEM_CACHE) > 200_000:
        _ITEM_CACHE.clear()
    _ITEM_CACHE[ck] = it
    return it


def _call_item(call: OpCall, phase: Phase, allow_tf32: bool) -> Item:
    return make_item(call.op, call.to_json_str(), phase, allow_tf32, call)  # optimizer and DDP work: no GEMMs


def dense_routed_experts(model: dict[str, Any]) -> tuple[int, int, int] | None:
    """(experts, hidden, expert FFN) of a model whose experts run densely over every token with a top-1 router's
    zero weights in the data (schema.ops.DENSE_ROUTED_MODEL_TYPES: transformers' Llama-4), from the config the
    graph was traced with (per-rank sizes); None for every other model."""
    if model.get("model_type") not in DENSE_ROUTED_MODEL_TYPES:
        return None
    try:
        # (what the file leaves out is its class's default, as transformers builds the module: Llama-4's class
        # fills num_local_experts 16 and intermediate_size 8192)
        cfg = with_own_class_defaults(json.loads(model.get("hf_config") or "{}"))
        experts, top_k = int(cfg.get("num_local_experts") or 0), int(cfg.get("num_experts_per_tok") or 1)
        ffn, hidden = int(cfg.get("intermediate_size") or 0), int(model.get("hidden_size") or 0)
    except (TypeError, ValueError):
        return None
    return (experts, hidden, ffn) if experts > 1 and top_k == 1 and ffn and hidden else None


def split_layers(n_layers: int, pp: int) -> list[int]:
    if pp > n_layers:
        raise PlanError(f"PP={pp} is larger than the number of layers ({n_layers})")
    base, extra = divmod(n_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


class Composer:
    """Section templates of one graph, ready to assemble stages for any layer count and PP."""

    def __init__(self, graph: Graph, allow_tf32: bool,
                 shared: dict[tuple[object, ...], Any] | None = None) -> None:
        self.graph = graph
        self.allow_tf32 = allow_tf32
        tl = graph.meta.traced_layers - 1
        self.template_layer = tl
        # the data the step's GEMMs run on (NaN under pure fp16 with Adam): part of their lookup
        self.operands = step_operands(graph.meta.setting, graph.meta.optimizer)
        # Layers of several attention types (sliding and global): one traced template per type, and the
        # stage's layer section is their mean, each operator weighted by its type's share of the layers.
        templates = layer_templates(graph.meta)
        weight_of = {li: w for li, w in templates.items()} if templates else {tl: 1.0}
        sec: dict[tuple[Phase, Section], list[Item]] = {}
        wts: dict[tuple[Phase, Section], list[float]] = {}
        src: dict[tuple[Phase, Section], list[int]] = {}
        routed = dense_routed_experts(graph.meta.model) if self.operands == Operands.RANDOM else None
        for o in graph.ops:
            if o.section == Section.LAYER and o.layer not in weight_of:
                continue
            ops, call = self.operands, None
            if routed is not None and o.op == "aten.bmm.default":  # the experts' batched GEMMs: the router's zeros
                call = OpCall.from_json_str(o.op, o.sig)
                ops = routed_operands(call.arg_tensor(0), call.arg_tensor(1), *routed)
            sec.setdefault((o.phase, o.section), []).append(make_item(o.op, o.sig, o.phase, allow_tf32, call,
                                                                      operands=ops))
            wts.setdefault((o.phase, o.section), []).append(weight_of.get(o.layer, 1.0)
                                                            if o.section == Section.LAYER else 1.0)
            src.setdefault((o.phase, o.section), []).append(o.layer)
        self.sections = sec
        mixed = bool(templates) and len(templates) > 1
        self._weights = {k: np.asarray(v) for k, v in wts.items() if mixed and k[1] == Section.LAYER}
        self._op_template = {k: np.asarray(v) for k, v in src.items() if mixed and k[1] == Section.LAYER}
        self.layer_kinds_mixed = mixed
        self.opt_records: list[OpRecord] = [o for o in graph.ops if o.phase == Phase.OPT]
        self._opt_calls_parsed: list[OpCall] | None = None
        self._partial: tuple[Any, ...] | None = None  # (op, calls per norm, dtype) of SP's Partial reductions
        self._blocks: dict[int, str] = {}  # traced optimizer call -> the per-parameter block it starts, if any
        # (traced optimizer call, argument) -> the traced parameters its per-parameter list holds, in list order
        self._list_maps: dict[tuple[int, int], tuple[int, ...]] | None = None
        self._trainable_dtypes: frozenset[str] | None = None
        self.traced_params = list(graph.params)
        # each model layer's traced template (one per layer kind) and each template's parameters
        self.template_of = layer_template_of(graph.meta) if graph.meta.traced_layers > 0 else []
        self.template_params = {t: [p for p in graph.params if p.section == Section.LAYER and p.layer == t]
                                for t in set(self.template_of) | {tl}}
        self.layer_params = self.template_params[tl]
        self.is_layered = graph.meta.traced_layers > 0
        # Parameters and optimizer steps do not depend on micro-batch, sequence, SP or recompute: graphs
        # that differ only there share these per-stage lists (a search builds each once).
        self._stage_cache = shared if shared is not None else {}
        # interned: every stage-list key holds it, and hashing ~300 parameter records per lookup cost a search
        # more than the lookups themselves
        interned = self._stage_cache.setdefault(("param_keys",), {})
        # the layer-to-template map is part of it: two DeepSeek cuts with the same traced parameters but another
        # dense-first count name other parameters per model layer (the second crashed on the first's list)
        self.param_key = interned.setdefault((tuple(graph.params), tuple((o.op, o.sig) for o in self.opt_records),
                                              allow_tf32, tuple(self.template_of)), len(interned))
        self.traced_numel = max(sum(p.numel for p in graph.params), 1)
        # each split's stage list, by what `stages` reads of the split (a search's candidates share them)
        self._stage_lists: dict[tuple[Any, ...], list[StageWork]] = {}
        self._layouts: dict[tuple[int, ...], list[tuple[Any, ...]]] = {}  # per layer split

    def part(self, phase: Phase, section: Section) -> list[Item]:
        return self.sections.get((phase, section), [])

    def part_weights(self, phase: Phase, section: Section,
                     mix: tuple[tuple[int, int], ...] | None = None) -> np.ndarray | None:
        """Per-operator layer shares of a section (None: every operator counts once): the model's mix of layer
        kinds, or a stage's own (`mix`: traced template -> layers of the stage)."""
        if mix is None or (phase, section) not in self._op_template:
            return self._weights.get((phase, section))
        n = sum(c for _, c in mix)
        share = dict(mix)
        return np.array([share.get(int(t), 0) / n for t in self._op_template[(phase, section)]])

    def stage_mix(self, start: int, layers: int) -> tuple[tuple[int, int], ...] | None:
        """Model layers start .. start+layers-1 counted per traced template, where layer kinds differ."""
        if not self._op_template or layers <= 0:
            return None
        counts: dict[int, int] = {}
        for i in range(start, start + layers):
            t = self.template_for(i)
            counts[t] = counts.get(t, 0) + 1
        return tuple(sorted(counts.items()))

    # -- parameters ---------------------------------------------------------------------------
    def template_for(self, layer: int) -> int:
        """The traced layer that stands for model layer `layer`."""
        return self.template_of[layer] if layer < len(self.template_of) else self.template_layer

    def stage_params(self, first: bool, last: bool, layers: int, start: int = 0) -> list[ParamRecord]:
        """The parameters of a stage holding model layers start .. start+layers-1 (named by model layer)."""
        if not self.is_layered:
            return list(self.traced_params)
        out: list[ParamRecord] = []
        tied = bool(self.graph.meta.model.get("tie_word_embeddings"))
        embed = [p for p in self.traced_params if p.section == Section.EMBED]
        head = [p for p in self.traced_params if p.section == Section.HEAD]
        if first:
            out += embed
        for i in range(start, start + layers):
            t = self.template_for(i)
            out += [ParamRecord(p.name.replace(f"layers.{t}.", f"layers.{i}.", 1), p.shape, p.dtype,
                                Section.LAYER, i) for p in self.template_params[t]]
        if last:
            out += head
            if tied and not first:  # Megatron keeps a copy of the tied embedding on the last stage
                w = next(p for p in embed if p.name.endswith("embed_tokens.weight"))
                out.append(ParamRecord("head.lm_head.weight", w.shape, w.dtype, Section.HEAD))
        return out

    def _traced_index(self) -> dict[str, int]:
        return {p.name: i for i, p in enumerate(self.traced_params)}

    # -- optimizer ----------------------------------------------------------------------------
    def optimizer_items(self, params: list[ParamRecord], zero_shards: int, expert_shards: int | None = None
                        ) -> list[Item]:
        """The traced optimizer step rebuilt for `params` (sharded 1/zero_shards each under ZeRO; routed
        experts 1/expert_shards: their replicas under expert parallelism)."""
        ex = zero_shards if expert_shards is None else expert_shards
        shards = [ex if ".experts." in p.name else zero_shards for p in params]
        n_traced = len(self.traced_params)
        index = self._traced_index()

        def src_index(p: ParamRecord) -> int:
            if p.section == Section.LAYER:
                return index[p.name.replace(f"layers.{p.layer}.", f"layers.{self.template_for(p.layer)}.", 1)]
            if p.name in index:
                return index[p.name]
            return index.get("embed.embed_tokens.weight", 0)

        order = [src_index(p) for p in params]

        unsharded = all(n <= 1 for n in shards)
        maps = self._opt_list_maps()

        # per list map: the stage's parameters that its lists hold (every one, or one dtype group's trainable
        # ones), in order; per list of the same tensors (a step's lists repeat the parameters' specs): the list
        selected: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        built: dict[tuple[tuple[int, ...], tuple[int, ...]], list[object]] = {}

        def remap(ci: int, ai: int, v: object) -> object:
            m = maps.get((ci, ai))
            if m is None or not isinstance(v, list):
                return v
            sel = selected.get(m)
            if sel is None:
                pos = {t: k for k, t in enumerate(m)}
                sel = selected[m] = [(j, pos[i]) for j, i in enumerate(order) if i in pos]
            key = (m, tuple(map(id, v)))  # (v's tensors are alive while this step is rebuilt)
            out = built.get(key)
            if out is None:
                if unsharded or not all(isinstance(x, TensorSpec) for x in v):
                    out = [v[k] for _, k in sel]  # (_shard leaves every tensor as it is at one shard)
                else:
                    out = [_shard(v[k], shards[j]) for j, k in sel]
                built[key] = out
            return list(out)

        def shard_args(call: OpCall, n: int) -> OpCall:
            if n <= 1:
                return call
            return OpCall(call.op, tuple(_shard(a, n) if isinstance(a, TensorSpec) else a for a in call.args),
                          call.kwargs)

        calls = self._opt_calls
        # (traced call, shards): the same item for every layer's copy, and for every stage layout of the graphs that
        # share these parameters and this optimizer step (param_key)
        per_param: dict[tuple[int, int], Item] = self._stage_cache.setdefault(("param_items", self.param_key), {})

        def param_item(k: int, n: int) -> Item:
            it = per_param.get((k, n))
            if it is None:
                it = per_param[(k, n)] = _call_item(shard_args(calls[k], n), Phase.OPT, self.allow_tf32)
            return it

        partial = self._partial_grad_reductions(params)
        items: list[Item] = []
        i = 0
        while i < len(calls):
            call = calls[i]
            if call.op.startswith("comm."):  # DTensor SP: the Partial gradients' all-reduces, for the stage's norms
                items += partial
                partial = []
                i += 1
                continue
            if any((i, ai) in maps for ai in range(len(call.args))):
                call = OpCall(call.op, tuple(remap(i, ai, a) for ai, a in enumerate(call.args)), call.kwargs)
                items.append(_call_item(call, Phase.OPT, self.allow_tf32))
                i += 1
                continue
            block = self._per_param_block(calls, i)
            if block == "params":  # one call per traced parameter, in their order: one per parameter here
                items += [param_item(i + s, shards[j]) for j, s in enumerate(order)]
                i += n_traced
            elif block == "repeat":  # the same call once per traced parameter (a host read of each norm)
                items += [make_item(self.opt_records[i].op, self.opt_records[i].sig, Phase.OPT, self.allow_tf32)
                          ] * len(params)
                i += n_traced
            else:
                items.append(make_item(self.opt_records[i].op, self.opt_records[i].sig, Phase.OPT, self.allow_tf32))
                i += 1
        return items

    def _opt_list_maps(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """Which traced parameters each per-parameter list of the traced optimizer step holds. torch.optim's
        foreach step runs once per (device, dtype) group of the parameters that require a gradient: a model with
        an fp32 router beside bf16 weights (ERNIE-4.5-MoE) or a frozen parameter (its routing bias) has lists
        shorter than the traced parameters, which must still be rebuilt for every layer of a stage (kept as
        traced, they priced ERNIE-4.5-MoE's optimizer for its 3 traced layers, not its 4). A list of
        parameter-shaped tensors is matched in order to the traced parameters of its shapes (its dtype first); a
        list of step counts or per-parameter scalars takes the group of the nearest such list of its length (the
        step runs group by group), the preceding one first."""
        if self._list_maps is None:  # once per traced step: graphs of one parameter key share it
            self._list_maps = self._sub(("opt_list_maps", self.param_key), self._opt_list_maps_built)
        return self._list_maps

    def _opt_list_maps_built(self) -> dict[tuple[int, int], tuple[int, ...]]:
        n_traced = len(self.traced_params)
        maps: dict[tuple[int, int], tuple[int, ...]] = {}
        unmatched: list[tuple[int, int, int]] = []  # (call, argument, length) of lists without shapes of their own
        for ci, call in enumerate(self._opt_calls):
            for ai, a in enumerate(call.args):
                if not isinstance(a, list) or not a or n_traced == 0:
                    continue
                if len(a) == n_traced:
                    maps[(ci, ai)] = tuple(range(n_traced))  # every parameter
                    continue
                m = self._match_params(a) if all(isinstance(x, TensorSpec) and x.shape for x in a) else None
                if m is not None:
                    maps[(ci, ai)] = m
                elif len(a) < n_traced:
                    unmatched.append((ci, ai, len(a)))
        shaped = sorted(maps.items())
        for ci, ai, n in unmatched:
            before = [m for (c, _), m in shaped if c <= ci and len(m) == n]
            after = [m for (c, _), m in shaped if c > ci and len(m) == n]
            if before or after:
                maps[(ci, ai)] = before[-1] if before else after[0]
        return maps

    def trainable_dtypes(self) -> frozenset[str]:
        """The dtypes of the parameters the traced optimizer step updates (empty where it has no per-parameter
        lists to tell them by): more than one is a model that keeps some weights in another dtype (ERNIE-4.5-MoE's
        fp32 routers in a bf16 model)."""
        if self._trainable_dtypes is None:  # once per graph: every FSDP2 candidate of a search asks
            n_traced = len(self.traced_params)
            maps = self._opt_list_maps().values()
            held = set(range(n_traced)) if any(len(m) == n_traced for m in maps) else {i for m in maps for i in m}
            self._trainable_dtypes = frozenset(self.traced_params[i].dtype for i in held)
        return self._trainable_dtypes

    def _match_params(self, lst: list[Any]) -> tuple[int, ...] | None:
        """The traced parameters a list of parameter-shaped tensors stands for: the first in order whose shapes
        (and dtypes, where they match) follow the list's; None when they do not."""
        for same_dtype in (True, False):
            out: list[int] = []
            for i, p in enumerate(self.traced_params):
                if len(out) == len(lst):
                    break
                t = lst[len(out)]
                if tuple(p.shape) == t.shape and (not same_dtype or p.dtype == str(t.dtype)):
                    out.append(i)
            if len(out) == len(lst):
                return tuple(out)
        return None

    @property
    def _opt_calls(self) -> list[OpCall]:
        """The traced optimizer step's calls, parsed once per traced step (every stage layout rebuilds from them;
        graphs of one parameter key, which holds the step's signatures, share them)."""
        if self._opt_calls_parsed is None:
            self._opt_calls_parsed = self._sub(("opt_calls", self.param_key), self._opt_calls_built)
        return self._opt_calls_parsed

    def _opt_calls_built(self) -> list[OpCall]:
        # each distinct spec one object (the same parameter's spec recurs in the step's lists of params,
        # grads and states): its cached hash, size and text serve them all, and a rebuild shards it once
        alike: dict[TensorSpec, TensorSpec] = {}

        def one(v: Any) -> Any:
            if type(v) is TensorSpec:
                return alike.setdefault(v, v)
            if type(v) is list:
                return [one(x) for x in v]
            return v

        return [OpCall(c.op, tuple(one(a) for a in c.args), tuple((k, one(v)) for k, v in c.kwargs), o.sig)
                for o in self.opt_records for c in (OpCall.from_json_str(o.op, o.sig),)]

    def _partial_grad_reductions(self, params: list[ParamRecord]) -> list[Item]:
        """DTensor sequence parallelism: the all-reduces the traced optimizer step made of the Partial gradients
        of its sequence-parallel norms (graph.sequence_parallel_norm), as many per norm of this stage."""
        if self._partial is None:
            traced = [o for o in self.opt_records if o.op.startswith("comm.")]
            n_traced = sum(sequence_parallel_norm(p.name, tuple(p.shape)) for p in self.traced_params)
            self._partial = (traced[0].op, len(traced) // n_traced,
                             OpCall.from_json_str(traced[0].op, traced[0].sig).args[0].dtype  # type: ignore[union-attr]
                             ) if traced and n_traced else ()
        if not self._partial:
            return []
        op, per_param, dt = self._partial
        items: dict[tuple[int, ...], Item] = {}
        out = []
        for p in params:
            if sequence_parallel_norm(p.name, tuple(p.shape)):
                it = items.get(p.shape)
                if it is None:
                    it = items[p.shape] = _call_item(OpCall(op, (TensorSpec(tuple(p.shape), dt),),
                                                            (("group", "tp"),)), Phase.OPT, self.allow_tf32)
                out += [it] * per_param
        return out

    def _per_param_block(self, calls: list[OpCall], i: int) -> str:
        """_block_at, once per traced call (every stage layout asks again)."""
        hit = self._blocks.get(i)
        if hit is None:
            hit = self._blocks[i] = self._block_at(calls, i)
        return hit

    def _block_at(self, calls: list[OpCall], i: int) -> str:
        """Whether the traced optimizer step has, from call i, one plain call per traced parameter in their
        order ("params": each call's tensors have its parameter's shape, like Megatron's per-tensor gradient
        norms and copy-back or a master-weight optimizer's gradient casts) or the same call once per parameter
        ("repeat": the host read of each norm). Such a block stands for every parameter of a stage, not only
        the traced layers'; anything else is one call."""
        n = len(self.traced_params)
        if n < 2 or i + n > len(calls) or any(isinstance(a, list) for c in calls[i:i + n] for a in c.args):
            return ""
        shapes = [tuple(p.shape) for p in self.traced_params]

        def tensors(c: OpCall) -> list[TensorSpec]:
            return [a for a in c.args if isinstance(a, TensorSpec)]

        if all(tensors(c) and all(t.shape == shapes[k] for t in tensors(c)) for k, c in enumerate(calls[i:i + n])) \
                and len({c.op for c in calls[i:i + n]}) == 1:
            return "params"
        # the same device call once per parameter (a host read of each norm); reads of host scalars (the
        # optimizer's step counts) stay as traced: the host model's optimizer cost was calibrated that way
        # (its per-operator cost already holds the per-tensor work of the foreach calls beside them)
        if len({(c.op, c.to_json_str()) for c in calls[i:i + n]}) == 1 and len(set(shapes)) > 1 \
                and not any(t.host for t in tensors(calls[i])):
            return "repeat"
        return ""

    def accumulate_items(self, params: list[ParamRecord]) -> list[Item]:
        """AccumulateGrad with an existing gradient: grad += new, once per parameter."""
        return _per_shape(params, lambda s: _call_item(OpCall("aten.add_.Tensor", (s, s)), Phase.BWD,
                                                       self.allow_tf32))

    def _sub(self, key: tuple[object, ...], build: Any) -> Any:
        hit = self._stage_cache.get(key)
        if hit is None:
            hit = self._stage_cache[key] = build()
        return hit

    def _bucket_copies(self, params: list[ParamRecord]) -> list[Item]:
        """DDP's copies of each gradient into its bucket (the division by the world size fused in: priced as
        the copy it is, one read and one write) and back (any world size)."""
        def build() -> list[Item]:
            into = _per_shape(params, lambda s: _call_item(OpCall("aten.copy_.default", (s, s)), Phase.BWD,
                                                           self.allow_tf32))
            back = _per_shape(params, lambda s: _call_item(OpCall("aten.copy_.default", (s, s)), Phase.OPT,
                                                           self.allow_tf32))
            return [it for pair in zip(into, back, strict=True) for it in pair]

        return list(self._sub(("ddp_copies", tuple(params)), build))  # type: ignore[arg-type]

    def ddp_items(self, params: list[ParamRecord], dp: int, copies: bool = True,
                  bucket_bytes: int = 25 * 2**20) -> list[Item]:
        """PyTorch DDP's reducer (default communication hook): with gradient_as_bucket_view=False (copies) each
        grad is copied into its bucket divided by the world size in the same pass (`at::mul_out(bucket_view,
        grad, 1/world)`, "to save one scan") and copied back after the all-reduce; with the bucket view the
        gradients are the buckets and are divided in place (`bucket_view.div_`), the same bytes as one
        division per bucket."""
        if copies:
            return self._bucket_copies(params)
        total = sum(p.numel * DType(p.dtype).itemsize for p in params)
        dt = DType(params[0].dtype) if params else DType.FP32
        n_buckets = max(1, math.ceil(total / bucket_bytes))
        per = max(1, total // n_buckets // dt.itemsize)
        div = _call_item(OpCall("aten.div_.Scalar", (TensorSpec((per,), dt), dp)), Phase.BWD, self.allow_tf32)
        return [div] * n_buckets  # one call per bucket, all alike

    def pipelining_grad_scaling(self, params: list[ParamRecord]) -> list[Item]:
        """torch.distributed.pipelining divides every gradient by the number of micro-batches once the schedule
        has run them all (`scale_grads=True`, its default: PipelineStage.scale_grads, `p.grad.div_(n)` per
        parameter of the stage); seen in the H200 profiles of 1F1B steps (20 calls on the last stage)."""
        return _per_shape(params, lambda s: _call_item(OpCall("aten.div_.Scalar", (s, 4)), Phase.BWD,
                                                       self.allow_tf32))

    def megatron_grad_scaling(self, params: list[ParamRecord], dp: int, expert_buffer: bool) -> list[Item]:
        """Megatron-Core's DDP multiplies each gradient buffer by 1/DP before its all-reduce or reduce-scatter
        (average_in_collective=False, its default: distributed/distributed_data_parallel.py and
        param_and_grad_buffer.py `bucket.grad_data *= gradient_scaling_factor`), one in-place multiply per
        fp32 buffer (one bucket per buffer without overlap_grad_reduce); under EP > 1 the routed experts have a
        buffer of their own. Seen in the H200 profiles: 3.6 ms on Llama-8B-L4's 1.9 G-element buffer."""
        expert = sum(p.numel for p in params if ".experts." in p.name) if expert_buffer else 0
        dense = sum(p.numel for p in params) - expert
        return [_call_item(OpCall("aten.mul_.Tensor", (TensorSpec((n,), DType.FP32), 1.0 / dp)), Phase.BWD,
                           self.allow_tf32) for n in (dense, expert) if n]

    # -- stages -------------------------------------------------------------------------------
    def stages(self, par: ParallelConfig) -> list[StageWork]:
        """Each pipeline stage's work under this split; computed once per distinct set of the split's fields it
        reads (a planner's schedules, micro-batch counts and ZeRO variants share most)."""
        key = (par.pp, par.framework, par.pp_schedule == "interleaved", par.zero, par.dp, par.ep,
               par.micro_batches > 1, par.ddp_bucket_view)
        hit = self._stage_lists.get(key)
        if hit is None:
            hit = self._stage_lists[key] = self._stages(par)
        return list(hit)

    def _stages(self, par: ParallelConfig) -> list[StageWork]:
        n_layers = int(self.graph.meta.model.get("num_layers", 0)) if self.is_layered else 0
        if not self.is_layered:
            if par.pp > 1:
                raise PlanError("pipeline parallelism needs a layered model (a HuggingFace config)")
            counts = [0]
        else:
            counts = split_layers(n_layers, par.pp)
            if par.framework == "megatron" and n_layers % par.pp:  # its get_num_layers_to_build asserts it
                raise PlanError(f"Megatron-Core splits layers evenly over pipeline stages: {n_layers} layers do not "
                                f"divide by PP={par.pp}")
            if par.pp_schedule == "interleaved" and par.pp > 1 and n_layers % (2 * par.pp):
                raise PlanError(f"interleaved 1F1B runs 2 chunks per rank: {n_layers} layers do not split into "
                                f"{2 * par.pp} equal stages")
        out = []
        for s, first, last, n, fwd_parts, bwd_parts, kinds, params, sums, mix in self._layout(counts):
            shards = par.dp if par.zero >= 1 else 1
            expert_shards = par.expert_dp if par.zero >= 1 else 1
            # PyTorch DDP's own kernels (Megatron-Core scales its gradient buffer in its DDP model instead)
            ddp_dp = par.dp if par.zero == 0 and par.framework == "torch" else 1
            pipelined = par.framework == "torch" and par.pp > 1 and par.micro_batches > 1
            # AccumulateGrad adds each micro-batch's gradient into .grad (PyTorch DDP, ZeRO-1, pipelining);
            # Megatron-Core's DDP hook adds it into the fp32 main_grad buffer and sets .grad to None (traced in
            # its backward), so nothing accumulates there; FSDP2 reduce-scatters every micro-batch's gradients
            accumulates = par.micro_batches > 1 and par.zero < 2 and par.framework == "torch"
            # what the lists depend on: the stage's layer kinds in order, not which layers they are (a
            # stage of 2 uniform layers is the same work wherever it sits)
            key = (self.param_key, first, last, kinds, shards, accumulates, ddp_dp,
                   par.ddp_bucket_view, expert_shards, par.framework, par.dp if par.framework == "megatron" else 0,
                   par.ep > 1, pipelined)
            cached = self._stage_cache.get(key)
            if cached is None:
                # each piece once per what it depends on: a search over DP re-uses the parameter list, the
                # optimizer step (unless ZeRO shards it) and the gradient accumulation
                base = (self.param_key, first, last, kinds)
                opt = self._sub(("opt", *base, shards, expert_shards),
                                functools.partial(self.optimizer_items, params, shards, expert_shards))
                accum = self._sub(("accum", *base), functools.partial(self.accumulate_items, params)) \
                    if accumulates else []
                ddp = self._sub(("ddp", *base, par.dp, par.ddp_bucket_view), functools.partial(
                    self.ddp_items, params, par.dp, copies=not par.ddp_bucket_view)) if ddp_dp > 1 else []
                if par.framework == "megatron" and par.dp > 1:
                    ddp = self._sub(("mcore_scale", *base, par.dp, par.ep > 1), functools.partial(
                        self.megatron_grad_scaling, params, par.dp, par.ep > 1))
                if pipelined:
                    ddp = ddp + self._sub(("pp_scale", *base), functools.partial(self.pipelining_grad_scaling, params))
                cached = (opt, accum, ddp, sum(p.numel for p in params),
                          sum(p.numel * DType(p.dtype).itemsize for p in params),
                          self._sub(("mean_layer", *base), functools.partial(mean_layer_bytes, params)))
                self._stage_cache[key] = cached
            opt, accum, ddp, numel, nbytes, layer_bytes = cached
            out.append(StageWork(s, first, last, n, fwd_parts, bwd_parts, opt, accum, ddp, params, self, numel,
                                 nbytes, layer_bytes, sums, mix))
        return out

    def _layout(self, counts: list[int]) -> list[tuple[Any, ...]]:
        """Each stage's place in a split of the layers: (index, first, last, layers, forward and backward sections,
        layer kinds, parameters, their sums, layer mix), once per split (a planner's variants of one PP share it)."""
        key = tuple(counts)
        hit = self._layouts.get(key)
        if hit is not None:
            return hit
        out = []
        for s, n in enumerate(counts):
            first, last = s == 0, s == len(counts) - 1
            start = sum(counts[:s])
            if not self.is_layered:
                fwd_parts = [(Section.BODY, 1)]
                bwd_parts = [(Section.BODY, 1)]
            else:
                fwd_parts = ([(Section.EMBED, 1)] if first else []) + [(Section.LAYER, n)] + \
                    ([(Section.HEAD, 1)] if last else [])
                bwd_parts = ([(Section.HEAD, 1)] if last else []) + [(Section.LAYER, n)] + \
                    ([(Section.EMBED, 1)] if first else [])
            kinds = tuple(self.template_for(i) for i in range(start, start + n)) if self.is_layered else ()
            # the stage's own parameters, named by its layers; the work built from them is the same for any
            # stage of the same kinds
            params = self._sub(("params", self.param_key, first, last, n, start),
                               functools.partial(self.stage_params, first, last, n, start))
            sums = self._sub(("sums", self.param_key, first, last, n, start), functools.partial(ParamSums.of, params))
            mix = self.stage_mix(start, n) if len(counts) > 1 else None
            out.append((s, first, last, n, fwd_parts, bwd_parts, kinds, params, sums, mix))
        self._layouts[key] = out
        return out


def mean_layer_bytes(params: list[ParamRecord]) -> tuple[int, ...]:
    """One decoder layer's parameter bytes, as the framework models take a stage's layers to be alike: the
    stage's most common layer kind, scaled to the stage's mean layer where kinds differ (dense and sparse MLPs)."""
    by_layer: dict[int, list[int]] = {}
    for p in params:
        if p.section == Section.LAYER:
            by_layer.setdefault(p.layer, []).append(p.numel * DType(p.dtype).itemsize)
    if not by_layer:
        return ()
    groups: dict[tuple[int, ...], int] = {}
    for v in by_layer.values():
        groups[tuple(v)] = groups.get(tuple(v), 0) + 1
    rep = max(groups, key=lambda k: groups[k])
    if len(groups) == 1:
        return rep
    mean = sum(sum(v) for v in by_layer.values()) / len(by_layer)
    return tuple(round(b * mean / sum(rep)) for b in rep)


def _spec(p: ParamRecord) -> TensorSpec:
    return _spec_of(tuple(p.shape), p.dtype)


@functools.lru_cache(maxsize=65536)
def _spec_of(shape: tuple[int, ...], dtype: str) -> TensorSpec:
    """One spec object per (shape, dtype): a stage's every layer has the same few."""
    return TensorSpec(shape, DType(dtype))


def _per_shape(params: list[ParamRecord], build: Callable[[TensorSpec], Item]) -> list[Item]:
    """One item per parameter, built once per distinct tensor (every layer's copy of a weight is the same call)."""
    alike: dict[TensorSpec, Item] = {}
    out = []
    for p in params:
        s = _spec(p)
        it = alike.get(s)
        if it is None:
            it = alike[s] = build(s)
        out.append(it)
    return out


@functools.lru_cache(maxsize=65536)
def _shard(t: TensorSpec, n: int) -> TensorSpec:
    """One rank's flat 1/n of a tensor (ZeRO); the same spec object for the same (tensor, n)."""
    if n <= 1 or t.host or not t.shape:
        return t
    return TensorSpec((math.ceil(t.numel / n),), t.dtype)
