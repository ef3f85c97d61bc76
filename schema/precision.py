"""Closed sets of dtypes and precision settings, shared by collector and engine.

Precision is part of every key: an operator's `precision` column says which arithmetic it ran in
(tf32 is fp32 storage with TF32 matrix math), and a training `Setting` says what a user asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class DType(StrEnum):
    """Tensor element types that appear in training graphs (short names used in keys)."""

    FP64 = "fp64"
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8E4M3 = "fp8e4m3"
    FP8E5M2 = "fp8e5m2"
    I64 = "i64"
    I32 = "i32"
    I16 = "i16"
    I8 = "i8"
    U8 = "u8"
    U64 = "u64"  # flash attention's RNG state (philox seed and offset), passed to its backward
    BOOL = "bool"
    C64 = "c64"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in _FLOATS


_ITEMSIZE = {
    DType.FP64: 8, DType.FP32: 4, DType.FP16: 2, DType.BF16: 2, DType.FP8E4M3: 1, DType.FP8E5M2: 1,
    DType.I64: 8, DType.I32: 4, DType.I16: 2, DType.I8: 1, DType.U8: 1, DType.U64: 8, DType.BOOL: 1, DType.C64: 8,
}
_FLOATS = {DType.FP64, DType.FP32, DType.FP16, DType.BF16, DType.FP8E4M3, DType.FP8E5M2}

# torch dtype repr ("torch.float32") <-> DType, kept as strings so this module needs no torch.
TORCH_NAME_TO_DTYPE: dict[str, DType] = {
    "torch.float64": DType.FP64, "torch.float32": DType.FP32, "torch.float16": DType.FP16,
    "torch.bfloat16": DType.BF16, "torch.float8_e4m3fn": DType.FP8E4M3, "torch.float8_e5m2": DType.FP8E5M2,
    "torch.int64": DType.I64, "torch.int32": DType.I32, "torch.int16": DType.I16, "torch.int8": DType.I8,
    "torch.uint8": DType.U8, "torch.uint64": DType.U64, "torch.bool": DType.BOOL, "torch.complex64": DType.C64,
}
DTYPE_TO_TORCH_NAME: dict[DType, str] = {v: k for k, v in TORCH_NAME_TO_DTYPE.items()}


class Precision(StrEnum):
    """The arithmetic an operator ran in: the `precision` key column of the database."""

    FP32 = "fp32"  # fp32 storage, TF32 off
    TF32 = "tf32"  # fp32 storage, TF32 tensor-core math (GEMM/conv family only)
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"  # reserved: torch._scaled_mm on Hopper
    INT = "int"  # ops that touch no floating data (index arithmetic)


class Setting(StrEnum):
    """Training precision settings users ask for (see ARCHITECTURE.md)."""

    FP32 = "fp32"
    TF32 = "tf32"
    FP16 = "fp16"
    BF16 = "bf16"
    AMP_FP16 = "amp_fp16"
    AMP_BF16 = "amp_bf16"
    # Half-precision parameters and compute with fp32 master weights in the optimizer and fp32 gradient
    # reduction: Megatron's --bf16/--fp16, FSDP2's MixedPrecisionPolicy(param_dtype=half, reduce_dtype=fp32).
    MP_FP16 = "mp_fp16"
    MP_BF16 = "mp_bf16"
    # torchao float8 training (eager) on the Linear layers of a bf16 model: scaled fp8 GEMMs, with the
    # casts, amax and scale computation around each; tensorwise or rowwise scaling.
    FP8_TENSORWISE = "fp8_tensorwise"
    FP8_ROWWISE = "fp8_rowwise"


@dataclass(frozen=True)
class SettingSpec:
    """What a precision setting means for the training step."""

    param_dtype: DType
    autocast_dtype: DType | None
    allow_tf32: bool
    grad_scaler: bool
    master_weights: bool = False  # an fp32 copy of every parameter lives in the optimizer
    fp8_recipe: str | None = None  # torchao Float8LinearConfig recipe name


SETTINGS: dict[Setting, SettingSpec] = {
    Setting.FP32: SettingSpec(DType.FP32, None, False, False),
    Setting.TF32: SettingSpec(DType.FP32, None, True, False),
    Setting.FP16: SettingSpec(DType.FP16, None, False, False),
    Setting.BF16: SettingSpec(DType.BF16, None, False, False),
    Setting.AMP_FP16: SettingSpec(DType.FP32, DType.FP16, False, True),
    Setting.AMP_BF16: SettingSpec(DType.FP32, DType.BF16, False, False),
    Setting.MP_FP16: SettingSpec(DType.FP16, None, False, True, master_weights=True),
    Setting.MP_BF16: SettingSpec(DType.BF16, None, False, False, master_weights=True),
    Setting.FP8_TENSORWISE: SettingSpec(DType.BF16, None, False, False, fp8_recipe="tensorwise"),
    Setting.FP8_ROWWISE: SettingSpec(DType.BF16, None, False, False, fp8_recipe="rowwise"),
}


def fp8_linear_filter(fqn: str, in_features: int, out_features: int) -> bool:
    """Which Linear layers the fp8 settings convert, as torchao's README and torchtitan do: every one
    whose dimensions are multiples of 16 (the fp8 GEMM's alignment), except the LM head."""
    return not fqn.endswith("lm_head") and in_features % 16 == 0 and out_features % 16 == 0


def op_precision(float_dtypes: list[DType], tf32_sensitive: bool, allow_tf32: bool) -> Precision:
    """The precision key of an op from its floating inputs: the widest float wins (casts key on both)."""
    if not float_dtypes:
        return Precision.INT
    order = [DType.FP64, DType.FP32, DType.FP16, DType.BF16, DType.FP8E4M3, DType.FP8E5M2]
    widest = min(float_dtypes, key=order.index)
    if widest in (DType.FP32, DType.FP64):
        return Precision.TF32 if (tf32_sensitive and allow_tf32 and widest == DType.FP32) else Precision.FP32
    if widest == DType.FP16:
        return Precision.FP16
    if widest == DType.BF16:
        return Precision.BF16
    return Precision.FP8
