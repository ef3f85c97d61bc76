"""The graph of a request: a graph file as given (checked against the request), or the traced graph of a
config, cached on disk by everything the trace depends on (the trace itself imports torch only here)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tp_query.schema.messages import first_line
from tp_query.schema.model_config import ConfigError, ModelSpec, parse_config
from tp_query.schema.precision import SETTINGS

from .graph import Graph, Phase, Section, graph_digest, is_graph_json
from .request import MAX_SEQ, PredictError, PredictRequest

if TYPE_CHECKING:
    from .template import GraphTemplate

TRACE_VERSION = 18  # 18: autograd formulas traced in their eager (in-place) branch
MEGATRON_TRACE_VERSION = 3  # Megatron-Core graphs only (templates do not hold them); 3: full recompute reruns the
# whole layer
# PyTorch graphs of one setting traced anew since TRACE_VERSION (their cache keys and structural types change,
# every other graph and shipped template stays): 1: fp16 with fp32 master weights (FSDP2's MixedPrecisionPolicy)
# unscales its fp32 gradients with torch.amp.GradScaler
SETTING_TRACE_REVISION = {"mp_fp16": 1}


def trace_version(setting: str, framework: str) -> int | str:
    """The trace version a PyTorch graph of this setting is keyed by: TRACE_VERSION, with the setting's revision."""
    rev = SETTING_TRACE_REVISION.get(setting) if framework == "torch" else None
    return f"{TRACE_VERSION}.{rev}" if rev else TRACE_VERSION


def cache_dir() -> Path:
    p = Path(os.environ.get("TP_QUERY_CACHE", Path.home() / ".cache" / "tp-query")) / "graphs"
    return p


def trace_fields(req: PredictRequest) -> dict[str, Any]:
    """What a request's traced graph depends on besides the model (DP, PP and ZeRO do not change it)."""
    par = req.parallel
    return {"setting": req.setting.value, "mb": par.micro_batch, "seq": req.seq_len, "tp": par.tp,
            "sp": par.sequence_parallel and par.tp > 1, "rc": par.recompute, "opt": req.optimizer,
            "fw": par.framework, **({"ep": par.ep} if par.ep > 1 else {}),
            **({"imb": req.moe_imbalance} if req.moe_imbalance != 1.0 else {})}


def graph_fields_key(req: PredictRequest) -> str:
    """The trace fields as text: which graph of one model a request needs (a planner groups its requests by it)."""
    return json.dumps(trace_fields(req), sort_keys=True)


@functools.cache
def _dist_info_versions() -> dict[str, str]:
    """Normalised distribution name -> version, from the dist-info folders on sys.path (the first one wins, as
    importlib.metadata finds them); one scan per process."""
    out: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for n in names:
            if n.endswith(".dist-info"):
                name, _, ver = n[:-len(".dist-info")].partition("-")
                if ver:
                    out.setdefault(name.replace("-", "_").lower(), ver)
    return out


@functools.cache
def _installed_version(package: str, missing: str) -> str:
    """A package's version without importing it (a cached graph must not outlive the torch or the tp-query
    that traced it); read once per process (a search asks once per graph). From the name of its dist-info folder
    on sys.path, as importlib.metadata finds it (importing that costs a warm predict 20 ms), else from
    importlib.metadata itself."""
    ver = _dist_info_versions().get(package.replace("-", "_").lower())
    if ver:
        return ver
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return missing


def _graph_cache_key(spec: ModelSpec, req: PredictRequest) -> str:
    body = json.dumps({"spec": spec.to_dict(), **trace_fields(req),
                       "v": trace_version(req.setting.value, req.parallel.framework),
                       "torch": _installed_version("torch", "none"),
                       "project": _installed_version("tp-query", "source"),
                       # transformers-built families and torchao's fp8 are whatever version is installed
                       "transformers": _installed_version("transformers", "none") if spec.builder.value == "hf" else "",
                       "torchao": _installed_version("torchao", "none") if "fp8" in req.setting.value else "",
                       # Megatron-Core steps traced again since (2: --fp16's unscale and inf check)
                       **({"mcore": MEGATRON_TRACE_VERSION} if req.parallel.framework == "megatron" else {})},
                      sort_keys=True)
    return hashlib.blake2b(body.encode(), digest_size=10).hexdigest()


def _cache_path(key: str) -> Path:
    return cache_dir() / f"{key}.json.gz"


def default_jobs() -> int:
    """Processes a planner traces in: the machine's cores, at most 8 (a tracer holds about 0.3 GB)."""
    return max(1, min(8, os.cpu_count() or 1))


def _spec_and_key(req: PredictRequest) -> tuple[ModelSpec, str] | None:
    """A config request's spec and graph cache key; None for a graph file or a config that will be refused
    (the caller's own trace says why)."""
    if is_graph_json(req.model):
        return None
    try:
        spec = parse_config(req.model, req.model_name)
        return spec, _graph_cache_key(spec, req)
    except ConfigError:
        return None


def _cached_key(req: PredictRequest) -> str | None:
    """The cache key of a config request's graph, None when it is cached already, a template builds it (the
    shipped templates' index says which boxes hold what: a planner need not load every template to know what to
    trace), or it is not a config to trace."""
    from . import template

    found = _spec_and_key(req)
    if found is None:
        return None
    spec, key = found
    typed = _structural_type(spec, req)
    if _cache_path(key).exists() or (typed is not None and template.may_cover(*typed)):
        return None
    return key


def _structural_type(spec: ModelSpec, req: PredictRequest) -> tuple[str, dict[str, int]] | None:
    """The structural type of a request whose family templates reproduce, and its per-rank dimensions (None: the
    graph is traced)."""
    from . import template

    par = req.parallel
    if not template.templatable(spec, par.framework, par.ep, req.moe_imbalance):
        return None
    dims = template.dims_of(spec, par.micro_batch, req.seq_len, par.tp)
    if dims is None or (SETTINGS[req.setting].fp8_recipe and not template.fp8_aligned(spec, par.tp)):
        return None
    return template.structure_key(spec, trace_fields(req), template.ones_of(dims),
                                  trace_version(req.setting.value, par.framework)), dims


def _trace_one(req: PredictRequest) -> bool:
    """A worker's trace into the cache; a failure is left for the caller's own trace to report."""
    try:
        graph_for(req)
        return True
    except Exception:
        return False


def trace_missing(reqs: list[PredictRequest], jobs: int, progress: Callable[[int, int], None] | None = None) -> int:
    """Trace the uncached graphs of `reqs` in `jobs` processes into the graph cache (a planner's graphs are
    independent traces of about 0.6 s each); the number traced. With one job or one graph, nothing is done
    here: the caller traces as it goes."""
    todo: dict[str, PredictRequest] = {}
    distinct: dict[tuple[int, str], PredictRequest] = {}  # one request per graph: a search asks for each many times
    for r in reqs:
        distinct.setdefault((id(r.model), graph_fields_key(r)), r)
    for r in distinct.values():
        key = _cached_key(r)
        if key is not None:
            todo.setdefault(key, r)
    if jobs <= 1 or len(todo) <= 1:
        return 0
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    done = 0
    # spawn: a worker imports torch itself (a fork of a process that holds torch's threads can hang)
    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)),
                                 mp_context=multiprocessing.get_context("spawn")) as ex:
            futures = [ex.submit(_trace_one, r) for r in todo.values()]
            for f in as_completed(futures):
                done += bool(f.result())
                if progress is not None:
                    progress(done, len(todo))
    except (OSError, RuntimeError):  # no worker processes here (a sandbox, a killed worker): the caller traces
        pass
    return done


def _template_of(spec: ModelSpec, req: PredictRequest) -> tuple[GraphTemplate, dict[str, int]] | None:
    """The structural type's template (shipped or built) whose box holds the request, and the request's
    dimensions; None when there is none (the graph is traced)."""
    from . import template

    typed = _structural_type(spec, req)
    if typed is None:
        return None
    t = template.find(typed[0])
    return None if t is None or not t.covers(typed[1]) else (t, typed[1])


def graph_identity(req: PredictRequest) -> str | None:
    """What a config request's graph is built from, without building it: its trace cache key (spec, trace fields,
    trace version, torch and project versions) and the bytes of its structural type's template files; None for a
    graph file or a config that does not parse (the costed-graph cache keeps none of those)."""
    from . import template

    found = _spec_and_key(req)
    if found is None:
        return None
    typed = _structural_type(found[0], req)
    return found[1] if typed is None else f"{found[1]}|template:{template.file_digest(typed[0])}"


def _from_template(spec: ModelSpec, req: PredictRequest) -> Graph | None:
    """The graph from its template, without torch; None when there is no template for it, the request lies
    outside the box its traces spanned, or an integer of the graph would not be one there."""
    found = _template_of(spec, req)
    return None if found is None else found[0].instantiate(found[1], spec.to_dict())


MAX_TENSOR_ELEMENTS = 1 << 40  # far beyond any tensor one GPU holds (a trillion elements)
MAX_GRAPH_MEMORY_BYTES = 1 << 50  # a petabyte: far beyond any GPU's memory


def graph_refusal(g: Graph) -> str:
    """Why a graph given as a file cannot be a training step ("" when it can): one that has no forward or no
    backward operators, no parameters, or a tensor beyond any GPU would answer with a step of nothing."""
    from tp_query.schema.signature import OpCall, TensorSpec

    phases = {o.phase for o in g.ops}
    for ph in (Phase.FWD, Phase.BWD):
        if ph not in phases:
            return f"it has no {ph.value} operators (a training step runs forward and backward)"
    if not g.params:
        return "it lists no parameters (a training step updates some)"
    # the memory profile is added into the peak as it stands: a negative or absurd byte count would be a peak
    # below zero that "fits"
    for name, v in asdict(g.memory).items():
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_GRAPH_MEMORY_BYTES:
            return f"its memory profile's {name} is {v!r} (bytes: an integer in 0..{MAX_GRAPH_MEMORY_BYTES:.1e})"[:200]
    for name in ("seq_len", "micro_batch", "tp"):  # a traced module may have no sequence or batch (0)
        v, low = getattr(g.meta, name), 1 if (name == "tp" or g.meta.source == "config") else 0
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_SEQ:
            return f"its meta.{name} is {v!r} (an integer in {low}..{MAX_SEQ})"[:200]
    if Phase.OPT not in phases:
        return "it has no optimizer operators (a training step ends with one: an optimizer time of 0 is no answer)"
    layers, traced = g.meta.model.get("num_layers", 0) if g.meta.source == "config" else 0, g.meta.traced_layers
    if not isinstance(layers, int) or not isinstance(traced, int) or not 0 <= layers <= 1024 or \
            not 0 <= traced <= layers or (layers and not traced):
        return (f"its model has {layers!r} layers of which {traced!r} were traced (at most 1024 layers, and from 1 to "
                "all of them traced)")
    outside = next((o.layer for o in g.ops if o.section == Section.LAYER and not 0 <= o.layer < max(traced, 1)),
                   None) if g.meta.source == "config" else None
    if outside is not None:
        return f"an operator of layer {outside} lies outside the {traced} traced layers"
    for p in g.params:
        if any(not isinstance(d, int) or d < 0 for d in p.shape) or p.numel > MAX_TENSOR_ELEMENTS:
            return f"parameter {p.name!r} has shape {list(p.shape)[:8]} (at most {MAX_TENSOR_ELEMENTS:.0e} elements)"
    for o in g.ops:
        try:
            call = OpCall.from_json_str(o.op, o.sig)
        except (TypeError, ValueError, KeyError) as e:
            return f"operator {o.op} has an unreadable signature ({first_line(e)})"
        for t in call.tensors():
            if isinstance(t, TensorSpec) and (any(d < 0 for d in t.shape) or t.numel > MAX_TENSOR_ELEMENTS):
                return f"operator {o.op} has a tensor of shape {list(t.shape)[:8]} (at most {MAX_TENSOR_ELEMENTS:.0e} elements)"
    return ""


def digest_refusal(obj: dict[str, Any]) -> str:
    """Why a graph file's content is not what `tp-query trace` wrote ("" when it is): its header and operators
    are read as one record (a header whose seq_len was doubled answered with the shorter step's time at twice its
    tokens/s), so a file edited after tracing, or written without a digest, is refused."""
    digest = obj.get("digest")
    if digest is None:
        return "it carries no digest (written by hand or by a tp-query before 2026-12-07): trace it again"
    if not isinstance(digest, str) or digest != graph_digest(obj):
        return "its content does not match its digest (edited after `tp-query trace` wrote it): trace it again"
    return ""


def graph_for(req: PredictRequest) -> Graph:
    if is_graph_json(req.model):
        try:
            g = Graph.from_json(req.model)
        except (TypeError, ValueError, KeyError) as e:
            raise PredictError(f"not a valid graph file: {first_line(e)}"
                               ) from None
        why = graph_refusal(g) or digest_refusal(req.model)
        if why:
            raise PredictError(f"not a valid graph file: {why}")
        par = req.parallel
        if (par.tp > 1 or par.pp > 1) and g.meta.source == "module":
            raise PredictError("a traced module runs as traced: use --tp 1 --pp 1 (DP and ZeRO are fine)")
        traced = {"precision": g.meta.setting, "seq-len": g.meta.seq_len, "micro-batch": g.meta.micro_batch,
                  "tp": g.meta.tp, "sequence-parallel": g.meta.sequence_parallel, "recompute": g.meta.recompute,
                  "optimizer": g.meta.optimizer, "framework": g.meta.extra.get("framework", "torch"),
                  "ep": int(g.meta.extra.get("ep", 1)),
                  "moe-imbalance": float(g.meta.extra.get("moe_imbalance", 1.0))}
        asked = {"precision": req.setting.value, "seq-len": req.seq_len, "micro-batch": par.micro_batch,
                 "tp": par.tp, "sequence-parallel": par.sequence_parallel and par.tp > 1,
                 "recompute": par.recompute, "optimizer": req.optimizer, "framework": par.framework, "ep": par.ep,
                 "moe-imbalance": req.moe_imbalance}
        if g.meta.source == "module":  # a user's module runs on its own inputs: a batch and sequence it has are
            for k in ("seq-len", "micro-batch"):  # held to (tp is 1 by construction); one it lacks asks nothing
                if not traced[k]:
                    traced.pop(k)
                    asked.pop(k)
        def flag(k: str, v: Any) -> str:  # as the CLI spells it: --recompute full|none, --sequence-parallel on|off
            if k == "recompute":
                return "full" if v else "none"
            if isinstance(v, bool):
                return "on" if v else "off"
            return str(v)

        diff = [f"--{k} {flag(k, asked[k])} (graph: {flag(k, traced[k])})" for k in traced if asked[k] != traced[k]]
        if diff:
            raise PredictError("a graph file answers only for what it was traced with: " + ", ".join(diff) +
                               "; pass the graph's values or trace again")
        return g
    try:
        spec = parse_config(req.model, req.model_name)
    except ConfigError as e:
        raise PredictError(str(e)) from None
    par = req.parallel
    g_t = _from_template(spec, req)
    if g_t is not None:
        return g_t
    key = _graph_cache_key(spec, req)
    path = _cache_path(key)
    if path.exists():
        try:
            return Graph.load(path)
        except Exception:
            path.unlink(missing_ok=True)
    try:
        from .trace.capture import TraceRequest, trace_config
    except ImportError:
        raise PredictError("tracing a config needs torch (pip install 'tp-query[trace]'), or pass a graph "
                           "file from `tp-query trace`") from None
    try:
        g = trace_config(TraceRequest(spec, req.setting, par.micro_batch, req.seq_len, par.tp,
                                      par.sequence_parallel, par.recompute, req.optimizer, framework=par.framework,
                                      ep=par.ep, moe_imbalance=req.moe_imbalance))
    except ValueError as e:  # TraceError, or a module hook's one-line refusal of a layout it does not model
        raise PredictError(first_line(e)) from None
    except RuntimeError as e:  # PyTorch's own refusal of the step (a grouped GEMM's stride alignment), as a GPU's
        raise PredictError(f"PyTorch refuses this model's training step: {first_line(e)}") from None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        g.save(path)
    except OSError:
        pass
    return g
