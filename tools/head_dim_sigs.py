"""The attention calls of head sizes the grid lacked (data/h200/campaigns/head-dims.jsonl): SDPA forward and backward
as a Llama-shaped layer dispatches them on an H200 (cuDNN in half precision, memory-efficient attention in fp32/tf32),
head sizes 80, 96, 112, 160 and 256, 8 or 32 query heads (GQA 4:1 in half precision, MHA), 1,024 to 8,192 tokens. These kernels are
compiled for head-size buckets, so a size between two measured ones is not their blend (docs/validation-notes.md
section 25). Run on the CPU: `.venv/bin/python tools/head_dim_sigs.py`."""

from pathlib import Path

from tp_query.collector.plan import write_signature_file
from tp_query.engine.tracecli import signature_entries
from tp_query.schema.precision import Setting

ROOT = Path(__file__).resolve().parent.parent


def config(hd: int, heads: int, kv: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "head_dim": hd,
            "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": 4096,
            "num_hidden_layers": 1, "vocab_size": 1024, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5}


entries = []
for hd in (80, 96, 112, 160, 256):
    # GQA in fp32 runs SDPA's math path (bmm, softmax): no fused kernel to measure there
    for heads, kv, settings in ((32, 8, [Setting.BF16, Setting.FP16]), (8, 8, [Setting.BF16, Setting.FP16, Setting.TF32]),
                                (32, 32, [Setting.TF32])):
        for op, sig, tf32 in signature_entries([config(hd, heads, kv)], settings, [1024, 2048, 4096, 8192], [1], [1],
                                               None):
            if "scaled_dot_product" in op:
                entries.append((op, sig, tf32))
n = write_signature_file(ROOT / "data" / "h200" / "campaigns" / "head-dims.jsonl", entries)
print(f"head-dims.jsonl: {n} distinct calls")
