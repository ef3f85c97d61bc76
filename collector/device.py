"""The NVML edge: which GPU this is, its software stack, and its clocks while we measure.

Only this module talks to NVML. On a machine without NVIDIA's library (or in CPU mode) it reports
a CPU "device", so the rest of the collector runs unchanged in tests.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tp_query.schema.gpus import known_nvml_names, normalise_nvml_name
from tp_query.schema.tables import Provenance


def machine_id() -> str:
    """This machine instance (a hash of its boot id and host name). Host-bound timings (DTensor dispatch,
    small kernels) differ between instances of one machine kind by more than the targets allow, so such
    measurements are kept per instance and combined, not replaced."""
    import hashlib

    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return "m" + hashlib.sha1(f"{platform.node()}|{boot}".encode()).hexdigest()[:10]


def cpu_model() -> str:
    """The host CPU's model name and logical core count (host costs are a property of this CPU)."""
    name = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{name} x{os.cpu_count() or 0}"


class DeviceError(RuntimeError):
    """The device cannot be used as asked (one line for the user)."""


@dataclass(frozen=True)
class ClockSample:
    sm_mhz: int
    mem_mhz: int
    throttle: int


class Device:
    """A measuring device: CUDA GPU with NVML, or the CPU (for tests)."""

    def __init__(self, cpu: bool = False) -> None:
        self.cpu = cpu or not torch.cuda.is_available()
        self._nvml: Any = None
        self._handle: Any = None
        if not self.cpu:
            self.torch_device = torch.device("cuda", torch.cuda.current_device())
            try:
                import pynvml

                pynvml.nvmlInit()
                idx = torch.cuda.current_device()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(idx)
                self._nvml = pynvml
            except Exception:  # NVML missing: clocks unknown, measurements still valid
                self._nvml = None
        else:
            self.torch_device = torch.device("cpu")

    @property
    def name(self) -> str:
        if self.cpu:
            return platform.processor() or "cpu"
        return torch.cuda.get_device_name(self.torch_device)

    @property
    def gpu_key(self) -> str | None:
        return "cpu" if self.cpu else normalise_nvml_name(self.name)

    def provenance(self) -> Provenance:
        key = self.gpu_key or "unknown"
        driver = "n/a"
        if self._nvml is not None:
            try:
                driver = str(self._nvml.nvmlSystemGetDriverVersion())
            except Exception:
                driver = "unknown"
        cudnn = "n/a"
        if not self.cpu and torch.backends.cudnn.is_available():
            cudnn = str(torch.backends.cudnn.version())
        return Provenance(gpu=key, gpu_name=self.name, driver=driver, cuda=str(torch.version.cuda or "n/a"),
                          torch=torch.__version__, cudnn=cudnn)

    def clocks(self) -> ClockSample:
        if self._nvml is None:
            return ClockSample(0, 0, 0)
        n = self._nvml
        try:
            sm = int(n.nvmlDeviceGetClockInfo(self._handle, n.NVML_CLOCK_SM))
            mem = int(n.nvmlDeviceGetClockInfo(self._handle, n.NVML_CLOCK_MEM))
            getter = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                n.nvmlDeviceGetCurrentClocksThrottleReasons
            thr = int(getter(self._handle))
        except Exception:
            return ClockSample(0, 0, 0)
        return ClockSample(sm, mem, thr)

    def memory_bytes(self) -> int:
        if self.cpu:
            return 8 * 2**30
        return int(torch.cuda.get_device_properties(self.torch_device).total_memory)

    def check_matches(self, wanted: str) -> None:
        """`make collect GPU=h200` on an H100 must fail loudly, not fill data/h200 with H100 numbers."""
        got = self.gpu_key
        if wanted == "cpu":
            if not self.cpu:
                return
            return
        if self.cpu:
            raise DeviceError(f"GPU={wanted} asked, but no CUDA GPU is visible (use GPU=cpu for the CPU mode)")
        if got != wanted:
            raise DeviceError(f"GPU={wanted} asked, but this machine has {self.name!r} "
                              + (f"({got})" if got else f"(not a part the project knows: {known_nvml_names()})"))
