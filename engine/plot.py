"""Plots as standalone SVG (no plotting library needed): scatter, stacked bars, curves.

PNG is written through matplotlib when it is installed (`pip install tp-query[plot]`); SVG always.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac"]


@dataclass(frozen=True)
class Series:
    name: str
    xs: Sequence[float]
    ys: Sequence[float]


class _Canvas:
    def __init__(self, w: int, h: int) -> None:
        self.w, self.h = w, h
        self.parts: list[str] = []

    def add(self, s: str) -> None:
        self.parts.append(s)

    def text(self, x: float, y: float, s: str, size: int = 12, anchor: str = "start", rotate: float = 0,
             color: str = "#222") -> None:
        tr = f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate else ""
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{color}"'
                 f' font-family="Helvetica, Arial, sans-serif"{tr}>{escape(s)}</text>')

    def svg(self) -> str:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.w}" height="{self.h}" '
                f'viewBox="0 0 {self.w} {self.h}"><rect width="100%" height="100%" fill="white"/>'
                + "".join(self.parts) + "</svg>\n")


def _log_ticks(lo: float, hi: float) -> list[float]:
    ticks = []
    for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10 ** e
            if lo <= v <= hi:
                ticks.append(v)
    return ticks


def _fmt(v: float) -> str:
    return f"{v:g}" if v < 1e4 else f"{v:.0e}"


def scatter_loglog(series: list[Series], title: str, xlabel: str, ylabel: str, diagonal: bool = True,
                   band: float | None = 0.1, w: int = 720, h: int = 560) -> str:
    xs = [x for s in series for x in s.xs if x > 0]
    ys = [y for s in series for y in s.ys if y > 0]
    lo = min(xs + ys) / 1.3
    hi = max(xs + ys) * 1.3
    c = _Canvas(w, h)
    ml, mr, mt, mb = 70, 160, 40, 55
    pw, ph = w - ml - mr, h - mt - mb

    def X(v: float) -> float:
        return ml + (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo)) * pw

    def Y(v: float) -> float:
        return mt + ph - (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo)) * ph

    c.add(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for t in _log_ticks(lo, hi):
        c.add(f'<line x1="{X(t):.1f}" y1="{mt}" x2="{X(t):.1f}" y2="{mt + ph}" stroke="#eee"/>')
        c.add(f'<line x1="{ml}" y1="{Y(t):.1f}" x2="{ml + pw}" y2="{Y(t):.1f}" stroke="#eee"/>')
        c.text(X(t), mt + ph + 16, _fmt(t), 10, "middle")
        c.text(ml - 6, Y(t) + 4, _fmt(t), 10, "end")
    if diagonal:
        c.add(f'<line x1="{X(lo):.1f}" y1="{Y(lo):.1f}" x2="{X(hi):.1f}" y2="{Y(hi):.1f}" stroke="#444" '
              'stroke-dasharray="4 3"/>')
        if band:
            for f in (1 + band, 1 - band):
                c.add(f'<line x1="{X(lo):.1f}" y1="{Y(lo * f):.1f}" x2="{X(hi / f if f > 1 else hi):.1f}" '
                      f'y2="{Y(hi if f > 1 else hi * f):.1f}" stroke="#bbb" stroke-dasharray="2 3"/>')
    for i, s in enumerate(series):
        col = PALETTE[i % len(PALETTE)]
        for x, y in zip(s.xs, s.ys, strict=True):
            if x > 0 and y > 0:
                c.add(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="4.5" fill="{col}" fill-opacity="0.8" '
                      f'stroke="white" stroke-width="0.8"/>')
        ly = mt + 14 + 18 * i
        c.add(f'<circle cx="{ml + pw + 18}" cy="{ly - 4}" r="5" fill="{col}"/>')
        c.text(ml + pw + 28, ly, s.name, 12)
    c.text(w / 2, 22, title, 15, "middle")
    c.text(ml + pw / 2, h - 14, xlabel, 12, "middle")
    c.text(18, mt + ph / 2, ylabel, 12, "middle", rotate=-90)
    return c.svg()


def stacked_bars(labels: list[str], parts: dict[str, list[float]], title: str, ylabel: str,
                 w: int = 820, h: int = 500) -> str:
    c = _Canvas(w, h)
    ml, mr, mt, mb = 70, 190, 40, 110
    pw, ph = w - ml - mr, h - mt - mb
    totals = [sum(p[i] for p in parts.values()) for i in range(len(labels))]
    top = max(totals) * 1.1 if totals and max(totals) > 0 else 1.0
    step = 10 ** math.floor(math.log10(top / 5)) if top > 0 else 1
    ticks = [i * step for i in range(int(top / step) + 1)]
    if len(ticks) > 12:
        ticks = ticks[::2]
    for t in ticks:
        y = mt + ph - t / top * ph
        c.add(f'<line x1="{ml}" y1="{y:.1f}" x2="{ml + pw}" y2="{y:.1f}" stroke="#eee"/>')
        c.text(ml - 6, y + 4, f"{t:g}", 10, "end")
    n = max(len(labels), 1)
    bw = pw / n * 0.7
    for i, lab in enumerate(labels):
        x = ml + (i + 0.15) * pw / n
        y = mt + ph
        for j, (_, vals) in enumerate(parts.items()):
            v = vals[i]
            hh = v / top * ph
            y -= hh
            c.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{hh:.1f}" fill="{PALETTE[j % 10]}"/>')
        c.text(x + bw / 2, mt + ph + 14, lab, 10, "end", rotate=-35)
    for j, name in enumerate(parts):
        ly = mt + 14 + 18 * j
        c.add(f'<rect x="{ml + pw + 14}" y="{ly - 10}" width="12" height="12" fill="{PALETTE[j % 10]}"/>')
        c.text(ml + pw + 32, ly, name, 12)
    c.add(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    c.text(w / 2, 22, title, 15, "middle")
    c.text(18, mt + ph / 2, ylabel, 12, "middle", rotate=-90)
    return c.svg()


def lines_loglog(series: list[Series], title: str, xlabel: str, ylabel: str, w: int = 760, h: int = 520,
                 joined: bool = True) -> str:
    """Log-log axes of their own for x and y; `joined=False` draws points only (measurements of different
    shapes are not a curve)."""
    xs = [x for s in series for x in s.xs if x > 0]
    ys = [y for s in series for y in s.ys if y > 0]
    xlo, xhi = min(xs) / 1.2, max(xs) * 1.2
    ylo, yhi = min(ys) / 1.2, max(ys) * 1.2
    c = _Canvas(w, h)
    ml, mr, mt, mb = 70, 170, 40, 55
    pw, ph = w - ml - mr, h - mt - mb

    def X(v: float) -> float:
        return ml + (math.log(v) - math.log(xlo)) / (math.log(xhi) - math.log(xlo)) * pw

    def Y(v: float) -> float:
        return mt + ph - (math.log(v) - math.log(ylo)) / (math.log(yhi) - math.log(ylo)) * ph

    for t in _log_ticks(xlo, xhi):
        c.add(f'<line x1="{X(t):.1f}" y1="{mt}" x2="{X(t):.1f}" y2="{mt + ph}" stroke="#eee"/>')
        c.text(X(t), mt + ph + 16, _fmt(t), 10, "middle")
    for t in _log_ticks(ylo, yhi):
        c.add(f'<line x1="{ml}" y1="{Y(t):.1f}" x2="{ml + pw}" y2="{Y(t):.1f}" stroke="#eee"/>')
        c.text(ml - 6, Y(t) + 4, _fmt(t), 10, "end")
    for i, s in enumerate(series):
        col = PALETTE[i % 10]
        pts = sorted((x, y) for x, y in zip(s.xs, s.ys, strict=True) if x > 0 and y > 0)
        if pts and joined:
            d = " ".join(f"{'M' if k == 0 else 'L'}{X(x):.1f},{Y(y):.1f}" for k, (x, y) in enumerate(pts))
            c.add(f'<path d="{d}" fill="none" stroke="{col}" stroke-width="2"/>')
        for x, y in pts:
            c.add(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="2.5" fill="{col}"/>')
        ly = mt + 14 + 18 * i
        c.add(f'<line x1="{ml + pw + 12}" y1="{ly - 4}" x2="{ml + pw + 28}" y2="{ly - 4}" stroke="{col}" '
              'stroke-width="3"/>')
        c.text(ml + pw + 34, ly, s.name, 12)
    c.add(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    c.text(w / 2, 22, title, 15, "middle")
    c.text(ml + pw / 2, h - 14, xlabel, 12, "middle")
    c.text(18, mt + ph / 2, ylabel, 12, "middle", rotate=-90)
    return c.svg()


def write(svg: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg)
    return path


@dataclass(frozen=True)
class Chart:
    """One picture, rendered as SVG here or as PNG through matplotlib."""

    kind: str  # "bars" | "lines" | "points" (own x and y axes, not joined) | "scatter" (predicted vs measured)
    title: str
    xlabel: str
    ylabel: str
    labels: list[str] | None = None
    parts: dict[str, list[float]] | None = None
    series: list[Series] | None = None

    def svg(self) -> str:
        if self.kind == "bars":
            return stacked_bars(self.labels or [], self.parts or {}, self.title, self.ylabel)
        if self.kind in ("lines", "points"):
            return lines_loglog(self.series or [], self.title, self.xlabel, self.ylabel, joined=self.kind == "lines")
        return scatter_loglog(self.series or [], self.title, self.xlabel, self.ylabel)


RASTER_OR_VECTOR = (".png", ".pdf", ".svg")


def save(chart: Chart, path: Path) -> Path:
    """The file is what its suffix says: SVG drawn here (no library needed), or PNG, PDF and SVG through
    matplotlib when it is installed. Any other suffix, or PNG/PDF without matplotlib, is refused."""
    suffix = path.suffix.lower()
    if suffix not in RASTER_OR_VECTOR:
        raise ValueError(f"plot files are .svg, .png or .pdf, not {path.name!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if suffix == ".svg":
            return write(chart.svg(), path)
        raise ValueError(f"{suffix} output needs matplotlib (pip install 'tp-query[plot]'); .svg needs nothing"
                         ) from None
    plt.rcParams["svg.fonttype"] = "none"  # SVG text stays text (searchable, selectable)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    if chart.kind == "bars":
        bottom = [0.0] * len(chart.labels or [])
        for name, vals in (chart.parts or {}).items():
            ax.bar(chart.labels or [], vals, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.tick_params(axis="x", rotation=30)
    else:
        for s in chart.series or []:
            ax.plot(s.xs, s.ys, "-o" if chart.kind == "lines" else "o", label=s.name, markersize=3)
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_title(chart.title)
    ax.set_xlabel(chart.xlabel)
    ax.set_ylabel(chart.ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, format=suffix[1:])
    plt.close(fig)
    return path


def breakdown_across(preds: list[tuple[str, object]]) -> tuple[list[str], dict[str, list[float]]]:
    """Stacked-bar data from (label, Prediction) pairs."""
    labels = [lab for lab, _ in preds]
    keys: list[str] = []
    for _, p in preds:
        for k in p.breakdown:  # type: ignore[attr-defined]
            if k not in keys:
                keys.append(k)
    parts = {k.removesuffix("_ms").replace("_", " "): [float(p.breakdown.get(k, 0.0)) for _, p in preds]  # type: ignore[attr-defined]
             for k in keys}
    return labels, {k: v for k, v in parts.items() if any(x > 0 for x in v)}


def latency_series(db: object, kind: str) -> list[Series]:
    """Measured latency against work per precision: FLOP for compute families, bytes otherwise."""
    t = db.sql(  # type: ignore[attr-defined]
        "SELECT precision, family, flops, bytes, latency_us FROM ops_ok WHERE kind = ? AND run = 1 "
        "ORDER BY precision", [kind]).to_pylist()
    by: dict[str, list[tuple[float, float]]] = {}
    compute = bool(t) and t[0]["family"] in ("gemm", "attention")
    for r in t:
        x = r["flops"] if compute else r["bytes"]
        if x and r["latency_us"]:
            by.setdefault(r["precision"], []).append((float(x), float(r["latency_us"])))
    suffix = " (flops)" if compute else ""
    return [Series(p + suffix, [x for x, _ in v], [y for _, y in v]) for p, v in sorted(by.items())]
