"""The Python API for notebooks and schedulers: typed results and Polars frames.

    from tp_query.engine.api import predict, search
    p = predict("examples/llama3.1-8b.json", dp=2, tp=4)             # -> Prediction
    p.iteration_ms, p.breakdown, p.peak_memory_gib, p.fits
    r = search("examples/llama3.1-70b.json", gpus=64, global_batch=512, seq_len=4096, tokens=2e12,
               price_per_gpu_hour=3.5)                                # -> SearchResult
    r.to_polars().head()

Every refusal (bad input, data it will not read) is a `TpQueryError` with a one-line message.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tp_query.schema.messages import TpQueryError
from tp_query.schema.model_config import ConfigError, is_numpy_scalar, load_model_file, plain_model
from tp_query.schema.precision import Setting

from .dbcache import DB_ENV, is_remote
from .engine import ENGINE_LOCK
from .graph import is_graph_json
from .parallel import ParallelConfig
from .predict import Engine, PredictError, Prediction, PredictRequest
from .request import graph_file_lengths, parse_setting
from .search import SearchError, SearchResult, SearchSpace
from .search import search as _search

__all__ = ["ParallelConfig", "Prediction", "SearchResult", "TpQueryError", "engine", "predict", "prediction_frame",
           "search"]

_ENGINES: dict[tuple[str, str | None, str | None, Any], Engine] = {}


def engine(gpu: str = "h200", db: str | None = None, torch_version: str | None = None,
           system: str | Path | None = None) -> Engine:
    """A shared engine per (GPU, database, software stack, cluster): graphs and lookups are reused across calls.
    The database is the one the call names now: a relative folder from the current directory, none given
    $TP_QUERY_DB as it is set now (a changed one, or another directory, is another engine). system: a preset
    name or a TOML system file (`--system`): GPUs per node, NVLink and network figures, price."""
    gpu, db, torch_version = _where(gpu, db, torch_version)
    sysspec = _system(system)
    where = db if db is not None else os.environ.get(DB_ENV) or None
    if where is not None and not is_remote(where):
        where = str(Path(where).expanduser().absolute())
    key = (gpu.strip().lower(), where, torch_version, sysspec)
    with ENGINE_LOCK:
        if key not in _ENGINES:
            _ENGINES[key] = Engine(gpu, where, sysspec, torch_version=torch_version)
        return _ENGINES[key]


def _system(system: Any, error: type[TpQueryError] = PredictError) -> Any:
    """The cluster a system= names (None: one 8-GPU host of the GPU's own links), refused as the caller's error."""
    if system is None:
        return None
    if not isinstance(system, str | Path) or not str(system):
        raise error(f"system= must be a preset name or a TOML file path, got {system!r}"[:200])
    from tp_query.schema.system import SystemError_, load_system

    try:
        return load_system(str(system))
    except SystemError_ as e:
        raise error(str(e)) from None


def _model(model: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(model, str) and model.lstrip().startswith("{"):
        raise ConfigError("model is JSON text: pass json.loads(text) (a dict) or the path of a config.json")
    if not isinstance(model, str | Path | dict):
        raise ConfigError(f"model must be a path or a config dict, got {type(model).__name__}")
    if isinstance(model, dict):
        cfg = plain_model(model)
        return cfg, str(cfg.get("_name_or_path") or cfg.get("model_type") or "model")
    p = Path(model)
    return load_model_file(p), (p.parent.name if p.name == "config.json" else p.stem)


def _plain(v: Any) -> Any:
    """A numpy scalar as the Python number it holds (the README's promise for every numeric argument)."""
    return v.item() if is_numpy_scalar(v) else v


def _where(gpu: Any, db: Any, torch_version: Any, error: type[TpQueryError] = PredictError
           ) -> tuple[str, str | None, str | None]:
    """The database a call reads: a GPU name, a root folder (or URL) and a torch version, each of its type (a
    wrong one refused as the calling function's error)."""
    if not isinstance(gpu, str) or not gpu:
        raise error(f"gpu= must be a GPU name such as 'h200', got {gpu!r}"[:200])
    if db is not None and not isinstance(db, str | Path):
        raise error(f"db= must be a folder path or URL, got {type(db).__name__}")
    if torch_version is not None and not isinstance(torch_version, str):
        raise error(f"torch_version= must be a version string such as '2.11.0', got {torch_version!r}"[:200])
    return gpu, (None if db is None else str(db)), torch_version


def predict(model: str | Path | dict[str, Any], *, gpu: str = "h200", db: str | None = None,
            precision: str | Setting | None = None, dp: int | None = None, tp: int | None = None,
            pp: int | None = None, micro_batch: int | None = None, global_batch: int | None = None,
            seq_len: int | None = None, optimizer: str = "adamw", sequence_parallel: bool | None = None,
            zero: int | None = None, recompute: bool | None = None, strict: bool = False, with_ops: bool = False,
            framework: str | None = None, pp_schedule: str | None = None, ddp_bucket_view: bool | None = None,
            ep: int | None = None, moe_imbalance: float = 1.0, parallel: ParallelConfig | None = None,
            torch_version: str | None = None, system: str | Path | None = None) -> Prediction:
    """One prediction; the split as keywords (those left out take ParallelConfig's defaults: DP=TP=PP=1, ...), or
    as a ParallelConfig (`parallel=`), not both. seq_len: 4096 if left out (a graph file: its own, as is its
    micro-batch); precision: amp_bf16 if left out (a graph file: its own, as the CLI takes it). Every refusal is
    a TpQueryError with a one-line message."""
    gpu, db, torch_version = _where(gpu, db, torch_version)
    if type(with_ops).__name__ not in ("bool", "bool_"):  # 'no' is truthy: a string would silently mean True
        raise PredictError(f"with_ops= must be True or False, got {with_ops!r}"[:200])
    cfg, name = _model(model)
    if is_graph_json(cfg):  # what it was traced with, unless asked otherwise (then checked against it)
        meta: dict[str, Any] = cfg["meta"] if isinstance(cfg.get("meta"), dict) else {}
        seq_len, mb = graph_file_lengths(meta, _plain(seq_len), _plain(micro_batch))
        if parallel is None:  # (parallel= holds its own micro-batch, checked against the graph's)
            micro_batch = mb
        if precision is None:
            precision = meta.get("setting", Setting.AMP_BF16.value)
    seq_len = 4096 if seq_len is None else seq_len
    precision = Setting.AMP_BF16 if precision is None else precision
    split = {k: v for k, v in dict(
        dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, global_batch=global_batch,
        sequence_parallel=sequence_parallel, zero=zero, recompute=recompute, pp_schedule=pp_schedule,
        framework=framework, ddp_bucket_view=ddp_bucket_view, ep=ep).items() if v is not None}
    if parallel is not None:
        if not isinstance(parallel, ParallelConfig):
            raise PredictError(f"parallel= must be a ParallelConfig (or pass the split as keywords), got "
                               f"{type(parallel).__name__}")
        if split:
            raise PredictError(f"the split is given twice: parallel= and {', '.join(split)}=; pass one of them")
        par = parallel
    else:
        par = ParallelConfig(**split)  # type: ignore[arg-type]
    req = PredictRequest(model=cfg, model_name=name, gpu=gpu, setting=parse_setting(precision), parallel=par,
                         seq_len=_plain(seq_len), optimizer=optimizer, strict=strict, db_root=db,
                         moe_imbalance=_plain(moe_imbalance), torch_version=torch_version)
    return engine(gpu, db, torch_version, system).predict(req, with_ops=with_ops, host_range=True)


def _distinct(what: str, values: Any, parse: Callable[[Any], Any]) -> tuple[Any, ...]:
    """A list option's values, each once in the order given; a bare string or an empty list is refused."""
    if isinstance(values, str | bytes) or not isinstance(values, list | tuple):
        raise SearchError(f"{what} must be a list, got {values!r}"[:200])
    if not values:
        raise SearchError(f"{what} is empty: give at least one")
    parsed = [parse(v) for v in values]
    if any(isinstance(v, list | dict | set) for v in parsed):
        raise SearchError(f"{what} must be a list of single values, got {values!r}"[:200])
    return tuple(dict.fromkeys(parsed))


def search(model: str | Path | dict[str, Any], *, gpus: int, global_batch: int, seq_len: int = 4096,
           precisions: list[str | Setting] | tuple[str | Setting, ...] = (Setting.AMP_BF16,), gpu: str = "h200",
           db: str | None = None, tokens: float | None = None, price_per_gpu_hour: float | None = None,
           optimizer: str = "adamw", micro_batches: tuple[int, ...] | list[int] = (1, 2, 4, 8),
           framework: str = "torch", torch_version: str | None = None, jobs: int | None = None,
           system: str | Path | None = None, pp_schedules: list[str] | tuple[str, ...] | None = None,
           moe_imbalance: float = 1.0) -> SearchResult:
    """Every parallel configuration of `gpus` GPUs for this global batch, ranked. The price needs `tokens` (a cost
    is job hours x GPUs x price); without price_per_gpu_hour, the system's price. pp_schedules: those tried with
    PP > 1 (default every one the framework runs). With jobs > 1 the candidates are evaluated in spawned processes,
    which import the calling script again: a script that calls search at top level needs
    `if __name__ == "__main__":`."""
    gpu, db, torch_version = _where(gpu, db, torch_version, SearchError)
    sysspec = _system(system, SearchError)
    cfg, name = _model(model)
    if price_per_gpu_hour is not None and tokens is None:
        raise SearchError("price_per_gpu_hour prices a job: give tokens= too (job hours = tokens / tokens per second)")
    space = SearchSpace(_plain(gpus), _plain(global_batch), _plain(seq_len),
                        _distinct("precisions", precisions, parse_setting),
                        _distinct("micro_batches", micro_batches, _plain),
                        optimizer=optimizer, framework=framework,
                        pp_schedules=None if pp_schedules is None else _distinct("pp_schedules", pp_schedules, str),
                        moe_imbalance=_plain(moe_imbalance))
    eng = engine(gpu, db, torch_version, system)
    price = price_per_gpu_hour if price_per_gpu_hour is not None or sysspec is None else sysspec.price_per_gpu_hour
    if price is not None and tokens is None:
        price = None  # a system's price prices a job only with its token budget, as the CLI does
    with ENGINE_LOCK:  # the planner's evaluation fills the engine's caches in the calling thread
        return _search(eng, cfg, space, _plain(tokens), _plain(price), name, jobs=_plain(jobs))


def prediction_frame(p: Prediction) -> Any:
    """One prediction's per-operator rows as a Polars frame (predict(..., with_ops=True))."""
    import polars as pl

    if not isinstance(p, Prediction):
        raise PredictError(f"prediction_frame takes a Prediction (from predict(..., with_ops=True)), got "
                           f"{type(p).__name__}")
    if not p.ops:  # an empty frame would read as a step of no operators
        raise PredictError("this prediction carries no operator rows: call predict(..., with_ops=True)")
    return pl.DataFrame([r.__dict__ for r in p.ops])
