"""The records a prediction passes along: the question (PredictRequest), its answer (Prediction, OpRow),
the one-line refusal (PredictError), and the bounds a request is checked against."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any

from tp_query.schema.messages import TpQueryError
from tp_query.schema.precision import SETTINGS, Setting

from .parallel import ParallelConfig

OPTIMIZERS = ("adamw", "adamw_fused", "sgd")
MAX_SEQ = 1 << 22  # 4M tokens of context
MAX_TOKENS = 1 << 24  # tokens in one micro-batch


class PredictError(TpQueryError):
    """Bad input for a prediction (one line for the user)."""


def graph_file_lengths(meta: dict[str, Any], seq_len: int | None, micro_batch: int | None) -> tuple[int, int]:
    """A graph file's sequence length and micro-batch as a request takes them: the graph's own where not given (a
    given one that differs is refused with the graph's other traced fields). A traced module runs on its own
    inputs: where they have no such dimension (0 in the file), one given would change nothing, and is refused."""
    out = []
    for flag, key, given, default in (("--seq-len", "seq_len", seq_len, 4096),
                                      ("--micro-batch", "micro_batch", micro_batch, 1)):
        own = meta.get(key, 0)
        if isinstance(own, bool) or not isinstance(own, int) or not 0 <= own <= MAX_SEQ:
            raise PredictError(f"not a valid graph file: its meta.{key} is {own!r}"[:200])
        if own:
            out.append(own if given is None else given)
            continue
        if given is not None:
            raise PredictError(f"{flag} does not apply to this graph: the traced module runs on its own inputs, "
                               f"which have no {dict(seq_len='sequence', micro_batch='batch')[key]} dimension (leave it out)")
        out.append(default)
    return out[0], out[1]


@dataclass(frozen=True, kw_only=True)
class PredictRequest:
    """One question: this model, on this GPU, at this precision, sequence and optimizer, split as `parallel`."""

    model: dict[str, Any]  # a HF config.json object or a tp-query graph object
    model_name: str = "model"
    gpu: str = "h200"
    setting: Setting = Setting.AMP_BF16
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seq_len: int = 4096
    optimizer: str = "adamw"
    strict: bool = False
    db_root: str | None = None
    moe_imbalance: float = 1.0  # MoE routing: the busiest expert's rows over the mean (1: balanced)
    torch_version: str | None = None  # whose operator rows answer (default: the database's primary stack)

    def __post_init__(self) -> None:
        """Each field of its own type (an API caller's "2" or a dict for the split is refused in one line)."""
        if not isinstance(self.model, dict):
            raise PredictError(f"model must be a config or graph object (a dict), got {type(self.model).__name__}")
        if not isinstance(self.setting, Setting):
            raise PredictError(f"setting must be a Setting, got {self.setting!r}"[:200])
        if not isinstance(self.parallel, ParallelConfig):
            raise PredictError(f"parallel must be a ParallelConfig, got {type(self.parallel).__name__}")
        imb = self.moe_imbalance
        if isinstance(imb, bool) or not isinstance(imb, numbers.Real) or not math.isfinite(imb) or imb < 1:
            raise PredictError(f"moe_imbalance must be a number >= 1 (the busiest expert's tokens over the mean), "
                               f"got {imb!r}"[:200])
        object.__setattr__(self, "moe_imbalance", float(imb))
        if type(self.strict).__name__ not in ("bool", "bool_"):
            raise PredictError(f"strict must be True or False, got {self.strict!r}"[:200])
        for name in ("gpu", "optimizer", "model_name"):
            if not isinstance(getattr(self, name), str):
                raise PredictError(f"{name} must be a string, got {getattr(self, name)!r}"[:200])


def parse_setting(value: object) -> Setting:
    """A precision setting by its name (a Setting passes through); an unknown one is refused with the list."""
    if isinstance(value, Setting):
        return value
    try:
        return Setting(value)
    except ValueError:
        raise PredictError(f"unknown precision setting {value!r}; choose from {', '.join(s.value for s in Setting)}"
                           [:300]) from None


def setting_refusal(setting: Setting, par: ParallelConfig, seq_len: int | None = None) -> str:
    """Why a precision setting is not modelled under this split ("" when it is): torchao's float8 training is
    traced on plain Linear layers, and its tensor-parallel styles (Float8ColwiseParallel, float8 all-gathers under
    sequence parallelism) change both the kernels and the collectives, which nothing here has measured.
    seq_len: the tokens of a micro-batch are the inner dimension of float8's weight-gradient GEMM."""
    if SETTINGS[setting].fp8_recipe and par.framework == "megatron":
        return ("the fp8 settings model torchao float8 training on PyTorch; Megatron-Core's FP8 needs Transformer "
                "Engine, which is not modelled")
    if SETTINGS[setting].master_weights and par.framework == "torch" and par.zero == 0:
        # PyTorch's recipe for fp32 master weights is FSDP2's MixedPrecisionPolicy (validated): DDP would all-reduce
        # the half-precision gradients while the memory model holds fp32 ones, and without data parallelism
        # (one GPU, TP or PP alone) PyTorch's stacks train under autocast (torchtitan: AMP when FSDP is off)
        return (f"{setting.value} on PyTorch is FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32), "
                f"{'which DDP does not have' if par.dp > 1 else 'which needs data parallelism'}: use --zero 2 or 3 "
                f"with DP > 1, --framework megatron, or amp_bf16 / bf16")
    if SETTINGS[setting].fp8_recipe and seq_len is not None and (par.micro_batch * seq_len) % 16:
        # torchao computes the weight gradient as grad_output_fp8.t() @ input_fp8 (pad_inner_dim off by default),
        # and CUDA's _scaled_mm refuses an inner dimension that is no multiple of 16: the step would fail
        return (f"{setting.value} needs micro-batch x sequence a multiple of 16 (torchao's weight-gradient "
                f"_scaled_mm runs over the tokens; {par.micro_batch} x {seq_len} = {par.micro_batch * seq_len}): "
                "the step would fail on the GPU")
    if SETTINGS[setting].fp8_recipe and par.tp > 1:
        return (f"{setting.value} is modelled at TP=1 (torchao float8 on plain Linear layers): its tensor-parallel "
                "styles are not modelled; use --tp 1 with DP/FSDP2 or PP, or a bf16 setting")
    return ""


def checkpointing_refusal(req: PredictRequest) -> str:
    """A config that turns gradient checkpointing on (transformers' from_config honours `gradient_checkpointing`)
    while the request has no recompute: one of them would be ignored (Llama was predicted without it, Qwen3 with
    it), so the request must say it."""
    cfg = req.model if isinstance(req.model, dict) else {}
    on = [c.get("gradient_checkpointing") for c in (cfg, cfg.get("text_config")) if isinstance(c, dict)]
    if any(v is True for v in on) and not req.parallel.recompute:
        return ("the config sets gradient_checkpointing: true (transformers then recomputes every layer): predict "
                "with --recompute full (recompute=True), or drop the key")
    return ""


@dataclass(frozen=True)
class OpRow:
    phase: str
    op: str
    kind: str
    precision: str
    shapes: str
    count: float  # calls per iteration (a layer type's share of a stage's layers can be fractional)
    latency_us: float
    total_ms: float
    source: str


@dataclass(frozen=True)
class Prediction:
    iteration_ms: float
    breakdown: dict[str, float]
    peak_memory_gib: float
    fits: bool
    # each kind's largest size over the step (`weights_gib`, ...; not all live together), the capacity and margin,
    # and what is live at the peak (`at_peak_weights_gib`, ...: they sum to peak_memory_gib)
    memory: dict[str, float]
    sources: dict[str, float]
    warnings: list[str]
    config: dict[str, Any]
    tokens_per_s: float | None  # None: a module graph whose inputs hold no tokens
    stages: list[dict[str, Any]] = field(default_factory=list)
    ops: list[OpRow] = field(default_factory=list)
    parameters: int | None = None  # of the whole model, every rank together
    model_flops: float | None = None  # Megatron-LM's count for one iteration
    model_tflops_per_gpu: float | None = None
    hardware_tflops_per_gpu: float | None = None  # every operator the GPUs run (recomputation, optimizer)
    mfu: float | None = None  # model FLOPs / (time x GPUs x datasheet dense peak of the compute precision)
    # GPU time of the slowest stage by section: the embedding, one decoder layer (and how many), the head,
    # the optimizer step (per iteration; host idle, pipeline bubble and data-parallel traffic apart)
    sections: list[dict[str, Any]] = field(default_factory=list)
    peak_at: str = ""  # where in the step the peak stage's memory peaks (memory.PeakPhase)

    def to_json(self, with_ops: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_ops:
            d.pop("ops")
        return d
