"""GPU types the project knows: names, capacity, roofline ceilings and interconnect figures.

The ceilings are used only where the database has no measurement (roofline hold and structured
misses) and for the alpha-beta communication model; everything measured wins over them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .precision import Precision


@dataclass(frozen=True)
class GpuSpec:
    name: str  # normalised key used for data/<name>/
    # NVML's device names of exactly this part (one memory size and form factor: the figures below are its own);
    # another part of the same chip (GH200, H100 PCIe/NVL, A100 40 GB) is a GPU the project does not know
    nvml_names: tuple[str, ...]
    memory_bytes: int
    context_bytes: int  # CUDA context + cuBLAS/cuDNN workspaces outside the caching allocator
    l2_bytes: int
    hbm_bytes_per_s: float  # achievable copy bandwidth (read + write counted)
    peak_flops: dict[Precision, float]  # achievable dense rates
    nvlink_bytes_per_s: float  # per direction, per GPU
    nvlink_latency_s: float
    ib_bytes_per_s: float  # per GPU across hosts
    ib_latency_s: float
    max_sm_clock_mhz: int = 0
    datasheet_flops: dict[Precision, float] | None = None  # dense peak as sold (MFU's denominator)


H200 = GpuSpec(
    name="h200", nvml_names=("NVIDIA H200",), memory_bytes=143771 * 2**20, context_bytes=600 * 2**20,
    l2_bytes=60 * 2**20, hbm_bytes_per_s=4.3e12,
    peak_flops={Precision.FP32: 51e12, Precision.TF32: 377e12, Precision.FP16: 754e12, Precision.BF16: 776e12,
                Precision.FP8: 1500e12, Precision.INT: 51e12},
    nvlink_bytes_per_s=450e9, nvlink_latency_s=8e-6, ib_bytes_per_s=50e9, ib_latency_s=15e-6,
    max_sm_clock_mhz=1980,
    datasheet_flops={Precision.FP32: 66.9e12, Precision.TF32: 494.7e12, Precision.FP16: 989.4e12,
                     Precision.BF16: 989.4e12, Precision.FP8: 1978.9e12, Precision.INT: 66.9e12},
)
H100 = GpuSpec(
    name="h100", nvml_names=("NVIDIA H100 80GB HBM3",), memory_bytes=81559 * 2**20, context_bytes=600 * 2**20,
    l2_bytes=50 * 2**20, hbm_bytes_per_s=3.0e12,
    peak_flops={Precision.FP32: 51e12, Precision.TF32: 377e12, Precision.FP16: 754e12, Precision.BF16: 776e12,
                Precision.FP8: 1500e12, Precision.INT: 51e12},
    nvlink_bytes_per_s=450e9, nvlink_latency_s=8e-6, ib_bytes_per_s=50e9, ib_latency_s=15e-6,
    datasheet_flops={Precision.FP32: 66.9e12, Precision.TF32: 494.7e12, Precision.FP16: 989.4e12,
                     Precision.BF16: 989.4e12, Precision.FP8: 1978.9e12, Precision.INT: 66.9e12},
)
A100 = GpuSpec(
    name="a100", nvml_names=("NVIDIA A100-SXM4-80GB",), memory_bytes=81920 * 2**20, context_bytes=500 * 2**20,
    l2_bytes=40 * 2**20, hbm_bytes_per_s=1.8e12,
    peak_flops={Precision.FP32: 19e12, Precision.TF32: 140e12, Precision.FP16: 280e12, Precision.BF16: 280e12,
                Precision.FP8: 280e12, Precision.INT: 19e12},
    nvlink_bytes_per_s=300e9, nvlink_latency_s=10e-6, ib_bytes_per_s=25e9, ib_latency_s=15e-6,
    datasheet_flops={Precision.FP32: 19.5e12, Precision.TF32: 156e12, Precision.FP16: 312e12,
                     Precision.BF16: 312e12, Precision.FP8: 312e12, Precision.INT: 19.5e12},
)
# A CPU "GPU" for the collector's CPU mode (tests): figures are rough and only used for rooflines.
CPU = GpuSpec(
    name="cpu", nvml_names=(), memory_bytes=8 * 2**30, context_bytes=0, l2_bytes=2 * 2**20,
    hbm_bytes_per_s=10e9, peak_flops={p: 50e9 for p in Precision},
    nvlink_bytes_per_s=5e9, nvlink_latency_s=20e-6, ib_bytes_per_s=1e9, ib_latency_s=50e-6,
)

GPUS: dict[str, GpuSpec] = {g.name: g for g in (H200, H100, A100, CPU)}


class UnknownGpu(ValueError):
    pass


def gpu_key(name: str) -> str:
    """A GPU type as a user names it ("H200", " h200") in the form GPUS and the database folders use."""
    return name.strip().lower()


def gpu_spec(name: str) -> GpuSpec:
    key = gpu_key(name)
    if key not in GPUS:
        raise UnknownGpu(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}")
    return GPUS[key]


REFERENCE_GPU = "h200"


def validation_folder(gpu: str) -> str:
    """Where a GPU's measured training iterations live: the reference GPU's in data/validation (they came first),
    another's in data/validation/<gpu>/, so a report never compares one GPU's runs with another's database."""
    return "data/validation" if gpu == REFERENCE_GPU else f"data/validation/{gpu}"


def normalise_nvml_name(nvml_name: str) -> str | None:
    """"NVIDIA H200" -> "h200"; None when the device is not one we know. The whole name must match (case and runs
    of spaces aside): "NVIDIA GH200 480GB" is no H200 (96 GB, another power limit) and "NVIDIA H100 PCIe" no SXM
    H100, and a database of one would be priced with the other's capacity and peaks."""
    key = " ".join(nvml_name.split()).casefold()
    for g in GPUS.values():
        if any(key == " ".join(n.split()).casefold() for n in g.nvml_names):
            return g.name
    return None


def known_nvml_names() -> str:
    """The device names the project knows, for a refusal."""
    return ", ".join(f"{n} ({g.name})" for g in GPUS.values() for n in g.nvml_names)


def bus_factor(collective: str, ranks: int) -> float:
    """Share of the message each rank moves over its link in a ring algorithm (nccl-tests' busbw):
    all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n, the rest 1."""
    n = max(ranks, 1)
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0
