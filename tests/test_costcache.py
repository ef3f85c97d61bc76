"""The costed-graph cache: a later engine answers from a graph's kept operator arrays exactly as from the graph
itself, a damaged file is priced again, other contexts are pruned, and a search's outcomes do not depend on it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tp_query.engine import costcache
from tp_query.engine.parallel import ParallelConfig
from tp_query.engine.predict import Engine, PredictRequest
from tp_query.engine.search import SearchSpace, search
from tp_query.schema.precision import Setting

from .conftest import TINY_LLAMA


def _req(**par: int) -> PredictRequest:
    return PredictRequest(model=TINY_LLAMA, model_name="tiny", gpu="cpu", setting=Setting.AMP_BF16,
                          parallel=ParallelConfig(**par), seq_len=64)


SPLITS = ({"dp": 2, "global_batch": 8}, {"pp": 2, "micro_batch": 2, "global_batch": 8},
          {"tp": 2, "dp": 2, "zero": 3, "global_batch": 4})


def _answer(eng: Engine, req: PredictRequest) -> tuple[object, ...]:
    p = eng.predict(req)
    return (p.iteration_ms, p.peak_memory_gib, p.breakdown, p.sources, p.memory, p.hardware_tflops_per_gpu,
            p.stages, p.sections, p.warnings)


def test_a_later_engine_answers_from_the_costed_graph_exactly(cpu_db: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path / "cache"))
    first = Engine("cpu", str(cpu_db))
    built = [_answer(first, _req(**s)) for s in SPLITS]
    files = sorted((tmp_path / "cache" / "costed").rglob("*.bin"))
    assert len(files) == 3  # one per graph: the three splits differ in micro-batch or TP
    again = Engine("cpu", str(cpu_db))
    again.predict(_req(dp=4, global_batch=8))  # DP and ZeRO do not change the graph: nothing new kept
    assert sorted((tmp_path / "cache" / "costed").rglob("*.bin")) == files
    later = Engine("cpu", str(cpu_db))
    assert [_answer(later, _req(**s)) for s in SPLITS] == built
    assert all(id(g) in later._precosted for g in later._graphs.values())  # every answer came from the kept arrays
    # per-operator rows need every operator: the full graph, the same totals
    p = later.predict(_req(**SPLITS[0]), with_ops=True)
    assert p.ops and p.iteration_ms == built[0][0]
    assert sum(r.total_ms for r in p.ops if r.phase == "fwd") > 0


def test_a_damaged_costed_graph_is_priced_again(cpu_db: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path / "cache"))
    want = _answer(Engine("cpu", str(cpu_db)), _req(dp=2, global_batch=8))
    (f,) = (tmp_path / "cache" / "costed").rglob("*.bin")
    good = f.read_bytes()
    flipped = bytearray(good)
    flipped[-100] ^= 0x40  # one bit of an array: it still decodes, to other numbers
    for bad in (good[:-5], good[:40], b"not a costed graph", good + b"x", good.replace(b'"fwd"', b'"xyz"', 1),
                bytes(flipped)):
        f.write_bytes(bad)
        assert costcache.CostedGraphs.load(f) is None
        eng = Engine("cpu", str(cpu_db))
        assert _answer(eng, _req(dp=2, global_batch=8)) == want
        assert not eng._precosted  # built from the graph, not from the damaged file
        assert f.read_bytes() == good  # and kept again


def test_pruning_removes_the_oldest_other_contexts_then_the_oldest_own_files(tmp_path: Path) -> None:
    for i, name in enumerate(("old", "mid", "new", "current")):
        d = tmp_path / name
        d.mkdir()
        (d / "a.bin").write_bytes(b"x" * 1000)
        os.utime(d / "a.bin", (1_000_000 + i, 1_000_000 + i))
    (tmp_path / "current" / "b.bin").write_bytes(b"x" * 1000)
    os.utime(tmp_path / "current" / "b.bin", (1_000_010, 1_000_010))
    assert costcache.prune(tmp_path, keep="current", cap_bytes=3500) == ["old", "mid"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "new"]
    assert costcache.prune(tmp_path, keep="current", cap_bytes=1000) == ["new", "current/a.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["current"]
    assert [p.name for p in (tmp_path / "current").iterdir()] == ["b.bin"]  # the newest stays


def test_a_search_is_the_same_from_an_empty_and_a_warm_costed_cache(cpu_db: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path / "cache"))
    space = SearchSpace(4, 8, 64, micro_batches=(1, 2), zero_stages=(0, 1, 3), recompute=(False,))

    def outcomes() -> list[tuple[object, ...]]:
        r = search(Engine("cpu", str(cpu_db)), TINY_LLAMA, space, jobs=1)
        return sorted((o.candidate.label(), o.iteration_ms, o.peak_memory_gib, o.fits, o.reason,
                       tuple(sorted(o.breakdown.items()))) for o in r.ranked + r.rejected)

    empty = outcomes()
    assert list((tmp_path / "cache" / "costed").rglob("*.bin"))
    assert outcomes() == empty
