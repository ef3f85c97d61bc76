"""Attention with dropout where models run it (data/h200/campaigns/attention-dropout.jsonl): SDPA's forward and
backward calls, as traced steps issue them, of decoder layers with attention_dropout 0.1, causal (MHA and GQA 4:1) and
behind a sliding-window mask (Mistral-style, window 1,024, GQA 4:1), heads 16/32/64 of size 64 and 128, 1,024 to
8,192 tokens, in bf16 and fp16 (cuDNN attention on an H200) and fp32 (memory-efficient attention).
`--masked`: the same masked calls without dropout (data/h200/campaigns/attention-mask.jsonl), windows of 1,024 and
4,096 (Mistral's, Starcoder2's and Cohere2's: a window as long as the sequence still passes its mask to SDPA); fp16
had no cuDNN point with a mask and without dropout, and borrowed one across both features.

The grid measures dropout only at head size 64, causal, without a mask or GQA; a call outside that (a masked layer
with dropout) borrowed dropout's cost from head 64 (engine/lookup.py `_transferred`). Cases with attention dropout at
these head sizes share shapes with it (Seed-OSS's 80 heads of 128 do not: between points; GPT-2's 12/16 heads of 64
neither). Run on the CPU: `.venv/bin/python tools/attention_dropout_sigs.py` (traces about 200 one-layer steps)."""

import json
import sys
from pathlib import Path

from tp_query.collector.plan import write_signature_file
from tp_query.engine.tracecli import signature_entries
from tp_query.schema.ops import ATTN_FLOP_CAP
from tp_query.schema.precision import Precision, Setting

ROOT = Path(__file__).resolve().parent.parent
HEADS = (16, 32, 64)
HEAD_DIMS = (64, 128)
SEQS = (1024, 2048, 4096, 8192)
SETTINGS = {Setting.BF16: Precision.BF16, Setting.FP16: Precision.FP16, Setting.FP32: Precision.FP32}


def config(h: int, d: int, ratio: int, window: int | None, dropout: float = 0.1) -> dict[str, object]:
    cfg: dict[str, object] = {
        "model_type": "mistral" if window else "llama", "hidden_size": h * d, "num_attention_heads": h,
        "num_key_value_heads": h // ratio, "head_dim": d, "intermediate_size": 256, "num_hidden_layers": 1,
        "vocab_size": 1024, "attention_dropout": dropout, "max_position_embeddings": 8192, "tie_word_embeddings": False}
    cfg["sliding_window"] = window
    return cfg


def main() -> None:
    masked = "--masked" in sys.argv
    name = "attention-mask" if masked else "attention-dropout"
    layers = ((4, 1024), (4, 4096)) if masked else ((1, None), (4, None), (4, 1024))
    entries: list[tuple[str, str, bool]] = []
    for setting, prec in SETTINGS.items():
        for h in HEADS:
            for d in HEAD_DIMS:
                for ratio, window in layers:
                    seqs = [s for s in SEQS if (window is None or s > window or masked)
                            and 4.0 * h * s * s * d * 0.5 * 2.5 <= ATTN_FLOP_CAP[prec] * (2 if window else 1)]
                    if not seqs:
                        continue
                    cfg = config(h, d, ratio, window, 0.0 if masked else 0.1)
                    for op, sig, tf32 in signature_entries([cfg], [setting], seqs, [1], [1], None):
                        # (masked: only the calls that pass a mask; the causal ones are measured already)
                        if "scaled_dot_product" in op and (not masked or '"T":[1,1,' in sig):
                            entries.append((op, sig, tf32))
    n = write_signature_file(ROOT / "data" / "h200" / "campaigns" / f"{name}.jsonl", entries)
    ops: dict[str, int] = {}
    for op, _, _ in dict.fromkeys(entries):
        ops[op] = ops.get(op, 0) + 1
    print(f"{name}.jsonl: {n} distinct calls", json.dumps(ops))


if __name__ == "__main__":
    main()
