"""The training graph a trace produces and the engine consumes (torch-free).

A graph holds the aten operators of one micro-batch's forward and backward and of one optimizer
step, in dispatch order, for a model cut to a few identical layers, each operator tagged with its
phase and section (embed / layer i / head / optim). The engine composes any layer count and any
pipeline stage from these sections. Communication points are records too (op "comm.<collective>").
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from tp_query.schema.model_config import layer_kinds_of

GRAPH_FORMAT = "tp-query-graph/1"


class Phase(StrEnum):
    FWD = "fwd"
    BWD = "bwd"
    OPT = "opt"


class Section(StrEnum):
    EMBED = "embed"
    LAYER = "layer"
    HEAD = "head"
    OPTIM = "optim"
    BODY = "body"  # a user module with no layer structure


@dataclass(frozen=True)
class OpRecord:
    op: str
    sig: str  # canonical JSON of the arguments (schema.signature)
    phase: Phase
    section: Section
    layer: int = -1
    alloc_bytes: int = 0  # bytes of new storage the op allocated (rounded like the caching allocator)


@dataclass(frozen=True)
class ParamRecord:
    name: str
    shape: tuple[int, ...]
    dtype: str
    section: Section
    layer: int = -1

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class MemoryProfile:
    """Live bytes above the static state (weights + optimizer state) at the points that set peaks,
    for one micro-batch of the traced model. See engine/memory.py for how they compose."""

    static_bytes: int
    embed_act_bytes: int
    layer_act_bytes: int
    head_peak_bytes: int  # transient peak over the live activations from the last layer's output to the start of layer backward
    layer_bwd_transient_bytes: int
    grad_bytes: int
    opt_peak_bytes: int  # optimizer transient over weights + state + grads
    traced_peak_bytes: int  # measured peak of the traced step (static included)
    fwd_end_bytes: int


def memory_profile_from(marks: dict[str, int], window_peak: dict[str, int], peak: int, static: int, grad_bytes: int,
                        n_layers: int, templates: dict[int, float]) -> MemoryProfile:
    """The profile from a recording's marks and window peaks (live bytes above the static state); activations a
    layer keeps are the templates' own, weighted by their share of the model's layers. The trace and a graph
    template's replay of its memory events both end here."""
    m = marks
    embed_end = m.get("embed_end", 0)
    last = m.get(f"layer{n_layers - 1}_end", embed_end)

    def kept(i: int) -> int:
        prev = m.get(f"layer{i - 1}_end", embed_end) if i >= 1 else embed_end
        return max(m.get(f"layer{i}_end", prev) - prev, 0)

    def transient(i: int) -> int:
        start = m.get(f"bwd_layer{i}", 0)
        return max(window_peak.get(f"bwd_layer{i}", start) - start, 0)

    layer_act = round(sum(kept(i) * w for i, w in templates.items()))
    head_peak = max(window_peak.get("head", last) - last, 0)
    layer_bwd = max(transient(i) for i in templates)
    opt_base = m.get("bwd_end", 0)
    opt_peak = max(window_peak.get("opt", opt_base) - opt_base, 0)
    return MemoryProfile(
        static_bytes=static, embed_act_bytes=embed_end, layer_act_bytes=layer_act, head_peak_bytes=head_peak,
        layer_bwd_transient_bytes=layer_bwd, grad_bytes=grad_bytes, opt_peak_bytes=opt_peak,
        traced_peak_bytes=static + peak, fwd_end_bytes=m.get("fwd_end", 0),
    )


@dataclass(frozen=True)
class GraphMeta:
    source: str  # "config" | "module"
    model: dict[str, Any]
    setting: str
    micro_batch: int
    seq_len: int
    tp: int
    sequence_parallel: bool
    recompute: bool
    optimizer: str
    traced_layers: int
    torch_version: str
    sdpa_policy: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Graph:
    meta: GraphMeta
    ops: tuple[OpRecord, ...]
    params: tuple[ParamRecord, ...]
    memory: MemoryProfile

    def to_json(self) -> dict[str, Any]:
        return {
            "format": GRAPH_FORMAT,
            # the fields as they are (asdict would deep-copy the model's config only to have it written out)
            "meta": {f.name: getattr(self.meta, f.name) for f in fields(GraphMeta)},
            "params": [[p.name, list(p.shape), p.dtype, p.section.value, p.layer] for p in self.params],
            "memory": asdict(self.memory),
            "ops": [[o.op, o.sig, o.phase.value, o.section.value, o.layer, o.alloc_bytes] for o in self.ops],
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Graph:
        if obj.get("format") != GRAPH_FORMAT:
            raise ValueError(f"not a {GRAPH_FORMAT} graph (format={obj.get('format')!r})")
        meta = GraphMeta(**obj["meta"])
        sections, phases = {s.value: s for s in Section}, {p.value: p for p in Phase}  # Enum(x) is slow
        params = tuple(ParamRecord(n, tuple(s), d, sections[sec], int(li)) for n, s, d, sec, li in obj["params"])
        ops = tuple(OpRecord(op, sig, phases[ph], sections[sec], int(li), int(ab))
                    for op, sig, ph, sec, li, ab in obj["ops"])
        return Graph(meta, ops, params, MemoryProfile(**obj["memory"]))

    def save(self, path: str | Path) -> None:
        """Atomically, through a temporary file of this writer's own (concurrent writers never collide); with the
        digest of what it holds, so a file edited afterwards is told apart from one the trace wrote."""
        p = Path(path)
        obj = self.to_json()
        obj["digest"] = graph_digest(obj)
        data = json.dumps(obj, separators=(",", ":")).encode()
        import tempfile  # only a save needs it (a prediction reads graphs; its import costs ~4 ms)

        from tp_query.schema.manifest import readable_mode

        fd, tmp = tempfile.mkstemp(prefix="." + p.name + ".", suffix=".tmp", dir=p.parent)
        try:
            os.fchmod(fd, readable_mode())  # a traced file is the user's, as any file they write (mkstemp: 0600)
            with os.fdopen(fd, "wb") as f:
                f.write(gzip.compress(data, 6) if p.suffix == ".gz" else data)
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @staticmethod
    def load(path: str | Path) -> Graph:
        raw = Path(path).read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return Graph.from_json(json.loads(raw))


_BLOCKS = (".self_attn.", ".attn.", ".attention.", ".self_attention.", ".mlp.", ".block_sparse_moe.")


def sequence_parallel_norm(name: str, shape: tuple[int, ...]) -> bool:
    """A parameter DTensor's SequenceParallel style applies to sequence shards: the norms between the attention
    and MLP blocks and the final norm (`layers.3.input_layernorm.weight`, `head.norm.weight`, GPT-2's `ln_*`);
    their gradients stay Partial over the TP ranks until an optimizer call reads them."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    return len(shape) == 1 and ("norm" in module or module.startswith("ln_")) and not any(b in name for b in _BLOCKS)


def graph_digest(obj: dict[str, Any]) -> str:
    """sha256 of a graph file's content without its digest, keys sorted (JSON round-trips every value it holds:
    ints, floats by repr, strings, lists): an edit of the header or of any operator changes it."""
    body = {k: v for k, v in obj.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def is_graph_json(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("format") == GRAPH_FORMAT


def _traced_and_model_kinds(meta: GraphMeta) -> tuple[list[str], list[str]]:
    """(the traced layers' kinds, the model's layers' kinds): meta.extra `traced_layer_kinds` (attention type, dense
    or sparse MLP, RoPE), or `traced_layer_types` of graphs that vary in attention type only."""
    extra = meta.extra if isinstance(meta.extra, dict) else {}
    m = meta.model
    if extra.get("traced_layer_kinds"):
        return list(extra["traced_layer_kinds"]), layer_kinds_of(int(m.get("num_layers") or 0), m.get("layer_types"),
                                                                 m.get("mlp_layer_types"), m.get("rope_layers"))
    return list(extra.get("traced_layer_types") or []), list(m.get("layer_types") or [])


def layer_templates(meta: GraphMeta) -> dict[int, float]:
    """Traced layer index -> share of the model's layers it stands for, for a model whose layers differ
    in kind (attention type, dense or sparse MLP, RoPE: meta.extra `traced_layer_kinds`, or `traced_layer_types`
    of graphs that vary in attention type only); empty for uniform layers."""
    traced, types = _traced_and_model_kinds(meta)
    if not traced or not types or len(set(types)) < 2:
        return {}
    out: dict[int, float] = {}
    for t in dict.fromkeys(types):
        # the template of a kind is its first traced layer after the leading one (that one alone only when
        # a whole model was traced and no later layer has the kind)
        idx = [i for i, x in enumerate(traced) if x == t and i >= 1] or [i for i, x in enumerate(traced) if x == t]
        if not idx:
            raise ValueError(f"the graph has no traced layer of kind {t}")
        out[idx[0]] = types.count(t) / len(types)
    return out


def layer_template_of(meta: GraphMeta) -> list[int]:
    """For each layer of the model, the traced layer that stands for it (the last traced layer for uniform
    layers)."""
    n = int(meta.model.get("num_layers") or 0)
    templates = layer_templates(meta)
    if not templates:
        return [meta.traced_layers - 1] * n
    traced, kinds = _traced_and_model_kinds(meta)
    of_kind = {traced[i]: i for i in templates}
    return [of_kind[k] for k in kinds]
