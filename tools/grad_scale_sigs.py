"""The in-place scalar multiplies Megatron-Core's DDP runs on its fp32 gradient buffers (compose.
megatron_grad_scaling): a size grid from 1 M to 4 G elements and the buffers of the validation cases, as a
signature campaign (data/h200/campaigns/grad-scale.jsonl) for one device call.
Run on the CPU: `.venv/bin/python tools/grad_scale_sigs.py`."""

from pathlib import Path

from tp_query.collector.plan import write_signature_file
from tp_query.schema.precision import DType
from tp_query.schema.signature import OpCall, TensorSpec

ROOT = Path(__file__).resolve().parent.parent
sizes = [2**k for k in range(20, 33)] + [346116096, 1409286144, 1923125248, 3164688384]
entries = [("aten.mul_.Tensor", OpCall("aten.mul_.Tensor", (TensorSpec((n,), DType.FP32), 0.5)).to_json_str(), False)
           for n in sorted(sizes)]
n = write_signature_file(ROOT / "data" / "h200" / "campaigns" / "grad-scale.jsonl", entries)
print(f"grad-scale.jsonl: {n} calls")
