"""How memory-bound calls are described: calls whose output size is an argument (factories, new_*,
slice_backward) follow that size, in-place updates follow the positions they touch, misaligned rows are their own
category; the collector replays factories on its device and rows that timed them on the host are never read.
Plus the guard that caught the factories: every row of the shipped database carries the features its signature
derives."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tp_query.schema import manifest
from tp_query.schema.ops import FAMILIES, FEATURE_COLUMNS, Family, describe, description_mismatches
from tp_query.schema.precision import DType
from tp_query.schema.signature import OpCall, Scalar, TensorSpec

ROOT = Path(__file__).resolve().parent.parent


def _dtype(d: str) -> tuple[tuple[str, Scalar], ...]:
    return (("dtype", Scalar("dtype", d)),)


@pytest.mark.parametrize(("call", "numel", "nbytes"), [
    (OpCall("aten.zeros.default", ([1, 64, 4096, 4097],), _dtype("fp32")), 64 * 4096 * 4097, 4 * 64 * 4096 * 4097),
    (OpCall("aten.ones.default", ([4096, 4096],), _dtype("bool")), 4096 ** 2, 4096 ** 2),
    (OpCall("aten.full.default", ([], 0.0), _dtype("fp32")), 1, 4),
    (OpCall("aten.arange.default", (4096,)), 4096, 8 * 4096),
    (OpCall("aten.arange.start", (10, 4106)), 4096, 8 * 4096),
    (OpCall("aten.arange.start_step", (0, 4096, 3)), 1366, 8 * 1366),
    (OpCall("aten.scalar_tensor.default", (float("-inf"),), _dtype("fp32")), 1, 4),
    # new_zeros reads nothing of its tensor (it lends dtype and device): its output alone, also where the template
    # is the larger (a [65536, 2048] template was filed at 134M elements and blended with real 134M fills)
    (OpCall("aten.new_zeros.default", (TensorSpec((2048, 2), DType.FP32), [2048, 8])), 2048 * 8, 4 * 2048 * 8),
    (OpCall("aten.new_zeros.default", (TensorSpec((65536, 2048), DType.BF16), [8192, 2048])), 8192 * 2048,
     2 * 8192 * 2048),
    # gathers: one element per index position, read from the source and written (x[idx] by 262,144 indices
    # writes 2.1 GB, by 4,096 indices 16 MB: they were one point at the source's size)
    (OpCall("aten.index.Tensor", (TensorSpec((4096, 2048), DType.BF16), [TensorSpec((262144,), DType.I64)])),
     262144 * 2048, 262144 * 8 + 2 * 2 * 262144 * 2048),
    (OpCall("aten.index.Tensor", (TensorSpec((4096, 128256), DType.FP32), [TensorSpec((4096,), DType.I64),
                                                                           TensorSpec((4096,), DType.I64)])),
     4096, 2 * 4096 * 8 + 2 * 4 * 4096),  # a loss's target pick: 4,096 elements, not the 525M logits
    (OpCall("aten.index_select.default", (TensorSpec((32, 5760), DType.BF16), 0, TensorSpec((16384,), DType.I64))),
     16384 * 5760, 16384 * 8 + 2 * 2 * 16384 * 5760),
    (OpCall("aten.gather.default", (TensorSpec((4096, 128256), DType.FP32), 1, TensorSpec((4096, 1), DType.I64))),
     4096, 4096 * 8 + 2 * 4 * 4096),
    # an empty gradient still writes the whole input size
    (OpCall("aten.slice_backward.default", (TensorSpec((4096, 1, 4, 0), DType.BF16), [4096, 1, 4, 128], 3, 128,
                                            2 ** 63 - 1, 1)), 4096 * 4 * 128, 2 * 4096 * 4 * 128),
    (OpCall("aten.slice_backward.default", (TensorSpec((8, 64), DType.BF16), [8, 128], 1, 64, 2 ** 63 - 1, 1)),
     8 * 128, 2 * (8 * 64 + 8 * 128)),
    (OpCall("aten.repeat.default", (TensorSpec((4, 8), DType.FP32), [3, 2])), 4 * 8 * 6, 4 * (32 + 192)),
    # in-place updates: the index and source, not the 2 GiB of scores updated (gpt-oss's max backward)
    (OpCall("aten.scatter_.src", (TensorSpec((1, 64, 4096, 4097), DType.BF16), 3,
                                  TensorSpec((1, 64, 4096, 1), DType.I64), TensorSpec((1, 64, 4096, 1), DType.BF16))),
     64 * 4096, 64 * 4096 * (8 + 2) + 64 * 4096 * 2),
    # index_backward's accumulation of 16,384 routed rows into 32
    (OpCall("aten._index_put_impl_.default", (TensorSpec((32, 5760), DType.BF16), [TensorSpec((16384,), DType.I64)],
                                              TensorSpec((16384, 5760), DType.BF16), True, True)),
     16384 * 5760, 16384 * 8 + 2 * 16384 * 5760 * 2),
    # a boolean mask writes where it is true, which no signature says: the tensor's size
    (OpCall("aten.index_put_.default", (TensorSpec((1, 4096, 4096), DType.BF16), [TensorSpec((1, 4096), DType.BOOL)],
                                        TensorSpec((), DType.BF16))),
     4096 * 4096, 2 * 4096 * 4096 + 4096 + 2 + 2 * 4096 * 4096),
])
def test_output_size_arguments_set_the_work(call: OpCall, numel: int, nbytes: int) -> None:
    info = describe(call, False)
    assert info.features["numel"] == numel
    assert info.bytes == nbytes


@pytest.mark.parametrize(("call", "pattern"), [
    # gpt-oss's scores and sink: rows of 4,097 bf16 elements in the output
    (OpCall("aten.cat.default", ([TensorSpec((1, 64, 4096, 4096), DType.BF16), TensorSpec((1, 64, 4096, 1), DType.BF16)],
                                 -1)), "cb/ua"),
    (OpCall("aten.cat.default", ([TensorSpec((8, 64), DType.BF16), TensorSpec((8, 64), DType.BF16)], -1)), "cc"),
    # an output beyond 32-bit indexing: one copy per input instead of the batched kernel
    (OpCall("aten.cat.default", ([TensorSpec((1, 64, 8192, 8192), DType.BF16), TensorSpec((1, 64, 8192, 1), DType.BF16)],
                                 -1)), "cb/ua/i64"),
    # the probabilities without the sink column: a view of pitch 4,097
    (OpCall("aten.mul.Tensor", (TensorSpec((64, 4096, 4096), DType.BF16, (4096 * 4097, 4097, 1)),
                                TensorSpec((64, 4096, 4096), DType.BF16))), "sc/ua"),
    (OpCall("aten.slice_backward.default", (TensorSpec((1, 64, 4096, 4096), DType.BF16), [1, 64, 4096, 4097], 3, 0,
                                            4096, 1)), "c/ua"),
    (OpCall("aten.slice_backward.default", (TensorSpec((1, 8, 4096, 64), DType.BF16), [1, 8, 4096, 128], 3, 64,
                                            2 ** 63 - 1, 1)), "c"),
    # labels shifted by one token: an int64 view starting 8 bytes in
    (OpCall("aten.ge.Scalar", (TensorSpec((1, 4096), DType.I64, None, 1), 0)), "c/ua"),
    # a size-1 dimension's stride means nothing; an odd contiguous size is flat to a pointwise kernel
    (OpCall("aten.clone.default", (TensorSpec((1, 4096), DType.BF16, (1, 1)),)), "s"),
    (OpCall("aten.mul.Tensor", (TensorSpec((4096, 50257), DType.BF16), TensorSpec((4096, 50257), DType.BF16))), "cc"),
])
def test_misaligned_rows_are_their_own_category(call: OpCall, pattern: str) -> None:
    assert describe(call, False).features["pattern"] == pattern


def test_rowwise_rows_of_no_multiple_of_8_are_their_own_category() -> None:
    spec = FAMILIES[Family.ROWWISE]
    odd = describe(OpCall("aten._softmax.default", (TensorSpec((1, 64, 4096, 4097), DType.BF16), -1, False)), False)
    even = describe(OpCall("aten._softmax.default", (TensorSpec((1, 64, 4096, 4096), DType.BF16), -1, False)), False)
    assert spec.exact_key(odd.features) != spec.exact_key(even.features)


def test_backward_formulas_are_traced_in_their_eager_branch() -> None:
    """A MoE router's topk backward and the experts' index backward: zeros updated in place, as eager CUDA runs
    them, not the out-of-place branch a dispatch mode takes."""
    pytest.importorskip("torch")
    from tp_query.engine.trace.capture import TraceRequest, trace_config
    from tp_query.schema.model_config import parse_config
    from tp_query.schema.precision import Setting

    from .conftest import TINY_FAMILIES

    spec = parse_config(TINY_FAMILIES["mixtral"])
    g = trace_config(TraceRequest(spec, Setting.BF16, 1, 64, traced_layers=spec.num_layers))
    bwd = {o.op for o in g.ops if o.phase.value == "bwd"}
    assert {"aten.scatter_.src", "aten._index_put_impl_.default"} <= bwd
    assert not {"aten.scatter.src", "aten.index_put.default"} & bwd
    fwd = [o for o in g.ops if o.phase.value == "fwd" and o.op == "aten.index_put_.default"]
    assert fwd  # the model's own in-place combine is untouched


def test_a_factory_replays_on_the_collectors_device() -> None:
    torch = pytest.importorskip("torch")
    from tp_query.collector import replay

    meta = torch.device("meta")
    out = replay.build(OpCall("aten.zeros.default", ([64, 8],), _dtype("bf16")), meta)()
    assert out.device == meta and tuple(out.shape) == (64, 8) and out.dtype == torch.bfloat16
    out = replay.build(OpCall("aten.arange.default", (100,)), meta)()
    assert out.device == meta and out.shape == (100,)


def test_host_timed_factory_rows_are_not_read(cpu_db: Path, tmp_path: Path) -> None:
    """A database whose factory rows come from collector 0.1.0 (which built them on the host): those rows stay in
    `ops` for SQL but never reach the lookups; rows of calls with tensors from that collector still do."""
    from tp_query.engine.db import Database

    root = tmp_path / "data"
    shutil.copytree(cpu_db / "cpu", root / "cpu")
    files = sorted((root / "cpu" / "ops").glob("*.parquet"))
    factory = tensor_rows = 0
    for f in files:
        t = pq.read_table(f)
        sigs = t.column("signature").to_pylist()
        factory += sum('"T":' not in s for s in sigs)
        tensor_rows += sum('"T":' in s for s in sigs)
        old = pa.array(["0.1.0"] * t.num_rows)
        t = t.set_column(t.schema.get_field_index("collector_version"), "collector_version", old)
        pq.write_table(t.replace_schema_metadata(pq.read_metadata(f).metadata), f)
    assert factory > 0 and tensor_rows > 0
    manifest.record(root / "cpu", [f"ops/{f.name}" for f in files], "cpu")
    db = Database("cpu", root)
    try:
        count = db.con.execute("SELECT count(*) FILTER (WHERE signature NOT LIKE '%\"T\":%'), count(*) FROM ops_ok"
                               ).fetchone()
        assert count is not None and count[0] == 0 and count[1] > 0
        assert db.con.execute("SELECT count(*) FROM ops WHERE signature NOT LIKE '%\"T\":%'").fetchone() == (factory,)
    finally:
        db.close()


def test_shipped_rows_carry_the_features_their_signatures_derive() -> None:
    """A change to how the registry describes a call must come with its rows measured again (or re-derived):
    stored features that disagree with the registry would interpolate a query against the wrong points (every
    factory once had numel 0). Rows the engine reads (ok, first run) are checked; a NaN-operand row's layout
    carries its operands, and attention rows from before `masked` existed read NULL, i.e. unmasked."""
    cols = ["key", "op", "signature", "math_mode", "kind", "family", "flops", "bytes", *FEATURE_COLUMNS]
    glob = str(ROOT / "data" / "h200" / "ops" / "*.parquet")
    rows = duckdb.connect().execute(f"SELECT {', '.join(cols)} FROM read_parquet(?, union_by_name = true) "
                                    "WHERE status = 'ok' AND run = 1", [glob]).fetchall()
    assert len(rows) > 10_000
    bad = []
    for r in rows:
        d = dict(zip(cols, r, strict=True))
        diff = description_mismatches(d)
        if diff:
            bad.append(f"{d['op']} {d['signature'][:80]}: {sorted(diff)}")
    assert not bad, f"{len(bad)} rows disagree, e.g. {bad[:3]}"


@pytest.mark.parametrize("case", ["one", "adjacent", "apart", "middle", "select", "gather"])
def test_gather_output_shapes_are_atens(case: str) -> None:
    """A gather's output shape, from its signature, is the one ATen returns (advanced indices adjacent or apart,
    broadcast among themselves; index_select along a dimension; gather as its index)."""
    import torch
    from tp_query.schema.ops import gather_output_shape

    x = torch.zeros(4, 5, 6, 7)
    i3, i21 = torch.zeros(3, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long)
    spec = {torch.float32: DType.FP32, torch.int64: DType.I64}

    def ts(t: torch.Tensor | None) -> TensorSpec | None:
        return None if t is None else TensorSpec(tuple(t.shape), spec[t.dtype])

    op, args = {"one": ("aten.index.Tensor", (x, [i3])), "adjacent": ("aten.index.Tensor", (x, [None, i3, i21])),
                "apart": ("aten.index.Tensor", (x, [None, i3, None, i3])),
                "middle": ("aten.index.Tensor", (x, [None, None, i21])),
                "select": ("aten.index_select.default", (x, 2, i3)),
                "gather": ("aten.gather.default", (x, 1, torch.zeros(4, 2, 6, 7, dtype=torch.long)))}[case]
    _, name, overload = op.split(".")
    want = tuple(getattr(getattr(torch.ops.aten, name), overload)(*args).shape)
    call = OpCall(op, tuple([ts(a) for a in v] if isinstance(v, list) else ts(v) if isinstance(v, torch.Tensor)
                            else v for v in args))
    assert gather_output_shape(call) == want


def test_contended_accumulating_index_put_is_a_category_of_its_own() -> None:
    """Hundreds of routed rows added onto each of 32 experts serialise on their atomics: such a call must not blend
    with spread-out index_puts of as many bytes; a few indices per row, or no accumulation, stay as they were."""
    from tp_query.schema.ops import describe
    from tp_query.schema.precision import DType
    from tp_query.schema.signature import OpCall, TensorSpec

    def pattern(rows: int, idx: int, acc: bool, op: str = "aten._index_put_impl_.default") -> str:
        call = OpCall(op, (TensorSpec((rows, 2880), DType.BF16), [TensorSpec((idx,), DType.I64)],
                           TensorSpec((idx, 2880), DType.BF16), acc, True))
        return str(describe(call, False).features["pattern"])

    assert pattern(32, 16384, True).endswith("/x512") and pattern(32, 24576, True).endswith("/x512")
    assert pattern(32, 4096, True).endswith("/x128") and pattern(32, 2048, True).endswith("/x64")
    assert "/x" not in pattern(32, 1024, True) and "/x" not in pattern(8192, 65536, True)
    assert "/x" not in pattern(32, 16384, False)
    assert pattern(32, 16384, True, "aten.index_put_.default").endswith("/x512")
