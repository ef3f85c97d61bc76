"""Interpolation against synthetic tables from closed-form physics, where the answers are known."""

from __future__ import annotations

import math
from typing import Any

import pytest
from tp_query.engine.lookup import LatencyModel, Query, Source, roofline_us
from tp_query.schema.gpus import H200
from tp_query.schema.ops import describe, gemm_layout_call
from tp_query.schema.precision import DType, Precision
from tp_query.schema.signature import OpCall, TensorSpec, call_key

PEAK = H200.peak_flops[Precision.BF16]


def power_law_us(m: int, n: int, k: int) -> float:
    """A latency that is a pure power law in m, n, k: log-multilinear interpolation is exact."""
    return 3.0 * (m / 1024) ** 0.9 * (n / 1024) ** 1.0 * (k / 1024) ** 1.1


def compute_bound_us(m: int, n: int, k: int) -> float:
    """70% of peak: holding efficiency against the roofline extrapolates exactly."""
    return 2.0 * m * n * k / (0.7 * PEAK) * 1e6


class FakeDb:
    """The PointSource protocol over an in-memory table (no DuckDB needed for the algebra)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def exact_all(self) -> dict[str, tuple[float, float | None]]:
        return {r["key"]: (r["latency_us"], r["latency_warm_us"]) for r in self.rows}

    def family_rows(self, family: str, columns: list[str]) -> list[dict[str, Any]]:
        return [{c: r.get(c) for c in columns} for r in self.rows if r["family"] == family]


def table(law: Any, values: tuple[int, ...], dtype: DType = DType.BF16) -> FakeDb:
    rows = []
    for m in values:
        for n in values:
            for k in values:
                call = gemm_layout_call(m, n, k, "nt", dtype)
                info = describe(call, False)
                t = law(m, n, k)
                rows.append({"key": call_key(call.op, call.to_json_str(), info.math_mode), "op": call.op,
                             "family": "gemm", "precision": str(info.precision), "math_mode": "", "dtypes": info.dtypes,
                             "flops": info.flops, "bytes": info.bytes, "latency_us": t, "latency_warm_us": t * 0.9,
                             **info.features})
    return FakeDb(rows)


def query(m: int, n: int, k: int, layout: str = "nt", dtype: DType = DType.BF16) -> Query:
    call = gemm_layout_call(m, n, k, layout, dtype)
    info = describe(call, False)
    return Query(call_key(call.op, call.to_json_str(), info.math_mode), call.op, info)


GRID = (512, 1024, 2048, 4096, 8192)


def test_exact_hit() -> None:
    lm = LatencyModel(table(power_law_us, GRID), H200)
    e = lm.estimate([query(1024, 2048, 4096)])[query(1024, 2048, 4096).key]
    assert e.source == Source.EXACT
    assert e.cold_us == pytest.approx(power_law_us(1024, 2048, 4096))
    assert e.warm_us == pytest.approx(0.9 * power_law_us(1024, 2048, 4096))


@pytest.mark.parametrize("mnk", [(1536, 3000, 5000), (704, 8000, 1096), (4104, 4088, 2056)])
def test_bracket_and_blend_is_exact_for_power_laws(mnk: tuple[int, int, int]) -> None:
    lm = LatencyModel(table(power_law_us, GRID), H200)
    q = query(*mnk)
    e = lm.estimate([q])[q.key]
    assert e.source == Source.INTERPOLATED
    assert e.cold_us == pytest.approx(power_law_us(*mnk), rel=1e-9)


def test_roofline_hold_extrapolates_compute_bound_exactly() -> None:
    lm = LatencyModel(table(compute_bound_us, GRID), H200)
    q = query(16384, 16384, 16384)
    e = lm.estimate([q])[q.key]
    assert e.source == Source.EXTRAPOLATED
    assert e.cold_us == pytest.approx(compute_bound_us(16384, 16384, 16384), rel=1e-6)


def test_unaligned_shapes_are_their_own_category() -> None:
    """cuBLAS runs slower kernels when a leading dimension is not a multiple of 8: an unaligned query is
    not blended from aligned points as if they were comparable; it is held, and labelled so."""
    lm = LatencyModel(table(power_law_us, GRID), H200)
    q = query(4097, 4095, 2049)
    assert lm.estimate([q])[q.key].source == Source.EXTRAPOLATED


def test_only_leading_dimensions_decide_alignment() -> None:
    """A row count that is no multiple of 8 (an MoE expert's routed tokens) is not a leading dimension in
    "nt": the query blends among the aligned points; an unaligned reduction dimension (a row stride) does not."""
    lm = LatencyModel(table(power_law_us, GRID), H200)
    rows = query(1756, 2048, 2048)
    e = lm.estimate([rows])[rows.key]
    assert e.source == Source.INTERPOLATED
    assert e.cold_us == pytest.approx(power_law_us(1756, 2048, 2048), rel=0.05)
    stride = query(2048, 2048, 1756)
    assert lm.estimate([stride])[stride.key].source == Source.EXTRAPOLATED


def test_other_layout_is_a_relaxed_category() -> None:
    lm = LatencyModel(table(compute_bound_us, GRID), H200)
    q = query(2048, 2048, 2048, layout="tn")
    e = lm.estimate([q])[q.key]
    assert e.source == Source.EXTRAPOLATED  # same op and dtypes, another layout: held, and said so
    assert e.cold_us == pytest.approx(compute_bound_us(2048, 2048, 2048), rel=1e-6)


def test_structured_miss_and_no_kernel() -> None:
    lm = LatencyModel(table(power_law_us, GRID), H200)
    t = TensorSpec((1 << 20,), DType.BF16)
    call = OpCall("aten.sigmoid.default", (t,))
    info = describe(call, False)
    view = OpCall("aten.view.default", (t, [1024, 1024]))
    vinfo = describe(view, False)
    qs = [Query("s", call.op, info), Query("v", view.op, vinfo)]
    res = lm.estimate(qs)
    assert res["s"].source == Source.MISS
    assert res["s"].cold_us == pytest.approx(roofline_us(info.flops, info.bytes, info.precision, H200) / 0.5)
    assert res["v"].source == Source.NO_KERNEL and res["v"].cold_us == 0.0


def test_one_dimensional_elementwise_blend() -> None:
    rows = []
    for e in range(12, 28, 2):
        n = 2 ** e
        call = OpCall("aten.mul.Tensor", (TensorSpec((n,), DType.BF16), TensorSpec((n,), DType.BF16)))
        info = describe(call, False)
        t = 2.0 + info.bytes / 3e12 * 1e6
        rows.append({"key": f"k{e}", "op": call.op, "family": "elementwise", "precision": "bf16", "math_mode": "",
                     "dtypes": info.dtypes, "flops": info.flops, "bytes": info.bytes, "latency_us": t,
                     "latency_warm_us": t, **info.features})
    lm = LatencyModel(FakeDb(rows), H200)
    n = 3 * 2**20
    call = OpCall("aten.mul.Tensor", (TensorSpec((n,), DType.BF16), TensorSpec((n,), DType.BF16)))
    info = describe(call, False)
    e = lm.estimate([Query("q", call.op, info)])["q"]
    exact = 2.0 + info.bytes / 3e12 * 1e6
    assert e.source == Source.INTERPOLATED
    assert e.cold_us == pytest.approx(exact, rel=1e-9)  # linear blend of an affine law: exact
    assert math.isfinite(e.warm_us)


def test_same_operator_in_another_precision_before_a_miss() -> None:
    """An fp32 call of an operator measured only in bf16 (the vocab-parallel loss's amax over fp32 logits):
    the bf16 points' efficiency against their roofline, held at the same axes and said to be extrapolated,
    not the family's median efficiency (which put it at 4x a real step's time). A kernel at a fixed fraction
    of HBM bandwidth moves fp32 bytes as it moved bf16 ones: exact."""
    rows = []
    for e in range(16, 28, 2):
        n = 2 ** e
        call = OpCall("aten.mul.Tensor", (TensorSpec((n,), DType.BF16), TensorSpec((n,), DType.BF16)))
        info = describe(call, False)
        t = info.bytes / 3e12 * 1e6
        rows.append({"key": f"k{e}", "op": call.op, "family": "elementwise", "precision": "bf16", "math_mode": "",
                     "dtypes": info.dtypes, "flops": info.flops, "bytes": info.bytes, "latency_us": t,
                     "latency_warm_us": t, **info.features})
    lm = LatencyModel(FakeDb(rows), H200)
    n = 3 * 2**22  # above the roofline's floor
    call = OpCall("aten.mul.Tensor", (TensorSpec((n,), DType.FP32), TensorSpec((n,), DType.FP32)))
    info = describe(call, False)
    e = lm.estimate([Query("q", call.op, info)])["q"]
    assert e.source == Source.EXTRAPOLATED
    assert e.cold_us == pytest.approx(info.bytes / 3e12 * 1e6, rel=1e-9)
    other = OpCall("aten.sigmoid.default", (TensorSpec((n,), DType.FP32),))
    assert lm.estimate([Query("s", other.op, describe(other, False))])["s"].source == Source.MISS


def test_integer_points_of_an_operator_never_price_its_float_calls() -> None:
    """aten.gt.Tensor measured only on int64 mask building (broadcast aranges whose output grows as the square of
    their inputs: latency quadratic in the inputs' numel) and called on a bf16 activation against a scalar (Apertus'
    xIELU backward): the integer points' slowdown extrapolated to 58 M elements had priced it at 15 ms (the
    roofline is 36 us). Integer and float calls of one name are different kernel classes: a structured miss at the
    family's typical efficiency, never the integer trend."""
    rows = []
    for e in range(11, 15):
        n = 2 ** e
        call = OpCall("aten.gt.Tensor", (TensorSpec((1, n), DType.I64), TensorSpec((n, 1), DType.I64)))
        info = describe(call, False)
        t = 13.66 * (n / 2048) ** 2  # the broadcast output's n^2 elements, which the inputs' features do not see
        rows.append({"key": f"k{e}", "op": call.op, "family": "elementwise", "precision": "int", "math_mode": "",
                     "dtypes": info.dtypes, "flops": info.flops, "bytes": info.bytes, "latency_us": t,
                     "latency_warm_us": t, **info.features})
    for e in range(16, 32, 2):  # the family's other points: bf16 multiplies at 3 TB/s (its typical efficiency)
        n = 2 ** e
        call = OpCall("aten.mul.Tensor", (TensorSpec((n,), DType.BF16), TensorSpec((n,), DType.BF16)))
        info = describe(call, False)
        rows.append({"key": f"m{e}", "op": call.op, "family": "elementwise", "precision": "bf16", "math_mode": "",
                     "dtypes": info.dtypes, "flops": info.flops, "bytes": info.bytes,
                     "latency_us": info.bytes / 3e12 * 1e6, "latency_warm_us": info.bytes / 3e12 * 1e6,
                     **info.features})
    lm = LatencyModel(FakeDb(rows), H200)
    call = OpCall("aten.gt.Tensor", (TensorSpec((1, 4096, 14336), DType.BF16), TensorSpec((), DType.BF16)))
    info = describe(call, False)
    e = lm.estimate([Query("q", call.op, info)])["q"]
    roof = roofline_us(info.flops, info.bytes, info.precision, H200)
    assert e.source == Source.MISS and e.cold_us < 10 * roof
    small = OpCall("aten.gt.Tensor", (TensorSpec((1, 3000), DType.I64), TensorSpec((3000, 1), DType.I64)))
    assert lm.estimate([Query("i", small.op, describe(small, False))])["i"].source != Source.MISS  # ints still do


def test_other_exact_features_hold_efficiency_not_latency() -> None:
    """A causal attention priced from non-causal points only (Gemma-7B's fp32 attention, whose head size the grid
    has for sliding-window masks only): the categories' work differs by half, so the efficiency against each
    one's own roofline carries over, not the latency (which put it at twice a real step's time)."""
    from tp_query.schema.ops import attention_fwd_call

    op = "aten._scaled_dot_product_efficient_attention.default"
    peak = H200.peak_flops[Precision.FP32]
    rows = []
    for h in (4, 8, 16, 32):
        for s in (1024, 2048, 4096, 8192):
            call = attention_fwd_call(op, 1, h, h, s, 256, DType.FP32, causal=False)
            info = describe(call, False)
            t = info.flops / (0.4 * peak) * 1e6  # 40% of peak
            rows.append({"key": f"a{h}-{s}", "op": op, "family": "attention", "precision": "fp32", "math_mode": "",
                         "dtypes": info.dtypes, "flops": info.flops, "bytes": info.bytes, "latency_us": t,
                         "latency_warm_us": t, **info.features})
    lm = LatencyModel(FakeDb(rows), H200)
    causal = attention_fwd_call(op, 1, 16, 16, 4096, 256, DType.FP32, causal=True)
    full = attention_fwd_call(op, 1, 16, 16, 4096, 256, DType.FP32, causal=False)
    ci, fi = describe(causal, False), describe(full, False)
    assert ci.flops == pytest.approx(fi.flops / 2)
    e = lm.estimate([Query("c", op, ci)])["c"]
    assert e.source == Source.EXTRAPOLATED
    assert e.cold_us == pytest.approx(ci.flops / (0.4 * peak) * 1e6, rel=1e-9)


def test_scattered_points_fit_a_local_power_law() -> None:
    """Between grid corners (no full bracket), log efficiency is fitted locally against the log axes: a power law
    in efficiency is recovered exactly from scattered points, where holding the nearest efficiencies flat is not;
    the value stays within the neighbours' range."""
    import random

    from tp_query.engine.lookup import Category, Point

    def eff(m: float, n: float) -> float:
        return 0.05 * m ** 0.2 * n ** 0.1

    rng = random.Random(7)
    pts = []
    for _ in range(40):  # scattered: no two points share an m or an n, so no multilinear bracket exists
        m, n = 2 ** rng.uniform(8, 14), 2 ** rng.uniform(8, 14)
        roof = m * n * 1e-6
        pts.append(Point((m, n), roof / eff(m, n), roof / eff(m, n), roof))
    cat = Category(pts, log_space=True)
    q = (2 ** 11.3, 2 ** 10.7)
    assert cat.inside(q) and cat.multilinear(q) is None
    roof_q = q[0] * q[1] * 1e-6
    cold, warm, src, n = cat.estimate(q, roof_q)
    assert src == Source.INTERPOLATED and n == Category.MLS_K
    assert cold == pytest.approx(roof_q / eff(*q), rel=1e-3) and warm == pytest.approx(cold, rel=1e-12)
    nearest = cat.nearest(q, 1)[0][1]  # holding the nearest point's efficiency misses the slope
    assert abs(roof_q / nearest.eff_cold - roof_q / eff(*q)) > 10 * abs(cold - roof_q / eff(*q))
    # held within the neighbours' efficiencies: a query beside the points never gets a steeper value than theirs
    e = cat.local_linear((2 ** 8.01, 2 ** 13.99))
    assert e is not None
    effs = [p.eff_cold for p in pts]
    assert min(effs) <= e[0] <= max(effs)
    # linear-space families (bytes moved) keep the inverse-distance blend
    lin = Category(pts, log_space=False)
    assert lin.estimate(q, roof_q)[3] == 4


def test_nearest_points_are_those_of_the_plain_distance_loop() -> None:
    """The nearest points, by log distance, are those a loop over every point finds: the same distances to the
    last bit, the same order, and the first of equally near points first (a grid has many ties)."""
    import math as m_

    from tp_query.engine.lookup import Category, Point, _logs

    pts = [Point((float(2 ** a), float(2 ** b), float(3 ** c)), 1.0 + a, 1.0 + b, 1.0) for a in range(6)
           for b in range(5) for c in range(3)]
    cat = Category(pts, log_space=True)
    for q in ((2.0 ** 2.5, 2.0 ** 1.5, 3.0), (1.0, 1.0, 1.0), (2.0 ** 9, 3.0, 3.0 ** 1.5), (5.0, 7.0, 11.0)):
        lq = _logs(q)
        loop = sorted(((m_.sqrt(sum((a - b) ** 2 for a, b in zip(cat._log_axes[p.axes], lq, strict=True))), i)
                       for i, p in enumerate(cat.points)), key=lambda t: t[0])
        for k in (1, 4, len(pts)):
            got = cat.nearest(q, k)
            assert [d for d, _ in got] == [d for d, _ in loop[:k]]
            assert [p for _, p in got] == [cat.points[i] for _, i in loop[:k]]
    assert Category([], log_space=True).nearest((1.0, 2.0), 4) == []


def test_attention_seed_scalars_do_not_split_a_category() -> None:
    """The collector's attention backward holds the RNG seed and offset on the device, a traced step's on the host:
    a traced call is still priced from the grid's points of its category (interpolated between two sequence
    lengths of a closed-form quadratic law, not held from elsewhere)."""
    from tp_query.schema.ops import attention_bwd_call

    op = "aten._scaled_dot_product_efficient_attention.default"
    rows = []
    for s in (1024, 2048, 4096, 8192):
        for h in (8, 16, 32):
            call = attention_bwd_call(op, 1, h, h, s, 128, DType.FP32, True)
            info = describe(call, False)
            assert info.dtypes == "fp32,i64"
            t = 0.1 * h * s * s / 1024  # (above fp32's compute peak for these FLOPs, as any real kernel)
            rows.append({"key": call_key(call.op, call.to_json_str(), info.math_mode), "op": call.op,
                         "family": "attention", "precision": "fp32", "math_mode": "", "dtypes": info.dtypes,
                         "flops": info.flops, "bytes": info.bytes, "latency_us": t, "latency_warm_us": t,
                         **{k: v for k, v in info.features.items() if not k.startswith("_")}})
    traced = attention_bwd_call(op, 1, 16, 16, 2896, 128, DType.FP32, True)
    seed = TensorSpec((), DType.I64, host=True)
    traced = OpCall(traced.op, tuple(seed if isinstance(a, TensorSpec) and a.dtype == DType.I64 else a
                                     for a in traced.args), traced.kwargs)
    info = describe(traced, False)
    assert info.dtypes == "fp32"
    q = Query(call_key(traced.op, traced.to_json_str(), info.math_mode), traced.op, info)
    e = LatencyModel(FakeDb(rows), H200).estimate([q])[q.key]
    assert e.source == Source.INTERPOLATED
    assert e.cold_us == pytest.approx(0.1 * 16 * 2896 ** 2 / 1024, rel=0.02)


def test_a_padded_view_is_its_own_gemm_category() -> None:
    """Attention with sinks reads its probabilities as a view of rows of seq + 1 scores: an odd row pitch, which
    cuBLAS runs on its unaligned kernels. Its layout says so (`/ua`, unaligned); a contiguous or plainly transposed
    operand of the same shape keeps the layout its dimensions give, and an odd-vocabulary GEMM keeps its dimension
    rule (no `/ua`: its pitch is its own dimension)."""
    p = TensorSpec((64, 4096, 4096), DType.BF16, (4096 * 4097, 4097, 1))
    v = TensorSpec((64, 4096, 64), DType.BF16)
    padded = describe(OpCall("aten.bmm.default", (p, v)), False)
    plain = describe(OpCall("aten.bmm.default", (TensorSpec((64, 4096, 4096), DType.BF16), v)), False)
    pt = TensorSpec((64, 4096, 4096), DType.BF16, (4096 * 4097, 1, 4097))  # its transpose (the backward's dV)
    padded_t = describe(OpCall("aten.bmm.default", (pt, TensorSpec((64, 4096, 64), DType.BF16))), False)
    transposed = describe(OpCall("aten.bmm.default", (TensorSpec((64, 4096, 4096), DType.BF16, (4096 * 4096, 1, 4096)),
                                                      v)), False)
    assert padded.features["layout"] == "nn/ua" and plain.features["layout"] == "nn"
    assert padded_t.features["layout"] == "tn/ua" and transposed.features["layout"] == "tn"
    from tp_query.schema.ops import FAMILIES, Family

    spec = FAMILIES[Family.GEMM]
    assert spec.exact_key(padded.features) != spec.exact_key(plain.features)
    vocab = describe(gemm_layout_call(4096, 50257, 768, "nt", DType.BF16), False)
    assert "/ua" not in vocab.features["layout"]
    lm = LatencyModel(table(power_law_us, GRID), H200)  # aligned points only: a padded query is held, and said so
    q = Query("padded", "aten.mm.default", describe(OpCall("aten.mm.default", (
        TensorSpec((2048, 2048), DType.BF16, (2049, 1)), TensorSpec((2048, 2048), DType.BF16))), False))
    assert lm.estimate([q])["padded"].source == Source.EXTRAPOLATED


def _attn_row(call: OpCall, t: float) -> dict[str, Any]:
    info = describe(call, False)
    return {"key": call_key(call.op, call.to_json_str(), info.math_mode), "op": call.op, "family": "attention",
            "precision": str(info.precision), "math_mode": info.math_mode, "dtypes": info.dtypes, "flops": info.flops,
            "bytes": info.bytes, "latency_us": t, "latency_warm_us": t, **info.features}


def _masked(call: OpCall, s: int) -> OpCall:
    """The call with an additive [1, 1, s, s] mask (a sliding window) in place of is_causal."""
    mask = TensorSpec((1, 1, s, s), DType.BF16)
    args = list(call.args)
    args[3], args[6] = mask, False
    return OpCall(call.op, tuple(args), call.kwargs)


def test_a_missing_feature_moves_the_nearest_category_by_its_measured_ratio() -> None:
    """cuDNN attention with dropout and a sliding-window mask, measured with neither together: the masked
    category without dropout, times what dropout costs where both were measured (x2 here, in closed form). Pooling
    the operator's every category held the median efficiency of the causal, unmasked points against the masked
    call's full roofline: faster than the same call without dropout (0.76x on the H200 database)."""
    from tp_query.schema.ops import attention_fwd_call

    op = "aten._scaled_dot_product_cudnn_attention.default"
    peak = H200.peak_flops[Precision.BF16]
    rows = []
    for h in (8, 16, 32, 64):
        for s in (1024, 2048, 4096, 8192):
            for p in (0.0, 0.1):  # head size 64, causal: 60% of peak, dropout twice the time
                call = attention_fwd_call(op, 1, h, h, s, 64, DType.BF16, True, p)
                rows.append(_attn_row(call, describe(call, False).flops / (0.6 * peak) * 1e6 * (2.0 if p else 1.0)))
            for d in (64, 128):  # causal, no dropout, as many points as the masked ones: the pool's median is theirs
                call = attention_fwd_call(op, 1, h, h, s, d, DType.BF16, True)
                rows.append(_attn_row(call, describe(call, False).flops / (0.6 * peak) * 1e6))
            masked = _masked(attention_fwd_call(op, 1, h, h, s, 128, DType.BF16, False), s)
            rows.append(_attn_row(masked, describe(masked, False).flops / (0.3 * peak) * 1e6))  # every tile, 30%
    lm = LatencyModel(FakeDb(rows), H200)
    plain = _masked(attention_fwd_call(op, 1, 32, 32, 4096, 128, DType.BF16, False), 4096)
    dropped = _masked(attention_fwd_call(op, 1, 32, 32, 4096, 128, DType.BF16, False, 0.1), 4096)
    pi, di = describe(plain, False), describe(dropped, False)
    assert di.features["masked"] and di.features["dropout"] and not di.features["causal"]
    q0, q1 = (Query(call_key(op, c.to_json_str(), i.math_mode), op, i) for c, i in ((plain, pi), (dropped, di)))
    e0, e1 = lm.estimate([q0])[q0.key], lm.estimate([q1])[q1.key]
    assert e0.source == Source.EXACT and e1.source == Source.EXTRAPOLATED
    assert e1.cold_us == pytest.approx(2.0 * e0.cold_us, rel=1e-9)


def test_cudnn_backward_grid_points_reach_traced_calls() -> None:
    """The grid's cuDNN backward passes empty int32 cumulative sequence lengths, a traced step None: the same
    kernel, one category (the grid's dropout points were out of a traced call's reach)."""
    from tp_query.schema.ops import attention_bwd_call

    op = "aten._scaled_dot_product_cudnn_attention.default"
    grid = attention_bwd_call(op, 1, 16, 16, 2048, 128, DType.BF16, True)
    args = list(grid.args)
    args[9] = args[10] = None
    traced = OpCall(grid.op, tuple(args), grid.kwargs)
    from tp_query.engine.lookup import _category_dtypes
    from tp_query.schema.ops import Family

    gi, ti = describe(grid, False), describe(traced, False)
    assert gi.dtypes != ti.dtypes
    assert _category_dtypes(Family.ATTENTION, gi.dtypes) == _category_dtypes(Family.ATTENTION, ti.dtypes)


def test_a_half_precision_past_its_grid_takes_the_other_halfs_bracketing_points() -> None:
    """fp16 and bf16 run on the same tensor cores: an fp16 GEMM past fp16's measured range (a 262k-vocab LM head
    past a grid that stops at 152k) blends bf16's bracketing points, not fp16's held efficiency, and says it is
    extrapolated; inside its own grid fp16 keeps its own points."""
    law_bf16, law_fp16 = power_law_us, (lambda m, n, k: 1.02 * power_law_us(m, n, k))
    rows = table(law_bf16, GRID).rows + table(law_fp16, GRID[:3], DType.FP16).rows  # fp16 up to 2048 only
    lm = LatencyModel(FakeDb(rows), H200)
    far = query(1024, 6000, 3000, dtype=DType.FP16)  # (all multiples of 8)
    e = lm.estimate([far])[far.key]
    assert e.source == Source.EXTRAPOLATED and e.cold_us == pytest.approx(power_law_us(1024, 6000, 3000), rel=1e-9)
    near = query(704, 1496, 1096, dtype=DType.FP16)
    e = lm.estimate([near])[near.key]
    assert e.source == Source.INTERPOLATED and e.cold_us == pytest.approx(law_fp16(704, 1496, 1096), rel=1e-9)


def test_inside_every_axis_but_past_the_largest_work_measured_is_extrapolated() -> None:
    """A FLOP-capped, scattered grid spans each axis apart: a call inside every axis's range can still do more work
    than any point measured (a 4096 x 131072 x 131072 GEMM against points that stop at 32768 on two axes). Its
    efficiency is carried past the data, so it is labelled extrapolated (the warning and --strict count it); a
    call within the measured work stays interpolated."""
    from tp_query.engine.lookup import Category, Point

    pts = [Point((m, n), m * n * 1e-6 / 0.5, m * n * 1e-6 / 0.5, m * n * 1e-6)
           for m, n in ((2 ** 8, 2 ** 14), (2 ** 14, 2 ** 8), (2 ** 11, 2 ** 11), (2 ** 9, 2 ** 12), (2 ** 12, 2 ** 9),
                        (2 ** 10, 2 ** 13), (2 ** 13, 2 ** 10))]
    cat = Category(pts, log_space=True)
    big, small = (2 ** 13.5, 2 ** 13.5), (2 ** 10.5, 2 ** 10.5)
    assert cat.inside(big) and cat.multilinear(big) is None and cat.inside(small)
    assert cat.estimate(big, big[0] * big[1] * 1e-6)[2] == Source.EXTRAPOLATED
    assert cat.estimate(small, small[0] * small[1] * 1e-6)[2] == Source.INTERPOLATED


def test_a_compute_bound_call_takes_no_efficiency_from_another_precision() -> None:
    """An operator measured only in fp32 (memory-efficient attention's forward: CUDA cores, 51 TFLOP/s) says
    nothing of its half-precision kernel on tensor cores: holding fp32's efficiency against bf16's 776 TFLOP/s
    priced bf16 attention at head size 512 four times fast. A compute-bound call in another precision is a miss
    (said, and refused under --strict); a bandwidth-bound one still holds the other precision's efficiency."""
    rows = []
    for e in range(8, 13):
        n = 2 ** e
        call = gemm_layout_call(n, n, n, "nt", DType.FP32)
        info = describe(call, False)
        t = compute_bound_us(n, n, n) * PEAK / H200.peak_flops[Precision.FP32]
        rows.append({"key": f"k{e}", "op": call.op, "family": "gemm", "precision": "fp32", "math_mode": "",
                     "dtypes": info.dtypes, "flops": info.flops, "bytes": info.bytes, "latency_us": t,
                     "latency_warm_us": t, **info.features})
    lm = LatencyModel(FakeDb(rows), H200)
    q = query(2048, 2048, 2048)  # bf16, compute-bound
    e = lm.estimate([q])[q.key]
    assert e.source == Source.MISS


def test_no_estimate_is_faster_than_the_compute_peak() -> None:
    """Whatever a lookup holds or blends, a call's time is at least its FLOPs at the GPU's datasheet peak."""
    lm = LatencyModel(table(lambda m, n, k: 1.0, (256, 512, 1024)), H200)  # impossible points: 1 us at any size
    q = query(16384, 16384, 16384)
    e = lm.estimate([q])[q.key]
    assert H200.datasheet_flops is not None
    floor_us = 2.0 * 16384 ** 3 / H200.datasheet_flops[Precision.BF16] * 1e6
    assert e.cold_us == pytest.approx(floor_us, rel=1e-12) and e.warm_us == pytest.approx(floor_us, rel=1e-12)


def test_a_category_measured_only_at_the_launch_floor_takes_the_familys_large_call_efficiency() -> None:
    """An elementwise operator measured at 2k-8k elements only (1.5 us each: an 'efficiency' above 1 against the
    2 us floor) held that efficiency for a call of hundreds of MB, and read 7 TB/s on a 4.3 TB/s GPU. A call that
    far past a launch-bound category moves its bytes as the family's large calls of its precision and layout do
    (here every large mul runs at 75% of the roofline); one near the floor still holds its category's points."""
    from tp_query.engine.lookup import LAUNCH_BOUND_US

    rows = []

    def row(op: str, n: int, t: float) -> None:
        call = OpCall(op, (TensorSpec((n,), DType.BF16),))
        info = describe(call, False)
        rows.append({"key": f"{op}{n}", "op": op, "family": "elementwise", "precision": "bf16", "math_mode": "",
                     "dtypes": info.dtypes, "flops": info.flops, "bytes": info.bytes, "latency_us": t,
                     "latency_warm_us": t, **info.features})

    for e in (11, 12, 13):
        row("aten.sigmoid.default", 2 ** e, 1.5)
    for e in range(24, 31):  # another unary of the same layout, measured large
        n = 2 ** e
        row("aten.neg.default", n, roofline_us(0.0, 4.0 * n, Precision.BF16, H200) / 0.75)
    lm = LatencyModel(FakeDb(rows), H200)
    big = OpCall("aten.sigmoid.default", (TensorSpec((2 ** 27,), DType.BF16),))
    info = describe(big, False)
    e = lm.estimate([Query("big", big.op, info)])["big"]
    roof = roofline_us(info.flops, info.bytes, info.precision, H200)
    assert roof > LAUNCH_BOUND_US and e.source == Source.EXTRAPOLATED
    assert e.warm_us == pytest.approx(roof / 0.75, rel=1e-9) and e.cold_us == pytest.approx(roof / 0.75, rel=1e-9)
    small = OpCall("aten.sigmoid.default", (TensorSpec((2 ** 15,), DType.BF16),))
    # (at the floor too: its nearest point's 1.5 us)
    assert lm.estimate([Query("small", small.op, describe(small, False))])["small"].warm_us == pytest.approx(1.5)
