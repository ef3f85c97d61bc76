"""The Python API for notebooks and schedulers: typed results and Polars frames.

    from tp_query.engine.api import predict, search
    p = predict("examples/llama3.1-8b.json", dp=2, tp=4)             # -> Prediction
    p.iteration_ms, p.breakdown, p.peak_memory_gib, p.fits
    r = search("examples/llama3.1-70b.json", gpus=64, global_batch=512, seq_len=4096, tokens=2e12,
               price_per_gpu_hour=3.5)                                # -> SearchResult
    r.to_polars().head()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tp_query.schema.model_config import load_model_file
from tp_query.schema.precision import Setting

from .parallel import ParallelConfig
from .predict import Engine, PredictError, Prediction, PredictRequest
from .search import SearchResult, SearchSpace
from .search import search as _search

_ENGINES: dict[tuple[str, str | None, str | None], Engine] = {}


def engine(gpu: str = "h200", db: str | None = None, torch_version: str | None = None) -> Engine:
    """A shared engine per (GPU, database, software stack): graphs and lookups are reused across calls."""
    key = (gpu, db, torch_version)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(gpu, db, torch_version=torch_version)
    return _ENGINES[key]


def _model(model: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(model, dict):
        return model, str(model.get("_name_or_path") or model.get("model_type") or "model")
    p = Path(model)
    return load_model_file(p), (p.parent.name if p.name == "config.json" else p.stem)


_DEFAULT_SPLIT = ParallelConfig()


def predict(model: str | Path | dict[str, Any], *, gpu: str = "h200", db: str | None = None,
            precision: str | Setting = Setting.AMP_BF16, dp: int = 1, tp: int = 1, pp: int = 1,
            micro_batch: int = 1, global_batch: int | None = None, seq_len: int = 4096, optimizer: str = "adamw",
            sequence_parallel: bool = False, zero: int = 0, recompute: bool = False, strict: bool = False,
            with_ops: bool = False, framework: str = "torch", pp_schedule: str = "1f1b",
            ddp_bucket_view: bool = False, ep: int = 1, moe_imbalance: float = 1.0,
            parallel: ParallelConfig | None = None, torch_version: str | None = None) -> Prediction:
    """One prediction; the split as keywords, or as a ParallelConfig (`parallel=`), not both."""
    cfg, name = _model(model)
    split = dict(dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, global_batch=global_batch,
                 sequence_parallel=sequence_parallel, zero=zero, recompute=recompute, pp_schedule=pp_schedule,
                 framework=framework, ddp_bucket_view=ddp_bucket_view, ep=ep)
    if parallel is not None:
        given = [k for k, v in split.items() if v != getattr(_DEFAULT_SPLIT, k)]
        if given:
            raise PredictError(f"the split is given twice: parallel= and {', '.join(given)}=; pass one of them")
        par = parallel
    else:
        par = ParallelConfig(**split)  # type: ignore[arg-type]
    req = PredictRequest(model=cfg, model_name=name, gpu=gpu, setting=Setting(precision), parallel=par,
                         seq_len=seq_len, optimizer=optimizer, strict=strict, db_root=db,
                         moe_imbalance=moe_imbalance, torch_version=torch_version)
    return engine(gpu, db, torch_version).predict(req, with_ops=with_ops, host_range=True)


def search(model: str | Path | dict[str, Any], *, gpus: int, global_batch: int, seq_len: int = 4096,
           precisions: list[str | Setting] | None = None, gpu: str = "h200", db: str | None = None,
           tokens: float | None = None, price_per_gpu_hour: float | None = None, optimizer: str = "adamw",
           micro_batches: tuple[int, ...] = (1, 2, 4, 8), framework: str = "torch",
           torch_version: str | None = None, jobs: int | None = None) -> SearchResult:
    cfg, name = _model(model)
    space = SearchSpace(gpus, global_batch, seq_len,
                        tuple(Setting(p) for p in (precisions or [Setting.AMP_BF16])), micro_batches,
                        optimizer=optimizer, framework=framework)
    return _search(engine(gpu, db, torch_version), cfg, space, tokens, price_per_gpu_hour, name, jobs=jobs)


def prediction_frame(p: Prediction) -> Any:
    """One prediction's per-operator rows as a Polars frame (predict(..., with_ops=True))."""
    import polars as pl

    return pl.DataFrame([r.__dict__ for r in p.ops])
