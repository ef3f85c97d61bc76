"""Human-readable output: prediction breakdown, operator rows, database summary, SQL results."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from .db import DbInfo
from .predict import OpRow, Prediction


def _bar(frac: float, width: int = 24) -> str:
    n = round(frac * width)
    return "█" * n + "·" * (width - n)


def prediction_table(p: Prediction) -> str:
    c = p.config
    lines = [
        f"{c['model']} on {c['gpus']} x {c['gpu'].upper()}  DP={c['dp']} TP={c['tp']} PP={c['pp']}  "
        f"{c['precision']}  seq {c['seq_len']}  micro-batch {c['micro_batch']} x {c['micro_batches']}  "
        f"global batch {c['global_batch']}  {c['optimizer']}"
        + ("  SP" if c["sequence_parallel"] else "") + (f"  ZeRO-{c['zero']}" if c["zero"] else "")
        + ("  recompute" if c["recompute"] != "none" else "")
        + f"  [{c.get('framework', 'torch')}" + (f", {c['pp_schedule']}" if c["pp"] > 1 else "") + "]",
        "",
        f"iteration time   {p.iteration_ms:10.2f} ms      ({p.tokens_per_s:,.0f} tokens/s)",
    ]
    if p.mfu is not None and p.model_tflops_per_gpu is not None:
        lines.append(f"MFU              {100 * p.mfu:10.1f} %       ({p.model_tflops_per_gpu:.0f} model TFLOP/s per GPU, "
                     f"{p.hardware_tflops_per_gpu or 0:.0f} hardware; {(p.parameters or 0) / 1e9:.2f} B parameters)")
    for k, v in p.breakdown.items():
        frac = v / p.iteration_ms if p.iteration_ms else 0
        lines.append(f"  {k[:-3].replace('_', ' '):<16}{v:10.2f} ms  {_bar(frac)} {frac:6.1%}")
    m = p.memory
    verdict = "fits" if p.fits else "DOES NOT FIT"
    lines += [
        "",
        f"peak memory      {p.peak_memory_gib:10.2f} GiB     {verdict} (usable {m['capacity_gib']:.1f} GiB, "
        f"margin {m['margin_gib']:+.1f} GiB)",
        f"  weights {m['weights_gib']:.2f}  grads {m['grads_gib']:.2f}  optimizer {m['optimizer_gib']:.2f}  "
        f"activations {m['activations_gib']:.2f}  transient {m['transient_gib']:.2f}  buffers {m['buffers_gib']:.2f}",
        "",
        "sources of the time: " + ", ".join(f"{k} {v:.1%}" for k, v in p.sources.items() if v > 0.0005),
    ]
    if len(p.stages) > 1:
        lines.append("stages: " + "; ".join(f"#{s['stage']} {s['layers']} layers {s['fwd_ms'] + s['bwd_ms']:.1f} ms/mb "
                                            f"{s['peak_memory_gib']:.1f} GiB" for s in p.stages))
    mg = c.get("model_graph") or {}
    if mg.get("family"):
        parts = [f"{mg['family']} via {mg['builder']}"]
        if mg.get("layer_types"):
            parts.append(", ".join(f"{n} {t.replace('_attention', '')}" for t, n in mg["layer_types"].items())
                         + f" layers (window {mg.get('sliding_window')})")
        if mg.get("moe_routing"):
            parts.append(f"MoE routing {mg['moe_routing']}")
        lines.append("model graph: " + "; ".join(parts))
    for w in p.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def ops_table(rows: list[OpRow], p: Prediction) -> str:
    head = f"{'phase':<5} {'operator':<52} {'prec':<5} {'count':>6} {'each us':>10} {'total ms':>10} {'source':<13} shapes"
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(f"{r.phase:<5} {r.op[:52]:<52} {r.precision:<5} {r.count:>6.4g} {r.latency_us:>10.1f} "
                   f"{r.total_ms:>10.3f} {r.source:<13} {r.shapes}")
    out.append(f"({len(rows)} rows; iteration {p.iteration_ms:.2f} ms)")
    return "\n".join(out)


def rollup(rows: list[OpRow], by: str) -> list[dict[str, Any]]:
    """Operator rows summed by kind (GEMM, attention, norm, communication, ...) or by phase, largest first."""
    acc: dict[str, dict[str, Any]] = {}
    for r in rows:
        k = getattr(r, by)
        g = acc.setdefault(k, {by: k, "calls": 0, "total_ms": 0.0})
        g["calls"] += r.count
        g["total_ms"] += r.total_ms
    return sorted(acc.values(), key=lambda g: -g["total_ms"])


def arrow_table_text(t: pa.Table, limit: int = 50) -> str:
    cols = t.column_names
    rows = t.slice(0, limit).to_pylist()

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        s = str(v)
        return s if len(s) <= 60 else s[:57] + "..."

    cells = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max([len(c), *[len(row[i]) for row in cells]]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    if t.num_rows > limit:
        lines.append(f"... {t.num_rows - limit} more rows")
    return "\n".join(lines)


def db_info_text(info: DbInfo, rep: dict[str, Any]) -> str:
    p = info.provenance
    lines = [f"database {info.gpu}: {info.rows} rows ({info.ok_rows} ok) in {info.files} files",
             "provenance: " + ", ".join(f"{k}={v}" for k, v in p.items())]
    if rep.get("n"):
        lines.append(f"repeatability: {rep['n']} points measured twice; median |difference| "
                     f"{rep['median_rel_diff']:.2%}, p90 {rep['p90_rel_diff']:.2%}; median p80/p20 spread "
                     f"{rep['median_spread']:.3f}")
    lines.append("")
    lines.append(f"{'family':<12} {'kind':<34} {'precision':<9} {'rows':>6}")
    for fam, kind, prec, n in info.by_kind:
        lines.append(f"{fam:<12} {kind:<34} {prec:<9} {n:>6}")
    return "\n".join(lines)
