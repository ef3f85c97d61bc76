"""Attention scores as SDPA's math path and eager attention materialise them (data/h200/campaigns/attention-scores.jsonl):
the (1, heads, seq, seq) calls of the scores' mask add (bool and float masks), safe softmax, softmax, softmax backward and
the casts of the probabilities, in fp32 (eager models upcast their scores; fp32 and tf32 settings) and in bf16 and fp16,
over 16, 32, 64 and 128 heads and 1,024 to 8,192 tokens (at most 2^31 elements a tensor). The grid had these only at
the shapes of the profiled families, so a model of another head count (Falcon-7B's 71) was extrapolated from rows of
other lengths. Cases whose eager scores have 16, 32, 64 or 128 heads at these lengths share shapes with it (PhiMoE's
32 heads at 4,096 tokens, which the families campaign had measured already); Falcon's 71 heads stay between points.
Run on the CPU: `.venv/bin/python tools/score_grid_sigs.py`."""

from pathlib import Path

from tp_query.collector.plan import write_signature_file
from tp_query.schema.ops import ROWWISE_NUMEL_CAP
from tp_query.schema.precision import DType
from tp_query.schema.signature import OpCall, Scalar, TensorSpec

ROOT = Path(__file__).resolve().parent.parent
HEADS = (16, 32, 64, 128)
SEQS = (1024, 2048, 4096, 8192)


def calls(dt: DType, h: int, s: int) -> list[OpCall]:
    sc = TensorSpec((1, h, s, s), dt)
    out = [
        OpCall("aten.add.Tensor", (sc, TensorSpec((1, 1, s, s), DType.BOOL))),
        OpCall("aten.add.Tensor", (sc, TensorSpec((1, 1, s, s), dt))),
        OpCall("aten._safe_softmax.default", (sc, -1)),
        OpCall("aten._softmax.default", (sc, -1, False)),
        OpCall("aten._softmax_backward_data.default", (sc, sc, -1, Scalar("dtype", str(dt)))),
    ]
    if dt == DType.FP32:  # probabilities cast back to the half dtype of the values (autocast, bf16/fp16 models)
        out += [OpCall("aten._to_copy.default", (sc,), (("dtype", Scalar("dtype", str(half))),))
                for half in (DType.BF16, DType.FP16)]
    return out


entries = []
for dt in (DType.FP32, DType.BF16, DType.FP16):
    for h in HEADS:
        for s in SEQS:
            if h * s * s <= ROWWISE_NUMEL_CAP:  # a tensor of at most 2^31 elements
                entries += [(c.op, c.to_json_str(), False) for c in calls(dt, h, s)]
n = write_signature_file(ROOT / "data" / "h200" / "campaigns" / "attention-scores.jsonl", entries)
print(f"attention-scores.jsonl: {n} distinct calls")
