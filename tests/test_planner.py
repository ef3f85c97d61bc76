"""Planning: search over splits, the Python API, plots, and the database read from object storage."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from tp_query.engine.api import predict as api_predict
from tp_query.engine.api import search as api_search
from tp_query.engine.db import DatabaseError
from tp_query.engine.predict import Engine
from tp_query.engine.search import SearchError, SearchSpace, search
from tp_query.schema.messages import TpQueryError
from tp_query.schema.precision import Setting

from .conftest import TINY_LLAMA, run_cli


def test_search_ranks_valid_configurations(cpu_db: Path) -> None:
    eng = Engine("cpu", str(cpu_db))
    res = search(eng, TINY_LLAMA, SearchSpace(4, 8, 64, micro_batches=(1, 2), zero_stages=(0, 1),
                                              recompute=(False,), sequence_parallel=(False,)),
                 tokens=1e6, price_per_gpu_hour=2.0)
    assert res.ranked and all(o.fits for o in res.ranked)
    times = [o.iteration_ms for o in res.ranked]
    assert times == sorted(times)
    labels = {o.candidate.label() for o in res.ranked}
    assert any("TP2" in s for s in labels) and any("DP4" in s for s in labels)
    # tiny llama has 4 heads and 2 KV heads: TP=4 divides heads but not KV heads
    assert any("does not divide the KV heads" in o.reason for o in res.rejected)
    best = res.ranked[0]
    assert best.job_hours == pytest.approx(1e6 / best.tokens_per_s / 3600)
    assert best.cost == pytest.approx(best.job_hours * 4 * 2.0)
    df = res.to_polars()
    assert df.height == len(res.ranked) and "iteration_ms" in df.columns


def test_search_traces_its_graphs_in_worker_processes(cpu_db: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With jobs > 1 the uncached graphs are traced in worker processes into the graph cache first: the ranking
    is the one a single process gives, every graph is in the cache, and a warm rerun traces nothing."""
    from tp_query.engine import graphcache

    space = SearchSpace(4, 8, 64, micro_batches=(1, 2), zero_stages=(0,), recompute=(False,),
                        sequence_parallel=(False,))
    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path / "serial"))
    one = search(Engine("cpu", str(cpu_db)), TINY_LLAMA, space, jobs=1)
    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path / "parallel"))
    seen: list[tuple[int, int]] = []
    two = search(Engine("cpu", str(cpu_db)), TINY_LLAMA, space, jobs=2, progress=lambda i, n: seen.append((i, n)))
    assert [(o.candidate.label(), o.iteration_ms) for o in two.ranked] == \
        [(o.candidate.label(), o.iteration_ms) for o in one.ranked]
    traced = sorted(p.name for p in (tmp_path / "parallel" / "graphs").glob("*.json.gz"))
    assert traced == sorted(p.name for p in (tmp_path / "serial" / "graphs").glob("*.json.gz")) and len(traced) >= 2
    assert seen[0][1] == len(traced)  # the tracing phase reported its graphs
    from tp_query.engine.predict import PredictRequest
    from tp_query.engine.search import candidates
    from tp_query.schema.model_config import parse_config

    reqs = [PredictRequest(model=TINY_LLAMA, model_name="model", gpu="cpu", setting=c.precision, parallel=c.parallel,
                           seq_len=64) for c, why in candidates(parse_config(TINY_LLAMA), space) if not why]
    assert all(graphcache._cached_key(r) is None for r in reqs)  # all cached: nothing to trace
    assert graphcache.trace_missing(reqs, 2) == 0
    with pytest.raises(SearchError, match="--jobs"):
        search(Engine("cpu", str(cpu_db)), TINY_LLAMA, space, jobs=-1)


def test_search_evaluates_in_worker_processes_with_the_same_outcomes(cpu_db: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With jobs > 1 the candidates are dealt to worker processes by precision and TP degree: every outcome
    (time, memory, fit, reason, breakdown) and the order of both lists equal one process's, and progress
    reaches the candidate count."""
    from tp_query.engine import search as search_mod

    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(search_mod, "PARALLEL_MIN_CANDIDATES", 0)  # a tiny search, dealt out all the same
    space = SearchSpace(4, 8, 64, precisions=(Setting.AMP_BF16, Setting.BF16, Setting.FP32), micro_batches=(1, 2),
                        zero_stages=(0, 1, 3), recompute=(False,))
    one = search(Engine("cpu", str(cpu_db)), TINY_LLAMA, space, jobs=1)
    seen: list[tuple[int, int]] = []
    two = search(Engine("cpu", str(cpu_db)), TINY_LLAMA, space, jobs=2, progress=lambda i, n: seen.append((i, n)))
    assert two.evaluated == one.evaluated > 10
    for a, b in ((one.ranked, two.ranked), (one.rejected, two.rejected)):
        assert [o.row() for o in a] == [o.row() for o in b]
    assert seen[-1] == (one.evaluated, one.evaluated)


def test_fp8_under_tensor_parallelism_is_refused_not_guessed(cpu_db: Path, tiny_llama_file: Path) -> None:
    """torchao's float8 TP styles are not modelled: predict refuses in one line (with or without SP) and a search
    over fp8 rejects its TP candidates with that reason instead of crashing in the trace."""
    eng = Engine("cpu", str(cpu_db))
    res = search(eng, TINY_LLAMA, SearchSpace(2, 2, 64, precisions=(Setting.FP8_TENSORWISE,), micro_batches=(1,),
                                              zero_stages=(0,), recompute=(False,), sequence_parallel=(False, True)))
    tp = [o for o in res.rejected if o.candidate.parallel.tp > 1]
    assert len(tp) == 2 and all("modelled at TP=1" in o.reason for o in tp)
    assert all(o.candidate.parallel.tp == 1 for o in res.ranked + res.rejected if o not in tp)
    for sp in ((), ("--sequence-parallel",)):
        r = run_cli("predict", str(tiny_llama_file), "--gpu", "cpu", "--db", str(cpu_db), "--tp", "2",
                    "--precision", "fp8_tensorwise", *sp)
        assert r.returncode == 2 and "modelled at TP=1" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_search_bad_input(cpu_db: Path) -> None:
    eng = Engine("cpu", str(cpu_db))
    with pytest.raises(SearchError, match="empty"):
        search(eng, TINY_LLAMA, SearchSpace(4, 8, 64, precisions=()))
    with pytest.raises(SearchError, match="no split"):
        search(eng, TINY_LLAMA, SearchSpace(3, 7, 64, micro_batches=(2,)))
    # a global batch every split divides but whose micro-batch count no job reaches: that reason, not "divides"
    with pytest.raises(SearchError, match="beyond any real job"):
        search(eng, TINY_LLAMA, SearchSpace(1, (1 << 31) - 1, 64, micro_batches=(1,)))
    # a token count beyond a float is refused in one line (math.isfinite overflowed on it)
    with pytest.raises(SearchError, match="tokens must be"):
        search(eng, TINY_LLAMA, SearchSpace(2, 4, 64), tokens=10**400)
    r = run_cli("search", str(Path(__file__).parent / "nonexistent.json"), "--gpus", "4", "--global-batch", "8")
    assert r.returncode == 2 and "not found" in r.stderr


def test_search_cli_json(cpu_db: Path, tiny_llama_file: Path) -> None:
    r = run_cli("search", str(tiny_llama_file), "--gpus", "2", "--global-batch", "4", "--seq-len", "64",
                "--gpu", "cpu", "--db", str(cpu_db), "--json", "--micro-batch", "1", "--show-unfit")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["ranked"] and {"dp", "tp", "pp", "iteration_ms", "fits"} <= set(d["ranked"][0])


def test_python_api(cpu_db: Path, tiny_llama_file: Path) -> None:
    p = api_predict(tiny_llama_file, gpu="cpu", db=str(cpu_db), precision="fp32", seq_len=64, with_ops=True)
    assert p.iteration_ms > 0 and p.config["precision"] == "fp32"
    from tp_query.engine.api import prediction_frame

    assert prediction_frame(p).height == len(p.ops)
    from tp_query.engine.api import TpQueryError

    with pytest.raises(TpQueryError, match="with_ops=True"):  # an empty frame read as a step of no operators
        prediction_frame(api_predict(tiny_llama_file, gpu="cpu", db=str(cpu_db), precision="fp32", seq_len=64))
    r = api_search(TINY_LLAMA, gpus=2, global_batch=2, seq_len=64, gpu="cpu", db=str(cpu_db), micro_batches=(1,))
    assert r.ranked
    from tp_query.engine.parallel import ParallelConfig
    from tp_query.engine.predict import PredictError

    with pytest.raises(PredictError, match="given twice"):  # a keyword beside parallel= was silently dropped
        api_predict(tiny_llama_file, gpu="cpu", db=str(cpu_db), seq_len=64, parallel=ParallelConfig(dp=2), tp=2)
    same = api_predict(tiny_llama_file, gpu="cpu", db=str(cpu_db), seq_len=64, parallel=ParallelConfig(dp=2))
    assert same.iteration_ms == api_predict(tiny_llama_file, gpu="cpu", db=str(cpu_db), seq_len=64, dp=2).iteration_ms
    beyond = TINY_LLAMA["max_position_embeddings"] * 2
    p = api_predict(tiny_llama_file, gpu="cpu", db=str(cpu_db), seq_len=beyond)
    assert any("exceeds the model's max_position_embeddings" in w for w in p.warnings)
    assert not any("max_position_embeddings" in w for w in same.warnings)


def test_api_inputs_are_checked_not_coerced(cpu_db: Path, tiny_llama_file: Path) -> None:
    """Each wrong value an API caller can pass is one TpQueryError, never a silent reading or a raw exception."""
    import numpy as np
    from tp_query.engine.api import TpQueryError
    from tp_query.engine.parallel import ParallelConfig

    kw = dict(gpu="cpu", db=str(cpu_db), seq_len=64)
    bad: list[tuple[dict[str, object], str]] = [
        ({"recompute": "none"}, "True or False"), ({"sequence_parallel": "no", "tp": 2}, "True or False"),
        ({"zero": True, "dp": 2}, "ZeRO stage"), ({"dp": 2.0}, "DP must be"), ({"global_batch": 0}, "global batch"),
        ({"global_batch": False}, "global batch"), ({"moe_imbalance": "2"}, "moe_imbalance"),
        ({"parallel": {"dp": 2}}, "ParallelConfig"), ({"precision": "BF16"}, "choose from"),
        ({"parallel": ParallelConfig(dp=2), "dp": 1}, "given twice"), ({"strict": "yes"}, "strict"),
        ({"with_ops": "no"}, "with_ops= must be True or False"),
    ]
    for extra, msg in bad:
        with pytest.raises(TpQueryError, match=msg):
            api_predict(tiny_llama_file, **kw, **extra)  # type: ignore[arg-type]
    with pytest.raises(TpQueryError, match="JSON text"):
        api_predict(json.dumps(TINY_LLAMA), **kw)  # type: ignore[arg-type]
    # where the answer comes from, and the stack: each of its type (an AttributeError or TypeError before)
    from tp_query.engine.api import search as api_search
    for where, msg in (({"gpu": None}, "gpu="), ({"gpu": 5}, "gpu="), ({"db": []}, "db="),
                       ({"torch_version": []}, "torch_version=")):
        with pytest.raises(TpQueryError, match=msg):
            api_predict(tiny_llama_file, **{**kw, **where})  # type: ignore[arg-type]
        with pytest.raises(TpQueryError, match=msg):
            api_search(tiny_llama_file, gpus=2, global_batch=4, seq_len=64, **{"gpu": "cpu", "db": str(cpu_db),
                                                                              **where})  # type: ignore[arg-type]
    for fw in ("jax", None):
        with pytest.raises(TpQueryError, match="unknown framework"):
            api_search(tiny_llama_file, gpus=2, global_batch=4, seq_len=64, gpu="cpu", db=str(cpu_db),
                       framework=fw)  # type: ignore[arg-type]
    # numpy's integers and bools are the numbers they hold
    a = api_predict(tiny_llama_file, **kw, dp=np.int64(2), recompute=np.bool_(True))  # type: ignore[arg-type]
    b = api_predict(tiny_llama_file, **kw, dp=2, recompute=True)  # type: ignore[arg-type]
    assert a.iteration_ms == b.iteration_ms and a.config == b.config
    s = dict(gpus=2, global_batch=2, seq_len=64, gpu="cpu", db=str(cpu_db), micro_batches=(1,))
    for extra, msg in (({"precisions": []}, "empty"), ({"precisions": "bf16"}, "must be a list"),
                       ({"price_per_gpu_hour": 2.0}, "tokens"), ({"gpus": 8192}, "no split")):
        with pytest.raises(TpQueryError, match=msg):
            api_search(TINY_LLAMA, **{**s, **extra})  # type: ignore[arg-type]
    r = api_search(TINY_LLAMA, **{**s, "precisions": ["fp32", "fp32", Setting.FP32], "micro_batches": [1, 1]})
    labels = [o.candidate.label() for o in r.ranked + r.rejected]
    assert len(labels) == len(set(labels))
    huge = api_search(TINY_LLAMA, **{**s, "gpus": 8192, "global_batch": 8192})  # PP=8192 is no candidate, not an abort
    assert huge.ranked and all(o.candidate.parallel.pp <= 4096 for o in huge.ranked + huge.rejected)
    best = r.ranked[0]  # the best rows say where their numbers come from, as predict does
    assert best.sources and abs(sum(best.sources.values()) - 1) < 1e-9
    assert best.row()["source_exact"] == best.sources["exact"]


def test_api_config_dicts_read_as_their_json_would(cpu_db: Path) -> None:
    """A config dict is read as its JSON file would be: numpy numbers as the values they hold, and what no file can
    hold (NaN, a cycle, an integer of thousands of digits, nesting past any config) one TpQueryError, not a raw
    ValueError or RecursionError from the graph key; list options of lists and the helpers' wrong arguments too."""
    import numpy as np
    from tp_query.engine.api import TpQueryError, engine, prediction_frame

    kw = dict(gpu="cpu", db=str(cpu_db), seq_len=64)
    base = api_predict(dict(TINY_LLAMA), **kw)  # type: ignore[arg-type]
    as_numpy = {**TINY_LLAMA, "num_hidden_layers": np.int64(TINY_LLAMA["num_hidden_layers"]),
                "tie_word_embeddings": np.bool_(bool(TINY_LLAMA.get("tie_word_embeddings", False)))}
    assert api_predict(as_numpy, **kw).iteration_ms == base.iteration_ms  # type: ignore[arg-type]
    assert api_predict(dict(TINY_LLAMA), **{**kw, "seq_len": np.int64(64)}).iteration_ms == base.iteration_ms
    cyclic: dict[str, object] = dict(TINY_LLAMA)
    cyclic["self"] = cyclic
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    for cfg, msg in (({**TINY_LLAMA, "x": float("nan")}, "x: NaN and Infinity"), (cyclic, "Circular"),
                     ({**TINY_LLAMA, "x": 10**5000}, "thousands of digits"), ({**TINY_LLAMA, "x": deep}, "deeply"),
                     ({**TINY_LLAMA, "x": object()}, "no JSON value")):
        with pytest.raises(TpQueryError, match=msg):
            api_predict(cfg, **kw)  # type: ignore[arg-type]
    r = api_search(TINY_LLAMA, gpus=np.int64(2), global_batch=np.int64(2), seq_len=64, gpu="cpu", db=str(cpu_db),
                   micro_batches=[np.int64(1)])  # type: ignore[arg-type]
    assert r.ranked
    with pytest.raises(TpQueryError, match="single values"):
        api_search(TINY_LLAMA, gpus=2, global_batch=2, seq_len=64, gpu="cpu", db=str(cpu_db),
                   micro_batches=[[1]])  # type: ignore[list-item]
    with pytest.raises(TpQueryError, match="gpu="):
        engine(None)  # type: ignore[arg-type]
    with pytest.raises(TpQueryError, match="takes a Prediction"):
        prediction_frame(None)  # type: ignore[arg-type]


def test_api_engine_follows_the_database_named_now(cpu_db: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared engine is the database the call names now: $TP_QUERY_DB changed to a missing folder, or a
    relative folder after a change of directory, is refused, not answered from the engine built before."""
    from tp_query.engine.api import TpQueryError

    monkeypatch.setenv("TP_QUERY_DB", str(cpu_db))
    assert api_predict(dict(TINY_LLAMA), gpu="cpu", seq_len=64).iteration_ms > 0
    monkeypatch.setenv("TP_QUERY_DB", str(tmp_path / "nowhere"))
    with pytest.raises(TpQueryError):
        api_predict(dict(TINY_LLAMA), gpu="cpu", seq_len=64)
    monkeypatch.delenv("TP_QUERY_DB")
    monkeypatch.chdir(cpu_db.parent)
    assert api_predict(dict(TINY_LLAMA), gpu="cpu", db=cpu_db.name, seq_len=64).iteration_ms > 0
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TpQueryError):
        api_predict(dict(TINY_LLAMA), gpu="cpu", db=cpu_db.name, seq_len=64)


def test_api_predictions_from_threads_equal_one_at_a_time(tmp_path: Path) -> None:
    """Eight threads asking at once from a fresh cache get the answers one thread gets (threads interleaving
    tracing and the engine's caches got other requests' numbers, and kept them in the cache on disk)."""
    code = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
from tp_query.engine.api import predict
m = sys.argv[1]
cases = [dict(dp=2, tp=2), dict(dp=2), dict(tp=4, seq_len=2048), dict(pp=2, global_batch=4)] * 2
if sys.argv[2] == "threads":
    with ThreadPoolExecutor(8) as ex:
        out = list(ex.map(lambda c: predict(m, **c).iteration_ms, cases))
else:
    out = [predict(m, **c).iteration_ms for c in cases]
print(json.dumps(out))
"""
    model = str(Path(__file__).resolve().parents[1] / "examples" / "qwen3-4b.json")

    def run(how: str, cache: str) -> list[float]:
        env = {**os.environ, "TP_QUERY_CACHE": str(tmp_path / cache)}
        r = subprocess.run([sys.executable, "-c", code, model, how], capture_output=True, text=True, env=env,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-800:]
        return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    threaded = run("threads", "a")
    assert threaded == run("serial", "b")
    assert run("serial", "a") == threaded  # what the threads kept on disk answers the same


def test_plots(cpu_db: Path, tiny_llama_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.svg"
    r = run_cli("plot", "breakdown", "--model", str(tiny_llama_file), "--gpu", "cpu", "--db", str(cpu_db),
                "--seq-len", "64", "--precision", "fp32", "--precision", "amp_bf16", "-o", str(out))
    assert r.returncode == 0, r.stderr
    svg = out.read_text()
    assert "<svg" in svg[:400] and "amp_bf16" in svg and "forward" in svg  # ours, or matplotlib's with text kept
    out2 = tmp_path / "l.svg"
    r = run_cli("plot", "latency", "--kind", "mm", "--gpu", "cpu", "--db", str(cpu_db), "-o", str(out2))
    assert r.returncode == 0, r.stderr
    assert "<svg" in out2.read_text()[:400]
    # the library-free writer: measurements of different shapes are points, never joined into lines
    from tp_query.engine import plot as P

    latency = P.Chart("points", "t", "x", "y", series=[P.Series("bf16", [1.0, 2.0, 4.0], [1.0, 3.0, 2.0])]).svg()
    assert latency.startswith("<svg") and "<circle" in latency and "<path" not in latency
    r = run_cli("plot", "latency", "--kind", "nope", "--gpu", "cpu", "--db", str(cpu_db), "-o", str(out2))
    assert r.returncode == 2 and "no measurements" in r.stderr
    for name in ("l.txt", "l.pdf", "l.png"):  # a file is what its suffix says, or it is not written
        r = run_cli("plot", "latency", "--kind", "mm", "--gpu", "cpu", "--db", str(cpu_db), "-o",
                    str(tmp_path / name))
        try:
            import matplotlib  # noqa: F401

            has_mpl = name != "l.txt"
        except ImportError:
            has_mpl = False
        if has_mpl:
            head = (tmp_path / name).read_bytes()[:8]
            assert r.returncode == 0 and head.startswith(b"%PDF" if name.endswith("pdf") else b"\x89PNG")
        else:
            assert r.returncode == 2 and not (tmp_path / name).exists() and len(r.stderr.strip().splitlines()) == 1


def test_plot_breakdown_takes_what_predict_takes(cpu_db: Path, tiny_llama_file: Path, tmp_path: Path) -> None:
    """A pipeline split needs the global batch (and schedule) its refusal names, and plot has those options; a
    graph file is plotted at its own precision, sequence and micro-batch (it was refused at every other one);
    plot latency names an unknown precision as one."""
    db = ["--gpu", "cpu", "--db", str(cpu_db)]
    out = tmp_path / "b.svg"
    r = run_cli("plot", "breakdown", "--model", str(tiny_llama_file), *db, "--seq-len", "64", "--precision", "fp32",
                "--pp", "2", "-o", str(out))
    assert r.returncode == 2 and "global batch" in r.stderr
    r = run_cli("plot", "breakdown", "--model", str(tiny_llama_file), *db, "--seq-len", "64", "--precision", "fp32",
                "--pp", "2", "--global-batch", "4", "--pp-schedule", "gpipe", "-o", str(out))
    assert r.returncode == 0 and "PP2" in out.read_text(), r.stderr
    graph = tmp_path / "g.json.gz"
    r = run_cli("trace", str(tiny_llama_file), "-o", str(graph), "--precision", "bf16", "--seq-len", "32",
                "--micro-batch", "2")
    assert r.returncode == 0, r.stderr
    r = run_cli("plot", "breakdown", "--model", str(graph), *db, "-o", str(out))
    assert r.returncode == 0 and ">bf16<" in out.read_text() and ">fp32<" not in out.read_text(), r.stderr
    r = run_cli("plot", "latency", "--precision", "amp_bf16", *db, "-o", str(tmp_path / "l.svg"))
    assert r.returncode == 2 and "not an operator precision" in r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_server() -> str:
    pytest.importorskip("moto")
    boto3 = pytest.importorskip("boto3")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    os.environ.update({"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": url})
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="fleet")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_database_on_object_storage(s3_server: str, cpu_db: Path, tmp_path: Path) -> None:
    """A fleet shares one database in object storage; DuckDB reads it in place through httpfs."""
    import boto3
    from tp_query.schema import manifest

    s3 = boto3.client("s3", endpoint_url=s3_server)
    base = cpu_db / "cpu"
    cal = json.dumps({"fwd_us": 12.0, "bwd_us": 6.0, "opt_us": 15.0, "per_tensor_us": 1.0,
                      "per_iteration_us": 300.0, "beta": 0.5})
    s3.put_object(Bucket="fleet", Key="profiles/cpu/calibration.json", Body=cal.encode())
    m = manifest.load(base)
    m["files"]["calibration.json"] = {"sha256": manifest.sha256_bytes(cal.encode()), "bytes": len(cal)}
    s3.put_object(Bucket="fleet", Key="profiles/cpu/manifest.json", Body=json.dumps(m).encode())
    for rel in manifest.tracked_files(base):
        s3.upload_file(str(base / rel), "fleet", f"profiles/cpu/{rel}")
    try:
        remote = Engine("cpu", "s3://fleet/profiles")
    except Exception as e:  # httpfs must be installable (it is downloaded once by DuckDB)
        if "httpfs" in str(e):
            pytest.skip(f"DuckDB httpfs unavailable here: {e}")
        raise
    local = Engine("cpu", str(cpu_db))
    n_remote = remote.db.sql("SELECT count(*) AS n FROM ops").to_pylist()[0]["n"]
    n_local = local.db.sql("SELECT count(*) AS n FROM ops").to_pylist()[0]["n"]
    assert n_remote == n_local > 0
    from tp_query.engine.predict import PredictRequest

    req = PredictRequest(model=TINY_LLAMA, model_name="tiny", gpu="cpu", setting=Setting.AMP_BF16, seq_len=64)
    p = remote.predict(req)
    assert p.config["calibration"] == "s3://fleet/profiles/cpu/calibration.json"  # read from the bucket too
    assert p.iteration_ms > 0
    # a damaged object is named, as a local file would be
    rel = manifest.tracked_files(base)[0]
    data = bytearray((base / rel).read_bytes())
    data[len(data) // 2] ^= 0x10
    s3.put_object(Bucket="fleet", Key=f"profiles/cpu/{rel}", Body=bytes(data))
    with pytest.raises(DatabaseError, match=f"{rel}: checksum mismatch"):
        Engine("cpu", "s3://fleet/profiles")
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_search_writes_every_configuration_and_how_to_launch_the_best(cpu_db: Path, tiny_llama_file: Path,
                                                                       tmp_path: Path) -> None:
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    base = ["search", str(tiny_llama_file), "--gpus", "4", "--global-batch", "8", "--seq-len", "64", "--gpu", "cpu",
            "--db", str(cpu_db)]
    r = run_cli(*base, "--output", str(tmp_path / "all.parquet"), "--json")
    assert r.returncode == 0, r.stderr
    t = pq.read_table(tmp_path / "all.parquet")
    shown = json.loads(r.stdout)
    assert t.num_rows >= len(shown["ranked"]) > 0 and {"dp", "tp", "pp", "iteration_ms", "fits"} <= set(t.column_names)
    best = shown["ranked"][0]
    for name in ("ALL.PARQUET", ".parquet"):  # the suffix read as the check reads it: Parquet, never CSV inside
        r = run_cli(*base, "--output", str(tmp_path / name))
        assert r.returncode == 0 and pq.read_table(tmp_path / name).num_rows == t.num_rows, r.stderr
    r = run_cli(*base, "--output", str(tmp_path / "all.csv"), "--emit", "torchrun")
    assert r.returncode == 0 and f"--dp {best['dp']} --tp {best['tp']} --pp {best['pp']}" in r.stdout
    written = pacsv.read_csv(tmp_path / "all.csv")
    assert written.num_rows == t.num_rows
    # every fitting row says where its time comes from, the host model's share included (sums to 1)
    cols = [c for c in written.column_names if c.startswith("source_")]
    assert "source_host_model" in cols
    for row in written.to_pylist():
        if row["fits"]:
            assert abs(sum(row[c] or 0.0 for c in cols) - 1.0) < 1e-9, row
    mcore = [*base, "--framework", "megatron", "--precision", "mp_bf16"]  # Megatron-LM's launch: its own ranking
    r = run_cli(*mcore, "--json")
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)["ranked"][0]
    r = run_cli(*mcore, "--emit", "megatron", "--optimizer", "sgd")
    assert r.returncode == 0, r.stderr
    assert f"--tensor-model-parallel-size {best['tp']} " in r.stdout and "pretrain_gpt.py" in r.stdout
    assert "--global-batch-size 8" in r.stdout and "--bf16" in r.stdout
    # everything the prediction assumed is on the line: the optimizer and the model's shape
    assert "--optimizer sgd --sgd-momentum 0" in r.stdout  # as priced: Megatron-LM's own default is 0.9
    assert "# optimizer as priced: torch's SGD without momentum" in r.stdout
    assert "--optimizer sgd" in r.stdout and f"--num-layers {TINY_LLAMA['num_hidden_layers']} " in r.stdout
    assert f"--hidden-size {TINY_LLAMA['hidden_size']} " in r.stdout and "--swiglu" in r.stdout
    # Megatron-LM's defaults that would run (or fail to build) something else than was priced: apex's weight-gradient
    # fusion, the fused softmax in bf16, a NaN check of every gradient buffer; --rotary-base is an integer there
    for flag in ("--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--attention-softmax-in-fp32",
                 "--no-check-for-nan-in-loss-and-grad", f"--rotary-base {int(TINY_LLAMA.get('rope_theta', 10000))} "):
        assert flag in r.stdout, flag
    big_theta = tmp_path / "theta.json"
    big_theta.write_text(json.dumps({**TINY_LLAMA, "rope_theta": 1e6}))
    r16 = run_cli(*[big_theta if a == str(tiny_llama_file) else ("mp_fp16" if a == "mp_bf16" else a) for a in mcore],
                  "--emit", "megatron")
    assert r16.returncode == 0 and "--rotary-base 1000000 " in r16.stdout, r16.stderr
    assert "--fp16 --accumulate-allreduce-grads-in-fp32" in r16.stdout  # fp32 reduction, as priced
    # Megatron-LM pads the vocabulary to 128 x TP unless told otherwise; the prediction priced the model's own
    padded = bool(TINY_LLAMA["vocab_size"] % (128 * best["tp"]))
    assert ("--make-vocab-size-divisible-by 1" in r.stdout) == padded
    odd = tmp_path / "odd-vocab.json"
    odd.write_text(json.dumps({**TINY_LLAMA, "vocab_size": TINY_LLAMA["vocab_size"] + 4}))
    r = run_cli(*[odd if a == str(tiny_llama_file) else a for a in mcore], "--emit", "megatron")
    assert r.returncode == 0 and "--make-vocab-size-divisible-by 1" in r.stdout, r.stderr
    r = run_cli(*base, "--emit", "torchrun", "--optimizer", "sgd")
    assert r.returncode == 0 and "--optimizer sgd" in r.stdout, r.stderr
    r = run_cli(*base, "--output", str(tmp_path / "x.xlsx"))
    assert r.returncode == 2 and "--output must end in .parquet or .csv" in r.stderr
    # a line that would launch another stack or another world size is refused, before the search
    r = run_cli(*mcore, "--emit", "torchrun")
    assert r.returncode == 2 and "--emit megatron" in r.stderr, r.stderr
    r = run_cli("search", str(tiny_llama_file), "--gpus", "12", "--global-batch", "24", *base[6:], "--emit", "torchrun")
    assert r.returncode == 2 and "no whole number of 8-GPU nodes" in r.stderr, r.stderr
    r = run_cli(*[a if a != "mp_bf16" else "tf32" for a in mcore], "--emit", "megatron")
    assert r.returncode == 0 and "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 torchrun" in r.stdout, r.stderr
    r = run_cli(*[a if a != "mp_bf16" else "fp32" for a in mcore], "--emit", "megatron")
    assert r.returncode == 0 and "TF32" not in r.stdout, r.stderr


def test_launch_lines_start_what_was_priced_and_tp_groups_stay_inside_nodes(cpu_db: Path, tiny_llama_file: Path
                                                                            ) -> None:
    """An audit's findings: a Megatron-LM line with TP > 1 sets CUDA_DEVICE_MAX_CONNECTIONS=1 (validate_args refuses
    it otherwise), never asks fewer positions than the sequence, carries the config's Llama-3 RoPE factor (the
    parser's default is 8), and a line over several nodes names each node's rank and the master; a TP that divides
    neither the node nor a whole number of nodes is refused by predict and search alike (its groups would straddle
    nodes, priced as NVLink); "all" given with other precisions is refused, not taken alone."""
    from tp_query.engine.parallel import ParallelConfig, straddle_refusal
    from tp_query.engine.predict import Engine, PredictError, PredictRequest
    from tp_query.engine.search import Candidate, Outcome, launch_command
    from tp_query.schema.model_config import parse_config, rope_scaling_factor
    from tp_query.schema.precision import Setting

    cfg = {**TINY_LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
           "max_position_embeddings": 128}
    spec = parse_config(cfg)

    def line(tp: int, dp: int, seq: int) -> str:
        par = ParallelConfig(dp=dp, tp=tp, framework="megatron", global_batch=dp * 2)
        o = Outcome(Candidate(Setting.MP_BF16, par), 10.0, 1.0, 1.0, True)
        return launch_command(o, "megatron", "m.json", seq, spec=spec, rope_factor=rope_scaling_factor(cfg))

    one = line(2, 1, 256)
    assert one.splitlines()[-1].startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nnodes 1 ")
    assert "--max-position-embeddings 256 " in one and "--use-rope-scaling --rope-scaling-factor 32 " in one
    from tp_query.engine.search import SearchError
    o = Outcome(Candidate(Setting.MP_BF16, ParallelConfig(tp=2, framework="megatron", global_batch=2)), 10.0, 1.0,
                1.0, True)
    with pytest.raises(SearchError, match="scaling factor"):  # not Megatron-LM's default in its place
        launch_command(o, "megatron", "m.json", 256, spec=spec)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in line(1, 2, 64) and "--max-position-embeddings 128 " in line(1, 2, 64)
    multi = line(2, 8, 64)
    assert "--nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER_ADDR" in multi
    assert straddle_refusal(3, 24, 8) and straddle_refusal(6, 24, 8) and not straddle_refusal(3, 6, 8)
    assert not straddle_refusal(4, 24, 8) and not straddle_refusal(16, 32, 8)
    eng = Engine("cpu", str(cpu_db))
    wide = {**TINY_LLAMA, "num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 96,
            "intermediate_size": 192, "vocab_size": 510}
    with pytest.raises(PredictError, match="straddle two nodes"):
        eng.predict(PredictRequest(model=wide, model_name="w", gpu="cpu", setting=Setting.BF16,
                                   parallel=ParallelConfig(dp=8, tp=3), seq_len=64))
    assert eng.predict(PredictRequest(model=wide, model_name="w", gpu="cpu", setting=Setting.BF16,
                                      parallel=ParallelConfig(dp=2, tp=3), seq_len=64)).iteration_ms > 0
    r = run_cli("search", str(tiny_llama_file), "--gpus", "4", "--global-batch", "8", "--gpu", "cpu", "--db",
                str(cpu_db), "--precision", "all", "--precision", "nonsense")
    assert r.returncode == 2 and "all alone" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_system_files_set_the_cluster(cpu_db: Path, tiny_llama_file: Path, tmp_path: Path) -> None:
    from tp_query.schema.system import load_system, presets

    assert {"h200-sxm-8x-ndr", "h100-sxm-8x-ndr"} <= set(presets())
    h200 = load_system("h200-sxm-8x-ndr")
    assert h200.gpus_per_node == 8 and h200.network_bytes_per_s == 50e9
    one_per_node = tmp_path / "tiny-cluster.toml"
    one_per_node.write_text('gpu = "cpu"\ngpus_per_node = 1\nnvlink_gbytes_per_s = 5\nnvlink_latency_us = 20\n'
                            'network_gbytes_per_s = 0.1\nnetwork_latency_us = 500\nprice_per_gpu_hour = 1.0\n')
    base = ["predict", str(tiny_llama_file), "--gpu", "cpu", "--db", str(cpu_db), "--seq-len", "64", "--dp", "2",
            "--json"]
    alone = json.loads(run_cli(*base).stdout)
    r = run_cli(*base, "--system", str(one_per_node))
    assert r.returncode == 0, r.stderr
    apart = json.loads(r.stdout)
    assert apart["config"]["system"] == "tiny-cluster"
    assert apart["breakdown"]["dp_comm_ms"] > alone["breakdown"]["dp_comm_ms"]  # DP now crosses a slow network
    # the GPU named as --gpu takes it (any case, spaces around): the same cluster, not a mismatch
    upper = tmp_path / "upper.toml"
    upper.write_text(one_per_node.read_text().replace('gpu = "cpu"', 'gpu = " CPU "'))
    assert load_system(str(upper)).gpu == "cpu"
    r = run_cli(*base, "--system", str(upper))
    assert r.returncode == 0 and json.loads(r.stdout)["breakdown"] == apart["breakdown"], r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('gpu = "cpu"\ngpus_per_node = 1\nnvlink_gbytes_per_s = -5\n')
    r = run_cli(*base, "--system", str(bad))
    assert r.returncode == 2 and "nvlink_gbytes_per_s" in r.stderr


def test_a_system_files_nvlink_is_said_unused_where_measured_tables_price_it(tiny_llama_file: Path,
                                                                              tmp_path: Path) -> None:
    """The shipped database's NCCL tables price collectives inside a node: a system file's NVLink latency (or
    bandwidth) changed nothing and was not said to; the answer now says its NVLink figures are not used."""
    slow = tmp_path / "slow-nvlink.toml"
    slow.write_text('gpu = "h200"\ngpus_per_node = 8\nnvlink_gbytes_per_s = 450\nnvlink_latency_us = 5000\n'
                    'network_gbytes_per_s = 50\nnetwork_latency_us = 15\n')
    base = ["predict", str(tiny_llama_file), "--seq-len", "64", "--dp", "2", "--json"]
    r = run_cli(*base, "--system", str(slow))
    assert r.returncode == 0, r.stderr
    warned = json.loads(r.stdout)["warnings"]
    assert any("NVLink (450 GB/s, 5000 us) is not used" in w for w in warned), warned
    plain = json.loads(run_cli(*base).stdout)
    assert not any("is not used" in w for w in plain["warnings"])
    # host costs measured with 2 ranks standing for 8 are said to
    assert not any("ranks and stand for" in w for w in plain["warnings"])
    eight = json.loads(run_cli(*[a if a != "2" else "8" for a in base]).stdout)
    assert any("measured with 2 ranks and stand for this group of 8" in w for w in eight["warnings"])


def test_fsdp2_gathered_parameters_are_their_own_memory_line(cpu_db: Path, tiny_llama_file: Path) -> None:
    """FSDP2's unsharded parameters were reported as activations (ZeRO-2: twice DDP's activations)."""
    base = ["predict", str(tiny_llama_file), "--gpu", "cpu", "--db", str(cpu_db), "--seq-len", "64", "--dp", "2",
            "--json"]
    ddp = json.loads(run_cli(*base).stdout)["memory"]
    z2 = json.loads(run_cli(*base, "--zero", "2").stdout)["memory"]
    assert ddp["gathered_gib"] == 0 and z2["gathered_gib"] > 0
    assert z2["activations_gib"] == pytest.approx(ddp["activations_gib"], rel=1e-9)


def test_a_search_whose_worker_cannot_start_evaluates_everything_itself(cpu_db: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker process that fails to start (here: its engine refuses its arguments) hands its groups back: the
    search's outcomes are one process's, and progress still reaches the candidate count."""
    from tp_query.engine import search as search_mod

    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(search_mod, "PARALLEL_MIN_CANDIDATES", 0)
    space = SearchSpace(4, 8, 64, precisions=(Setting.AMP_BF16, Setting.BF16), micro_batches=(1, 2),
                        zero_stages=(0, 1), recompute=(False,))
    one = search(Engine("cpu", str(cpu_db)), TINY_LLAMA, space, jobs=1)
    eng = Engine("cpu", str(cpu_db))
    eng.init_args = ("no-such-gpu", *eng.init_args[1:])  # what the worker builds its engine from
    seen: list[tuple[int, int]] = []
    two = search(eng, TINY_LLAMA, space, jobs=2, progress=lambda i, n: seen.append((i, n)))
    assert [o.row() for o in two.ranked] == [o.row() for o in one.ranked]
    assert seen[-1] == (one.evaluated, one.evaluated)


def test_the_collector_pause_is_restored_as_it_was_even_on_error() -> None:
    """A search evaluates with the cyclic collector off and leaves it as it found it (on or off), also when the
    evaluation raises."""
    import gc

    from tp_query.engine.search import gc_paused

    for start in (True, False):
        (gc.enable if start else gc.disable)()
        try:
            with gc_paused():
                assert not gc.isenabled()
            assert gc.isenabled() == start
            with pytest.raises(RuntimeError), gc_paused():
                raise RuntimeError("boom")
            assert gc.isenabled() == start
        finally:
            gc.enable()


def test_search_tries_every_schedule_and_ddps_bucket_view(cpu_db: Path, tiny_llama_file: Path, tmp_path: Path) -> None:
    """A search is over what the stack runs: each pipeline schedule with PP > 1 (a split one schedule refuses is
    a rejected outcome with the schedule's reason, not dropped) and DDP with and without gradient_as_bucket_view."""
    eng = Engine("cpu", str(cpu_db))
    space = SearchSpace(2, 1, 64, micro_batches=(1,), recompute=(False,), sequence_parallel=(False,))
    res = search(eng, TINY_LLAMA, space)
    labels = {o.candidate.label(): o for o in res.ranked + res.rejected}
    # PP=2 with one micro-batch: PyTorch's Schedule1F1B refuses it (fewer micro-batches than stages), GPipe runs it
    assert "Schedule1F1B needs at least as many micro-batches" in labels["DP1 TP1 PP2 1f1b mb1 amp_bf16"].reason
    assert labels["DP1 TP1 PP2 gpipe mb1 amp_bf16"].fits
    res = search(eng, TINY_LLAMA, replace(space, gpus=4, global_batch=8))
    by = {o.candidate.label(): o for o in res.ranked}
    for sched in ("1f1b", "gpipe", "interleaved"):
        assert f"DP2 TP1 PP2 {sched} mb1 amp_bf16" in by, sched
    plain, view = by["DP4 TP1 PP1 mb1 amp_bf16"], by["DP4 TP1 PP1 mb1 amp_bf16+bucket_view"]
    assert view.candidate.parallel.ddp_bucket_view and view.peak_memory_gib < plain.peak_memory_gib
    assert not any("bucket_view" in s and "Z" in s for s in by)  # DDP's option only: never beside FSDP2
    only = search(eng, TINY_LLAMA, replace(space, gpus=4, global_batch=8, pp_schedules=("gpipe",)))
    assert {o.candidate.parallel.pp_schedule for o in only.ranked if o.candidate.parallel.pp > 1} == {"gpipe"}
    with pytest.raises(SearchError, match="megatron runs 1f1b, interleaved"):
        search(eng, TINY_LLAMA, replace(space, framework="megatron", pp_schedules=("gpipe",)))
    # every row in one table, rejected ones (no breakdown) beside evaluated ones, with what they share
    frame = res.to_polars(include_rejected=True)
    assert frame.height == len(res.ranked) + len(res.rejected)
    assert set(frame["gpu"]) == {"cpu"} and set(frame["seq_len"]) == {64} and "forward_ms" in frame.columns
    assert frame.filter(frame["fits"].not_())["forward_ms"].null_count() >= 1
    # the CLI: --output with mixed rows, and --json --top 0 explains every row it shows
    base = ["search", str(tiny_llama_file), "--gpus", "2", "--global-batch", "1", "--seq-len", "64", "--gpu", "cpu",
            "--db", str(cpu_db), "--micro-batch", "1"]
    r = run_cli(*base, "--output", str(tmp_path / "all.parquet"))
    assert r.returncode == 0, r.stderr
    r = run_cli(*base, "--json", "--top", "0")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)["ranked"]
    assert len(shown) > 1 and all(row["source_host_model"] is not None for row in shown)
    r = run_cli(*base, "--pp-schedule", "gpipe", "--pp-schedule", "1f1b", "--json", "--show-unfit")
    assert r.returncode == 0, r.stderr
    assert {row["pp_schedule"] for row in json.loads(r.stdout)["ranked"]} <= {"gpipe", "1f1b"}


def test_api_takes_the_cluster_as_the_cli_does(cpu_db: Path, tiny_llama_file: Path, tmp_path: Path) -> None:
    cluster = tmp_path / "slow-net.toml"
    cluster.write_text('gpu = "cpu"\ngpus_per_node = 1\nnvlink_gbytes_per_s = 5\nnvlink_latency_us = 20\n'
                       'network_gbytes_per_s = 0.1\nnetwork_latency_us = 500\nprice_per_gpu_hour = 3.0\n')
    kw = {"gpu": "cpu", "db": str(cpu_db), "seq_len": 64, "dp": 2}
    alone, apart = api_predict(tiny_llama_file, **kw), api_predict(tiny_llama_file, system=cluster, **kw)
    assert apart.config["system"] == "slow-net" and apart.breakdown["dp_comm_ms"] > alone.breakdown["dp_comm_ms"]
    res = api_search(tiny_llama_file, gpus=2, global_batch=2, seq_len=64, gpu="cpu", db=str(cpu_db), tokens=1e6,
                     system=cluster, micro_batches=[1])
    best = res.ranked[0]
    assert best.cost == pytest.approx(best.job_hours * 2 * 3.0)  # the system's price
    assert all(o.candidate.parallel.tp == 1 for o in res.ranked)  # one GPU per node: TP stays inside it
    with pytest.raises(TpQueryError, match="no system file or preset"):
        api_predict(tiny_llama_file, system=tmp_path / "missing.toml", **kw)


def test_a_stage_parameter_lists_sums_are_the_lists_own() -> None:
    """ParamSums (what memory and the data-parallel model read for every candidate, summed once per list) against
    sums written out for a closed-form list: two layers of bf16 weights and an fp32 routed expert, an embedding
    and a head."""
    from tp_query.engine.compose import ParamSums
    from tp_query.engine.graph import ParamRecord, Section

    params = [ParamRecord("embed.weight", (10, 4), "bf16", Section.EMBED)]
    for i in (3, 1):  # out of order: sums come back in layer order
        params += [ParamRecord(f"layers.{i}.attn.weight", (4, 4), "bf16", Section.LAYER, i),
                   ParamRecord(f"layers.{i}.mlp.experts.w", (2, 4, 8), "fp32", Section.LAYER, i)]
    params.append(ParamRecord("head.lm_head.weight", (10, 4), "bf16", Section.HEAD))
    s = ParamSums.of(params)
    assert s.layer_numel == ((1, 16 + 64), (3, 16 + 64))
    assert (s.head_numel, s.expert_numel) == (40, 128)
    assert s.section_bytes == {Section.EMBED: (80,), Section.LAYER: (32, 256, 32, 256), Section.HEAD: (80,)}
