"""What a campaign measures, in a fixed order, so a rerun resumes where the last one stopped.

Two sources of points: the generic grid every operator kind defines in schema/ops.py, and
signature files (JSON lines of {"op", "sig", "tf32"}) with the exact calls of traced graphs, written
by `tp-query sigs`. A point's key is the hash of (operator, canonical arguments, math mode).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tp_query.schema.ops import (
    CallInfo,
    Family,
    Operands,
    describe,
    grid_calls,
    routed_expert_calls,
    with_operands,
)
from tp_query.schema.precision import Precision
from tp_query.schema.signature import OpCall, call_key
from tp_query.schema.tables import GRID_CAMPAIGN

SKIP_FAMILIES = (Family.VIEW, Family.HOST)


@dataclass(frozen=True)
class Point:
    key: str
    call: OpCall
    allow_tf32: bool
    info: CallInfo
    campaign: str
    operands: Operands = Operands.RANDOM

    @property
    def cost_estimate_s(self) -> float:
        """Rough device seconds to measure the point (warm-up, samples, overhead)."""
        rate = {Precision.FP32: 45e12, Precision.TF32: 300e12, Precision.FP16: 600e12, Precision.BF16: 600e12}
        t = max(self.info.flops / rate.get(self.info.precision, 45e12), self.info.bytes / 3.0e12) + 8e-6
        reps = 12 if t > 1e-3 else 25
        return reps * (t + 35e-6) + 0.01


def make_point(call: OpCall, allow_tf32: bool, campaign: str, operands: Operands = Operands.RANDOM) -> Point:
    info = describe(call, allow_tf32)
    key, info = with_operands(call_key(call.op, call.to_json_str(), info.math_mode), info, operands)
    return Point(key, call, allow_tf32, info, campaign, operands)


def with_operand_variant(points: list[Point], operands: Operands) -> list[Point]:
    """The fp16 GEMM points of a list, measured again with `operands` (other points do not depend on data)."""
    return [make_point(p.call, p.allow_tf32, p.campaign, operands) for p in points
            if p.info.family == Family.GEMM and p.info.precision == Precision.FP16]


GRID_ORDER = (Precision.BF16, Precision.FP32, Precision.FP16, Precision.TF32)


def routed_points(precisions: Iterable[Precision] = GRID_ORDER) -> list[Point]:
    """The expert-shaped batched GEMMs of the grid with the zero rows a top-1 router leaves in them (dense experts:
    schema.ops.routed_expert_calls), each beside its random-operand point."""
    return _dedupe([make_point(c, p == Precision.TF32, GRID_CAMPAIGN, ops) for p in precisions
                    for c, ops in routed_expert_calls(p)])


def grid_points(precisions: Iterable[Precision] = GRID_ORDER, kinds: set[str] | None = None,
                tiny: int = 0) -> list[Point]:
    """The generic sweep. `tiny` > 0 keeps only the `tiny` smallest calls per kind and precision
    (the CPU mode used by tests)."""
    by: dict[tuple[str, Precision], list[Point]] = {}
    for kind, p, call in grid_calls(precisions):
        if kinds and kind.name not in kinds:
            continue
        by.setdefault((kind.name, p), []).append(make_point(call, p == Precision.TF32, GRID_CAMPAIGN))
    out: list[Point] = []
    for (_, _), pts in by.items():
        if tiny:
            pts = sorted(pts, key=lambda q: q.info.flops + q.info.bytes)[:tiny]
        out.extend(pts)
    return _dedupe(out)


class InputError(ValueError):
    """A campaign's input the user can fix (a sigs file, a flag): one line, exit code 2."""


def signature_points(path: Path, campaign: str | None = None) -> list[Point]:
    """The points of a signature file: one JSON object per line, {"op", "sig", "tf32": true|false}."""
    camp = campaign or path.stem
    out = []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"signature file {path}: {getattr(e, 'strerror', None) or e}") from None
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if not isinstance(d, dict) or not isinstance(d.get("op"), str) or not isinstance(d.get("sig"), str):
                raise ValueError('not an object with "op" and "sig" strings')
            tf32 = d.get("tf32", False)
            if not isinstance(tf32, bool):  # ("no" would be read as true)
                raise ValueError(f'"tf32" must be true or false, got {tf32!r}')
            call = OpCall.from_json_str(d["op"], d["sig"])
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise InputError(f"signature file {path}, line {no}: {why}") from None
        pt = make_point(call, tf32, camp)
        if pt.info.family in SKIP_FAMILIES or call.op.startswith("comm."):
            continue
        out.append(pt)
    return _dedupe(out)


def write_signature_file(path: Path, entries: Iterable[tuple[str, str, bool]]) -> int:
    seen: set[tuple[str, str, bool]] = set()
    lines = []
    for op, sig, tf32 in entries:
        if (op, sig, tf32) in seen:
            continue
        seen.add((op, sig, tf32))
        lines.append(json.dumps({"op": op, "sig": sig, "tf32": tf32}, separators=(",", ":")))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def repeat_sample(points: list[Point], fraction: float, seed: int = 7) -> list[Point]:
    """A deterministic sample re-measured as run 2, for the repeatability figure."""
    rng = random.Random(seed)
    k = max(1, int(len(points) * fraction))
    return rng.sample(points, min(k, len(points)))


def _dedupe(points: list[Point]) -> list[Point]:
    seen: set[str] = set()
    out = []
    for p in points:
        if p.key not in seen:
            seen.add(p.key)
            out.append(p)
    return out


def summary(points: list[Point]) -> dict[str, Any]:
    by: dict[str, int] = {}
    for p in points:
        k = f"{p.info.family}/{p.info.precision}"
        by[k] = by.get(k, 0) + 1
    return {"points": len(points), "estimate_s": round(sum(p.cost_estimate_s for p in points), 1), "by": by}
