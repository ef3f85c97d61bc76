"""Framework models on closed-form inputs: the two-stream timeline, DDP buckets, FSDP2's exposed
communication, pipeline schedules as torch orders them, and the framework data read from a database."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from tp_query.engine.framework import (
    FrameworkData,
    Interference,
    PipeSchedule,
    StageShape,
    Timeline,
    _gpipe_longest_path,
    _one_f_one_b_periodic,
    ddp_buckets,
    ddp_overhead,
    fsdp_overhead,
    in_flight_microbatches,
    pipeline_time,
    schedule_actions,
)
from tp_query.engine.hostsim import ShiftedHostMap, host_map


def test_timeline_serialises_each_stream_and_respects_dependencies() -> None:
    tl = Timeline()
    a = tl.add("compute", 10.0)
    c = tl.add("comm", 4.0, [a])
    tl.add("compute", 3.0)
    tl.add("compute", 5.0, [c])
    comp_end, end = tl.run()
    assert comp_end == pytest.approx(19.0) and end == pytest.approx(19.0)  # comm 10..14 hidden behind 10..13, 14..19


def test_interference_stretches_both_streams_while_they_overlap() -> None:
    inter = Interference({"all_reduce": [(1.0, 1.5, 2.0)]})
    tl = Timeline()
    tl.add("compute", 30.0)
    tl.comm(inter, "all_reduce", 1.0, 10.0)
    comp_end, end = tl.run()
    # both run at reduced rate: comm needs 10 us of work at rate 1/2 -> 20 us; meanwhile compute did 20/1.5
    # = 13.33 us of work; the remaining 16.67 run alone
    assert end == pytest.approx(20.0 + (30.0 - 20.0 / 1.5))
    assert comp_end == end


def test_interference_interpolates_in_log_bytes_and_holds_outside() -> None:
    inter = Interference({"all_reduce": [(1e6, 1.2, 2.0), (1e8, 1.4, 1.0)]})
    assert inter.factors("all_reduce", 1e7) == pytest.approx((1.3, 1.5))
    assert inter.factors("all_reduce", 1e3) == (1.2, 2.0) and inter.factors("all_reduce", 1e12) == (1.4, 1.0)
    assert inter.factors("all_gather", 1e7) == pytest.approx((1.3, 1.5))  # nearest measured collective
    assert Interference().factors("all_reduce", 1e9) == (1.0, 1.0)


def test_ddp_buckets_never_split_a_parameter() -> None:
    mib = 1 << 20
    assert ddp_buckets([mib // 2, mib // 2, 30 * mib, mib, 24 * mib, 2 * mib]) == [mib, 30 * mib, 25 * mib, 2 * mib]


def _shape(layers: int = 4, layer_us: float = 1000.0) -> StageShape:
    return StageShape(fwd_embed_us=10.0, fwd_layer_us=layer_us, fwd_head_us=500.0, bwd_head_us=1000.0,
                      bwd_layer_us=2 * layer_us, bwd_embed_us=20.0, layers=layers, embed_params=(400 << 20,),
                      layer_params=(64 << 20,) * 4, head_params=(1 << 12, 400 << 20))


def _comm(kind: str, nbytes: float) -> float:
    return 20.0 + nbytes / 200e3  # 20 us + 200 GB/s


def test_ddp_exposes_only_what_backward_cannot_hide() -> None:
    s = _shape()
    none = Interference()
    exposed = ddp_overhead(s, _comm, none)
    embed_ar = _comm("all_reduce", 400 << 20)
    assert embed_ar <= exposed < embed_ar + _comm("all_reduce", 64 << 20) * 4  # the last bucket at least
    slow = ddp_overhead(s, _comm, Interference({"all_reduce": [(1.0, 1.3, 1.3)]}))
    assert slow > exposed
    fast = ddp_overhead(s, lambda k, b: 1.0, none)
    assert fast == pytest.approx(1.0)


def _ddp_by_timeline(s: StageShape, comm, inter: Interference) -> float:  # type: ignore[no-untyped-def]
    """DDP's backward as the general two-stream timeline runs it (what the one-pass DDP path must equal)."""
    from tp_query.engine.framework import _bucket_ends

    tl = Timeline()
    grads: list[tuple[int, int]] = []
    t = tl.add("compute", s.bwd_head_us)
    grads += [(t, b) for b in reversed(s.head_params)]
    for _ in range(s.layers):
        t = tl.add("compute", s.bwd_layer_us)
        grads += [(t, b) for b in reversed(s.layer_params)]
    t = tl.add("compute", s.bwd_embed_us)
    grads += [(t, b) for b in reversed(s.embed_params)]
    prev = None
    for nbytes, producer in _bucket_ends(grads):
        prev = tl.comm(inter, "all_reduce", nbytes, comm("all_reduce", nbytes), [producer, prev])
    return tl.run()[1] - s.plain_bwd_us


def test_ddp_one_pass_equals_the_general_timeline_on_random_stages() -> None:
    """The one-pass DDP simulation against the general timeline: random layer counts, parameter sizes (buckets
    closing mid-layer, parameters larger than a bucket), zero-length sections, bandwidths and slowdowns."""
    rng = np.random.default_rng(7)

    def sizes(n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in rng.choice([0, 4096, 1 << 20, 9 << 20, 40 << 20, 300 << 20], n))

    def priced(alpha: float, bw: float):  # type: ignore[no-untyped-def]
        return lambda k, b: alpha + b / bw

    for _ in range(300):
        s = StageShape(fwd_embed_us=0.0, fwd_layer_us=0.0, fwd_head_us=0.0,
                       bwd_head_us=float(rng.choice([0.0, rng.uniform(1, 3000)])),
                       bwd_layer_us=float(rng.choice([0.0, rng.uniform(1, 5000)])),
                       bwd_embed_us=float(rng.choice([0.0, rng.uniform(1, 100)])), layers=int(rng.integers(0, 9)),
                       embed_params=sizes(int(rng.integers(0, 2))), layer_params=sizes(int(rng.integers(1, 12))),
                       head_params=sizes(int(rng.integers(0, 3))))
        alpha, bw = float(rng.uniform(0, 50)), float(rng.uniform(20e3, 400e3))
        inter = Interference({"all_reduce": [(1e5, float(rng.uniform(1, 1.5)), float(rng.uniform(1, 2))),
                                             (1e9, float(rng.uniform(1, 1.5)), float(rng.uniform(1, 2)))]})
        comm = priced(alpha, bw)
        assert ddp_overhead(s, comm, inter) == pytest.approx(_ddp_by_timeline(s, comm, inter), rel=1e-9, abs=1e-6)


def test_fsdp_exposes_the_first_gather_and_the_last_reduce_scatter() -> None:
    s = _shape(layer_us=3000.0)  # a layer computes longer than its gather (1.36 ms) takes
    none = Interference()

    def copy(phase: str, nbytes: float) -> float:
        return 0.0

    f3, b3 = fsdp_overhead(s, _comm, none, reshard=True, gather_ratio=1.0, reduce_ratio=1.0, copy_us=copy)
    f2, b2 = fsdp_overhead(s, _comm, none, reshard=False, gather_ratio=1.0, reduce_ratio=1.0, copy_us=copy)
    root = 2 * (400 << 20) + (1 << 12)
    # the root's gather and the first layer's (queued behind it) are exposed; later layers' hide behind compute
    assert f3 == pytest.approx(_comm("all_gather", root) + _comm("all_gather", 256 << 20) - s.fwd_embed_us)
    assert f2 == f3
    assert b3 >= b2 >= _comm("reduce_scatter", root) * 0.99  # the root's reduce-scatter is last and exposed
    slow = _shape(layer_us=300.0)  # now every gather waits: the exposed time grows with the layers
    fs, _ = fsdp_overhead(slow, _comm, none, reshard=True, gather_ratio=1.0, reduce_ratio=1.0, copy_us=copy)
    assert fs > f3 + 3 * (_comm("all_gather", 256 << 20) - 300.0) * 0.9
    _, b32 = fsdp_overhead(s, _comm, none, reshard=True, gather_ratio=1.0, reduce_ratio=2.0, copy_us=copy)
    assert b32 > b3  # fp32 reduction of half-precision gradients moves twice the bytes


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (3, 5)])
def test_one_f_one_b_matches_the_textbook_formula_when_balanced(pp: int, m: int) -> None:
    t = pipeline_time([1.0] * pp, [2.0] * pp, pp, m, PipeSchedule.ONE_F_ONE_B, 0.0)
    assert t == pytest.approx((m + pp - 1) * 3.0)
    g = pipeline_time([1.0] * pp, [2.0] * pp, pp, m, PipeSchedule.GPIPE, 0.0)
    assert g == pytest.approx((m + pp - 1) * 3.0)


def _simulated(fwd: list[float], bwd: list[float], pp: int, m: int, schedule: PipeSchedule, p2p: float) -> float:
    """The schedule as a plain event simulation: each rank runs its actions in order, each as soon as the rank
    is free and its input has arrived (the reference the engine's precompiled order must equal)."""
    acts = [schedule_actions(r, pp, m, schedule) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    clock, pos = [0.0] * pp, [0] * pp
    while any(pos[r] < len(acts[r]) for r in range(pp)):
        before = sum(pos)
        for r in range(pp):
            while pos[r] < len(acts[r]):
                kind, s, i = acts[r][pos[r]]
                last = s == len(fwd) - 1
                dep = (done.get(("F", s - 1, i)) if s else 0.0) if kind == "F" else \
                    (done.get(("F", s, i)) if last else done.get(("B", s + 1, i)))
                if dep is None:
                    break
                hop = p2p if (kind == "F" and s) or (kind == "B" and not last) else 0.0
                clock[r] = max(clock[r], dep + hop) + (fwd[s] if kind == "F" else bwd[s])
                done[(kind, s, i)] = clock[r]
                pos[r] += 1
        if sum(pos) == before:
            raise RuntimeError("deadlock")
    return max(clock)


def _completes(pp: int, m: int, schedule: PipeSchedule, n: int) -> bool:
    try:
        _simulated([1.0] * n, [1.0] * n, pp, m, schedule, 0.0)
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("schedule", list(PipeSchedule))
@pytest.mark.parametrize("pp, m", [(2, 1), (2, 7), (3, 5), (4, 8), (4, 16), (8, 3)])
def test_pipeline_time_equals_the_event_simulation(schedule: PipeSchedule, pp: int, m: int) -> None:
    rng = np.random.default_rng(pp * 100 + m)
    n = pp * (2 if schedule == PipeSchedule.INTERLEAVED else 1)
    for _ in range(3):
        fwd, bwd = list(rng.uniform(1, 100, n)), list(rng.uniform(1, 200, n))
        p2p = float(rng.uniform(0, 30))
        if not _completes(pp, m, schedule, n):  # interleaving with m not in rounds of pp can wait forever
            with pytest.raises(RuntimeError, match="deadlock"):
                pipeline_time(fwd, bwd, pp, m, schedule, p2p)
            continue
        # (GPipe and long 1F1B are timed in closed form: the same maxima of the same sums, another association)
        assert pipeline_time(fwd, bwd, pp, m, schedule, p2p) == pytest.approx(
            _simulated(fwd, bwd, pp, m, schedule, p2p), rel=1e-12)


_CLOSED_FORMS = {PipeSchedule.ONE_F_ONE_B: _one_f_one_b_periodic, PipeSchedule.GPIPE: _gpipe_longest_path}


@pytest.mark.parametrize("schedule, pp, m", [
    *((PipeSchedule.ONE_F_ONE_B, pp, m) for pp, m in [(2, 3), (2, 300), (3, 4), (4, 64), (5, 37), (8, 9), (8, 128),
                                                       (16, 40)]),
    *((PipeSchedule.GPIPE, pp, m) for pp, m in [(2, 1), (2, 300), (3, 4), (4, 64), (5, 37), (8, 9), (8, 128),
                                                 (16, 40)])])
def test_long_schedules_in_closed_form_equal_the_event_simulation(schedule: PipeSchedule, pp: int, m: int) -> None:
    """Long schedules are timed in closed form: 1F1B through the max-plus matrix of one steady period raised to
    the number of periods, GPipe as the longest path through its grid of actions in O(pp^2). Each must equal the
    plain event simulation (to float rounding), with uneven stages, a bottleneck stage in the middle (forward and
    backward) and transfers larger than a stage; and a million micro-batches must take no time (the simulation
    took minutes and gigabytes)."""
    closed = _CLOSED_FORMS[schedule]
    rng = np.random.default_rng(pp * 1000 + m + (7 if schedule == PipeSchedule.GPIPE else 0))
    for _ in range(3):
        fwd, bwd = tuple(rng.uniform(1, 100, pp)), tuple(rng.uniform(1, 200, pp))
        p2p = float(rng.uniform(0, 30))
        assert closed(fwd, bwd, pp, m, p2p) == pytest.approx(_simulated(list(fwd), list(bwd), pp, m, schedule, p2p),
                                                             rel=1e-12)
        slow = tuple(x * (5.0 if k == pp // 2 else 1.0) for k, x in enumerate(fwd))
        for f, b in ((slow, bwd), (fwd, tuple(x * (5.0 if k == pp // 2 else 1.0) for k, x in enumerate(bwd)))):
            want = _simulated(list(f), list(b), pp, m, schedule, 150.0)
            assert closed(f, b, pp, m, 150.0) == pytest.approx(want, rel=1e-12)
    assert pipeline_time([1.0] * pp, [2.0] * pp, pp, 1 << 20, schedule, 0.0) == \
        pytest.approx(((1 << 20) + pp - 1) * 3.0, rel=1e-12)


def test_interleaving_shrinks_the_bubble_of_balanced_stages() -> None:
    pp, m = 4, 8
    one = pipeline_time([2.0] * pp, [4.0] * pp, pp, m, PipeSchedule.ONE_F_ONE_B, 0.0)
    inter = pipeline_time([1.0] * 2 * pp, [2.0] * 2 * pp, pp, m, PipeSchedule.INTERLEAVED, 0.0)
    assert inter < one
    assert inter >= m * 6.0  # never below the work of one rank


@pytest.mark.parametrize("schedule", list(PipeSchedule))
def test_every_rank_runs_every_microbatch_once_each_way(schedule: PipeSchedule) -> None:
    pp, m = 4, 8
    chunks = 2 if schedule == PipeSchedule.INTERLEAVED else 1
    for r in range(pp):
        acts = schedule_actions(r, pp, m, schedule)
        for c in range(chunks):
            stage = r + c * pp
            assert sorted(i for k, s, i in acts if k == "F" and s == stage) == list(range(m))
            assert sorted(i for k, s, i in acts if k == "B" and s == stage) == list(range(m))
        assert len(acts) == 2 * m * chunks


def test_microbatches_in_flight() -> None:
    assert in_flight_microbatches(0, 4, 8, PipeSchedule.ONE_F_ONE_B) == 4
    assert in_flight_microbatches(3, 4, 8, PipeSchedule.ONE_F_ONE_B) == 1
    assert in_flight_microbatches(0, 4, 8, PipeSchedule.GPIPE) == 8
    assert in_flight_microbatches(0, 1, 8, PipeSchedule.GPIPE) == 1
    # every schedule: the most micro-batches whose forward ran and backward has not, over the rank's own actions
    # (schedule_actions, as torch.distributed.pipelining orders them), in units of the rank's whole layer range
    for sched in PipeSchedule:
        chunks = 2 if sched == PipeSchedule.INTERLEAVED else 1
        for pp, m in ((2, 2), (2, 4), (4, 4), (4, 8), (4, 6), (4, 2), (8, 24), (3, 5)):
            for r in range(pp):
                live = peak = 0
                for kind, _, _ in schedule_actions(r, pp, m, sched):
                    live += 1 if kind == "F" else -1
                    peak = max(peak, live)
                assert in_flight_microbatches(r, pp, m, sched) == peak / chunks, (sched, pp, m, r)


def test_framework_data_reads_measured_rows() -> None:
    rows = [{"framework": "torch", "kind": "tp", "setting": "bf16", "phase": ph, "quantity": q, "value_us": v,
             "ranks": 2, "status": "ok"}
            for ph, q, v in (("fwd", "extra_per_layer_us", 100.0), ("fwd", "extra_fixed_us", -5.0),
                             ("bwd", "extra_per_layer_us", 200.0))]
    rows += [{"framework": "torch", "kind": k, "setting": "bf16", "phase": "fwd", "quantity": "per_op_us",
              "value_us": v, "ranks": 2, "status": "ok"} for k, v in (("plain", 10.0), ("plain_tp_shard", 12.0))]
    fd = FrameworkData([], rows)
    e = fd.host_extra("torch", "tp", "bf16", 8)
    assert e.per_layer_us == {"fwd": 100.0, "bwd": 200.0} and e.fixed_us == {"fwd": 0.0}  # a cost is >= 0
    assert "2 ranks" in e.source
    assert fd.host_extra("torch", "tp", "amp_bf16", 2).source == "none"
    # only what was measured; without the chain probe a view is charged as any other operator
    assert fd.per_op_host_us("bf16") == {"fwd_us": 11.0, "fwd_view_us": 11.0}


def _chain_rows(machine: str, mean_us: float, view_us: float, launch_us: float, python_us: float,
                ops: float = 76.0, views: float = 38.0, chain: float = 128.0) -> list[dict[str, Any]]:
    """One instance's probe rows, closed form: the plain layer's operators cost `mean_us` each; the chains' add
    `chain` operators a layer issued by one loop (`python_us` each) costing `view_us` or `launch_us` beyond it."""
    plain_layer = mean_us * ops

    def row(kind: str, q: str, v: float) -> dict[str, Any]:
        return {"framework": "torch", "kind": kind, "setting": "bf16", "phase": "fwd", "quantity": q, "value_us": v,
                "ranks": 1, "status": "ok", "machine": machine}

    return [row("plain", "per_op_us", mean_us), row("plain", "per_layer_ops", ops),
            row("plain", "per_layer_views", views), row("plain", "per_layer_us", plain_layer),
            row("chain_views", "per_layer_us", plain_layer + chain * (python_us + view_us)),
            row("chain_views", "per_layer_ops", ops + chain), row("chain_views", "per_layer_views", views + chain),
            row("chain_launches", "per_layer_us", plain_layer + chain * (python_us + launch_us)),
            row("chain_launches", "per_layer_ops", ops + chain), row("chain_launches", "per_layer_views", views)]


def test_views_cost_the_host_less_than_launching_operators() -> None:
    """The chain probe's two slopes give what a launch costs beyond a view (d), as a fraction of the instance's
    plain per-operator cost: a view is charged mean - (1 - s) d, a launching operator mean + s d, so the plain
    layer's mix costs its measured mean; the loop's own Python cancels out of d."""
    rows = _chain_rows("a", mean_us=10.0, view_us=1.0, launch_us=6.0, python_us=2.0)  # d = 5 = 0.5 x mean
    rows += _chain_rows("b", mean_us=20.0, view_us=2.0, launch_us=8.0, python_us=4.0)  # d = 6 = 0.3 x mean
    fd = FrameworkData([], rows)
    f, s = fd.on("a").launch_split("bf16", "fwd")
    assert f == pytest.approx(0.5) and s == pytest.approx(0.5)
    a = fd.on("a").per_op_host_us("bf16")
    assert a["fwd_us"] == pytest.approx(12.5) and a["fwd_view_us"] == pytest.approx(7.5)
    assert (a["fwd_us"] + a["fwd_view_us"]) / 2 == pytest.approx(10.0)  # the plain layer's cost is kept
    b = fd.on("b").per_op_host_us("bf16")
    assert b["fwd_us"] - b["fwd_view_us"] == pytest.approx(6.0)
    typical = fd.per_op_host_us("bf16")  # the median fraction (0.4) of the median mean (15)
    assert typical["fwd_us"] - typical["fwd_view_us"] == pytest.approx(0.4 * 15.0)
    assert fd.launch_split("bf16", "bwd") is None
    # an instance whose launches cost more than the whole mean over the views' share: views charged 0, not less
    big = FrameworkData([], _chain_rows("c", mean_us=10.0, view_us=0.0, launch_us=40.0, python_us=1.0))
    c = big.per_op_host_us("bf16")
    assert c["fwd_view_us"] == 0.0 and c["fwd_us"] == pytest.approx(20.0)


def _with_samples(rows: list[dict[str, Any]], noise_us: float = 0.0) -> list[dict[str, Any]]:
    """The per-layer rows with the probe's samples ({layers: us}) on their line (a fixed 500 us outside the layers),
    the chains' moved by +-noise_us alternately."""
    out = []
    for r in rows:
        if r["quantity"] == "per_layer_us":
            wobble = noise_us if r["kind"] != "plain" else 0.0
            samples = {str(n): 500.0 + n * r["value_us"] + (wobble if i % 2 else -wobble)
                       for i, n in enumerate((1, 2, 4, 6, 8))}
            r = {**r, "samples_json": json.dumps(samples)}
        out.append(r)
    return out


def test_the_forward_charges_each_operator_its_own_cost_and_the_module_python_once_per_layer() -> None:
    """A loop's operators cost the host their chain slopes (8 us a launch, 3 a view here, the loop's Python in
    both); the plain layer costs more (10 us an operator): its modules' Python, once per layer. So a layer of many
    more operators is no longer charged the plain mean for each: each operator its own, the rest once per layer,
    and the plain layer still costs what it was measured to."""
    fd = FrameworkData([], _with_samples(_chain_rows("a", mean_us=10.0, view_us=1.0, launch_us=6.0, python_us=2.0)))
    lam, nu, ops, views = fd.tight_loop_costs("bf16")
    assert (lam, nu, ops, views) == (pytest.approx(0.8), pytest.approx(0.3), 76.0, 38.0)
    a = fd.per_op_host_us("bf16")
    assert a["fwd_us"] == pytest.approx(8.0) and a["fwd_view_us"] == pytest.approx(3.0)
    assert a["fwd_layer_us"] == pytest.approx(760.0 - 38 * 8.0 - 38 * 3.0)
    assert 38 * a["fwd_us"] + 38 * a["fwd_view_us"] + a["fwd_layer_us"] == pytest.approx(760.0)
    # a probe whose slopes scatter (timed variant by variant on a drifting host) keeps the mean-keeping split
    noisy = FrameworkData([], _with_samples(_chain_rows("b", 10.0, 1.0, 6.0, 2.0), noise_us=1500.0))
    assert noisy.tight_loop_costs("bf16") is None and "fwd_layer_us" not in noisy.per_op_host_us("bf16")
    assert noisy.per_op_host_us("bf16")["fwd_us"] == pytest.approx(12.5)  # launch_split's, as before
    # a view that costs nothing or less is no measurement of one (the loop's Python alone costs more)
    odd = FrameworkData([], _with_samples(_chain_rows("c", 10.0, -3.0, 6.0, 2.0)))
    assert odd.tight_loop_costs("bf16") is None
    # operators alone dearer than the plain layer (noise): scaled to it, nothing left per layer
    dear = FrameworkData([], _with_samples(_chain_rows("d", 10.0, 8.0, 14.0, 2.0)))
    d = dear.per_op_host_us("bf16")
    assert d["fwd_layer_us"] == 0.0 and 38 * d["fwd_us"] + 38 * d["fwd_view_us"] == pytest.approx(760.0)


def test_ddp_host_costs_are_the_same_in_every_setting() -> None:
    """DDP's hooks do the same host work in any dtype (as FSDP2's): bf16's and amp_bf16's rows answer for both,
    their median; DTensor TP's, which dispatch per operator under autocast's casts too, stay per setting."""
    rows = [{"framework": "torch", "kind": k, "setting": st, "phase": "fwd", "quantity": "extra_per_layer_us",
             "value_us": v, "ranks": 2, "status": "ok"}
            for k in ("ddp", "tp") for st, v in (("bf16", -300.0), ("amp_bf16", 900.0))]
    fd = FrameworkData([], rows)
    assert fd.host_extra("torch", "ddp", "bf16", 2).per_layer_us == {"fwd": 300.0}
    assert fd.host_extra("torch", "ddp", "amp_bf16", 2).per_layer_us == {"fwd": 300.0}
    assert fd.host_extra("torch", "tp", "bf16", 2).per_layer_us == {"fwd": 0.0}
    assert fd.host_extra("torch", "tp", "amp_bf16", 2).per_layer_us == {"fwd": 900.0}


def test_host_costs_come_from_one_machine_instance() -> None:
    """Each instance keeps its rows; by default each cost is the median over the instances that measured it
    (the typical host), one instance on request; a kind the chosen instance did not measure comes from the
    median of those that did."""
    def row(kind: str, q: str, v: float, machine: str | None) -> dict[str, object]:
        return {"framework": "torch", "kind": kind, "setting": "bf16", "phase": "fwd", "quantity": q,
                "value_us": v, "ranks": 2, "status": "ok", "machine": machine}

    rows = [row("tp", "extra_per_layer_us", v, m) for v, m in ((600.0, None), (300.0, "mA"), (200.0, "mB"))]
    rows += [row("ddp", "extra_per_layer_us", v, m) for v, m in ((50.0, "mA"), (70.0, "mB"))]
    # an instance's plain variants are averaged (mA: 7, 9 -> 8); the typical host is the default
    rows += [row("plain", "per_op_us", 20.0, None), row("plain", "per_op_us", 7.0, "mA"),
             row("plain_tp_shard", "per_op_us", 9.0, "mA"), row("plain", "per_op_us", 12.0, "mB")]
    fd = FrameworkData([], rows)
    assert fd.machines() == ["first", "mA", "mB"]
    by_speed = [i["machine"] for i in sorted(fd.instances(), key=lambda i: -i["per_op_us"])]
    assert by_speed[0] == "first" and by_speed[-1] == "mA"
    assert fd.per_op_host_us("bf16") == {"fwd_us": 12.0, "fwd_view_us": 12.0}  # the median of 20, 8 and 12
    assert fd.host_extra("torch", "tp", "bf16", 2).per_layer_us == {"fwd": 300.0}
    assert "median of 3 machines" in fd.host_extra("torch", "tp", "bf16", 2).source
    ddp = fd.host_extra("torch", "ddp", "bf16", 2)  # only mA and mB measured DDP: their median
    assert ddp.per_layer_us == {"fwd": 60.0} and "median of 2 machines" in ddp.source
    assert fd.on("first").per_op_host_us("bf16") == {"fwd_us": 20.0, "fwd_view_us": 20.0}
    assert "machine first" in fd.on("first").host_extra("torch", "tp", "bf16", 2).source
    assert fd.on("first").host_extra("torch", "ddp", "bf16", 2).per_layer_us == {"fwd": 60.0}
    # the typical host of the others: mA left out
    assert fd.without("mA").per_op_host_us("bf16") == {"fwd_us": 16.0, "fwd_view_us": 16.0}
    assert fd.on("mA").per_op_host_us("bf16") == {"fwd_us": 8.0, "fwd_view_us": 8.0}
    assert fd.on("mA").host_extra("torch", "ddp", "bf16", 2).per_layer_us == {"fwd": 50.0}
    assert "machine mB" in fd.on("mB").host_extra("torch", "tp", "bf16", 2).source
    with pytest.raises(ValueError, match="no host measurements of machine"):
        fd.on("mZ")


def test_grad_scaler_step_is_the_amp_fp16_optimizer_fixed_cost_over_amp_bf16() -> None:
    """GradScaler's host step per instance: the plain model's fixed optimizer host time under amp_fp16 less under
    amp_bf16 (never negative); the typical host takes the median over instances that measured both, a chosen
    instance its own where it has both; none measured: None."""
    def row(setting: str, v: float, machine: str, phase: str = "opt", q: str = "fixed_us") -> dict[str, object]:
        return {"framework": "torch", "kind": "plain", "setting": setting, "phase": phase, "quantity": q,
                "value_us": v, "ranks": 1, "status": "ok", "machine": machine}

    rows = [row("amp_bf16", 500.0, "mA"), row("amp_fp16", 580.0, "mA"),
            row("amp_bf16", 600.0, "mB"), row("amp_fp16", 640.0, "mB"),
            row("amp_bf16", 700.0, "mC"), row("amp_fp16", 650.0, "mC"),  # noise below 0: none
            row("amp_bf16", 400.0, "mD"),  # only one setting: not counted
            row("amp_fp16", 9000.0, "mA", q="per_op_us"), row("amp_fp16", 9000.0, "mB", phase="fwd")]
    fd = FrameworkData([], rows)
    assert fd.grad_scaler_step_us() == pytest.approx(40.0)  # median of 80, 40 and 0
    assert fd.on("mA").grad_scaler_step_us() == pytest.approx(80.0)
    assert fd.on("mD").grad_scaler_step_us() == pytest.approx(40.0)  # mD has no amp_fp16 rows: the median
    assert FrameworkData([], rows[:1]).grad_scaler_step_us() is None


def test_fsdp_copy_kernels_are_measured_lines_and_no_host_instance() -> None:
    """FSDP2's copy kernels come from the copies campaign: a line in the unit's MiB for the nearest world size
    and the element size's dtype, the median over the instances that measured it; the rows are GPU work and
    do not make an instance of the host-cost table."""
    def row(phase: str, setting: str, ranks: int, q: str, v: float, machine: str) -> dict[str, object]:
        return {"framework": "torch", "kind": "fsdp_copy", "setting": setting, "phase": phase, "quantity": q,
                "value_us": v, "ranks": ranks, "status": "ok", "machine": machine}

    rows = [row("copy_out", "bf16", 2, "us_per_mib", 0.5, "m1"), row("copy_out", "bf16", 2, "fixed_us", 40.0, "m1"),
            row("copy_out", "bf16", 2, "us_per_mib", 0.7, "m2"), row("copy_out", "bf16", 2, "fixed_us", 20.0, "m2"),
            row("copy_out", "bf16", 8, "us_per_mib", 0.1, "m1"), row("copy_out", "bf16", 8, "fixed_us", 0.0, "m1"),
            row("copy_out", "fp32", 2, "us_per_mib", 1.0, "m1"), row("copy_out", "fp32", 2, "fixed_us", 0.0, "m1"),
            {"framework": "torch", "kind": "plain", "setting": "bf16", "phase": "fwd", "quantity": "per_op_us",
             "value_us": 10.0, "ranks": 2, "status": "ok", "machine": "h1"}]
    fd = FrameworkData([], rows)
    mib = 2**20
    assert fd.fsdp_copy_us("copy_out", 100 * mib, 2, 2) == pytest.approx(30.0 + 0.6 * 100)  # medians of m1, m2
    assert fd.fsdp_copy_us("copy_out", 100 * mib, 2, 4) == pytest.approx(30.0 + 0.6 * 100)  # 4: nearest is 2
    assert fd.fsdp_copy_us("copy_out", 100 * mib, 2, 8) == pytest.approx(10.0)
    assert fd.fsdp_copy_us("copy_out", 100 * mib, 4, 2) == pytest.approx(100.0)  # fp32 elements: the fp32 line
    assert fd.fsdp_copy_us("copy_in", 100 * mib, 2, 2) is None
    assert fd.machines() == ["h1"] and fd.on("h1").copies == fd.copies
    # copy_in moves the rank's shard: beyond the world sizes measured, its slope falls as 1/ranks
    fd = FrameworkData([], [*rows, row("copy_in", "bf16", 8, "us_per_mib", 0.1, "m1"),
                            row("copy_in", "bf16", 8, "fixed_us", 8.0, "m1")])
    assert fd.fsdp_copy_us("copy_in", 100 * mib, 2, 8) == pytest.approx(8.0 + 0.1 * 100)
    assert fd.fsdp_copy_us("copy_in", 100 * mib, 2, 64) == pytest.approx(8.0 + 0.1 * 100 * 8 / 64)
    assert fd.fsdp_copy_us("copy_out", 100 * mib, 2, 64) == pytest.approx(10.0)  # the whole unit at any size


def test_a_shifted_host_map_equals_the_map_of_the_shifted_costs() -> None:
    """A framework's host extra shifts every operator's host cost of a stage by one delta; the envelope of the
    unshifted scan must give host_map's answer at any delta (with syncs, idle GPU stretches, one operator)."""
    rng = np.random.default_rng(7)
    for t in range(60):
        n = int(rng.integers(1, 300))
        g = rng.exponential(20.0, n) * (rng.random(n) < 0.9)
        h = rng.uniform(2.0, 30.0, n)
        sync = rng.random(n) < (0.02 if t % 2 else 0.0)
        shifted = ShiftedHostMap(g, h, sync)
        # a map's first reads take the lines directly, later ones its hull (HULL_AFTER): both at every delta
        deltas = (0.0, 1e-9, 0.7, 5.0, 33.0, 1e4)
        assert 1 < ShiftedHostMap.HULL_AFTER <= len(deltas)
        for d in deltas:
            want = host_map(g, h + d, sync)
            for got in (ShiftedHostMap(g, h, sync).at(d), shifted.at(d)):
                for x, y in zip(got, want, strict=True):
                    assert x == y if y == float("-inf") else x == pytest.approx(y, rel=1e-12)
