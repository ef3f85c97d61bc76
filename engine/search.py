"""Plan a job: enumerate every valid DP/TP/PP split, micro-batch, precision, sequence parallelism,
ZeRO stage and recomputation for N GPUs, predict each, rank them, and cost the token budget.

Graphs depend only on (precision, micro-batch, TP, SP, recompute), so a search traces each such
combination once and evaluates every DP/PP/ZeRO variant from the shared graph and lookups.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tp_query.schema.messages import TpQueryError
from tp_query.schema.model_config import ModelSpec, parse_config
from tp_query.schema.precision import Setting

from .graph import Graph
from .lookup import Source
from .parallel import MEGATRON_MOE_ARGS, STACK_ZERO_STAGES, ParallelConfig, PlanError, straddle_refusal
from .predict import Engine, PredictError, PredictRequest
from .prediction import HOST_SOURCE
from .request import OPTIMIZERS, setting_refusal


class SearchError(TpQueryError):
    """No configuration can be evaluated (one line for the user)."""


@dataclass(frozen=True)
class SearchSpace:
    gpus: int
    global_batch: int
    seq_len: int
    precisions: tuple[Setting, ...] = (Setting.AMP_BF16,)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[bool, ...] = (False, True)
    sequence_parallel: tuple[bool, ...] = (False, True)
    optimizer: str = "adamw"
    max_tp: int = 8  # TP stays inside one 8-GPU host
    framework: str = "torch"  # the stack every candidate runs under (its kernels, buckets, host costs)
    # pipeline schedules tried when PP > 1; None: every schedule the stack runs (STACK_PP_SCHEDULES)
    pp_schedules: tuple[str, ...] | None = None
    # DDP's gradient_as_bucket_view tried both ways (PyTorch, DP > 1, no ZeRO): the view saves a gradient copy
    ddp_bucket_views: tuple[bool, ...] = (False, True)
    moe_imbalance: float = 1.0  # MoE routing: the busiest expert's rows over the mean (predict's --moe-imbalance)


# the pipeline schedules each stack runs (torch.distributed.pipelining: Schedule1F1B, ScheduleGPipe,
# ScheduleInterleaved1F1B; Megatron-Core: 1F1B with and without interleaving)
STACK_PP_SCHEDULES: dict[str, tuple[str, ...]] = {"torch": ("1f1b", "gpipe", "interleaved"),
                                                  "megatron": ("1f1b", "interleaved")}


@dataclass(frozen=True)
class Candidate:
    """One point of the search: a precision and a (valid) parallel configuration."""

    precision: Setting
    parallel: ParallelConfig

    def label(self) -> str:
        p = self.parallel
        extra = ("+SP" if p.sequence_parallel else "") + (f"+Z{p.zero}" if p.zero else "") + \
            ("+RC" if p.recompute else "") + (f"+EP{p.ep}" if p.ep > 1 else "") + \
            ("+bucket_view" if p.ddp_bucket_view else "")
        pp = f"PP{p.pp}" + (f" {p.pp_schedule}" if p.pp > 1 else "")
        return f"DP{p.dp} TP{p.tp} {pp} mb{p.micro_batch} {self.precision.value}{extra}"


@dataclass(frozen=True)
class Outcome:
    candidate: Candidate
    iteration_ms: float | None
    tokens_per_s: float | None
    peak_memory_gib: float | None
    fits: bool
    reason: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)
    job_hours: float | None = None
    cost: float | None = None
    # where the time comes from and what the answer assumes, as `predict` says them: filled for the best ranked
    # configurations (search(..., explain=N)); empty elsewhere
    sources: dict[str, float] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def row(self) -> dict[str, Any]:
        c = asdict(self.candidate.parallel)
        c["precision"] = self.candidate.precision.value
        return {**c, "label": self.candidate.label(), "iteration_ms": self.iteration_ms,
                "tokens_per_s": self.tokens_per_s, "peak_memory_gib": self.peak_memory_gib, "fits": self.fits,
                "reason": self.reason, "job_hours": self.job_hours, "cost": self.cost,
                **{f"{k}": v for k, v in self.breakdown.items()},
                **{f"source_{k.replace('-', '_')}": self.sources.get(k) for k in SOURCE_KEYS},
                "warnings": " | ".join(self.warnings) if self.sources else None}


# a row's source columns: every lookup source and the host model's share, summing to 1
SOURCE_KEYS = (*(k.value for k in Source), HOST_SOURCE)


@dataclass
class SearchResult:
    ranked: list[Outcome]  # fitting configurations, fastest first
    rejected: list[Outcome]  # invalid or out of memory, with the reason
    evaluated: int
    seconds: float
    eval_seconds: float
    # what every row shares, so a saved table says what it planned
    gpu: str = ""
    seq_len: int = 0
    optimizer: str = ""

    def to_polars(self, include_rejected: bool = False) -> Any:
        """One row per configuration, with the GPU, sequence length and optimizer they share. Rows differ in their
        columns (a rejected one has no breakdown): the schema is read from every row, a missing column null."""
        import polars as pl

        shared = {"gpu": self.gpu, "seq_len": self.seq_len, "optimizer": self.optimizer}
        rows = [{**shared, **o.row()} for o in self.ranked + (self.rejected if include_rejected else [])]
        return pl.DataFrame(rows, infer_schema_length=None)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def invalid_reason(spec: ModelSpec, cand: Candidate, space: SearchSpace) -> str:
    c = cand.parallel
    if c.tp > space.max_tp:
        return f"TP={c.tp} exceeds one host ({space.max_tp} GPUs)"
    why = straddle_refusal(c.tp, space.gpus, space.max_tp)
    if why:
        return why
    why = spec.split_refusal(c.tp, c.sequence_parallel) or setting_refusal(cand.precision, c, space.seq_len)
    if why:
        return why
    if c.pp > spec.num_layers:
        return f"PP={c.pp} > {spec.num_layers} layers"
    if c.sequence_parallel and (c.tp == 1 or space.seq_len % c.tp):
        return "sequence parallelism needs TP > 1 dividing the sequence"
    return c.unmodelled()


def candidates(spec: ModelSpec, space: SearchSpace, beyond: list[str] | None = None
               ) -> Iterable[tuple[Candidate, str]]:
    """Every configuration of the space with why it is invalid ("" when valid). beyond: collects why a split is
    no candidate at all (ParallelConfig refuses it as beyond any real job), for a search that finds none."""
    schedules = STACK_PP_SCHEDULES[space.framework] if space.pp_schedules is None else space.pp_schedules
    for tp, pp in itertools.product(_divisors(space.gpus), repeat=2):
        if space.gpus % (tp * pp):
            continue
        dp = space.gpus // (tp * pp)
        for prec, mb, sp, z, rc, sched, bv in itertools.product(
                space.precisions, space.micro_batches, space.sequence_parallel, space.zero_stages, space.recompute,
                schedules if pp > 1 else ("1f1b",), space.ddp_bucket_views):
            if (sp and tp == 1) or (z and dp == 1):
                continue  # the same configuration as without the option: skip silently
            if bv and not (space.framework == "torch" and dp > 1 and z == 0):
                continue  # DDP's option: the same configuration as without it
            if space.global_batch % (dp * mb) or z not in STACK_ZERO_STAGES[space.framework]:
                continue  # not a configuration of this job (or of this stack: PyTorch has no ZeRO-1) at all
            # Megatron-Core MoE: every expert-parallel size that divides DP and the experts
            eps = [e for e in _divisors(dp) if spec.num_experts % e == 0] \
                if spec.is_moe and space.framework == "megatron" else [1]
            for ep in eps:
                try:
                    par = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch=mb, global_batch=space.global_batch,
                                         sequence_parallel=sp, zero=z, recompute=rc, framework=space.framework, ep=ep,
                                         pp_schedule=sched, ddp_bucket_view=bv)
                except PlanError as e:
                    if beyond is not None and not beyond:  # the first reason is enough
                        beyond.append(str(e))
                    continue  # beyond any real job (PP of thousands of stages): not a candidate
                c = Candidate(prec, par)
                yield c, invalid_reason(spec, c, space)


def search(engine: Engine, model: dict[str, Any], space: SearchSpace, tokens: float | None = None,
           price_per_gpu_hour: float | None = None, name: str = "model",
           progress: Callable[[int, int], None] | None = None, jobs: int | None = None,
           explain: int = 10) -> SearchResult:
    """explain: how many of the best configurations carry their prediction's sources and warnings. jobs: processes that trace the uncached graphs first, then evaluate the candidates, those of one precision
    and TP degree in one process (None or 0: the machine's cores, at most 8; 1: this process alone, each graph
    traced when its first candidate needs it). The outcomes do not depend on it."""
    for what, v, low, top in (("--gpus", space.gpus, 1, 1 << 20), ("--global-batch", space.global_batch, 1, 1 << 31),
                              ("--seq-len", space.seq_len, 2, 1 << 22)):
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= top:
            raise SearchError(f"{what} must be an integer in {low}..{top}, got {v!r}")
    if not space.precisions:
        raise SearchError("the precision list is empty")
    bounds: tuple[tuple[str, float | None, bool, float, str], ...] = (
        ("tokens", tokens, True, 1e16, "a number in (0, 1e16]: no training run has more"),
        ("price per GPU-hour", price_per_gpu_hour, False, 1e6,
         "a number in [0, 1e6] (dollars, as a system file's price is bounded)"))
    for what, amount, low_open, ceiling, rule in bounds:
        if amount is not None and (isinstance(amount, bool) or not isinstance(amount, int | float)
                                   or not (isinstance(amount, int) or math.isfinite(amount))  # (an int of
                                   # any size is finite; math.isfinite overflows on one beyond a float)
                                   or amount < 0 or (low_open and amount == 0) or amount > ceiling):
            raise SearchError(f"{what} must be {rule}, got {repr(amount)[:40]}")
    if space.framework not in ("torch", "megatron"):
        raise SearchError(f"unknown framework {space.framework!r}: torch or megatron")
    if space.optimizer not in OPTIMIZERS:
        raise SearchError(f"unknown optimizer {space.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    if space.pp_schedules is not None:
        runs = STACK_PP_SCHEDULES[space.framework]
        bad = [s for s in space.pp_schedules if s not in runs]
        if not space.pp_schedules or bad:
            raise SearchError(f"pipeline schedules {list(space.pp_schedules)!r}: {space.framework} runs "
                              f"{', '.join(runs)}")
        space = replace(space, pp_schedules=tuple(dict.fromkeys(space.pp_schedules)))
    if not space.micro_batches or any(isinstance(m, bool) or not isinstance(m, int) or not 0 < m <= 1 << 16
                                      for m in space.micro_batches):
        raise SearchError(f"--micro-batch candidates must be integers in 1..{1 << 16}, got {list(space.micro_batches)}")
    # a value given twice is one candidate, in the order first given
    space = replace(space, precisions=tuple(dict.fromkeys(space.precisions)),
                    micro_batches=tuple(dict.fromkeys(space.micro_batches)))
    spec = parse_config(model, name)
    if engine.system is not None and engine.system.gpus_per_node != space.max_tp:
        space = replace(space, max_tp=engine.system.gpus_per_node)  # TP stays inside one node
    t0 = time.perf_counter()
    ranked: list[Outcome] = []
    rejected: list[Outcome] = []
    beyond: list[str] = []
    cands = list(candidates(spec, space, beyond))
    valid = [c for c, r in cands if not r]
    for c, r in cands:
        if r:
            rejected.append(Outcome(c, None, None, None, False, r))
    if not cands and beyond:
        raise SearchError(f"no split of {space.gpus} GPUs is a configuration to evaluate: {beyond[0]}")
    if not cands:
        raise SearchError(f"no split of {space.gpus} GPUs divides the global batch {space.global_batch} into "
                          f"micro-batches of {', '.join(map(str, space.micro_batches))} on every data-parallel rank")
    if not valid:
        raise SearchError(f"no split of {space.gpus} GPUs is valid for this model: " + common_reason(rejected))
    # group by graph so each graph is traced once, then evaluate every variant
    valid.sort(key=lambda c: (c.precision.value, c.parallel.micro_batch, c.parallel.tp, c.parallel.sequence_parallel,
                              c.parallel.recompute))
    try:
        reqs = [PredictRequest(model=model, model_name=name, gpu=engine.gpu.name, setting=c.precision,
                               parallel=c.parallel, seq_len=space.seq_len, optimizer=space.optimizer,
                               moe_imbalance=space.moe_imbalance) for c in valid]
    except PredictError as e:  # (a request's own fields: the same for every candidate)
        raise SearchError(str(e)) from None
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or not 0 <= jobs <= 256):
        raise SearchError(f"--jobs must be an integer in 0..256 (0: the machine's cores), got {jobs!r}")
    from .graphcache import default_jobs, graph_fields_key, trace_missing

    workers = jobs or default_jobs()
    # one request per graph, and none whose costed form is kept already (nothing to build for those)
    per_graph: dict[str, PredictRequest] = {}
    for rq in reqs:
        per_graph.setdefault(graph_fields_key(rq), rq)
    with gc_paused():
        trace_missing([rq for rq in per_graph.values() if not engine.has_costed(rq)], workers, progress)
        evaluated = _evaluate(engine, list(zip(valid, reqs, strict=True)), tokens, price_per_gpu_hour, space.gpus,
                              workers, progress)
    eval_time = 0.0
    for o, dt in evaluated:
        eval_time += dt
        (ranked if o.fits else rejected).append(o)
    ranked.sort(key=lambda o: o.iteration_ms or float("inf"))
    by_candidate = dict(zip(valid, reqs, strict=True))
    ranked[:explain] = [_explained(engine, o, by_candidate[o.candidate]) for o in ranked[:explain]]
    return SearchResult(ranked, rejected, len(valid), time.perf_counter() - t0, eval_time, gpu=engine.gpu.name,
                        seq_len=space.seq_len, optimizer=space.optimizer)


def _explained(engine: Engine, o: Outcome, req: PredictRequest) -> Outcome:
    """The outcome with the sources and warnings of its full prediction (the planner's numbers are kept: they
    are the same prediction without them)."""
    p = engine.predict(req)
    return replace(o, sources=dict(p.sources), warnings=tuple(p.warnings))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a search evaluates: the caches it fills hold millions of objects,
    which every full collection walks again (a fifth of a search's time, measured by tools/search_parts.py), and
    the evaluation leaves little cyclic garbage (peak memory unchanged). Restored as it was afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            # what the evaluation allocated goes to the oldest generation unscanned (freeze, then unfreeze puts
            # it there): otherwise the first collection after enabling walks every cached object once more
            # (0.2-0.6 s a search); a full collection still reaches it later, so nothing is kept for good
            gc.freeze()
            gc.unfreeze()
            gc.enable()


def _outcome(engine: Engine, c: Candidate, req: PredictRequest, tokens: float | None,
             price_per_gpu_hour: float | None, gpus: int,
             graphs: dict[str, Graph | PredictError] | None = None) -> tuple[Outcome, float]:
    """One candidate's outcome and the seconds its prediction took (its graph's trace or instantiation apart).
    graphs: this search's graphs by trace fields (every candidate has the same model: the engine's own key
    would encode the model's config again for each)."""
    from .graphcache import graph_fields_key

    k = graph_fields_key(req)
    g = graphs.get(k) if graphs is not None else None
    if g is None:
        try:
            g = engine.graph(req)  # trace (once per graph key) outside the timed evaluation
        except PredictError as e:
            g = e
        if graphs is not None:
            graphs[k] = g
    if isinstance(g, PredictError):
        return Outcome(c, None, None, None, False, str(g)), 0.0
    te = time.perf_counter()
    try:
        asm = engine.assemble(req, graph=g)
        total_us, breakdown, mem, fits = asm.plan_numbers()  # what `predict` reports, without the rest
    except PredictError as e:
        return Outcome(c, None, None, None, False, str(e)), time.perf_counter() - te
    dt = time.perf_counter() - te
    tokens_per_s = asm.tokens_per_step() / (total_us / 1e6)
    peak_gib = mem.peak_bytes / 2**30
    hours = cost = None
    if tokens:
        hours = tokens / tokens_per_s / 3600.0
        if price_per_gpu_hour is not None:
            cost = hours * gpus * price_per_gpu_hour
    return Outcome(c, total_us / 1e3, tokens_per_s, peak_gib, fits,
                   "" if fits else f"out of memory: peak {peak_gib:.1f} GiB > "
                                   f"{mem.capacity_bytes / 2**30:.1f} GiB usable",
                   breakdown, hours, cost), dt


# Below this many candidates a search evaluates in its own process: a worker's start (imports and its engine,
# about a second) would cost more than it saves.
PARALLEL_MIN_CANDIDATES = 400


_WORKER: dict[str, Any] = {}  # a worker process's own engine and graphs, built once by _worker_start


def _worker_start(engine_args: tuple[Any, ...]) -> None:
    import atexit

    # registered first, so it runs last: after the handlers that write this worker's caches (the estimate memo),
    # the worker leaves without tearing down its heap (millions of cached objects: seconds the planner would
    # wait for in the pool's shutdown)
    atexit.register(_leave_now)
    _WORKER["engine"] = Engine(*engine_args)
    _WORKER["graphs"] = {}


def _leave_now() -> None:
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _evaluate_group(work: list[tuple[int, Candidate, PredictRequest]], tokens: float | None,
                    price_per_gpu_hour: float | None, gpus: int) -> list[tuple[int, Outcome, float]]:
    """One group of a search in a worker process, with the engine it holds for every group it is dealt."""
    eng, graphs = _WORKER["engine"], _WORKER["graphs"]
    with gc_paused():
        return [(i, *_outcome(eng, c, r, tokens, price_per_gpu_hour, gpus, graphs)) for i, c, r in work]


def _evaluate(engine: Engine, work: list[tuple[Candidate, PredictRequest]], tokens: float | None,
              price_per_gpu_hour: float | None, gpus: int, jobs: int,
              progress: Callable[[int, int], None] | None) -> list[tuple[Outcome, float]]:
    """Every candidate's outcome, in the order given. The candidates of one precision and TP degree form a group
    (their graphs share instantiation, lookups and stage lists). With several jobs the groups are dealt as they
    are taken, largest first, to this process and to jobs - 1 worker processes (each keeps its engine for every
    group it gets): a process that started later or got slower groups takes fewer. The outcomes are the same
    as in one process: each is a pure function of the database and the request."""
    import threading

    total = len(work)
    out: list[tuple[Outcome, float] | None] = [None] * total
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (c, _) in enumerate(work):
        groups.setdefault((c.precision.value, c.parallel.tp), []).append(i)
    queue = sorted(groups.values(), key=len, reverse=True)
    lock = threading.Lock()

    def take() -> list[int] | None:
        with lock:
            return queue.pop(0) if queue else None

    done = 0
    finished: list[list[tuple[int, Outcome, float]]] = []  # a worker's groups, handed over under the lock
    pool = None
    feeders: list[threading.Thread] = []
    n_workers = min(jobs, len(groups)) - 1
    if total >= PARALLEL_MIN_CANDIDATES and n_workers > 0:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        try:
            pool = ProcessPoolExecutor(max_workers=n_workers,
                                       mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_worker_start, initargs=(engine.init_args,))
        except (OSError, RuntimeError):  # no worker processes here (a sandbox): everything in this one
            pool = None

    def feed(p: Any) -> None:
        """Deal groups to one worker process until none is left; a group whose worker failed comes back."""
        while (idx := take()) is not None:
            try:
                got = p.submit(_evaluate_group, [(i, work[i][0], work[i][1]) for i in idx], tokens,
                               price_per_gpu_hour, gpus).result()
            except Exception:  # the worker died or could not start (its own errors are outcomes)
                with lock:
                    queue.append(idx)
                return
            with lock:
                finished.append(got)

    if pool is not None:
        feeders = [threading.Thread(target=feed, args=(pool,), daemon=True) for _ in range(n_workers)]
        for t in feeders:
            t.start()

    def drain() -> None:
        nonlocal done
        with lock:
            ready, finished[:] = list(finished), []
        for got in ready:
            for i, o, dt in got:
                out[i] = (o, dt)
            done += len(got)
            if progress:
                progress(done, total)

    graphs: dict[str, Graph | PredictError] = {}
    try:
        while True:
            idx = take()
            if idx is None:
                if not any(t.is_alive() for t in feeders):
                    drain()
                    if not queue:  # (a failed worker's groups come back to the queue)
                        break
                    continue
                for t in feeders:
                    t.join(timeout=0.05)
                drain()
                continue
            for i in idx:
                out[i] = _outcome(engine, work[i][0], work[i][1], tokens, price_per_gpu_hour, gpus, graphs)
                done += 1
                if progress:
                    progress(done, total)
            drain()
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return [x for x in out if x is not None]


def common_reason(outcomes: list[Outcome]) -> str:
    """The reason most outcomes share, and how many (a search that finds nothing says why)."""
    counts = Counter(o.reason for o in outcomes if o.reason)
    if not counts:
        return "nothing to try"
    reason, n = counts.most_common(1)[0]
    return reason if n == len(outcomes) else f"{reason} ({n} of {len(outcomes)} configurations)"


def megatron_refusal(spec: ModelSpec) -> str:
    """Why no pretrain_gpt.py line can launch this model ("" when one can): asked before a search runs."""
    if not float(spec.rope_theta).is_integer():  # arguments.py: --rotary-base is type=int
        return (f"rope_theta {spec.rope_theta!r} is no whole number, and Megatron-LM's --rotary-base takes an "
                "integer: no launch line")
    return ""


def _megatron_model_args(spec: ModelSpec, seq_len: int, rope_factor: float | None = None) -> list[str]:
    """pretrain_gpt.py's model flags for a parsed config as the prediction built it (Megatron-Core's local spec).
    rope_factor: the config's Llama-3 RoPE scaling factor (Megatron-LM's --rope-scaling-factor defaults to 8)."""
    why = megatron_refusal(spec)
    if why:
        raise SearchError(why)
    # validate_args: max_position_embeddings >= seq_length (RoPE computes the positions it is given)
    positions = max(spec.max_position_embeddings, seq_len)
    scaling = ["--use-rope-scaling"] if spec.rope_type == "llama3" else []
    if scaling:  # never Megatron-LM's default factor (8) in place of the config's
        if rope_factor is None:
            raise SearchError("a Llama-3 RoPE config's line needs its scaling factor: pass rope_factor="
                              "rope_scaling_factor(config) (Megatron-LM would take its default, 8)")
        scaling.append(f"--rope-scaling-factor {rope_factor:g}")
    a = [f"--num-layers {spec.num_layers}", f"--hidden-size {spec.hidden_size}",
         f"--num-attention-heads {spec.num_heads}", f"--max-position-embeddings {positions}",
         "--position-embedding-type rope", f"--rotary-base {int(spec.rope_theta)}", "--normalization RMSNorm",
         *scaling,
         f"--norm-epsilon {spec.norm_eps:g}", "--attention-dropout 0", "--hidden-dropout 0",
         "--transformer-impl local", "--tokenizer-type NullTokenizer", f"--vocab-size {spec.vocab_size}"]
    if spec.num_kv_heads != spec.num_heads:
        a.append(f"--group-query-attention --num-query-groups {spec.num_kv_heads}")
    if spec.head_dim * spec.num_heads != spec.hidden_size:
        a.append(f"--kv-channels {spec.head_dim}")
    if spec.gated_mlp:
        a.append("--swiglu")
    if spec.is_moe:
        a.append(f"--num-experts {spec.num_experts} --moe-router-topk {spec.experts_per_token} "
                 f"--moe-ffn-hidden-size {spec.moe_intermediate_size} {MEGATRON_MOE_ARGS}")
    else:
        a.append(f"--ffn-hidden-size {spec.intermediate_size}")
    if not (spec.qkv_bias or spec.o_bias or spec.mlp_bias):
        a.append("--disable-bias-linear")
    elif spec.qkv_bias and not (spec.o_bias or spec.mlp_bias):
        a.append("--disable-bias-linear --add-qkv-bias")
    if spec.qk_norm:
        a.append("--qk-layernorm")
    if not spec.tie_word_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    return a


# the optimizer as each launcher names it (Megatron's adam is AdamW: decoupled weight decay)
_MEGATRON_OPTIMIZER = {"adamw": "adam", "adamw_fused": "adam", "sgd": "sgd"}


def _rendezvous(nodes: int, per_node: int) -> str:
    """torchrun's node flags: over several nodes every node runs the same line with its own NODE_RANK and a shared
    MASTER_ADDR (torchrun's default static rendezvous on one node would wait for the others forever)."""
    if nodes == 1:
        return f"--nnodes 1 --nproc-per-node {per_node}"
    return (f"--nnodes {nodes} --nproc-per-node {per_node} --node-rank $NODE_RANK --master-addr $MASTER_ADDR "
            "--master-port ${MASTER_PORT:-29500}")


def launch_refusal(gpus: int, gpus_per_node: int) -> str:
    """Why torchrun cannot launch this many GPUs as nodes of equal size ("" when it can)."""
    if gpus > gpus_per_node and gpus % gpus_per_node:
        return (f"{gpus} GPUs are no whole number of {gpus_per_node}-GPU nodes: torchrun starts the same number of "
                f"processes on every node, so a launch line would start {-(-gpus // gpus_per_node) * gpus_per_node}; "
                "search a multiple of the node size (or one node's worth at most)")
    return ""


# what each optimizer the prediction priced is under Megatron-Core (megatron/core/optimizer: Transformer Engine's or
# apex's FusedAdam when installed, else torch's AdamW; torch's SGD with --sgd-momentum, 0.9 by default)
_MEGATRON_OPTIMIZER_NOTE = {
    "adamw": "torch's AdamW (multi-tensor), which Megatron-Core takes without Transformer Engine or apex",
    "adamw_fused": "a fused Adam (Transformer Engine's or apex's FusedAdam, which Megatron-Core takes when installed)",
    "sgd": "torch's SGD without momentum",
}


def launch_command(o: Outcome, how: str, model: str, seq_len: int, gpus_per_node: int = 8, *,
                   optimizer: str = "adamw", spec: ModelSpec | None = None, rope_factor: float | None = None) -> str:
    """How to launch a configuration: torchrun flags for a PyTorch-native script (the parallel sizes, precision
    and optimizer as the script's arguments), or Megatron-LM's pretrain_gpt.py arguments (with the model's shape
    when its parsed config is given). Everything the prediction assumed is on the line."""
    p = o.candidate.parallel
    prec = o.candidate.precision.value
    gpus = p.dp * p.tp * p.pp
    why = launch_refusal(gpus, gpus_per_node)
    if why:
        raise SearchError(why)
    if how == "torchrun" and p.framework != "torch":
        raise SearchError("a torchrun line launches a PyTorch-native script; this configuration is Megatron-Core's")
    nodes = max(1, -(-gpus // gpus_per_node))
    per_node = min(gpus, gpus_per_node)
    head = (f"# {o.candidate.label()}: {o.iteration_ms:.1f} ms per iteration, {o.peak_memory_gib:.1f} GiB per GPU "
            "(predicted)")
    if how == "megatron":
        args = [f"--tensor-model-parallel-size {p.tp}", f"--pipeline-model-parallel-size {p.pp}",
                f"--micro-batch-size {p.micro_batch}", f"--global-batch-size {p.global_batch}",
                f"--seq-length {seq_len}"]
        args.append({"mp_bf16": "--bf16", "mp_fp16": "--fp16 --accumulate-allreduce-grads-in-fp32", "bf16": "--bf16",
                     "fp16": "--fp16"}.get(prec, ""))  # (fp32 gradient reduction, as priced: --bf16 implies it)
        # what was priced, where Megatron-LM's defaults differ: no apex weight-gradient fusion (without apex the
        # build fails), the unfused softmax in fp32 (the fused one needs its compiled kernel), no NaN check of
        # every gradient buffer each step
        args.append("--no-gradient-accumulation-fusion --no-masked-softmax-fusion --attention-softmax-in-fp32 "
                    "--no-check-for-nan-in-loss-and-grad")
        if p.sequence_parallel:
            args.append("--sequence-parallel")
        if p.zero >= 1:
            args.append("--use-distributed-optimizer")
        if p.ep > 1:
            args.append(f"--expert-model-parallel-size {p.ep}")
        if p.recompute:
            args.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
        if p.pp_schedule == "interleaved":
            args.append("--num-layers-per-virtual-pipeline-stage "
                        f"{spec.num_layers // (2 * p.pp) if spec else '<layers / (2 x PP)>'}")
        args.append(f"--optimizer {_MEGATRON_OPTIMIZER.get(optimizer, optimizer)}")
        if optimizer == "sgd":
            args.append("--sgd-momentum 0")  # as priced: no momentum buffer (Megatron-LM's default is 0.9)
        if spec is not None:
            args += _megatron_model_args(spec, seq_len, rope_factor)
            if spec.vocab_size % (128 * p.tp):
                # Megatron-LM pads the vocabulary to a multiple of 128 x TP by default (_vocab_size_with_padding);
                # the prediction priced the model's own vocabulary, split over TP as Megatron-Core builds it
                args.append("--make-vocab-size-divisible-by 1")
        # PyTorch leaves TF32 GEMMs off: fp32 runs so, and tf32 is switched on for cuBLAS by the environment
        # validate_args refuses TP > 1 on Hopper without one connection (it keeps the TP collectives in issue
        # order); the measured Megatron-Core runs set it
        env = "CUDA_DEVICE_MAX_CONNECTIONS=1 " if p.tp > 1 else ""
        env += "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 " if prec == "tf32" else ""
        note = f"\n# optimizer as priced: {_MEGATRON_OPTIMIZER_NOTE.get(optimizer, optimizer)}"
        return head + note + f"\n{env}torchrun {_rendezvous(nodes, per_node)} pretrain_gpt.py " + \
            " ".join(a for a in args if a)
    dp_kind = {0: "ddp", 2: "fsdp2 --reshard-after-forward false", 3: "fsdp2"}[p.zero]
    return head + (f"\ntorchrun {_rendezvous(nodes, per_node)} train.py --config {model} "
                   f"--dp {p.dp} --tp {p.tp} --pp {p.pp} --data-parallel {dp_kind} --micro-batch {p.micro_batch} "
                   f"--global-batch {p.global_batch} --seq-len {seq_len} --precision {prec} --optimizer {optimizer}"
                   + (" --sequence-parallel" if p.sequence_parallel else "")
                   + (" --activation-checkpointing full" if p.recompute else "")
                   + f" --pp-schedule {p.pp_schedule}"
                   + (" --gradient-as-bucket-view" if p.ddp_bucket_view else "")
                   + "\n# train.py: your script; its flags are the parallel sizes to build the device mesh with")
