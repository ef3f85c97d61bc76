"""Loading what users hand to `tp-query trace` and `tp-query sigs` (needs torch)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tp_query.schema.model_config import ConfigError, load_model_file, parse_config
from tp_query.schema.ops import describe
from tp_query.schema.precision import SETTINGS, Setting

from .graph import Graph, Phase

MAX_SOURCE_BYTES = 16 << 20


def _load_callable(ref: str) -> Callable[..., Any]:
    if ":" not in ref:
        raise ConfigError(f"expected path/to/file.py:function or package.module:function, got {ref!r}")
    mod_ref, _, fn_name = ref.rpartition(":")
    if mod_ref.endswith(".py") or "/" in mod_ref:
        path = Path(mod_ref)
        if not path.exists():
            raise ConfigError(f"no such file: {path}")
        # a FIFO waited for a writer forever, and /dev/zero grew the import to gigabytes: a source file is a
        # regular file of a source's size
        if not path.is_file() or path.stat().st_size > MAX_SOURCE_BYTES:
            raise ConfigError(f"{path}: not a Python source file (a regular file of at most "
                              f"{MAX_SOURCE_BYTES >> 20} MiB)")
        spec = importlib.util.spec_from_file_location(f"_tpq_user_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"cannot import {path}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as e:
            raise ConfigError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            mod = importlib.import_module(mod_ref)
        except ImportError as e:
            raise ConfigError(f"cannot import {mod_ref}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"{mod_ref} has no callable {fn_name!r}")
    return fn


def trace_target(target: str, inputs: str | None, setting: Setting, optimizer: str, seq_len: int | None,
                 micro_batch: int | None, tp: int | None, sequence_parallel: bool, recompute: bool,
                 framework: str = "torch") -> Graph:
    """A config is traced at the asked shapes and split; a module at the shapes its make_inputs returns, as
    one GPU runs it: flags that would change a module's graph are refused, never ignored."""
    from .trace.capture import TraceError, TraceRequest, trace_config, trace_module

    for name, v, low in (("--seq-len", seq_len, 2), ("--micro-batch", micro_batch, 1), ("--tp", tp, 1)):
        if v is not None and v < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {v}")
    try:
        if target.endswith(".json") or Path(target).is_dir():
            if inputs is not None:
                raise ConfigError("--inputs applies to a module; a config is traced on token ids of --seq-len")
            if sequence_parallel and (tp or 1) == 1:
                raise ConfigError("--sequence-parallel needs --tp > 1 (sequence parallelism splits the sequence "
                                  "over the tensor-parallel ranks)")
            spec = parse_config(load_model_file(target), Path(target).stem)
            return trace_config(TraceRequest(spec, setting, 1 if micro_batch is None else micro_batch,
                                             4096 if seq_len is None else seq_len, 1 if tp is None else tp,
                                             sequence_parallel, recompute, optimizer, framework=framework))
        given = [f for f, v in (("--seq-len", seq_len is not None), ("--micro-batch", micro_batch is not None),
                                ("--tp", tp is not None),
                                ("--sequence-parallel", sequence_parallel), ("--recompute full", recompute),
                                ("--framework megatron", framework != "torch")) if v]
        if given:
            raise ConfigError(f"{', '.join(given)} cannot apply to a module: it is traced at the shapes its "
                              "make_inputs returns, as one GPU runs it (use a HuggingFace config for splits)")
        factory = _load_callable(target)
        if inputs is None:
            raise ConfigError("tracing a module needs --inputs file.py:make_inputs (a function of the model that "
                              "returns the forward's positional arguments, created as ordinary CPU tensors)")
        make_inputs = _load_callable(inputs)
        try:
            return trace_module(factory, lambda m: tuple(make_inputs(m)), setting, optimizer,
                                name=target.rpartition(":")[2])
        except SystemExit as e:  # the user's module left the interpreter: nothing was traced
            raise ConfigError(f"{target} called exit({e.code!r}) while it was traced: nothing written") from None
    except TraceError as e:
        raise ConfigError(str(e)) from None


def signature_entries(configs: list[dict[str, Any]], settings: list[Setting], seqs: list[int], mbs: list[int],
                      tps: list[int], layers: int | None, framework: str = "torch",
                      progress: Callable[[int, int], None] | None = None, ep: int = 1
                      ) -> Iterable[tuple[str, str, bool]]:
    """Every distinct operator call (with its TF32 mode) the engine prices for the configs: the traced forward and
    backward, and the optimizer step rebuilt for all of the model's parameters as a prediction rebuilds it (the
    trace runs two layers, and its step's per-parameter lists hold only theirs). layers: a slice of the model's
    first layers (at most its own count)."""
    from .compose import Composer
    from .parallel import ParallelConfig
    from .trace.capture import TraceRequest, trace_config

    total = len(configs) * len(settings) * len(seqs) * len(mbs) * len(tps)
    done = 0
    for cfg in configs:
        spec = parse_config(cfg)
        if layers is not None:
            if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= spec.num_layers:
                raise ConfigError(f"--layers cuts a slice of the model's first layers: an integer in "
                                  f"1..{spec.num_layers}, got {layers!r}")
            spec = spec.with_layers(layers)
        for s in settings:
            tf32 = SETTINGS[s].allow_tf32
            for seq in seqs:
                for mb in mbs:
                    for tp in tps:
                        # every distinct layer shape is in the default trace (one template per layer type)
                        g = trace_config(TraceRequest(spec, s, mb, seq, tp, traced_layers=min(2, spec.num_layers),
                                                      framework=framework, ep=ep))
                        done += 1
                        if progress is not None:
                            progress(done, total)
                        for o in g.ops:
                            if o.op.startswith("comm.") or o.phase == Phase.OPT:
                                continue
                            yield o.op, o.sig, tf32 and describe_tf32(o.op, o.sig)
                        # (expert-parallel ranks are data-parallel ranks: EP of them)
                        par = ParallelConfig(dp=ep, tp=tp, micro_batch=mb, global_batch=mb * ep, framework=framework,
                                             ep=ep)
                        for st in Composer(g, tf32).stages(par):  # one stage: PP 1
                            for it in st.opt:
                                if not it.call.op.startswith("comm."):
                                    yield it.call.op, it.call.to_json_str(), it.info.math_mode == "tf32"


def describe_tf32(op: str, sig: str) -> bool:
    from tp_query.schema.signature import OpCall

    return describe(OpCall.from_json_str(op, sig), True).math_mode == "tf32"
