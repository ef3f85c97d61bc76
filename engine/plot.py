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


def lines_loglog(series: list[Series], title: str, xlabel: str, ylabel: str, w: int = 760, h: int = 520) -> str:
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
        if pts:
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
    """Write SVG, or PNG through matplotlib's SVG-free path when the suffix asks for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".png":
        raise ValueError("PNG output needs the matplotlib renderer: use plot_png()")
    path.write_text(svg)
    return path
