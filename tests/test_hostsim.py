"""The two-queue host/GPU simulation against a step-by-step reference."""

from __future__ import annotations

import numpy as np
import pytest
from tp_query.engine.hostsim import simulate


def reference(g: np.ndarray, h: np.ndarray, sync: np.ndarray) -> float:
    cpu = gpu = 0.0
    for gi, hi, si in zip(g, h, sync, strict=True):
        if si:
            cpu = max(cpu, gpu)
        cpu += hi
        gpu = max(gpu, cpu) + gi
    return max(cpu, gpu)


@pytest.mark.parametrize("seed", range(20))
def test_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    g = rng.exponential(20.0, n) * (rng.random(n) > 0.3)
    h = rng.exponential(8.0, n)
    sync = rng.random(n) < 0.02
    res = simulate(g, h, sync)
    assert res.elapsed_us == pytest.approx(reference(g, h, sync), rel=1e-9)
    assert res.elapsed_us >= g.sum() - 1e-9
    assert res.elapsed_us >= h.sum() - 1e-9


def test_gpu_bound_and_host_bound() -> None:
    g = np.full(100, 50.0)
    h = np.full(100, 5.0)
    assert simulate(g, h, np.zeros(100, bool)).elapsed_us == pytest.approx(5.0 + 5000.0)
    assert simulate(h, g, np.zeros(100, bool)).elapsed_us == pytest.approx(5000.0 + 5.0)
