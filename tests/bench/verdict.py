"""One line per bench figure: minimum and median over whole-process runs against the target."""

from __future__ import annotations

import statistics


def verdict(name: str, xs: list[float], unit: str, target: str, good: bool, width: int) -> str:
    return (f"{name:<{width}}  min {min(xs):10.3f}  median {statistics.median(xs):10.3f} {unit:<3} target "
            f"{target:<11} {'ok' if good else 'MISSED'}  ({len(xs)} runs)")
