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


@pytest.mark.parametrize("seed", range(6))
def test_composed_maps_equal_the_simulation_of_the_concatenation(seed: int) -> None:
    """A stage timed as its sections' maps (n layers: the n-th power) equals simulate on the concatenated
    operators: host-bound and GPU-bound stretches, syncs inside a section and at its first operator."""
    from tp_query.engine.hostsim import IDENTITY, compose, elapsed_us, host_map, power

    rng = np.random.default_rng(seed)
    sections = []
    for n_ops in (7, 40, 11):
        g = rng.uniform(0.5, 30.0, n_ops) * (10.0 if seed % 2 else 1.0)
        h = rng.uniform(1.0, 20.0, n_ops)
        s = rng.random(n_ops) < 0.08
        s[0] = seed % 3 == 0
        sections.append((g, h, s))
    counts = (1, 5 + seed, 1)
    m = IDENTITY
    for (g, h, s), n in zip(sections, counts, strict=True):
        m = compose(power(host_map(g, h, s), n), m)
    cat = [np.concatenate([np.tile(sec[i], n) for sec, n in zip(sections, counts, strict=True)]) for i in range(3)]
    want = simulate(cat[0], cat[1], cat[2]).elapsed_us
    assert elapsed_us(m) == pytest.approx(want, rel=1e-12)
    assert elapsed_us(host_map(*cat)) == pytest.approx(want, rel=1e-12)
