"""tp-query: predict LLM training iteration time and memory from the operator database.

Every error a user can fix is one line on stderr with exit code 2 (no traceback).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from tp_query.engine.graph import GRAPH_FORMAT
from tp_query.schema.gpus import UnknownGpu
from tp_query.schema.messages import first_line
from tp_query.schema.model_config import ConfigError, load_model_file
from tp_query.schema.precision import Setting

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("tp-query")
        except PackageNotFoundError:
            v = "source checkout"
        typer.echo(f"tp-query {v}")
        raise typer.Exit(0)


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print the version and exit")] = False) -> None:
    """tp-query: predict LLM training iteration time and memory from the operator database."""
db_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Inspect the profile database.")
app.add_typer(db_app, name="db")


class UserError(Exception):
    """A one-line error for the user."""


def _gpu_key(gpu: str) -> str:
    """A --gpu value as the database folder names it (raises UnknownGpu, one line, for a GPU the project lacks)."""
    from tp_query.schema.gpus import gpu_spec

    return gpu_spec(gpu).name


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


GpuOpt = Annotated[str, typer.Option("--gpu", help="GPU type with a database under data/ (e.g. h200)")]
DbOpt = Annotated[str | None, typer.Option("--db", help="database root: a folder or s3://bucket/prefix")]
PrecisionOpt = Annotated[Setting, typer.Option("--precision", help="training precision setting")]
FrameworkOpt = Annotated[str, typer.Option("--framework", help="torch (DDP/FSDP2/DTensor/pipelining) | megatron")]
PipeOpt = Annotated[str, typer.Option("--pp-schedule", help="1f1b | gpipe | interleaved (2 chunks per rank)")]
BucketViewOpt = Annotated[bool, typer.Option("--ddp-bucket-view", help="DDP(gradient_as_bucket_view=True)")]
EpOpt = Annotated[int, typer.Option("--ep", help="expert-parallel degree (MoE, --framework megatron; divides DP)")]
ImbalanceOpt = Annotated[float, typer.Option("--moe-imbalance", help="MoE: the busiest expert's tokens over the mean "
                                             "(1 = balanced routing; --framework megatron)")]
TorchOpt = Annotated[str | None, typer.Option("--torch", help="answer from the operator rows measured under this "
                                               "torch version (default: the database's primary stack)")]
SystemOpt = Annotated[str | None, typer.Option("--system", help="a TOML system file or a preset "
                                               "(h200-sxm-8x-ndr, h100-sxm-8x-ndr): GPUs per node, links, price")]


def _system(ref: str | None) -> Any:
    from tp_query.schema.system import SystemError_, load_system

    if ref is None:
        return None
    try:
        return load_system(ref)
    except SystemError_ as e:
        raise UserError(str(e)) from None


def _setting(name: str) -> Setting:
    try:
        return Setting(name)
    except ValueError:
        raise UserError(f"unknown precision setting {name!r}; choose from {', '.join(s.value for s in Setting)}"
                        ) from None


def _request(model: Path, gpu: str, dp: int, tp: int, pp: int, precision: Setting | None, seq_len: int | None,
             micro_batch: int | None,
             global_batch: int | None, optimizer: str, sequence_parallel: bool, zero: int, recompute: str,
             strict: bool, db: str | None, framework: str = "torch", pp_schedule: str = "1f1b",
             ddp_bucket_view: bool = False, ep: int = 1, moe_imbalance: float = 1.0,
             torch_version: str | None = None) -> Any:
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.predict import PredictRequest

    obj = load_model_file(model)
    fmt = obj.get("format")
    if isinstance(fmt, str) and fmt.startswith("tp-query-graph") and fmt != GRAPH_FORMAT:
        raise UserError(f"{model}: a {fmt} graph; this engine reads {GRAPH_FORMAT} (trace it again)")
    meta = obj.get("meta") if obj.get("format", "").startswith("tp-query-graph") else None
    if isinstance(meta, dict):  # a graph file: what it was traced with, unless asked otherwise (then checked)
        from tp_query.engine.request import graph_file_lengths

        precision = precision or Setting(meta.get("setting", "amp_bf16"))
        seq_len, micro_batch = graph_file_lengths(meta, seq_len, micro_batch)
    precision = precision or Setting.AMP_BF16
    seq_len = 4096 if seq_len is None else seq_len
    micro_batch = 1 if micro_batch is None else micro_batch
    if recompute not in ("none", "full"):
        raise UserError(f"--recompute must be none or full, got {recompute!r}")
    for name, v in (("--seq-len", seq_len), ("--micro-batch", micro_batch), ("--dp", dp), ("--tp", tp),
                    ("--pp", pp), ("--ep", ep)):
        if v <= 0:
            raise UserError(f"{name} must be a positive integer, got {v}")
    if global_batch is not None and global_batch <= 0:
        raise UserError(f"--global-batch must be a positive integer, got {global_batch}")
    name = model.parent.name if model.name == "config.json" else model.stem
    par = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, global_batch=global_batch,
                         sequence_parallel=sequence_parallel, zero=zero, recompute=recompute == "full",
                         pp_schedule=pp_schedule, framework=framework, ddp_bucket_view=ddp_bucket_view, ep=ep)
    return PredictRequest(model=obj, model_name=name, gpu=gpu, setting=precision, parallel=par, seq_len=seq_len,
                          optimizer=optimizer, strict=strict, db_root=db, moe_imbalance=moe_imbalance,
                          torch_version=torch_version)


class _Progress:
    """A rich progress bar on stderr when it is a terminal (commands that can run for seconds); silent in
    pipes and logs, where the result alone is wanted."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> _Progress:
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.description, total=None)
        return self

    def update(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


class _Status:
    """A spinner on stderr when it is a terminal, for steps of unknown length (tracing a new graph, building
    the validation study); silent in pipes and logs."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.status: Any = None

    def __enter__(self) -> _Status:
        if sys.stderr.isatty():
            from rich.console import Console

            self.status = Console(stderr=True).status(self.description)
            self.status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is not None:
            self.status.stop()


def _guard(fn: Any) -> Any:
    from tp_query.engine.compose import PlanError
    from tp_query.engine.dbcache import DatabaseError
    from tp_query.engine.predict import PredictError

    try:
        return fn()
    except (UserError, ConfigError, PredictError, PlanError, DatabaseError, UnknownGpu, ValueError) as e:
        if _DEBUG and type(e) is ValueError:  # a bare ValueError may come from inside: --debug shows where
            raise
        _fail(first_line(e))


def _report_files(out: Path) -> tuple[Path, Path, Path]:
    """What `report --out X.md` writes: the markdown, its JSON and its scatter plot beside it."""
    return out, out.with_suffix(".json"), out.with_name(out.stem + "-scatter.svg")


def _check_output(path: Path, flag: str, suffixes: tuple[str, ...]) -> None:
    """An output file checked before any work: its kind by suffix, an existing writable folder, not a folder
    or a dangling link itself (each was a raw exception after the work, or a folder made silently)."""
    if not path.name.lower().endswith(suffixes):
        raise UserError(f"{flag} must end in {' or '.join(suffixes)}, got {path.name!r}")
    if path.is_symlink() and not path.exists():
        raise UserError(f"{flag} {path}: a symbolic link to nothing")
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder: give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: folder {parent} does not exist")
    if (path.exists() and (not path.is_file() or not os.access(path, os.W_OK))) or not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {path}: cannot write there")


@app.command()
def predict(
    model: Annotated[Path, typer.Argument(help="HF config.json (or its folder) or a graph from `tp-query trace`")],
    gpu: GpuOpt = "h200",
    dp: Annotated[int, typer.Option(help="data-parallel degree")] = 1,
    tp: Annotated[int, typer.Option(help="tensor-parallel degree")] = 1,
    pp: Annotated[int, typer.Option(help="pipeline-parallel degree")] = 1,
    precision: Annotated[Setting | None, typer.Option("--precision", help="training precision setting "
                                                      "(default amp_bf16; a graph file's own)")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="default 4096 (a graph file's own)")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="default 1 (a graph file's own)")] = None,
    global_batch: Annotated[int | None, typer.Option("--global-batch", help="default DP x micro-batch")] = None,
    optimizer: Annotated[str, typer.Option(help="adamw | adamw_fused | sgd")] = "adamw",
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel")] = False,
    zero: Annotated[int, typer.Option(help="ZeRO stage 0-3")] = 0,
    recompute: Annotated[str, typer.Option(help="none | full")] = "none",
    strict: Annotated[bool, typer.Option(help="refuse extrapolated or missing operator costs")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object on stdout")] = False,
    db: DbOpt = None,
    framework: FrameworkOpt = "torch",
    pp_schedule: PipeOpt = "1f1b",
    ddp_bucket_view: BucketViewOpt = False,
    ep: EpOpt = 1,
    moe_imbalance: ImbalanceOpt = 1.0,
    system: SystemOpt = None,
    torch_version: TorchOpt = None,
) -> None:
    """Predict one training iteration: time, breakdown, peak memory and a fits/OOM verdict."""
    from tp_query.engine.predict import predict as run
    from tp_query.engine.report import prediction_table

    def go() -> None:
        req = _request(model, gpu, dp, tp, pp, precision, seq_len, micro_batch, global_batch, optimizer,
                       sequence_parallel, zero, recompute, strict, db, framework, pp_schedule, ddp_bucket_view, ep,
                       moe_imbalance, torch_version)
        with _Status("predicting (a new model or split is traced first: seconds)"):
            p = run(req, system=_system(system))
        if as_json:
            typer.echo(json.dumps(p.to_json(), indent=1, default=float))
        else:
            typer.echo(prediction_table(p))

    _guard(go)


@app.command()
def ops(
    model: Annotated[Path, typer.Argument()],
    gpu: GpuOpt = "h200",
    dp: int = 1, tp: int = 1, pp: int = 1,
    precision: Annotated[Setting | None, typer.Option("--precision")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch")] = None,
    global_batch: Annotated[int | None, typer.Option("--global-batch")] = None,
    optimizer: str = "adamw",
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel")] = False,
    zero: int = 0,
    recompute: str = "none",
    top: Annotated[int, typer.Option(help="rows to show (0: all)")] = 40,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    db: DbOpt = None,
    by: Annotated[str, typer.Option(help="op (every call) | kind | phase | layer (embedding, one decoder layer, "
                                         "head, optimizer): roll the rows up")] = "op",
    framework: FrameworkOpt = "torch",
    pp_schedule: PipeOpt = "1f1b",
    ddp_bucket_view: BucketViewOpt = False,
    ep: EpOpt = 1,
    moe_imbalance: ImbalanceOpt = 1.0,
    torch_version: TorchOpt = None,
) -> None:
    """List the per-operator rows behind a prediction (slowest stage, one iteration)."""
    from tp_query.engine.predict import Engine
    from tp_query.engine.report import ops_table

    def go() -> None:
        if top < 0:
            raise UserError(f"--top must be >= 0 (0: all rows), got {top}")
        req = _request(model, gpu, dp, tp, pp, precision, seq_len, micro_batch, global_batch, optimizer,
                       sequence_parallel, zero, recompute, False, db, framework, pp_schedule, ddp_bucket_view, ep,
                       moe_imbalance, torch_version)
        if by not in ("op", "kind", "phase", "layer"):
            raise UserError(f"--by must be op, kind, phase or layer, got {by!r}")
        with _Status("predicting (a new model or split is traced first: seconds)"):
            p = Engine(req.gpu, req.db_root, torch_version=req.torch_version).predict(req, with_ops=by != "layer",
                                                                                     host_range=True)
        if by == "layer":  # --top keeps the largest sections, as it keeps the slowest rows
            from tp_query.engine.report import sections_table

            cut = 0 < top < len(p.sections)
            largest = sorted(p.sections, key=lambda r: -r["total_ms"])[:top] if cut else p.sections
            typer.echo(json.dumps(largest, indent=1, default=float) if as_json else sections_table(p, top if cut else 0))
            return
        if by != "op":
            from tp_query.engine.report import rollup

            groups = rollup(p.ops, by)
            total = sum(g["total_ms"] for g in groups) or 1.0  # shares of every group's time
            if 0 < top < len(groups):
                groups = sorted(groups, key=lambda g: -g["total_ms"])[:top]
            if as_json:
                typer.echo(json.dumps(groups, indent=1, default=float))
            else:
                from tp_query.engine.report import text_table

                typer.echo(text_table([by, "calls", "total ms", "share"],
                                      [[g[by], f"{g['calls']:.4g}", f"{g['total_ms']:.3f}",
                                        f"{100 * g['total_ms'] / total:.1f}%"] for g in groups], right={1, 2, 3}))
            return
        rows = p.ops if top == 0 else p.ops[:top]
        if as_json:
            typer.echo(json.dumps([r.__dict__ for r in rows], indent=1, default=float))
        else:
            typer.echo(ops_table(rows, p))

    _guard(go)


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="SQL over the views ops, ops_ok, op_summary, repeatability, ...")],
    gpu: GpuOpt = "h200",
    db: DbOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="table | csv | json")] = "table",
    limit: Annotated[int | None, typer.Option(help="rows to print (default: 50 in table format, all in csv and "
                                                   "json)")] = None,
) -> None:
    """Run ad-hoc DuckDB SQL over the operator database."""
    from tp_query.engine.db import Database
    from tp_query.engine.report import arrow_table_text

    def go() -> None:
        nonlocal gpu
        gpu = _gpu_key(gpu)  # H100 as h100; an unknown name refused as predict refuses it
        if fmt not in ("table", "csv", "json"):
            raise UserError(f"--format must be table, csv or json, got {fmt!r}")
        if limit is not None and limit < 1:
            raise UserError(f"--limit must be a positive integer (rows printed), got {limit}")
        _bound_address_space()
        keep = (50 if limit is None else limit) if fmt == "table" else limit
        t, total = Database(gpu, db).user_sql_rows(query, keep)
        if fmt == "json":  # JSON has no NaN or infinity: a non-finite number is null; written a batch at a time
            sys.stdout.write("[" if t.num_rows else "[]\n")
            first = True
            for batch in t.to_batches(max_chunksize=4096):
                for r in batch.to_pylist():
                    row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                    text = json.dumps(row, default=str, indent=1, allow_nan=False).replace("\n", "\n ")
                    sys.stdout.write(("\n " if first else ",\n ") + text)
                    first = False
            if t.num_rows:
                sys.stdout.write("\n]\n")
            sys.stdout.flush()
        elif fmt == "csv":
            import pyarrow.csv as pacsv

            sys.stdout.flush()
            pacsv.write_csv(t, sys.stdout.buffer)
            sys.stdout.buffer.flush()
        else:
            typer.echo(arrow_table_text(t, keep or 50, total))

    _guard(go)


def _shown_path(p: str | Path) -> str:
    """A path as a report names it: relative to the working folder where it lies inside it."""
    try:
        return f"{Path(p).resolve().relative_to(Path.cwd().resolve()).as_posix()}/"
    except ValueError:
        return f"{str(p).rstrip('/')}/"


def _bound_address_space() -> None:
    """`tp-query sql` runs one query in its own process: its address space is bounded to what it holds now plus
    DuckDB's memory limit and the result's bound (and headroom), so an allocation DuckDB does not count (a 2 GB
    string from repeat()) fails as DuckDB's out-of-memory error instead of growing the process."""
    try:
        import resource
    except ImportError:  # not POSIX: DuckDB's memory limit and the result's bound remain
        return
    from tp_query.engine.db import USER_SQL_MEMORY_MB, USER_SQL_RESULT_MB

    try:
        with open("/proc/self/status") as f:
            vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return
    want = vm_kb * 1024 + ((USER_SQL_MEMORY_MB + 4 * USER_SQL_RESULT_MB + 512) << 20)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft > want:
        resource.setrlimit(resource.RLIMIT_AS, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


@db_app.command("verify")
def db_verify(gpu: GpuOpt = "h200", db: DbOpt = None) -> None:
    """Check every file against the manifest (checksums), its provenance (GPU, schema), unique keys and values,
    and the shipped snapshot against the reads derived from the files."""
    from tp_query.engine.db import Database

    def go() -> None:
        nonlocal gpu
        gpu = _gpu_key(gpu)  # H100 as h100; an unknown name refused as predict refuses it
        from tp_query.engine.snapshot import check

        d = Database(gpu, db)
        n = sum(len(v) for v in d.tables.values())
        shipped = check(gpu, db)
        cal = " and calibration.json" if not d.remote and (Path(d.base) / "calibration.json").is_file() else ""
        if cal:  # its constants within their bounds, as a prediction reads them (refused there otherwise)
            from tp_query.engine.hostsim import HostModel

            HostModel.load(Path(d.base) / "calibration.json")
        typer.echo(f"ok: {n} Parquet files{cal} of {d.base} match the manifest; provenance, schemas, keys and "
                   f"values checked; {shipped}")

    _guard(go)


@db_app.command("path")
def db_path(gpu: GpuOpt = "h200", db: DbOpt = None) -> None:
    """Print where the database of a GPU is read from (--db, else $TP_QUERY_DB, else the shipped one)."""
    from tp_query.engine.db import default_root

    def go() -> None:
        nonlocal gpu
        gpu = _gpu_key(gpu)  # H100 as h100; an unknown name refused as predict refuses it
        from tp_query.engine.db import is_remote, missing_database

        if db is not None and not db.strip():  # as every other command refuses it (it named the default)
            raise UserError(missing_database(db, gpu))
        root = db or default_root()
        where = f"{str(root).rstrip('/')}/{gpu}"

        if not is_remote(root) and not (Path(where) / "ops").is_dir():
            raise UserError(missing_database(str(root), gpu))
        typer.echo(where)

    _guard(go)


@db_app.command("manifest")
def db_manifest(
    adopt: Annotated[bool, typer.Option("--adopt", help="record every file as it is now (trusts them)")] = False,
    force: Annotated[bool, typer.Option("--force", help="with --adopt: replace a manifest the files no longer "
                                                        "match")] = False,
    gpu: GpuOpt = "h200",
    root: Annotated[Path | None, typer.Option("--root", help="the databases' folder (default: see db path)")] = None,
) -> None:
    """Show the manifest, or record the files as they are (--adopt) for a database that has none."""
    from tp_query.engine.db import default_root
    from tp_query.schema import manifest

    def go() -> None:
        nonlocal gpu
        gpu = _gpu_key(gpu)  # H100 as h100; an unknown name refused as predict refuses it
        base = Path(root or default_root()) / gpu
        if not base.is_dir():
            raise UserError(f"no database folder {base}")
        if force and not adopt:
            raise UserError("--force applies to --adopt")
        if adopt and (base / manifest.MANIFEST_NAME).is_file() and not force:
            # a manifest the files no longer match is what `db verify` refuses: re-recording it would trust them
            try:
                manifest.verify(base, gpu)
            except manifest.ManifestError as err:
                raise UserError(f"{base} has a manifest the files no longer match ({err}); --adopt --force records "
                                "them as they are now, trusting them") from None
            raise UserError(f"{base} has a manifest and every file matches it: nothing to adopt")
        if adopt:
            typer.echo(f"recorded {manifest.adopt(base, gpu)} files in {base / manifest.MANIFEST_NAME}")
        else:
            m = manifest.load(base)
            for rel, e in sorted(m["files"].items()):
                typer.echo(f"{e['sha256'][:16]}  {e['bytes']:>10}  {rel}")

    _guard(go)


@db_app.command("info")
def db_info(gpu: GpuOpt = "h200", db: DbOpt = None,
            as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Rows per operator kind and precision, provenance, and repeatability of the database."""
    from tp_query.engine.db import Database
    from tp_query.engine.report import db_info_text

    def go() -> None:
        nonlocal gpu
        gpu = _gpu_key(gpu)  # H100 as h100; an unknown name refused as predict refuses it
        d = Database(gpu, db)
        info = d.info()
        rep = d.sql("SELECT count(*) AS n, median(rel_diff) AS median_rel_diff, quantile_cont(rel_diff, 0.9) AS "
                    "p90_rel_diff, median(spread) AS median_spread FROM repeatability").to_pylist()[0]
        if as_json:
            typer.echo(json.dumps({"gpu": info.gpu, "files": info.files, "rows": info.rows, "ok_rows": info.ok_rows,
                                   "provenance": info.provenance, "repeatability": rep,
                                   "by_kind": [list(r) for r in info.by_kind]}, indent=1, default=str))
        else:
            typer.echo(db_info_text(info, rep))

    _guard(go)


@app.command()
def trace(
    target: Annotated[str, typer.Argument(help="path/to/file.py:factory or package.module:factory, or a HF "
                                               "config.json")],
    out: Annotated[Path, typer.Option("--out", "-o", help="graph file to write (.json or .json.gz)")],
    inputs: Annotated[str | None, typer.Option(help="file.py:make_inputs or module:fn taking the model")] = None,
    precision: PrecisionOpt = Setting.AMP_BF16,
    optimizer: str = "adamw",
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="configs only (default 4096)")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="configs only (default 1)")] = None,
    tp: Annotated[int | None, typer.Option(help="configs only (default 1)")] = None,
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel")] = False,
    recompute: str = "none",
    framework: FrameworkOpt = "torch",
) -> None:
    """Capture the training graph CUDA would run (fake tensors, on the CPU) into a graph file."""

    def go() -> None:
        from tp_query.engine.tracecli import trace_target

        if recompute not in ("none", "full"):
            raise UserError(f"--recompute must be none or full, got {recompute!r}")
        _check_output(out, "--out", (".json", ".json.gz"))
        with _Status("tracing"):
            g = trace_target(target, inputs, precision, optimizer, seq_len, micro_batch, tp, sequence_parallel,
                             recompute == "full", framework)
        g.save(out)
        typer.echo(f"wrote {out}: {len(g.ops)} operators, {len(g.params)} parameters "
                   f"({g.meta.source}, {g.meta.setting})")

    _guard(go)


@app.command()
def sigs(
    models: Annotated[list[Path], typer.Argument(help="HF configs whose exact operator calls to profile")],
    out: Annotated[Path, typer.Option("--out", "-o")],
    precision: Annotated[list[Setting] | None, typer.Option(help="settings (default: all six)")] = None,
    seq_len: Annotated[list[int] | None, typer.Option("--seq-len")] = None,
    micro_batch: Annotated[list[int] | None, typer.Option("--micro-batch")] = None,
    tp: Annotated[list[int] | None, typer.Option("--tp")] = None,
    layers: Annotated[int | None, typer.Option(help="override num_hidden_layers (for slices)")] = None,
    framework: FrameworkOpt = "torch",
) -> None:
    """Write a signature file: the exact operator calls of traced configs, for `make collect`."""

    def go() -> None:
        from tp_query.collector.plan import write_signature_file
        from tp_query.engine.tracecli import signature_entries

        if layers is not None and layers < 1:
            raise UserError(f"--layers must be a positive integer, got {layers}")
        _check_output(out, "--out", (".jsonl",))
        for name, vals, low in (("--seq-len", seq_len, 2), ("--micro-batch", micro_batch, 1), ("--tp", tp, 1)):
            bad = [v for v in vals or [] if v < low]
            if bad:
                raise UserError(f"{name} must be integers >= {low}, got {bad[0]}")

        with _Progress("tracing") as progress:
            entries = signature_entries([load_model_file(m) for m in models], precision or list(Setting),
                                        seq_len or [4096], micro_batch or [1], tp or [1], layers, framework,
                                        progress.update)
            n = write_signature_file(out, entries)
        typer.echo(f"wrote {out}: {n} distinct calls")

    _guard(go)


@app.command()
def search(
    model: Annotated[Path, typer.Argument(help="HF config.json")],
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs to plan for")],
    global_batch: Annotated[int, typer.Option("--global-batch")],
    seq_len: Annotated[int, typer.Option("--seq-len")] = 4096,
    precision: Annotated[list[str] | None, typer.Option(help="settings to consider, or 'all' (default amp_bf16)")] = None,
    tokens: Annotated[float | None, typer.Option(help="token budget of the job, e.g. 2e12")] = None,
    price_per_gpu_hour: Annotated[float | None, typer.Option("--price-per-gpu-hour")] = None,
    top: Annotated[int, typer.Option(help="configurations to list")] = 20,
    optimizer: str = "adamw",
    micro_batch: Annotated[list[int] | None, typer.Option("--micro-batch", help="candidates (default 1 2 4 8)")] = None,
    show_unfit: Annotated[bool, typer.Option("--show-unfit", help="also list what does not fit, and why")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    gpu: GpuOpt = "h200",
    db: DbOpt = None,
    framework: FrameworkOpt = "torch",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="every configuration with its outcome, "
                                                "as .parquet or .csv")] = None,
    emit: Annotated[str | None, typer.Option(help="print how to launch the fastest configuration: "
                                                  "torchrun | megatron")] = None,
    system: SystemOpt = None,
    torch_version: TorchOpt = None,
    jobs: Annotated[int, typer.Option(help="processes tracing the model's graphs and evaluating the candidates "
                                           "(0: the machine's cores, at most 8)")] = 0,
    pp_schedule: Annotated[list[str] | None, typer.Option(
        "--pp-schedule", help="pipeline schedules to try with PP > 1 (default every one the framework runs: "
                              "torch 1f1b gpipe interleaved, megatron 1f1b interleaved)")] = None,
    moe_imbalance: Annotated[float, typer.Option("--moe-imbalance", help="MoE: the busiest expert's tokens over "
                                                 "the mean, as predict takes it (1: balanced)")] = 1.0,
) -> None:
    """Search DP/TP/PP, micro-batch, precision, SP, ZeRO, recomputation, pipeline schedule and DDP's bucket view
    for N GPUs; rank by speed."""

    def go() -> None:
        from tp_query.engine.predict import Engine
        from tp_query.engine.search import SearchError, SearchSpace
        from tp_query.engine.search import search as run_search

        if output is not None:  # refused now, not after the search
            _check_output(output, "--output", (".parquet", ".csv"))
        if emit not in (None, "torchrun", "megatron"):
            raise UserError(f"--emit must be torchrun or megatron, got {emit!r}")
        if emit is not None and as_json:
            raise UserError("--emit prints a launch command and --json a table of configurations: choose one")
        if emit == "megatron" and framework != "megatron":
            raise UserError("--emit megatron launches Megatron-LM: search with --framework megatron (and its "
                            "precisions, mp_bf16 or mp_fp16) so the ranking is Megatron-Core's")
        if emit == "torchrun" and framework != "torch":
            raise UserError("--emit torchrun launches a PyTorch-native script; the ranking is Megatron-Core's: use "
                            "--emit megatron")
        if price_per_gpu_hour is not None and tokens is None:
            raise UserError("--price-per-gpu-hour prices a job: give its token budget with --tokens")
        if top < 0:
            raise UserError(f"--top must be 0 (every configuration) or more, got {top}")
        if precision and "all" in precision and len(precision) > 1:
            raise UserError(f"--precision all already names every setting; given with {', '.join(p for p in precision if p != 'all')}: "
                            "give all alone, or the settings")
        precs = list(Setting) if precision and "all" in precision else [_setting(p) for p in (precision or ["amp_bf16"])]
        space = SearchSpace(gpus, global_batch, seq_len, tuple(precs), tuple(micro_batch or (1, 2, 4, 8)),
                            optimizer=optimizer, framework=framework,
                            pp_schedules=tuple(pp_schedule) if pp_schedule else None, moe_imbalance=moe_imbalance)
        cfg = load_model_file(model)
        if str(cfg.get("format", "")).startswith("tp-query-graph"):
            raise UserError(f"{model} is a graph file, traced at one split and precision: search takes the "
                            "model's config (config.json) and traces each candidate's graph")
        progress = _Progress("tracing and evaluating")
        prog = progress.update

        try:
            sysspec = _system(system)
            if emit is not None:  # refused before the search, not after it
                from tp_query.engine.search import launch_refusal, megatron_refusal
                from tp_query.schema.model_config import parse_config

                why = launch_refusal(gpus, sysspec.gpus_per_node if sysspec else 8) or (
                    megatron_refusal(parse_config(cfg)) if emit == "megatron" else "")
                if why:
                    raise UserError(why)
            price = price_per_gpu_hour if price_per_gpu_hour is not None else (
                sysspec.price_per_gpu_hour if sysspec else None)
            with progress:
                # the rows shown with --json carry their sources and warnings; the table names #1's
                # rows written to --output carry them all
                explain = 1 << 30 if output is not None else (top or 1 << 30) if as_json else 1
                res = run_search(Engine(gpu, db, sysspec, torch_version), cfg, space, tokens, price, model.stem,
                                 prog, jobs=jobs, explain=explain)
        except SearchError as e:
            raise UserError(str(e)) from None
        if not res.ranked:
            from tp_query.engine.search import common_reason

            oom = [o for o in res.rejected if o.reason.startswith("out of memory")]
            if not oom:
                raise UserError(f"no configuration of {gpus} GPUs could be evaluated: {common_reason(res.rejected)}")
            best = min(oom, key=lambda o: o.peak_memory_gib or 1e9)
            raise UserError(f"no configuration of {gpus} GPUs fits this model; the smallest footprint is "
                            f"{best.candidate.label()} at {best.peak_memory_gib:.0f} GiB")
        shown = res.ranked[:top] if top > 0 else res.ranked
        if output is not None:
            frame = res.to_polars(include_rejected=True)
            if output.name.lower().endswith(".parquet"):  # as _check_output read it (.PARQUET, a bare .parquet)
                frame.write_parquet(output)
            else:
                frame.write_csv(output)
        if emit is not None:
            from tp_query.engine.search import launch_command
            from tp_query.schema.model_config import parse_config, rope_scaling_factor

            typer.echo(launch_command(res.ranked[0], emit, str(model), seq_len,
                                      sysspec.gpus_per_node if sysspec else 8, optimizer=optimizer,
                                      spec=parse_config(cfg), rope_factor=rope_scaling_factor(cfg)))
            return
        if as_json:
            typer.echo(json.dumps({"evaluated": res.evaluated, "seconds": res.seconds, "gpu": res.gpu,
                                   "seq_len": res.seq_len, "optimizer": res.optimizer,
                                   "ranked": [o.row() for o in shown],
                                   "rejected": [o.row() for o in res.rejected] if show_unfit else []},
                                  indent=1, default=float))
            return
        head = f"{'#':>3} {'configuration':<52} {'iter ms':>9} {'tokens/s':>11} {'GiB':>6}"
        if tokens:
            head += f" {'days':>7}"
        if price is not None and tokens:
            head += f" {'cost':>12}"
        lines = [f"{res.evaluated} configurations evaluated ({res.seconds:.1f} s, "
                 f"{res.evaluated / max(res.eval_seconds, 1e-9):,.0f}/s after tracing); {len(res.ranked)} fit", head]
        for i, o in enumerate(shown, 1):
            line = f"{i:>3} {o.candidate.label():<52} {o.iteration_ms:>9.1f} {o.tokens_per_s:>11,.0f} " \
                   f"{o.peak_memory_gib:>6.1f}"
            if o.job_hours is not None:
                line += f" {o.job_hours / 24:>7.1f}"
            if o.cost is not None:
                line += f" {o.cost:>12,.0f}"
            lines.append(line)
        best = res.ranked[0]
        if best.sources:
            srcs = ", ".join(f"{k} {v:.1%}" for k, v in sorted(best.sources.items(), key=lambda kv: -kv[1]) if v > 0)
            lines.append(f"#1's time comes from: {srcs}")
            lines += [f"#1 warning: {w}" for w in best.warnings]
        if show_unfit:
            lines.append("")
            lines.append("not evaluated or not fitting:")
            for o in res.rejected:
                lines.append(f"    {o.candidate.label():<52} {o.reason}")
        typer.echo("\n".join(lines))

    _guard(go)


@app.command()
def plot(
    what: Annotated[str, typer.Argument(help="breakdown | latency")],
    out: Annotated[Path, typer.Option("--out", "-o", help=".svg (or .png, .pdf with matplotlib installed)")],
    model: Annotated[Path | None, typer.Option(help="breakdown: the model config")] = None,
    dp: int = 1, tp: int = 1, pp: int = 1,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="breakdown: default 4096 (a graph file: its "
                                                "own)")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="breakdown: default 1 (a graph file: "
                                                    "its own)")] = None,
    global_batch: Annotated[int | None, typer.Option("--global-batch", help="breakdown: sequences per iteration "
                                                     "(default DP x micro-batch, one micro-batch per step; with PP "
                                                     "1F1B needs at least PP of them)")] = None,
    pp_schedule: Annotated[str | None, typer.Option("--pp-schedule", help="breakdown: 1f1b | gpipe | "
                                                    "interleaved")] = None,
    precision: Annotated[list[str] | None, typer.Option(help="settings to compare (default every setting; a "
                                                             "graph file: its own)")] = None,
    kind: Annotated[str | None, typer.Option(help="latency: operator kind (mm, elementwise, attn_cudnn_fwd, ...; "
                                                  "default mm)")] = None,
    gpu: GpuOpt = "h200",
    db: DbOpt = None,
) -> None:
    """Pictures: a prediction's breakdown across precisions, or operator latency against size."""

    def go() -> None:
        from tp_query.engine import plot as P

        if what not in ("breakdown", "latency"):
            raise UserError("plot what? breakdown | latency")
        _check_output(out, "--out", P.RASTER_OR_VECTOR)
        if what == "breakdown":
            if model is None:
                raise UserError("plot breakdown needs --model")
            if kind is not None:
                raise UserError("--kind applies to plot latency (operator latency against size), not to breakdown")
            from tp_query.engine.api import predict as api_predict

            precs = [_setting(p) for p in precision] if precision else list(Setting)
            from tp_query.engine.graph import is_graph_json
            from tp_query.engine.request import graph_file_lengths

            obj = load_model_file(model) if model.is_file() else None
            graph_meta = obj.get("meta") if obj is not None and is_graph_json(obj) else None
            meta: dict[str, Any] = graph_meta if isinstance(graph_meta, dict) else {}
            if meta:  # a graph file: its own lengths unless given (a module's inputs may have none)
                seq, mb = graph_file_lengths(meta, seq_len, micro_batch)
            else:
                seq, mb = seq_len if seq_len is not None else 4096, micro_batch if micro_batch is not None else 1
            notes: list[str] = []  # said once the chart is drawn (a refused input is one error line alone)
            if not precision and meta:  # a graph file answers for its own precision
                precs = [_setting(str(meta.get("setting", "amp_bf16")))]
            elif not precision:
                import importlib.util

                from tp_query.schema.precision import SETTINGS

                if importlib.util.find_spec("torchao") is None:  # the fp8 settings trace torchao itself
                    precs = [s for s in precs if not SETTINGS[s].fp8_recipe]
                    notes.append("note: fp8_tensorwise and fp8_rowwise left out (pip install torchao==0.18.0)")
                # the default list holds the settings this split models; asked for by name, one is refused
                from tp_query.engine.parallel import ParallelConfig
                from tp_query.engine.request import setting_refusal

                split = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch=mb)
                left = [s for s in precs if setting_refusal(s, split, seq)]
                if left:
                    precs = [s for s in precs if s not in left]
                    notes.append(f"note: {', '.join(s.value for s in left)} left out: "
                                 f"{setting_refusal(left[0], split, seq)}")
            with _Status(f"predicting {len(precs)} settings"):
                preds = [(s.value, api_predict(model, gpu=gpu, db=db, precision=s, dp=dp, tp=tp, pp=pp,
                                               micro_batch=micro_batch, seq_len=seq_len, global_batch=global_batch,
                                               pp_schedule=pp_schedule)) for s in precs]
            # a bar of a step that does not fit says so on the chart itself
            labels, parts = P.breakdown_across([(lab if p.fits else f"{lab} (does not fit)", p) for lab, p in preds])
            P.save(P.Chart("bars", f"{model.stem}: one iteration (DP{dp} TP{tp} PP{pp})", "", "ms",
                           labels=labels, parts=parts), out)
            for n in notes:
                typer.echo(n, err=True)
            from tp_query.engine.report import sources_text

            for lab, p in preds:  # what each bar rests on, as predict says it (its warnings there)
                typer.echo(f"{lab}: {p.iteration_ms:.1f} ms, peak {p.peak_memory_gib:.1f} GiB "
                           f"{'fits' if p.fits else 'DOES NOT FIT'}; sources: {sources_text(p)}"
                           + (f"; {len(p.warnings)} warnings (tp-query predict shows them)" if p.warnings else ""),
                           err=True)
        elif what == "latency":
            from tp_query.engine.db import Database

            given = [f for f, v in (("--model", model is not None), ("--dp", dp != 1), ("--tp", tp != 1),
                                    ("--pp", pp != 1), ("--seq-len", seq_len is not None),
                                    ("--micro-batch", micro_batch is not None),
                                    ("--global-batch", global_batch is not None),
                                    ("--pp-schedule", pp_schedule is not None)) if v]
            if given:
                raise UserError(f"{', '.join(given)} apply to plot breakdown; plot latency shows measured "
                                "operator latency against size, per precision")
            kind_ = kind or "mm"
            series = P.latency_series(Database(_gpu_key(gpu), db), kind_)  # (H100 as every command takes it)
            if not series:
                raise UserError(f"no measurements of kind {kind_!r} in the {gpu} database")
            if precision:  # the precisions asked for, each one measured for this kind
                have = {x.name.split(" ")[0] for x in series}
                from tp_query.schema.precision import Precision

                known = [x.value for x in Precision]
                unknown = [p_ for p_ in precision if p_ not in known]
                if unknown:
                    raise UserError(f"--precision {unknown[0]!r} is not an operator precision: plot latency takes "
                                    f"{', '.join(known)} (measured for {kind_}: {', '.join(sorted(have))})")
                missing = [p_ for p_ in precision if p_ not in have]
                if missing:
                    raise UserError(f"no {kind_} measurements in {', '.join(missing)} (measured: "
                                    f"{', '.join(sorted(have))})")
                series = [x for x in series if x.name.split(" ")[0] in precision]
            P.save(P.Chart("points", f"{kind_} latency on {gpu.upper()} by precision",
                           "FLOP" if series[0].name.endswith("(flops)") else "bytes moved", "latency (us)",
                           series=series), out)
        else:
            raise UserError("plot what? breakdown | latency")
        typer.echo(f"wrote {out}")

    _guard(go)


@app.command()
def report(
    gpu: GpuOpt = "h200",
    validation: Annotated[Path | None, typer.Option(
        help="folder of measured iterations (default data/validation for h200, data/validation/<gpu> else)")] = None,
    out: Annotated[Path | None, typer.Option(
        help="markdown report to write (default docs/validation.md for h200, docs/validation-<gpu>.md else)")] = None,
    fit: Annotated[bool, typer.Option(help="fit the host model on the calibration split (from fixed defaults)")] = True,
    calibration_out: Annotated[Path | None, typer.Option("--calibration-out",
                                                         help="write the fitted host model here")] = None,
    db: DbOpt = None,
) -> None:
    """Compare predictions with measured training iterations; write docs/validation.md and its plot."""

    def go() -> None:
        import dataclasses

        from tp_query.engine import plot
        from tp_query.engine.db import default_root
        from tp_query.engine.predict import Engine
        from tp_query.engine.validation import Study, load_rows, report_markdown, summary
        from tp_query.schema.gpus import REFERENCE_GPU, validation_folder

        key = _gpu_key(gpu)
        md = out or Path("docs/validation.md" if key == REFERENCE_GPU else f"docs/validation-{key}.md")

        if calibration_out is not None and not fit:
            raise UserError("--calibration-out writes the fitted host model: it needs --fit (the default)")
        _check_output(md, "--out", (".md",))  # its .json and -scatter.svg are written beside it
        if calibration_out is not None:  # checked before minutes of assembling and fitting
            _check_output(calibration_out, "--calibration-out", (".json",))
            if calibration_out.resolve() in {f.resolve() for f in _report_files(md)}:
                raise UserError(f"--calibration-out {calibration_out} is a file the report writes (--out {md} "
                                "writes its .md, .json and -scatter.svg): name another")
        eng = Engine(gpu, db)
        folder = validation or Path(validation_folder(eng.gpu.name))
        rows = load_rows(folder, eng.gpu.name)
        if not rows:
            raise UserError(f"no validation measurements under {folder} (run `make validate` on a GPU)")
        from tp_query.schema.tables import CALIBRATION_CAMPAIGN, FAMILIES_CAMPAIGN

        # a calibration case is one whose exact calls the database measured (the calibration campaign); a database
        # without that campaign (another GPU's, gap-filling campaigns at other lengths aside) holds none
        calibrated = eng.db.has_campaign(CALIBRATION_CAMPAIGN)
        if not calibrated:
            rows = [{**r, "split": "holdout"} if r["split"] == "calibration" else r for r in rows]
        with _Status(f"assembling {len(rows)} validation cases (traces each new one: minutes)"):
            study = Study(eng, rows)
        host = eng.host
        fitted = fit and bool(study.runs("calibration"))
        if fit and not fitted:  # nothing to fit host costs on: the constants stay as the database gives them
            typer.echo("note: no calibration run was measured on a host whose per-operator host costs are measured "
                       "(`python -m tp_query.collector dist-probe --what host` on this GPU's host): the host model "
                       "is kept as the database gives it, and no calibration file is written", err=True)
        if fitted:
            with _Status("fitting the host model on the calibration split"):
                host = study.fit()
            if calibration_out is not None:
                from tp_query.schema import manifest

                n = len(study.runs("calibration"))
                calibration_out.write_text(json.dumps({**dataclasses.asdict(host), "fitted_on_cases": n,
                                                       "split": "calibration"}, indent=1) + "\n")
                if (calibration_out.parent / manifest.MANIFEST_NAME).is_file():  # part of a database
                    manifest.record(calibration_out.parent, [calibration_out.name], gpu)
        study.finalize(host)
        summ = summary(study.cases)
        series = []
        for st in Setting:
            cs = [c for c in study.cases if c.setting == st.value and c.predicted_ms and c.measured_ms]
            series.append(plot.Series(st.value, [c.measured_ms for c in cs], [c.predicted_ms for c in cs]))
        svg = plot.scatter_loglog([s for s in series if s.xs], f"Predicted vs measured iteration time ({key.upper()})",
                                  "measured ms", "predicted ms")
        _, out_json, plot_path = _report_files(md)
        plot.write(svg, plot_path)
        prov = eng.db.info().provenance
        md.write_text(report_markdown(study.cases, host, summ, plot_path.name, prov, eng.framework.instances(),
                                      fitted=fitted, validation_dir=f"{folder.as_posix().rstrip('/')}/",
                                      database_dir=_shown_path(Path(db or default_root()) / key),
                                      has_calibration=not eng.calibration_source.startswith("default"),
                                      calibrated=calibrated,
                                      families_campaign=eng.db.has_campaign(FAMILIES_CAMPAIGN)))
        out_json.write_text(json.dumps(
            {"summary": summ, "host_model": dataclasses.asdict(host),
             "cases": [{**dataclasses.asdict(c), "ape": c.ape} for c in study.cases]}, indent=1, default=str))
        a, h = summ["all"], summ["holdout"]
        typer.echo(f"wrote {md}: {a['n']} cases, MAPE {100 * a['mape']:.1f}% (holdout {100 * h['mape']:.1f}%, "
                   f"max {100 * a['max']:.1f}%), static-TF32 baseline {100 * a['baselines']['static-tf32']:.0f}%")

    _guard(go)


_DEBUG = False  # set by main(): --debug or TP_QUERY_DEBUG=1


def _app_for(args: list[str]) -> typer.Typer:
    """The app to parse these arguments with: where the first names a top-level command, one holding that
    command alone (typer builds every command's parameters from its signature at each start, a tenth of a warm
    prediction's process here); the whole app otherwise (help, the version, `db`, a misspelt command). The
    command parses, helps and fails exactly as in the whole app: the same callback, name and function."""
    name = args[0] if args else ""
    chosen = [c for c in app.registered_commands
              if (c.name or (c.callback.__name__.replace("_", "-") if c.callback else "")) == name]
    if len(chosen) != 1 or name.startswith("-"):
        return app
    lean = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)
    lean.registered_callback = app.registered_callback
    lean.registered_commands = chosen
    return lean


def main() -> None:
    """Every failure is one line and exit code 2; `--debug` (anywhere) or TP_QUERY_DEBUG=1 shows tracebacks."""
    import os

    global _DEBUG
    debug = _DEBUG = "--debug" in sys.argv or os.environ.get("TP_QUERY_DEBUG") == "1"
    if "--debug" in sys.argv:
        sys.argv.remove("--debug")
    try:
        rc = _app_for(sys.argv[1:])(standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except typer.Exit as e:  # typer's own (it may or may not sit on click, which we do not import)
        sys.exit(getattr(e, "exit_code", 0))
    except typer.Abort:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except SystemExit:
        raise
    except BaseException as e:  # the last guard: no input may end in a traceback
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):  # a usage error (typer's own click)
            if getattr(e, "exit_code", 2) == 0:
                sys.exit(0)
            typer.echo(f"error: {(e.format_message().splitlines() or [type(e).__name__])[0]}", err=True)
            sys.exit(2)
        if debug:
            raise
        msg = (str(e).strip().splitlines() or [""])[0][:300]
        typer.echo(f"error: {type(e).__name__}{': ' + msg if msg else ''} (rerun with --debug for the traceback)",
                   err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
