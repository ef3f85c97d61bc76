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


def test_views_are_charged_their_own_host_cost() -> None:
    """Operators that launch no kernel (source no-kernel, not a sync) take the view charge of their phase; a
    synchronising read and every launching operator take the phase's charge; the optimizer's are one."""
    from dataclasses import replace

    from tp_query.engine.hostsim import HostModel
    from tp_query.engine.lookup import Source
    from tp_query.engine.segments import SOURCES, Segment

    src = np.array([SOURCES.index(s) for s in (Source.EXACT, Source.NO_KERNEL, Source.NO_KERNEL, Source.NO_KERNEL,
                                               Source.INTERPOLATED, Source.NO_KERNEL)])
    seg = Segment(np.zeros(6), np.zeros(6), np.zeros(6), np.zeros(6, dtype=bool), np.array([0, 0, 1, 0, 1, 2]),
                  np.array([0, 0, 0, 0, 0, 3.0]), np.array([False, False, False, True, False, False]), src)
    host = HostModel(fwd_us=10.0, bwd_us=5.0, opt_us=7.0, fwd_view_us=2.0, bwd_view_us=1.0, per_tensor_us=0.5)
    _, h = seg.times(host)
    assert h.tolist() == [10.0, 2.0, 1.0, 10.0, 5.0, 7.0 + 1.5]
    same = replace(host, fwd_view_us=10.0, bwd_view_us=5.0)
    assert seg.times(same)[1].tolist() == [10.0, 10.0, 5.0, 10.0, 5.0, 8.5]


def test_a_calibration_without_view_costs_charges_views_as_other_operators(tmp_path: object) -> None:
    from pathlib import Path

    from tp_query.engine.hostsim import CalibrationError, HostModel

    d = {"fwd_us": 11.0, "bwd_us": 4.0, "opt_us": 9.0, "per_tensor_us": 1.0, "per_iteration_us": 300.0, "beta": 0.5}
    h = HostModel.from_dict(d, "old")
    assert (h.fwd_view_us, h.bwd_view_us) == (11.0, 4.0)
    assert HostModel.from_dict({**d, "fwd_view_us": 3.0}, "new").fwd_view_us == 3.0
    with pytest.raises(CalibrationError, match="fwd_view_us"):
        HostModel.from_dict({**d, "fwd_view_us": -1.0}, "bad")
    p = Path(str(tmp_path)) / "c.json"
    p.write_text(h.to_json())
    assert HostModel.load(p) == h
