"""Human-readable output: prediction breakdown, operator rows, database summary, SQL results."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from .predict import OpRow, Prediction

if TYPE_CHECKING:  # the prediction path reads no DuckDB or Arrow when its database snapshot is warm
    import pyarrow as pa

    from .db import DbInfo


def text_table(headers: list[str], rows: list[list[Any]], right: set[int] | None = None,
               max_width: int = 70) -> str:
    """Columns as wide as their longest cell (capped, with an ellipsis): a rich table on a terminal,
    plain aligned text in pipes and logs (so that scripts and CI read the same lines)."""
    right = right or set()
    cells = [["" if v is None else str(v) for v in r] for r in rows]
    cells = [[c if len(c) <= max_width else c[: max_width - 3] + "..." for c in r] for r in cells]
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        for i, h in enumerate(headers):
            t.add_column(h, justify="right" if i in right else "left", overflow="fold")
        for r in cells:
            t.add_row(*r)
        console = Console(width=max(Console().width, 80))
        with console.capture() as cap:
            console.print(t)
        return cap.get().rstrip("\n")
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals: list[str]) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths,
                                                                                             strict=True))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _bar(frac: float, width: int = 24) -> str:
    n = round(frac * width)
    return "█" * n + "·" * (width - n)


def _memory_parts(m: dict[str, float], prefix: str) -> str:
    """One memory line: each kind in GiB (gathered only where FSDP2 gathers)."""
    kinds = ("weights", "grads", "optimizer", "activations", "gathered", "transient", "buffers")
    return "  ".join(f"{k} {m[f'{prefix}{k}_gib']:.2f}" for k in kinds
                     if k != "gathered" or m.get(f"{prefix}gathered_gib"))


def sources_text(p: Prediction) -> str:
    """Where the time comes from, each source's share (those under 0.05% left out)."""
    return ", ".join(f"{k} {v:.1%}" for k, v in p.sources.items() if v > 0.0005)


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
        f"iteration time   {p.iteration_ms:10.2f} ms      "
        + (f"({p.tokens_per_s:,.0f} tokens/s)" if p.tokens_per_s is not None else "(no tokens: a module's own inputs)"),
    ]
    if p.mfu is not None and p.model_tflops_per_gpu is not None:
        lines.append(f"MFU              {100 * p.mfu:10.1f} %       ({p.model_tflops_per_gpu:.0f} model TFLOP/s per GPU, "
                     f"{p.hardware_tflops_per_gpu or 0:.0f} hardware; {(p.parameters or 0) / 1e9:.2f} B parameters)")
        lines.append("                 (model FLOPs by Megatron-LM's formula: attention counted in full, as if not "
                     "causal; hardware FLOPs are the kernels' own)")
    for k, v in p.breakdown.items():
        frac = v / p.iteration_ms if p.iteration_ms else 0
        lines.append(f"  {k[:-3].replace('_', ' '):<16}{v:10.2f} ms  {_bar(frac)} {frac:6.1%}")
    m = p.memory
    verdict = "fits" if p.fits else "DOES NOT FIT"
    lines += [
        "",
        f"peak memory      {p.peak_memory_gib:10.2f} GiB     {verdict} (usable {m['capacity_gib']:.1f} GiB, "
        f"margin {m['margin_gib']:+.1f} GiB)",
        f"  at the {p.peak_at or 'peak'}: " + _memory_parts(m, "at_peak_"),
        "  largest over the step: " + _memory_parts(m, ""),
        "",
        "sources of the time: " + sources_text(p),
    ]
    if len(p.stages) > 1:
        lines.append("stages: " + "; ".join(f"#{s['stage']} {s['layers']} layers {s['fwd_ms'] + s['bwd_ms']:.1f} ms/mb "
                                            f"{s['peak_memory_gib']:.1f} GiB" for s in p.stages))
    mg = c.get("model_graph") or {}
    if mg.get("family"):
        parts = [f"{mg['family']} via {mg['builder']}"]
        if mg.get("layer_types"):
            spans = [f"window {mg.get('sliding_window')}" if "sliding_attention" in mg["layer_types"] else "",
                     f"chunk {mg.get('attention_chunk_size')}" if "chunked_attention" in mg["layer_types"] else ""]
            spans = [x for x in spans if x]
            parts.append(", ".join(f"{n} {t.replace('_attention', '')}" for t, n in mg["layer_types"].items())
                         + " layers" + (f" ({', '.join(spans)})" if spans else ""))
        if mg.get("mlp_layer_types"):
            parts.append(", ".join(f"{n} {t}" for t, n in mg["mlp_layer_types"].items()) + " MLP layers")
        if mg.get("rope_layers"):
            parts.append(f"RoPE in {mg['rope_layers']['rope']} layers, none in {mg['rope_layers']['none']}")
        if mg.get("moe_routing"):
            parts.append(f"MoE routing {mg['moe_routing']}")
        lines.append("model graph: " + "; ".join(parts))
    db = c.get("database") or {}
    if db:  # which measurements answered: a copy or another stack of the database answers differently
        lines.append(f"database: {db.get('root')} ({c['gpu']}, files {db.get('fingerprint')}), measured under torch "
                     f"{db.get('torch')}, CUDA {db.get('cuda')}, cuDNN {db.get('cudnn')}; calibration: "
                     f"{c.get('calibration')}")
    for w in p.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def ops_table(rows: list[OpRow], p: Prediction) -> str:
    body = [[r.phase, r.op, r.precision, f"{r.count:.4g}", f"{r.latency_us:.1f}", f"{r.total_ms:.3f}", r.source,
             r.shapes] for r in rows]
    return (text_table(["phase", "operator", "prec", "count", "each us", "total ms", "source", "shapes"], body,
                       right={3, 4, 5}, max_width=60)
            + f"\n({len(rows)} rows; iteration {p.iteration_ms:.2f} ms)")


def sections_table(p: Prediction, top: int = 0) -> str:
    """GPU time by section of the slowest stage: the per-layer roll-up DeepSpeed's profiler gives (the `top`
    largest when given, their shares of every section's)."""
    total = sum(r["total_ms"] for r in p.sections) or 1.0
    rows = sorted(p.sections, key=lambda r: -r["total_ms"])[:top] if top else p.sections
    body = [[r["section"], r["count"], f"{r['fwd_ms']:.3f}", f"{r['bwd_ms']:.3f}", f"{r['each_ms']:.3f}",
             f"{r['total_ms']:.3f}", f"{100 * r['total_ms'] / total:.1f}%"] for r in rows]
    return (text_table(["section", "copies", "fwd ms", "bwd ms", "each ms", "total ms", "share"], body,
                       right={1, 2, 3, 4, 5, 6})
            + f"\n(GPU time per iteration, {p.config['micro_batches']} micro-batch(es); host idle "
              f"{p.breakdown.get('host_overhead_ms', 0):.2f} ms, bubble and DP traffic apart)")


def rollup(rows: list[OpRow], by: str) -> list[dict[str, Any]]:
    """Operator rows summed by kind (GEMM, attention, norm, communication, ...) or by phase, largest first."""
    acc: dict[str, dict[str, Any]] = {}
    for r in rows:
        k = getattr(r, by)
        g = acc.setdefault(k, {by: k, "calls": 0, "total_ms": 0.0})
        g["calls"] += r.count
        g["total_ms"] += r.total_ms
    return sorted(acc.values(), key=lambda g: -g["total_ms"])


def arrow_table_text(t: pa.Table, limit: int = 50, total: int | None = None) -> str:
    """The first `limit` rows as aligned text, and how many more the result has (`total`: its row count when the
    table holds only its first rows)."""
    total = t.num_rows if total is None else total
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
    if total > min(limit, t.num_rows):
        lines.append(f"... {total - min(limit, t.num_rows)} more rows")
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
    lines.append(text_table(["family", "kind", "precision", "rows"], [list(r) for r in info.by_kind], right={3}))
    return "\n".join(lines)
