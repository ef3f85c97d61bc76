"""The cluster a job runs on, from a TOML system file: GPUs per node, NVLink and network bandwidth and
latency, price per GPU-hour. Presets ship in schema/systems/; `--system FILE|PRESET` picks one."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .gpus import gpu_key
from .messages import first_line

PRESET_DIR = Path(__file__).resolve().parent / "systems"


class SystemError_(ValueError):
    """A system file that cannot be used (one line for the user)."""


@dataclass(frozen=True, kw_only=True)
class SystemSpec:
    name: str
    gpu: str
    gpus_per_node: int
    nvlink_bytes_per_s: float
    nvlink_latency_s: float
    network_bytes_per_s: float
    network_latency_s: float
    price_per_gpu_hour: float | None = None


SYSTEM_KEYS = frozenset({"name", "gpu", "gpus_per_node", "nvlink_gbytes_per_s", "nvlink_latency_us",
                         "network_gbytes_per_s", "network_latency_us", "price_per_gpu_hour"})


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def load_system(ref: str) -> SystemSpec:
    """A preset name or a TOML file; every figure present, finite and positive."""
    path = Path(ref)
    if not path.is_file():
        path = PRESET_DIR / f"{ref}.toml"
        if not path.is_file():
            raise SystemError_(f"no system file or preset {ref!r} (presets: {', '.join(presets())})")
    import tomllib  # a system file is read only when --system is given (every prediction imports this module)

    try:
        with path.open("rb") as f:
            d = tomllib.load(f) if path.stat().st_size < (1 << 20) else None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SystemError_(f"{path}: not a TOML system file ({first_line(e)})") from None
    if not isinstance(d, dict):
        raise SystemError_(f"{path}: larger than 1 MiB, not a system file")

    def num(key: str, lo: float, hi: float) -> float:
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo < v <= hi:
            raise SystemError_(f"{path}: {key} must be a number in ({lo:g}, {hi:g}], got {v!r}")
        return float(v)

    gpn = d.get("gpus_per_node")
    if isinstance(gpn, bool) or not isinstance(gpn, int) or not 0 < gpn <= 1024:
        raise SystemError_(f"{path}: gpus_per_node must be an integer in 1..1024, got {gpn!r}")
    gpu = d.get("gpu")
    if not isinstance(gpu, str) or not gpu:
        raise SystemError_(f"{path}: gpu must name the GPU type (h200, h100, ...)")
    unknown = sorted(set(d) - SYSTEM_KEYS)
    if unknown:  # a misspelt key would silently drop what it was meant to set
        raise SystemError_(f"{path}: unknown key {unknown[0]!r} (a system file has {', '.join(sorted(SYSTEM_KEYS))})")
    price = d.get("price_per_gpu_hour")
    return SystemSpec(
        name=str(d.get("name", path.stem)), gpu=gpu_key(gpu), gpus_per_node=gpn,
        nvlink_bytes_per_s=num("nvlink_gbytes_per_s", 0, 1e5) * 1e9,
        nvlink_latency_s=num("nvlink_latency_us", 0, 1e6) * 1e-6,
        network_bytes_per_s=num("network_gbytes_per_s", 0, 1e5) * 1e9,
        network_latency_s=num("network_latency_us", 0, 1e6) * 1e-6,
        price_per_gpu_hour=num("price_per_gpu_hour", 0, 1e6) if price is not None else None)
