"""The engine: one GPU's database, its latency model, host calibration, collectives and framework tables,
and the caches a planner shares across predictions (graphs, composers, costed segments, stage times)."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from tp_query.schema.gpus import GpuSpec, gpu_spec
from tp_query.schema.messages import first_line
from tp_query.schema.precision import SETTINGS, Setting
from tp_query.schema.system import SystemSpec

from .comm import CommModel
from .compose import Composer
from .costcache import CostedGraphs
from .dbcache import DatabaseError, DbSnapshot
from .framework import FrameworkData
from .graph import Graph, Phase, Section, is_graph_json
from .graphcache import graph_for, trace_fields
from .hostsim import CalibrationError, HostModel, ShiftedHostMap
from .lookup import LatencyModel, Source
from .parallel import PlanError, straddle_refusal
from .prediction import Assembled
from .request import (
    MAX_SEQ,
    MAX_TOKENS,
    OPTIMIZERS,
    PredictError,
    Prediction,
    PredictRequest,
    checkpointing_refusal,
    setting_refusal,
)
from .schedule import SectionSummary
from .segments import Segment, SegmentCache

# One prediction at a time in a process: tracing sets process-wide state (torch.library overrides, autocast's
# cache, transformers' lazy imports) and the engines' caches are filled in several steps; threads that
# interleaved them got other requests' numbers, and kept them in the graph cache on disk. The work is Python
# under the GIL, so holding the lock costs a threaded caller nothing it had.
ENGINE_LOCK = threading.RLock()


P = ParamSpec("P")
R = TypeVar("R")


def _serialised(f: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(f)
    def locked(*a: P.args, **k: P.kwargs) -> R:
        with ENGINE_LOCK:
            return f(*a, **k)
    return locked


class Engine:
    """Holds the database connection and caches shared across predictions (search reuses it); safe to call from
    several threads (one request at a time)."""

    def __init__(self, gpu: str = "h200", db_root: str | None = None, system: SystemSpec | None = None,
                 torch_version: str | None = None) -> None:
        try:
            self.gpu: GpuSpec = gpu_spec(gpu)
        except ValueError as e:
            raise PredictError(str(e)) from None
        self.torch_version = torch_version
        # what a planner's worker processes build their own engine from (search evaluates in several)
        self.init_args = (gpu, db_root, system, torch_version)
        self.db = DbSnapshot(self.gpu.name, db_root, torch_version)  # no DuckDB when a snapshot exists
        self.latency = LatencyModel(self.db, self.gpu)
        self.host = self._host_model(db_root)
        if system is not None and system.gpu != self.gpu.name:
            raise PredictError(f"system {system.name!r} has {system.gpu} GPUs, not {self.gpu.name}")
        self.system = system
        self.comm = CommModel(self.gpu, self._comm_table(), system)
        self.framework = FrameworkData(self._optional_table("overlap"), self._optional_table("framework"))
        self._framework_on: dict[str | None, FrameworkData] = {None: self.framework}
        try:
            stacks = self.db.software_versions()
        except DatabaseError as e:
            raise PredictError(str(e)) from None
        used = next((v for v in stacks if v.get("used")), stacks[0] if stacks else {})
        self.software = {k: used.get(k) for k in ("torch", "cuda", "cudnn")}
        others = [v for v in stacks if not v.get("used")]
        listed = "; ".join(f"torch {v['torch']} CUDA {v['cuda']} cuDNN {v['cudnn']}" for v in others[:3])
        self.version_warning = "" if not others else (
            f"operator costs measured under torch {used.get('torch')} (CUDA {used.get('cuda')}, cuDNN "
            f"{used.get('cudnn')}: {used.get('rows')} rows); the database also holds {listed}"
            + (f" and {len(others) - 3} more stacks" if len(others) > 3 else "") + " (choose with --torch)")
        self._graphs: dict[str, Graph] = {}
        self._full_graphs: dict[str, Graph] = {}  # with every operator, where _graphs holds a costed one
        self._costed: CostedGraphs | None = None
        self._costed_paths: dict[str, Path | None] = {}
        self._precosted: dict[int, dict[tuple[Phase, Section], Segment]] = {}  # id(graph) -> its costed sections
        self._to_store: dict[int, Path] = {}  # id(graph) -> where its costed sections go once built
        self._composers: dict[tuple[int, bool], Composer] = {}
        self._segments: dict[tuple[int, int, int], SegmentCache] = {}
        self.stage_times: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._stage_lists: dict[tuple[object, ...], Any] = {}
        self.item_segments: dict[tuple[int, int, str, int, int], Segment] = {}
        # per TP degree: (call key, phase) -> the raw row of one operator (latencies, comm, flags, source)
        self.item_rows: dict[tuple[int, int], dict[tuple[str, Phase], tuple[float, float, float, bool, int, float, bool,
                                                                Source]]] = {}
        self.segment_flops: dict[int, float] = {}
        self.dp_overheads: dict[tuple[Any, ...], float] = {}
        self.section_summaries: dict[tuple[Any, ...], SectionSummary] = {}
        self.section_gpu: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # per (section, beta): GPU times and sums
        self.shifted_maps: dict[tuple[Any, ...], ShiftedHostMap] = {}  # per (section, host model)
        self.stage_raws: dict[int, dict[tuple[Any, ...], Any]] = {}  # per segment cache: stage kind -> costed stage

    @property
    def costed(self) -> CostedGraphs:
        if self._costed is None:
            self._costed = CostedGraphs(self)
        return self._costed

    @_serialised
    def graph(self, req: PredictRequest, full: bool = False) -> Graph:
        """The graph of a request, kept in memory (search asks for the same ones often): its costed form from the
        costed-graph cache where one was kept (the optimizer step its only operators, the sections' operator
        arrays beside it), else built (template or trace) and its costed form kept once its sections are priced;
        full: with every operator (per-operator rows need them)."""
        if is_graph_json(req.model):
            return graph_for(req)
        key = _graph_key(req)
        g = self._graphs.get(key)
        if g is not None and not (full and id(g) in self._precosted):
            return g
        if full:
            g = self._full_graphs.get(key)
            if g is None:
                g = self._full_graphs[key] = graph_for(req)
            return g
        path = self._costed_path(req, key)
        hit = CostedGraphs.load(path) if path is not None else None
        if hit is not None:
            g, sections = hit
            self._precosted[id(g)] = sections
        else:
            g = graph_for(req)
            if path is not None:
                self._to_store[id(g)] = path
        self._graphs[key] = g
        return g

    def has_costed(self, req: PredictRequest) -> bool:
        """Whether the costed-graph cache holds this request's graph (a planner need not build it)."""
        if is_graph_json(req.model):
            return False
        key = _graph_key(req)
        path = self._costed_path(req, key)
        return path is not None and path.exists()

    def _costed_path(self, req: PredictRequest, key: str) -> Path | None:
        if key not in self._costed_paths:
            self._costed_paths[key] = self.costed.path(req, key)
        return self._costed_paths[key]

    def _keep_costed(self, g: Graph, comp: Composer, tp: int, ep: int) -> None:
        """Write a built graph's costed sections once (priced by now or on the way: every section is asked)."""
        path = self._to_store.pop(id(g), None)
        if path is None:
            return
        sections = self.segments_for(comp, tp, ep).costed_sections()
        if sections is not None:
            self.costed.store(path, g, sections)

    def composer(self, g: Graph) -> Composer:
        k = (id(g), SETTINGS[Setting(g.meta.setting)].allow_tf32)
        if k not in self._composers:
            self._composers[k] = Composer(g, k[1], self._stage_lists)
        return self._composers[k]

    def segments_for(self, comp: Composer, tp: int, ep: int = 1) -> SegmentCache:
        k = (id(comp), tp, ep)
        if k not in self._segments:
            self._segments[k] = SegmentCache(self, comp, tp, ep, self._precosted.get(id(comp.graph)))
        return self._segments[k]

    def _host_model(self, db_root: str | None) -> HostModel:
        """The database's calibration (local or in object storage), validated; defaults when it has none."""
        root = db_root or self.db.root
        try:
            if "://" in str(root):
                url = f"{str(root).rstrip('/')}/{self.gpu.name}/calibration.json"
                try:
                    text = self.db.sql("SELECT content FROM read_text(?)", [url]).to_pylist()[0]["content"]
                except Exception:
                    self.calibration_source = f"default constants (no calibration at {url})"
                    return HostModel()
                self.calibration_source = url
                return HostModel.from_dict(json.loads(text), url)
            p = Path(root) / self.gpu.name / "calibration.json"
            if not p.exists():
                self.calibration_source = f"default constants (no calibration at {p})"
                return HostModel()
            self.calibration_source = str(p)
            return HostModel.load(p)
        except (CalibrationError, ValueError) as e:
            raise PredictError(first_line(e)) from None

    def _comm_table(self) -> list[dict[str, Any]]:
        return self._optional_table("comm")

    def _optional_table(self, view: str) -> list[dict[str, Any]]:
        return self.db.optional_table(view)

    @_serialised
    def predict(self, req: PredictRequest, graph: Graph | None = None, with_ops: bool = False,
                host_range: bool = False) -> Prediction:
        """host_range: also evaluate under the fastest measured host instance and say so when it differs
        (a user's single answer: `tp-query predict`, the API; not a planner's loop)."""
        return self.assemble(req, graph, with_ops).run(host_range=host_range)

    def framework_on(self, machine: str | None) -> FrameworkData:
        """The framework tables with one measured machine instance's host costs (None: the typical host, each
        cost the median over the instances)."""
        if machine not in self._framework_on:
            self._framework_on[machine] = self.framework.on(machine)
        return self._framework_on[machine]

    @_serialised
    def assemble(self, req: PredictRequest, graph: Graph | None = None, with_ops: bool = False,
                 host_machine: str | None = None) -> Assembled:
        """The raw material of a prediction, to evaluate under several host models (calibration); with
        host_machine, under the host costs measured on that instance (validation of its own runs)."""
        par = req.parallel  # validated when it was built
        if req.torch_version is not None and req.torch_version != self.torch_version:
            raise PredictError(f"this engine answers from the torch {self.torch_version or 'primary'} rows, the "
                               f"request asks for torch {req.torch_version}: use Engine(..., torch_version=...)")
        if req.optimizer not in OPTIMIZERS:
            raise PredictError(f"unknown optimizer {req.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        if isinstance(req.seq_len, bool) or not isinstance(req.seq_len, int) or not 1 < req.seq_len <= MAX_SEQ:
            # a causal LM's loss predicts each next token: one token leaves nothing to train on
            raise PredictError(f"sequence length must be an integer in 2..{MAX_SEQ}, got {req.seq_len!r}")
        why = setting_refusal(req.setting, par, req.seq_len) or par.unmodelled() or checkpointing_refusal(req) or \
            straddle_refusal(par.tp, par.gpus, self.comm.gpus_per_node)
        if why:
            raise PredictError(why)
        if req.seq_len * par.micro_batch > MAX_TOKENS:
            raise PredictError(f"micro-batch x sequence = {req.seq_len * par.micro_batch} tokens is beyond any real "
                               f"micro-batch (at most {MAX_TOKENS})")
        g = graph or self.graph(req, full=with_ops)
        if with_ops and id(g) in self._precosted:
            g = self.graph(req, full=True)
        comp = self.composer(g)
        if par.framework == "torch" and par.zero >= 2 and par.dp > 1 and len(dtypes := comp.trainable_dtypes()) > 1:
            # FSDPParamGroup._init_mp_dtypes: "FSDP expects uniform original parameter dtype" per fully_shard unit
            raise PredictError(f"FSDP2 (ZeRO-{par.zero}) cannot shard this model as it is: its trainable parameters "
                               f"are {' and '.join(sorted(dtypes))} (e.g. fp32 routers beside half-precision weights), "
                               "and fully_shard refuses a unit of mixed dtypes; cast the model to one dtype, shard "
                               "those modules apart, or use DDP or Megatron-Core")
        try:
            stages = comp.stages(par)
        except PlanError as e:
            raise PredictError(str(e)) from None
        out = Assembled(self, req, g, comp, stages, par, with_ops, host_machine)
        if id(g) in self._to_store:
            self._keep_costed(g, comp, par.tp, par.ep)
        return out


def _graph_key(req: PredictRequest) -> str:
    """What a config request's graph depends on: the model and the trace fields."""
    return json.dumps({"model": req.model, **trace_fields(req)}, sort_keys=True, default=str)
