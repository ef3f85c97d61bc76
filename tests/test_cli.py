"""The command-line contract, run as users and scripts run it: subprocesses, exit codes, JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .conftest import TINY_LLAMA, run_cli


def test_predict_json_contract(cpu_db: Path, tiny_llama_file: Path) -> None:
    r = run_cli("predict", str(tiny_llama_file), "--gpu", "cpu", "--db", str(cpu_db), "--seq-len", "64",
                "--dp", "2", "--tp", "2", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for k in ("iteration_ms", "breakdown", "peak_memory_gib", "fits", "sources", "warnings"):
        assert k in d
    for k in ("forward_ms", "backward_ms", "optimizer_ms", "dp_comm_ms", "tp_comm_ms", "pp_comm_ms",
              "pipeline_bubble_ms", "host_overhead_ms"):
        assert isinstance(d["breakdown"][k], float)
    assert set(d["sources"]) >= {"exact", "interpolated", "extrapolated", "miss"}
    assert d["config"]["gpus"] == 4


def test_predict_table_and_ops(cpu_db: Path, tiny_llama_file: Path) -> None:
    r = run_cli("predict", str(tiny_llama_file), "--gpu", "cpu", "--db", str(cpu_db), "--seq-len", "64")
    assert r.returncode == 0 and "iteration time" in r.stdout and "peak memory" in r.stdout
    r = run_cli("ops", str(tiny_llama_file), "--gpu", "cpu", "--db", str(cpu_db), "--seq-len", "64", "--json",
                "--top", "5")
    rows = json.loads(r.stdout)
    assert len(rows) == 5 and {"op", "phase", "precision", "count", "latency_us", "source"} <= set(rows[0])


def test_a_signature_file_holds_every_optimizer_call_a_prediction_prices(cpu_db: Path, tiny_llama_file: Path,
                                                                         tmp_path: Path) -> None:
    """`sigs` wrote the trace's optimizer step, whose per-parameter lists hold its two traced layers only: a campaign
    from it never measured the step a prediction prices (every layer's parameters), and `--layers` changed nothing.
    The fixture's database was collected from such a file of the 4-layer tiny Llama: its optimizer is priced exactly."""
    r = run_cli("ops", str(tiny_llama_file), "--gpu", "cpu", "--db", str(cpu_db), "--seq-len", "64",
                "--precision", "amp_bf16", "--json", "--top", "1000")
    assert r.returncode == 0, r.stderr
    opt = [x for x in json.loads(r.stdout) if x["phase"] == "opt"]
    # (a host-side step counter launches nothing)
    assert opt and {x["source"] for x in opt} == {"exact", "no-kernel"}, {(x["op"], x["source"]) for x in opt}
    files = {}
    for n in ("2", "3"):
        out = tmp_path / f"s{n}.jsonl"
        r = run_cli("sigs", str(tiny_llama_file), "-o", str(out), "--seq-len", "64", "--precision", "bf16",
                    "--layers", n)
        assert r.returncode == 0, r.stderr
        files[n] = out.read_text()
    assert files["2"] != files["3"]  # three layers' parameters in the step's lists
    r = run_cli("sigs", str(tiny_llama_file), "-o", str(tmp_path / "s5.jsonl"), "--layers", "5")
    assert r.returncode == 2 and "1..4" in r.stderr and not (tmp_path / "s5.jsonl").exists()


def test_sql_and_db_info(cpu_db: Path) -> None:
    r = run_cli("sql", "SELECT kind, count(*) AS n FROM ops GROUP BY kind ORDER BY n DESC", "--gpu", "cpu",
                "--db", str(cpu_db), "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)[0]["n"] > 0
    r = run_cli("db", "info", "--gpu", "cpu", "--db", str(cpu_db))
    assert r.returncode == 0 and "provenance" in r.stdout


@pytest.mark.parametrize("content, args, msg", [
    ("{not json", [], "malformed JSON"),
    (json.dumps({**TINY_LLAMA, "architectures": ["BertForMaskedLM"], "model_type": "bert"}), [],
     "unsupported architecture"),  # not a causal LM (any *ForCausalLM of transformers is built as it is)
    (json.dumps(TINY_LLAMA), ["--tp", "3"], "does not divide"),
    (json.dumps(TINY_LLAMA), ["--pp", "9", "--global-batch", "9"], "larger than the number of layers"),
    (json.dumps(TINY_LLAMA), ["--seq-len", "0"], "positive"),
    (json.dumps(TINY_LLAMA), ["--gpu", "h900"], "unknown GPU"),
    (json.dumps(TINY_LLAMA), ["--gpu", "h100"], "no profile database"),
    (json.dumps({**TINY_LLAMA, "hidden_size": 0}), [], "positive integer"),
    # an option that means something only beside another, or a combination nothing here models: refused,
    # never silently dropped (each gave the plain split's numbers)
    (json.dumps(TINY_LLAMA), ["--zero", "1"], "needs DP > 1"),
    (json.dumps(TINY_LLAMA), ["--ddp-bucket-view"], "gradient_as_bucket_view"),
    (json.dumps(TINY_LLAMA), ["--dp", "2", "--zero", "3", "--ddp-bucket-view"], "gradient_as_bucket_view"),
    (json.dumps(TINY_LLAMA), ["--pp-schedule", "gpipe"], "needs PP > 1"),
    (json.dumps(TINY_LLAMA), ["--pp", "2", "--dp", "2", "--zero", "2", "--global-batch", "4"],
     "ZeRO with pipeline parallelism is not modelled"),
    (json.dumps(TINY_LLAMA), ["--seq-len", "1"], "2.."),
    (json.dumps({**TINY_LLAMA, "model_type": "gpt2"}), [], "correct one of them"),
    (json.dumps({**TINY_LLAMA, "model_type": "bogus_xyz"}), [], "correct one of them"),
    # one family here, two models to transformers (it builds by model_type: Mistral's window, Qwen2's biases)
    (json.dumps({**TINY_LLAMA, "model_type": "mistral", "sliding_window": 16}), [], "builds by model_type"),
    (json.dumps({**TINY_LLAMA, "model_type": "qwen2"}), [], "builds by model_type"),
])
def test_bad_input_is_one_line_exit_2(cpu_db: Path, tmp_path: Path, content: str, args: list[str], msg: str) -> None:
    f = tmp_path / "m.json"
    f.write_text(content)
    full = ["predict", str(f), "--db", str(cpu_db), "--seq-len", "64"]
    if "--gpu" not in args:
        full += ["--gpu", "cpu"]
    r = run_cli(*full, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert msg in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_missing_model_file(cpu_db: Path) -> None:
    r = run_cli("predict", "/nonexistent/config.json", "--gpu", "cpu", "--db", str(cpu_db))
    assert r.returncode == 2 and "not found" in r.stderr


def _trace(mod: Path, precision: str) -> Path:
    """`tp-query trace file.py:make --inputs file.py:inputs`: the graph file it writes."""
    out = mod.with_suffix(".json.gz")
    r = run_cli("trace", f"{mod}:make", "--inputs", f"{mod}:inputs", "--out", str(out), "--precision", precision)
    assert r.returncode == 0, r.stderr
    return out


def test_trace_a_user_module(tmp_path: Path, cpu_db: Path) -> None:
    mod = tmp_path / "mymodel.py"
    mod.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = torch.nn.Linear(64, 256)\n"
        "        self.b = torch.nn.Linear(256, 64)\n"
        "    def forward(self, x):\n"
        "        return self.b(torch.relu(self.a(x))).square().mean()\n"
        "def make():\n    return Net()\n"
        "def inputs(model):\n    return (torch.randn(32, 64),)\n")
    out = _trace(mod, "fp32")
    r = run_cli("predict", str(out), "--gpu", "cpu", "--db", str(cpu_db), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["iteration_ms"] > 0
    assert json.loads(r.stdout)["tokens_per_s"] is None  # its inputs hold no tokens: no rate, not 0 tokens/s
    r = run_cli("predict", str(out), "--gpu", "cpu", "--db", str(cpu_db), "--tp", "2")
    assert r.returncode == 2 and "runs as traced" in r.stderr
    # a flag the graph was not traced with is named as the CLI spells it
    r = run_cli("predict", str(out), "--gpu", "cpu", "--db", str(cpu_db), "--recompute", "full")
    assert r.returncode == 2 and "--recompute full (graph: none)" in r.stderr, r.stderr
    # its inputs have no sequence: a length given would change nothing (it was answered as if none were given)
    r = run_cli("predict", str(out), "--gpu", "cpu", "--db", str(cpu_db))  # the text names the database it read
    assert r.returncode == 0 and f"database: {cpu_db}" in r.stdout and "no tokens" in r.stdout, r.stdout
    r = run_cli("plot", "breakdown", "--model", str(out), "-o", str(tmp_path / "p.svg"), "--gpu", "cpu", "--db",
                str(cpu_db), "--precision", "fp32")  # each bar's verdict and sources, as predict says them
    assert r.returncode == 0 and "fp32: " in r.stderr and " fits; sources: " in r.stderr, r.stderr
    for cmd in (["predict", str(out)], ["ops", str(out)], ["plot", "breakdown", "--model", str(out), "-o",
                                                            str(tmp_path / "b.svg"), "--precision", "fp32"]):
        r = run_cli(*cmd, "--gpu", "cpu", "--db", str(cpu_db), "--seq-len", "128")
        assert r.returncode == 2 and "--seq-len does not apply to this graph" in r.stderr, (cmd, r.stderr)
    from tp_query.engine import api
    from tp_query.engine.predict import PredictError

    with pytest.raises(PredictError, match="does not apply"):
        api.predict(out, gpu="cpu", db=str(cpu_db), precision="fp32", seq_len=128)
    assert api.predict(out, gpu="cpu", db=str(cpu_db), precision="fp32").iteration_ms > 0
    # the graph's own precision where none is given (it was refused as if amp_bf16 had been asked for)
    assert api.predict(out, gpu="cpu", db=str(cpu_db)).config["precision"] == "fp32"


def test_ops_roll_up_by_kind_and_phase(cpu_db: Path, tiny_llama_file: Path) -> None:
    base = ["ops", str(tiny_llama_file), "--gpu", "cpu", "--db", str(cpu_db), "--seq-len", "64", "--tp", "2"]
    r = run_cli(*base, "--top", "0", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    for by in ("kind", "phase"):
        r = run_cli(*base, "--by", by, "--json")
        assert r.returncode == 0, r.stderr
        groups = json.loads(r.stdout)
        assert sum(g["total_ms"] for g in groups) == pytest.approx(sum(x["total_ms"] for x in rows))
        assert sum(g["calls"] for g in groups) == sum(x["count"] for x in rows)
    assert "communication" in {g["kind"] for g in json.loads(run_cli(*base, "--by", "kind", "--json").stdout)}
    assert run_cli(*base, "--by", "nope").returncode == 2
    # by layer: the embedding, one decoder layer (x layers), the head and the optimizer add up to the GPU
    # time of the slowest stage's iteration, which is at most the sum over the operator rows (comm included)
    sections = json.loads(run_cli(*base, "--by", "layer", "--json").stdout)
    assert [s["section"] for s in sections][1] == "decoder layer" and sections[1]["count"] == 4
    assert 0 < sum(s["total_ms"] for s in sections) <= sum(x["total_ms"] for x in rows) * 1.0001
    # --top keeps the largest groups and sections (it was ignored by every roll-up)
    two = json.loads(run_cli(*base, "--by", "kind", "--top", "2", "--json").stdout)
    every = json.loads(run_cli(*base, "--by", "kind", "--json", "--top", "0").stdout)
    assert [g["kind"] for g in two] == [g["kind"] for g in sorted(every, key=lambda g: -g["total_ms"])[:2]]
    assert len(json.loads(run_cli(*base, "--by", "layer", "--top", "1", "--json").stdout)) == 1
    # with gradient accumulation the sections add up to forward + backward + optimizer and the in-layer TP traffic
    # (accumulation was left out)
    acc = [*base, "--global-batch", "4"]
    sec = json.loads(run_cli(*acc, "--by", "layer", "--json").stdout)
    pred = json.loads(run_cli("predict", *acc[1:], "--json").stdout)["breakdown"]
    assert any(s["section"].startswith("gradient accumulation") for s in sec)
    assert sum(s["total_ms"] for s in sec) == pytest.approx(
        pred["forward_ms"] + pred["backward_ms"] + pred["optimizer_ms"] + pred["tp_comm_ms"], rel=1e-6)


def test_cli_needs_no_click(tmp_path: Path) -> None:
    """typer vendors click; an installed tp-query has no click to import (a fresh venv showed it)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['click'] = None\n"
            "from tp_query.engine.cli import main\n"
            "sys.argv = ['tp-query'] + sys.argv[1:]\n"
            "main()")
    r = subprocess.run([sys.executable, "-c", code, "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("tp-query"), r.stderr
    r = subprocess.run([sys.executable, "-c", code, "predict", "/dev/zero"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr


def test_a_traced_language_model_reports_tokens_and_its_own_dtype(tmp_path: Path, cpu_db: Path) -> None:
    """A user's LM traced as a module: tokens/s from its [batch, sequence] token ids, and a warning when its
    parameters are not in the dtype the requested setting implies (transformers builds in the config's)."""
    mod = tmp_path / "lm.py"
    mod.write_text(
        "import torch\n"
        "class LM(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.e = torch.nn.Embedding(512, 64, dtype=torch.bfloat16)\n"
        "        self.o = torch.nn.Linear(64, 512, dtype=torch.bfloat16)\n"
        "    def forward(self, ids):\n"
        "        return torch.nn.functional.cross_entropy(self.o(self.e(ids)).flatten(0, 1).float(), ids.flatten())\n"
        "def make():\n    return LM()\n"
        "def inputs(model):\n    return (torch.randint(0, 512, (4, 128)),)\n")
    out = _trace(mod, "amp_bf16")
    r = run_cli("predict", str(out), "--gpu", "cpu", "--db", str(cpu_db), "--precision", "amp_bf16", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["tokens_per_s"] == pytest.approx(4 * 128 / (p["iteration_ms"] / 1e3))
    assert any("parameters are bf16" in w for w in p["warnings"])
    # the module ran on its own [4, 128] token ids: another batch or sequence is refused, not echoed over them
    for flags, what in ((["--micro-batch", "8"], "--micro-batch 8"), (["--seq-len", "256"], "--seq-len 256")):
        r = run_cli("predict", str(out), "--gpu", "cpu", "--db", str(cpu_db), "--precision", "amp_bf16", *flags)
        assert r.returncode == 2 and what in r.stderr, r.stderr


def test_a_family_without_transformers_is_one_line(tmp_path: Path) -> None:
    """Families built from transformers' modules need it installed: without it, one line saying what to
    install and exit code 2 (not a traceback)."""
    import subprocess
    import sys

    from .conftest import TINY_FAMILIES

    cfg = tmp_path / "qwen3.json"
    cfg.write_text(json.dumps(TINY_FAMILIES["qwen3"]))
    code = ("import sys; sys.modules['transformers'] = None; from tp_query.engine.cli import main; "
            f"sys.argv = ['tp-query', 'predict', {str(cfg)!r}, '--seq-len', '64']; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TP_QUERY_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2 and "transformers==5.17.0" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_debug_shows_where_a_bare_value_error_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare ValueError may be bad input or a fault inside: one line and exit 2 by default, the exception itself
    (its traceback) under --debug."""
    from tp_query.engine import cli

    def inside() -> None:
        raise ValueError("too many values to unpack (expected 3)")

    with pytest.raises(cli.typer.Exit) as e:
        cli._guard(inside)
    assert e.value.exit_code == 2
    monkeypatch.setattr(cli, "_DEBUG", True)
    with pytest.raises(ValueError, match="too many values"):
        cli._guard(inside)


def test_a_fifo_is_refused_not_waited_on(cpu_db: Path, tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "model.json"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    r = run_cli("predict", str(fifo), "--gpu", "cpu", "--db", str(cpu_db))
    assert r.returncode == 2 and "not a regular file" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, msg", [
    (["--price-per-gpu-hour", "5"], "--tokens"),
    (["--emit", "torchrun", "--json"], "choose one"),
    (["--emit", "megatron"], "--framework megatron"),
    (["--top", "-5"], "--top"),
    (["--tokens", "nan"], "tokens must be a number in (0, 1e16]"),
    (["--tokens", "-5"], "tokens must be a number in (0, 1e16]"),
    (["--tokens", "1e300"], "no training run has more"),
    (["--tokens", "1e9", "--price-per-gpu-hour", "-3"], "a number in [0, 1e6]"),
    (["--tokens", "1e9", "--price-per-gpu-hour", "1e300"], "a number in [0, 1e6]"),
    (["--framework", "jax"], "unknown framework 'jax'"),
    (["--optimizer", "adam"], "unknown optimizer"),
    (["--micro-batch", "3"], "divides the global batch"),
])
def test_search_refuses_what_it_would_ignore(cpu_db: Path, tiny_llama_file: Path, args: list[str], msg: str) -> None:
    r = run_cli("search", str(tiny_llama_file), "--gpus", "2", "--global-batch", "4", "--seq-len", "64", "--gpu",
                "cpu", "--db", str(cpu_db), *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_search_that_evaluates_nothing_says_why(cpu_db: Path, tiny_llama_file: Path) -> None:
    """Every candidate refused for one reason (amp_bf16 under Megatron-Core): that reason, not 'nothing fits'."""
    r = run_cli("search", str(tiny_llama_file), "--gpus", "2", "--global-batch", "4", "--seq-len", "64", "--gpu",
                "cpu", "--db", str(cpu_db), "--framework", "megatron")
    assert r.returncode == 2 and "could be evaluated" in r.stderr and "mp_bf16" in r.stderr, r.stderr


def test_a_command_parses_in_an_app_of_its_own_exactly_as_in_the_whole_app() -> None:
    """main() builds only the command it runs (typer derives every command's parameters at each start): the lean
    app must hold that command's own definition, and anything else (help, the version, `db`, a misspelt
    command, an option first) must go to the whole app."""
    import typer
    from tp_query.engine import cli

    for name in ("predict", "search", "sql", "report"):
        lean = cli._app_for([name, "x.json"])
        assert lean is not cli.app
        assert [c.callback for c in lean.registered_commands] == \
            [c.callback for c in cli.app.registered_commands if c.callback and c.callback.__name__ == name]
        assert lean.registered_callback is cli.app.registered_callback
        whole = typer.main.get_command(cli.app).commands[name]  # type: ignore[attr-defined]
        alone = typer.main.get_command(lean).commands[name]  # type: ignore[attr-defined]
        assert [p.opts for p in alone.params] == [p.opts for p in whole.params]
    for args in ([], ["--help"], ["--version"], ["db", "info"], ["predct"], ["--debug", "predict"]):
        assert cli._app_for(args) is cli.app


def test_a_lean_command_fails_as_the_whole_app_does(cpu_db: Path, tiny_llama_file: Path) -> None:
    r = run_cli("predict", str(tiny_llama_file), "--gpu", "cpu", "--db", str(cpu_db), "--no-such-flag")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: No such option: --no-such-flag")
    r = run_cli("predict", "--help")
    assert r.returncode == 0 and " predict [OPTIONS] {model}" in r.stdout
