"""Every outcome of five searches (8B over 64 GPUs and 70B over 32, every precision; Megatron-Core 8B over 16 and
Qwen3-30B-A3B, a MoE, over 16; PyTorch Qwen3-30B-A3B over 8) as JSON, and the comparison of two
such files (iteration time and peak memory to 1e-9, fits): how stop 24 checked that its speed work changed no answer.
    .venv/bin/python tools/search_outcomes.py OUT.json          (TP_QUERY_CACHE=/tmp/prof/warm; JOBS=1: one process)
    .venv/bin/python tools/search_outcomes.py --compare A.json B.json"""
import json
import os
import sys


def dump(path: str) -> None:
    os.environ.setdefault('TP_QUERY_CACHE', '/tmp/prof/warm')
    from tp_query.engine.predict import Engine
    from tp_query.engine.search import SearchSpace, search
    from tp_query.schema.precision import Setting
    out = {}
    for model, gpus, gb, fw, precs in (
            ("examples/llama3.1-8b.json", 64, 512, "torch", tuple(Setting)),
            ("examples/llama3.1-70b.json", 32, 256, "torch", tuple(Setting)),
            ("examples/llama3.1-8b.json", 16, 128, "megatron", (Setting.BF16, Setting.AMP_BF16)),
            ("examples/qwen3-30b-a3b.json", 16, 128, "megatron", (Setting.BF16,)),
            ("examples/qwen3-30b-a3b.json", 8, 64, "torch", (Setting.AMP_BF16,))):
        cfg = json.load(open(model))
        r = search(Engine('h200'), cfg, SearchSpace(gpus, gb, 4096, precisions=precs, framework=fw),
                   jobs=int(os.environ.get("JOBS", 0)))
        for o in r.ranked + r.rejected:
            out[f"{model} {fw} {gpus} {o.candidate.label()}"] = [o.iteration_ms, o.peak_memory_gib, o.fits,
                                                                 o.reason[:60], o.breakdown]
    json.dump(out, open(path, "w"), sort_keys=True)


def compare(pa: str, pb: str) -> int:
    a, b = json.load(open(pa)), json.load(open(pb))
    assert a.keys() == b.keys(), (len(a), len(b))
    bad = 0
    for k in a:
        x, y = a[k], b[k]
        if x[0] is None or y[0] is None:
            bad += x[:3] != y[:3]
            continue
        if abs(x[0] - y[0]) > 1e-9 * abs(x[0]) or abs(x[1] - y[1]) > 1e-9 * abs(x[1]) or x[2] != y[2] \
                or x[4].keys() != y[4].keys() or any(abs(x[4][j] - y[4][j]) > 1e-9 * max(1.0, abs(x[4][j]))
                                                     for j in x[4]):
            bad += 1
            if bad <= 5:
                print("differs:", k, x[:3], y[:3])
    print(len(a), "outcomes,", bad, "differ")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    dump(sys.argv[1])
