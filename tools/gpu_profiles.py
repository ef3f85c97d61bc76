"""Reading what a real step reports, for the profiling tools beside this file (imported as a sibling
module: the tools run as scripts from this folder): device time per aten operator from torch.profiler,
the kernels' busy time, the comparison with the engine's operator rows, and the allocations live at the
peak of a step from the CUDA caching allocator's history."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

GiB = 2**30

# the profiler attributes a kernel to the innermost aten op: _to_copy and clone run copy_'s kernel
_GROUPS = {"_to_copy": "copy", "clone": "copy", "copy_": "copy", "masked_fill_": "masked_fill", "contiguous": "copy"}


def group(op: str) -> str:
    """An operator's group for comparison ("aten.clone.default" and "aten::copy_" are both "copy")."""
    base = op.removeprefix("aten.").split(".")[0]
    return _GROUPS.get(base, base)


def aten_ops(prof: Any) -> dict[str, list[float]]:
    """{aten op: [self device us, calls]} of a finished profile."""
    return {e.key.replace("aten::", "aten."): [e.self_device_time_total, e.count] for e in prof.key_averages()
            if e.key.startswith("aten::") and e.self_device_time_total > 0}


def shaped_ops(prof: Any, min_us: float) -> list[list[Any]]:
    """[aten op, input shapes, self device us, calls] per input shape, above `min_us` (record_shapes=True)."""
    return [[e.key.replace("aten::", "aten."), str(e.input_shapes)[:160], e.self_device_time_total, e.count]
            for e in prof.key_averages(group_by_input_shape=True)
            if e.key.startswith("aten::") and e.self_device_time_total > min_us]


def kernel_busy(prof: Any) -> tuple[float, float]:
    """(union of the kernels' intervals, first kernel start to last kernel end), in us."""
    import torch
    from tp_query.collector.dist_validate import intervals_union

    kernels = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                     if ev.device_type == torch.autograd.DeviceType.CUDA)
    return sum(b - a for a, b in intervals_union(kernels)), kernels[-1][1] - kernels[0][0]


def kernel_timeline(prof: Any) -> dict[str, Any]:
    """One rank's step on its GPU: span, busy union of all kernels, of compute kernels, NCCL kernel time
    (sum, and each kernel's duration in order) and the NCCL time with no compute kernel beside it, in us."""
    import torch
    from tp_query.collector.dist_validate import covered_length
    from tp_query.collector.dist_validate import intervals_union as union

    # a set: the profiler lists each NCCL kernel twice (the kernel and its GPU-side annotation, same interval)
    ks = sorted({(ev.time_range.start, ev.time_range.end, "nccl" in ev.name.lower()) for ev in prof.events()
                 if ev.device_type == torch.autograd.DeviceType.CUDA})
    comp = union([(a, b) for a, b, n in ks if not n])
    nccl = [(a, b) for a, b, n in ks if n]
    nccl_union = union(nccl)
    exposed = sum(b - a for a, b in nccl_union) - covered_length(nccl_union, comp)  # no compute kernel beside
    return {"span_us": ks[-1][1] - ks[0][0], "busy_us": sum(b - a for a, b in union([(a, b) for a, b, _ in ks])),
            "compute_busy_us": sum(b - a for a, b in comp), "nccl_us": sum(b - a for a, b in nccl),
            "nccl_exposed_us": exposed, "nccl_kernels_us": [round(b - a, 1) for a, b in nccl]}


def print_comparison(real_ops: dict[str, list[float]], engine_rows: list[Any], top: int,
                     by_size: bool = False) -> None:
    """Real and engine time per operator group: the `top` largest differences (or largest times)."""
    ours: dict[str, float] = defaultdict(float)
    theirs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for o in engine_rows:
        ours[group(o.op)] += o.total_ms * 1e3
    for n, (us, calls) in real_ops.items():
        theirs[group(n)][0] += us
        theirs[group(n)][1] += calls

    def key(n: str) -> float:
        real, eng = theirs.get(n, [0.0])[0], ours.get(n, 0.0)
        return -max(real, eng) if by_size else -abs(real - eng)

    for n in sorted(set(theirs) | set(ours), key=key)[:top]:
        t = theirs.get(n, [0.0, 0])
        print(f"  {n:32s} real {t[0] / 1e3:8.2f} ms ({t[1]:4d})  engine {ours.get(n, 0) / 1e3:8.2f} ms")


def live_at_peak(trace: list[dict[str, Any]], where: Callable[[list[dict[str, Any]]], str]
                 ) -> tuple[int, dict[str, int]]:
    """Replay one device's allocator history (torch.cuda.memory._snapshot()["device_traces"][i]) to the peak
    of the allocations it records: (bytes live then, those bytes grouped by where(frames))."""
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], where(ev.get("frames", [])))
            cur += ev["size"]
            if cur > best:
                best, best_live = cur, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    by: dict[str, int] = defaultdict(int)
    for size, w in best_live.values():
        by[w] += size
    return best, dict(by)
