"""One prediction: model + training setup + parallel split -> iteration time, breakdown, memory.

The pipeline, one module each, in order: the graph (graphcache: a template instantiated, or traced and cached)
-> stages (compose: DP/TP/PP partition, optimizer, DDP and ZeRO work per stage) -> costed stages (segments:
every operator looked up, exact / interpolated / extrapolated / miss) -> the schedule (schedule, with
framework's timelines: host/GPU two-queue model per stage, pipeline schedule, TP, PP and DP communication)
-> the prediction (prediction, with peak memory per stage from memory). The engine (engine) holds the
database and the caches a planner shares; this module is the public entry point.
"""

from __future__ import annotations

from tp_query.schema.system import SystemSpec

from .engine import Engine
from .graphcache import TRACE_VERSION, cache_dir, graph_for
from .request import OpRow, PredictError, Prediction, PredictRequest

__all__ = ["TRACE_VERSION", "Engine", "OpRow", "PredictError", "PredictRequest", "Prediction", "cache_dir",
           "graph_for", "predict"]


def predict(req: PredictRequest, with_ops: bool = False, system: SystemSpec | None = None) -> Prediction:
    """One prediction with a fresh engine."""
    return Engine(req.gpu, req.db_root, system, req.torch_version).predict(req, with_ops=with_ops, host_range=True)
