"""Fault injection: bad input, corrupt or foreign data and hostile SQL never give a silent wrong answer.

Every bad-input class ends in exit code 2 with one line on stderr, no traceback, under a 2 GiB address-space
limit (bounded memory). Every bit flipped in the shipped database is caught by the manifest before anything
reads it. Every SQL escape is refused. The counts are in the README.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import random
import resource
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tp_query.engine.db import Database, DatabaseError
from tp_query.schema import manifest

from .conftest import ROOT, TINY_LLAMA

LLAMA = json.loads((ROOT / "examples" / "llama3.1-8b.json").read_text())
MEM_LIMIT = 2 << 30


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT, MEM_LIMIT))


def _cli(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tp_query.engine.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120, preexec_fn=_limit,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")

    def cfg(name: str, **change: object) -> Path:
        p = d / f"{name}.json"
        p.write_text(json.dumps({**LLAMA, **change}))
        return p

    out = {
        "llama": cfg("llama"),
        "hidden_1e12": cfg("h", hidden_size=10**12),
        "layers_1e9": cfg("l", num_hidden_layers=10**9),
        "heads_negative": cfg("hn", num_attention_heads=-32),
        "heads_not_dividing": cfg("hd", hidden_size=4000, num_attention_heads=33, num_key_value_heads=3),
        "kv_not_dividing": cfg("kv", num_key_value_heads=7),
        "vocab_zero": cfg("v0", vocab_size=0),
        "dims_as_strings": cfg("s", hidden_size="4096"),
        "dims_as_bool": cfg("b", num_hidden_layers=True),
        "dims_as_float": cfg("f", hidden_size=4096.5),
        "rope_negative": cfg("rn", rope_theta=-1.0),
        "tie_as_string": cfg("t", tie_word_embeddings="false"),
        "unknown_arch": cfg("u", architectures=["T5ForConditionalGeneration"], model_type="t5"),
        "arch_not_list": cfg("al", architectures="LlamaForCausalLM"),
        "unknown_act": cfg("act", hidden_act="swiglu9"),
        "model_type_int": cfg("mt", model_type=5),
        "rope_scaling_string": cfg("rs", rope_scaling="yes"),
        "rope_factor_negative": cfg("rf", rope_scaling={"rope_type": "linear", "factor": -3}),
        "two_architectures": cfg("ta", architectures=["LlamaForCausalLM", "MistralForCausalLM"]),
        "gemma2_window_null": cfg("g2", architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=None),
        # keys transformers honours that the prediction would not: refused, not ignored
        "attn_eager": cfg("ae", attn_implementation="eager"),
        "router_logits_on": cfg("rl", architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                                num_experts_per_tok=2, output_router_logits=True),
        "mlp_bias": cfg("mb", mlp_bias=True),
        "gelu_mlp": cfg("gm", hidden_act="gelu"),
        "attn_dropout": cfg("ad", attention_dropout=0.1),
        "gradient_checkpointing": cfg("gc", gradient_checkpointing=True),  # transformers recomputes: say so
    }
    for name, obj in (  # whole files (not changes of the Llama config)
            ("gpt2_cross_attention", {"model_type": "gpt2", "n_layer": 2, "add_cross_attention": True}),
            ("gpt2_two_widths", {"model_type": "gpt2", "n_layer": 2, "n_embd": 768, "hidden_size": 1024}),
            ("gemma3_two_ties", {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                 "tie_word_embeddings": False,
                                 "text_config": {"hidden_size": 2560, "num_hidden_layers": 2, "intermediate_size": 10240,
                                                 "tie_word_embeddings": True}})):
        out[name] = d / f"{name}.json"
        out[name].write_text(json.dumps(obj))
    for name, text in (("empty", ""), ("not_json", "hidden_size: 4096"), ("json_array", "[1, 2, 3]"),
                       ("json_string", '"llama"'), ("deep_nesting", "[" * 100_000 + "]" * 100_000),
                       ("nan_literal", json.dumps(LLAMA)[:-1] + ', "rope_theta": NaN}'),
                       ("infinity_literal", json.dumps(LLAMA)[:-1] + ', "rope_theta": Infinity}'),
                       ("hidden_null", json.dumps({**LLAMA, "hidden_size": None})),  # left out: the class default
                       ("duplicate_key", json.dumps(LLAMA)[:-1] + ', "num_hidden_layers": 2}'),
                       ("digits_5000", json.dumps(LLAMA)[:-1] + ', "max_position_embeddings": ' + "9" * 5000 + "}"),
                       ("system_typo", 'name = "x"\ngpu = "h200"\ngpus_per_node = 8\nnvlink_gbytes_per_s = 450.0\n'
                                       'nvlink_latency_us = 8.0\nnetwork_gbytes_per_s = 50.0\n'
                                       'network_latency_us = 15.0\nprice_per_gpu_hourx = 3.5\n')):
        p = d / f"{name}.json"
        p.write_text(text)
        out[name] = p
    (d / "bad_utf8.json").write_bytes(b'{"hidden_size": "\xff\xfe"}')
    out["bad_utf8"] = d / "bad_utf8.json"
    (d / "garbage.bin").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    out["binary_garbage"] = d / "garbage.bin"
    bomb = d / "bomb.json.gz"  # 16 KiB that inflates to 1 GiB of zeros
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        chunk = b"0" * (1 << 20)
        for _ in range(1024):
            f.write(chunk)
    out["gzip_bomb"] = bomb
    (d / "truncated.json.gz").write_bytes(gzip.compress(json.dumps(LLAMA).encode())[:40])
    out["truncated_gzip"] = d / "truncated.json.gz"
    big = d / "sparse.json"
    with big.open("wb") as f:
        f.truncate(64 << 20)
    out["huge_file"] = big
    (d / "emptydir").mkdir()
    out["dir_without_config"] = d / "emptydir"
    g = d / "graph_empty_meta.json"
    g.write_text(json.dumps({"format": "tp-query-graph/1", "meta": {}, "params": [], "memory": {}, "ops": []}))
    out["graph_empty_meta"] = g
    (d / "dangling.csv").symlink_to(d / "no-such-folder" / "x.csv")
    out["dangling"] = d / "dangling.csv"
    os.mkfifo(d / "fifo.py")  # a source file that is a FIFO waited for a writer forever
    out["fifo_source"] = d / "fifo.py"
    return out


def _predict(f: dict[str, Path], name: str, *flags: str) -> list[str]:
    return ["predict", str(f[name]), *flags]


def _predict_file(name: str, f: dict[str, Path]) -> list[str]:
    return _predict(f, name)


BAD_INPUTS: list[tuple[str, object]] = [
    # files that are not model files
    ("dev_zero", lambda f: ["predict", "/dev/zero"]),
    ("dev_urandom", lambda f: ["predict", "/dev/urandom"]),
    ("missing_file", lambda f: ["predict", "/nonexistent/config.json"]),
    *[(n, functools.partial(_predict_file, n)) for n in (
        "empty", "not_json", "json_array", "json_string", "deep_nesting", "nan_literal", "infinity_literal",
        "hidden_null", "bad_utf8", "binary_garbage", "gzip_bomb", "truncated_gzip", "huge_file",
        "dir_without_config", "graph_empty_meta",
        # config values no real model has, or of the wrong type
        "hidden_1e12", "layers_1e9", "heads_negative", "heads_not_dividing", "kv_not_dividing", "vocab_zero",
        "dims_as_strings", "dims_as_bool", "dims_as_float", "rope_negative", "tie_as_string", "unknown_arch",
        "arch_not_list", "unknown_act", "model_type_int", "rope_scaling_string", "rope_factor_negative",
        "two_architectures", "duplicate_key", "digits_5000", "gemma2_window_null", "attn_eager",
        "router_logits_on", "gpt2_cross_attention", "gpt2_two_widths", "gemma3_two_ties",
        "gradient_checkpointing")],
    ("system_unknown_key", lambda f: _predict(f, "llama", "--system", str(f["system_typo"]))),
    # flags
    ("micro_batch_zero", lambda f: _predict(f, "llama", "--micro-batch", "0")),
    ("micro_batch_1e11", lambda f: _predict(f, "llama", "--micro-batch", str(10**11))),
    ("dp_zero", lambda f: _predict(f, "llama", "--dp", "0")),
    ("dp_not_int", lambda f: _predict(f, "llama", "--dp", "two")),
    ("tp_not_dividing", lambda f: _predict(f, "llama", "--tp", "3")),
    ("pp_beyond_layers", lambda f: _predict(f, "llama", "--pp", "1000")),
    ("pp_fewer_micro_batches", lambda f: _predict(f, "llama", "--pp", "2")),  # Schedule1F1B refuses it
    ("torch_zero1", lambda f: _predict(f, "llama", "--dp", "2", "--zero", "1")),  # no such PyTorch stack
    ("torch_ddp_master_weights", lambda f: _predict(f, "llama", "--dp", "2", "--precision", "mp_bf16")),
    # outputs and sources checked before any work
    ("report_calibration_over_its_json", lambda f: ["report", "--out", str(f["llama"].parent / "r.md"),
                                                    "--calibration-out", str(f["llama"].parent / "r.json")]),
    ("report_calibration_to_a_folder", lambda f: ["report", "--calibration-out", str(f["llama"].parent)]),
    ("trace_fifo_source", lambda f: ["trace", f"{f['fifo_source']}:build", "-o", str(f["llama"].parent / "g.json")]),
    ("db_path_empty", lambda f: ["db", "path", "--db", ""]),
    ("plot_missing_model", lambda f: ["plot", "breakdown", "--model", "/nonexistent/m.json", "-o",
                                      str(f["llama"].parent / "p.svg")]),
    # fp32 master weights on PyTorch are FSDP2's: one GPU (or TP alone) has no such stack
    ("torch_master_weights_one_gpu", lambda f: _predict(f, "llama", "--precision", "mp_fp16")),
    # torchao's weight-gradient _scaled_mm runs over micro-batch x sequence, which CUDA needs a multiple of 16
    ("fp8_tokens_not_multiple_of_16", lambda f: _predict(f, "llama", "--precision", "fp8_rowwise", "--seq-len", "100")),
    # output files refused before any work (each was a raw exception after it, or a folder made silently)
    ("plot_out_folder", lambda f: ["plot", "breakdown", "--model", str(f["llama"]), "-o", str(f["llama"].parent)]),
    ("plot_out_missing_folder", lambda f: ["plot", "breakdown", "--model", str(f["llama"]), "-o",
                                           "/nonexistent/x.svg"]),
    ("plot_out_csv", lambda f: ["plot", "breakdown", "--model", str(f["llama"]), "-o", "/tmp/x.csv"]),
    ("trace_out_missing_folder", lambda f: ["trace", str(f["llama"]), "-o", "/nonexistent/g.json"]),
    ("search_out_dangling_link", lambda f: ["search", str(f["llama"]), "--gpus", "2", "--global-batch", "2",
                                            "--output", str(f["dangling"])]),
    ("seq_zero", lambda f: _predict(f, "llama", "--seq-len", "0")),
    ("seq_1e9", lambda f: _predict(f, "llama", "--seq-len", str(10**9))),
    ("global_batch_indivisible", lambda f: _predict(f, "llama", "--dp", "2", "--global-batch", "3")),
    ("zero_stage_7", lambda f: _predict(f, "llama", "--zero", "7")),
    ("unknown_optimizer", lambda f: _predict(f, "llama", "--optimizer", "lamb")),
    ("precision_fp8", lambda f: _predict(f, "llama", "--precision", "fp8")),
    ("unknown_framework", lambda f: _predict(f, "llama", "--framework", "jax")),
    ("unknown_schedule", lambda f: _predict(f, "llama", "--pp", "2", "--global-batch", "4", "--pp-schedule", "zb")),
    ("megatron_zero3", lambda f: _predict(f, "llama", "--dp", "2", "--zero", "3", "--framework", "megatron")),
    ("megatron_sp", lambda f: _predict(f, "llama", "--tp", "2", "--sequence-parallel", "--framework", "megatron",
                                       "--precision", "mp_bf16")),
    ("megatron_pure_bf16", lambda f: _predict(f, "llama", "--precision", "bf16", "--framework", "megatron")),
    # what Megatron-Core's local spec is modelled without (and --emit megatron would not write): refused
    *[(f"megatron_{n}", functools.partial(lambda n, f: _predict(f, n, "--framework", "megatron", "--precision",
                                                                 "mp_bf16"), n))
      for n in ("mlp_bias", "gelu_mlp", "attn_dropout")],
    ("ep_without_megatron", lambda f: _predict(f, "llama", "--dp", "2", "--ep", "2")),
    ("ep_not_dividing_dp", lambda f: _predict(f, "llama", "--dp", "2", "--ep", "4", "--framework", "megatron")),
    ("moe_imbalance_nan", lambda f: _predict(f, "llama", "--moe-imbalance", "nan")),
    ("unknown_gpu", lambda f: _predict(f, "llama", "--gpu", "rtx9090")),
    ("missing_db", lambda f: _predict(f, "llama", "--db", "/nonexistent")),
    ("search_micro_batch_zero", lambda f: ["search", str(f["llama"]), "--gpus", "8", "--global-batch", "8",
                                           "--micro-batch", "0"]),
    ("search_gpus_zero", lambda f: ["search", str(f["llama"]), "--gpus", "0", "--global-batch", "8"]),
    # system files
    ("system_missing", lambda f: _predict(f, "llama", "--system", "/nonexistent.toml")),
    ("system_not_toml", lambda f: _predict(f, "llama", "--system", str(f["not_json"]))),
    ("system_wrong_gpu", lambda f: _predict(f, "llama", "--system", "h100-sxm-8x-ndr")),
    # a traced module runs at its own shapes: split and shape flags are refused, not ignored
    ("trace_module_tp", lambda f: ["trace", "mymodel.py:build", "-o", "/tmp/g.json.gz", "--inputs", "m.py:i",
                                   "--tp", "2"]),
    ("trace_module_seq", lambda f: ["trace", "mymodel.py:build", "-o", "/tmp/g.json.gz", "--inputs", "m.py:i",
                                    "--seq-len", "128"]),
    ("trace_module_recompute", lambda f: ["trace", "mymodel.py:build", "-o", "/tmp/g.json.gz", "--inputs",
                                          "m.py:i", "--recompute", "full"]),
    # SQL escapes
    ("sql_copy_into_db", lambda f: ["sql", "COPY (SELECT 1) TO 'data/h200/ops/x.parquet'"]),
    ("sql_read_outside", lambda f: ["sql", "SELECT * FROM read_csv('/etc/passwd')"]),
    ("sql_read_text_outside", lambda f: ["sql", "SELECT * FROM read_text('/etc/hostname')"]),
    ("sql_attach", lambda f: ["sql", "ATTACH '/tmp/x.duckdb'"]),
    ("sql_install", lambda f: ["sql", "INSTALL httpfs"]),
    ("sql_load", lambda f: ["sql", "LOAD httpfs"]),
    ("sql_set", lambda f: ["sql", "SET enable_external_access = true"]),
    ("sql_two_statements", lambda f: ["sql", "SELECT 1; SELECT 2"]),
    ("sql_create", lambda f: ["sql", "CREATE TABLE t AS SELECT 1"]),
    ("sql_syntax", lambda f: ["sql", "SELEC 1"]),
    # options that would be ignored: honoured or refused
    ("sql_format_xml", lambda f: ["sql", "SELECT 1", "--format", "xml"]),
    ("sql_limit_negative", lambda f: ["sql", "SELECT 1", "--limit", "-2"]),
    ("ops_top_negative", lambda f: ["ops", str(f["llama"]), "--top", "-3"]),
    ("sigs_layers_zero", lambda f: ["sigs", str(f["llama"]), "-o", "/tmp/tpq-sigs.jsonl", "--layers", "0"]),
    ("trace_out_txt", lambda f: ["trace", str(f["llama"]), "-o", "/tmp/tpq-g.txt"]),
    ("trace_micro_batch_zero", lambda f: ["trace", str(f["llama"]), "-o", "/tmp/tpq-g.json", "--micro-batch", "0"]),
    ("trace_sp_without_tp", lambda f: ["trace", str(f["llama"]), "-o", "/tmp/tpq-g.json", "--sequence-parallel"]),
    ("trace_config_inputs", lambda f: ["trace", str(f["llama"]), "-o", "/tmp/tpq-g.json", "--inputs", "m.py:i"]),
    ("plot_latency_split", lambda f: ["plot", "latency", "-o", "/tmp/tpq-l.svg", "--tp", "4"]),
    ("plot_latency_int8", lambda f: ["plot", "latency", "-o", "/tmp/tpq-l.svg", "--precision", "int8"]),
    ("search_graph_file", lambda f: ["search", str(f["graph_empty_meta"]), "--gpus", "8", "--global-batch", "8"]),
    ("search_precision_int8", lambda f: ["search", str(f["llama"]), "--gpus", "8", "--global-batch", "8",
                                         "--precision", "int8"]),
    ("report_out_json", lambda f: ["report", "--out", "/tmp/tpq-report.json"]),  # its .json beside it overwrote it
    ("db_path_unknown_gpu", lambda f: ["db", "path", "--gpu", "nosuch"]),
    ("db_verify_unknown_gpu", lambda f: ["db", "verify", "--gpu", "b200"]),
    ("db_info_unknown_gpu", lambda f: ["db", "info", "--gpu", "b200"]),
    ("sql_unknown_gpu", lambda f: ["sql", "SELECT 1", "--gpu", "b200"]),
    ("report_calibration_without_fit", lambda f: ["report", "--no-fit", "--calibration-out", "/tmp/tpq-cal.json",
                                                  "--out", "/tmp/tpq-report.md"]),
    ("plot_breakdown_kind", lambda f: ["plot", "breakdown", "--model", str(f["llama"]), "-o", "/tmp/tpq-b.svg",
                                       "--kind", "mm"]),
]


def test_at_least_forty_bad_input_classes() -> None:
    assert len(BAD_INPUTS) >= 40


def test_every_bad_input_is_one_line_and_exit_2(files: dict[str, Path]) -> None:
    def run(item: tuple[str, object]) -> tuple[str, subprocess.CompletedProcess[str]]:
        name, make = item
        return name, _cli(make(files))  # type: ignore[operator]

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, BAD_INPUTS))
    bad = []
    for name, r in results:
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        if r.returncode != 2 or len(lines) != 1 or "Traceback" in r.stderr or not lines[0].startswith("error:"):
            bad.append(f"{name}: rc={r.returncode} stderr={r.stderr[-300:]!r}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("name", "said"), [
    ("mlp_bias", "biases on the QKV projection only"), ("gelu_mlp", "activation is 'gelu'"),
    ("attn_dropout", "attention_dropout 0.1")])
def test_megatron_refuses_what_its_local_spec_is_not_modelled_with(files: dict[str, Path], name: str,
                                                                   said: str) -> None:
    """Megatron-Core's local spec is modelled with SwiGLU, QKV bias at most and no dropout (the --emit megatron
    line says so): a config asking for more was predicted without it, and the parameter count disagreed."""
    r = _cli(_predict(files, name, "--framework", "megatron", "--precision", "mp_bf16"))
    assert r.returncode == 2 and said in r.stderr, r.stderr[-400:]


def test_db_commands_read_a_gpu_name_as_predict_does() -> None:
    """`--gpu H200` names the h200 database in the db commands and sql too, as predict reads it (they said there
    was no database 'H200'), and an unknown GPU is that, not a missing database."""
    for args in (["db", "path"], ["db", "verify"], ["sql", "SELECT count(*) AS n FROM ops"]):
        r = _cli([*args, "--gpu", "H200"])
        assert r.returncode == 0, (args, r.stderr)
    r = _cli(["db", "path", "--gpu", "B200"])
    assert r.returncode == 2 and "unknown GPU 'B200'" in r.stderr


def test_graph_files_without_a_step_are_refused(tmp_path: Path) -> None:
    """A graph file with no operators, no parameters or a tensor beyond any GPU is no training step: refused in
    one line, not answered with an iteration of nothing; a zero --seq-len on a graph is refused, not read as
    "the graph's"."""
    pytest.importorskip("torch")
    from tp_query.engine.predict import PredictRequest, graph_for
    from tp_query.schema.precision import Setting

    good = graph_for(PredictRequest(model=TINY_LLAMA, model_name="tiny", gpu="cpu", setting=Setting.BF16,
                                    seq_len=64)).to_json()
    layer_op = next(o for o in good["ops"] if o[3] == "layer")
    cases = {"no_ops": {**good, "ops": []}, "no_params": {**good, "params": []},
             "no_optimizer": {**good, "ops": [o for o in good["ops"] if o[2] != "opt"]},
             "billion_layers": {**good, "meta": {**good["meta"], "model": {**good["meta"]["model"], "num_layers": 10**9}}},
             "traced_beyond_the_model": {**good, "meta": {**good["meta"], "traced_layers": 1000}},
             "op_outside_the_traced_layers": {**good, "ops": [*good["ops"], [*layer_op[:4], 7, *layer_op[5:]]]},
             "huge_param": {**good, "params": [[good["params"][0][0], [10**9, 10**9], *good["params"][0][2:]],
                                               *good["params"][1:]]},
             # a peak below zero that "fits" (one field alone moved the peak by GiB)
             "negative_memory": {**good, "memory": {**good["memory"], "opt_peak_bytes": -10**12}},
             "float_memory": {**good, "memory": {**good["memory"], "static_bytes": 1.5}},
             "negative_seq_len": {**good, "meta": {**good["meta"], "seq_len": -5}}}
    from tp_query.engine.graph import graph_digest

    for name, obj in cases.items():  # each with its own digest: the step's own check refuses it, not the digest's
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({**obj, "digest": graph_digest(obj)}))
        r = _cli(["predict", str(p)])
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "not a valid graph file" in lines[0], (name, r.stderr)
        assert "digest" not in lines[0], (name, r.stderr)
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({**good, "digest": graph_digest(good)}))
    r = _cli(["predict", str(ok), "--seq-len", "0"])
    assert r.returncode == 2 and "--seq-len must be a positive integer" in r.stderr, r.stderr


def test_a_graph_file_edited_after_tracing_is_refused(tmp_path: Path) -> None:
    """A graph file's header and operators are one record: its seq_len doubled was answered with the 2,048-token
    step's time at twice the tokens/s (and a model-FLOP rate above the kernels' own), a hidden size or vocabulary
    edited moved the parameter count and not the time, a setting edited to fp32 priced bf16 operators as fp32.
    `trace` writes a digest of the content; an edited file, or one without a digest, is refused in one line."""
    pytest.importorskip("torch")
    from tp_query.engine.predict import PredictRequest, graph_for
    from tp_query.schema.precision import Setting

    g = tmp_path / "tiny.json.gz"
    graph_for(PredictRequest(model=TINY_LLAMA, model_name="tiny", gpu="cpu", setting=Setting.BF16, seq_len=64)).save(g)
    r = _cli(["predict", str(g), "--json"])
    assert r.returncode == 0, r.stderr
    from tp_query.schema.manifest import readable_mode

    assert g.stat().st_mode & 0o777 == readable_mode()  # the user's file, as the umask makes it (mkstemp: 0600)
    good = json.loads(gzip.decompress(g.read_bytes()))
    model = good["meta"]["model"]
    edits = {"seq_len": {**good, "meta": {**good["meta"], "seq_len": 128}},
             "hidden_size": {**good, "meta": {**good["meta"], "model": {**model, "hidden_size": 2 * model["hidden_size"]}}},
             "setting": {**good, "meta": {**good["meta"], "setting": "fp32"}},
             "an_operator": {**good, "ops": good["ops"][:-1]},
             "no_digest": {k: v for k, v in good.items() if k != "digest"}}
    for name, obj in edits.items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(obj))
        flags = ["--seq-len", "128"] if name == "seq_len" else ["--precision", "fp32"] if name == "setting" else []
        r = _cli(["predict", str(p), *flags])
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        want = "carries no digest" if name == "no_digest" else "does not match its digest"
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], (name, r.stderr)


def test_graph_files_honour_or_refuse_every_flag(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    g = tmp_path / "tiny.json.gz"
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY_LLAMA))
    from tp_query.engine.predict import PredictRequest, graph_for
    from tp_query.schema.precision import Setting

    graph_for(PredictRequest(model=TINY_LLAMA, model_name="tiny", gpu="cpu", setting=Setting.BF16, seq_len=64)).save(g)
    for flags, what in ((["--tp", "2"], "--tp 2"), (["--precision", "fp32"], "--precision fp32"),
                        (["--seq-len", "128"], "--seq-len 128"), (["--micro-batch", "2"], "--micro-batch 2")):
        r = _cli(["predict", str(g), *flags])
        assert r.returncode == 2 and what in r.stderr, (flags, r.stderr)


# ---------------------------------------------------------------------------------------------
# the database
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = ROOT / "data" / "h200"
    if not (src / manifest.MANIFEST_NAME).is_file():
        pytest.skip("no shipped H200 database with a manifest")
    root = tmp_path_factory.mktemp("db")
    shutil.copytree(src, root / "h200")
    return root


def test_shipped_database_verifies(shipped_copy: Path) -> None:
    assert manifest.verify(shipped_copy / "h200", "h200") >= 40


def test_files_that_are_no_regular_files_are_refused_unread(shipped_copy: Path, tmp_path: Path) -> None:
    """A snapshot that is /dev/zero or a gzip bomb grew `db verify` to gigabytes, a FIFO hung it; a data file that
    is a FIFO hung `db manifest --adopt`. Neither is read now: the snapshot is unused, the adoption refused."""
    from tp_query.engine.dbcache import SHIPPED_NAME, read_shipped

    base = tmp_path / "db" / "h200"
    shutil.copytree(shipped_copy / "h200", base)
    (base / SHIPPED_NAME).unlink(missing_ok=True)
    (base / SHIPPED_NAME).symlink_to("/dev/zero")
    assert read_shipped(base / SHIPPED_NAME, "any") is None
    (base / SHIPPED_NAME).unlink()
    with gzip.open(base / SHIPPED_NAME, "wb", compresslevel=9) as f:  # 1 GiB of zeros inflated
        for _ in range(1024):
            f.write(b"0" * (1 << 20))
    assert read_shipped(base / SHIPPED_NAME, "any") is None
    victim = sorted((base / "ops").glob("*.parquet"))[0]
    victim.unlink()
    os.mkfifo(victim)
    with pytest.raises(manifest.ManifestError, match="not a regular file"):
        manifest.adopt(base, "h200")


def test_a_database_path_duckdb_would_read_as_a_pattern_is_refused(shipped_copy: Path, tmp_path: Path) -> None:
    """DuckDB's read_parquet globs every file name: `db[1]` was verified as itself and read from a sibling `db1`
    (a damaged copy's answer under a valid database's name). Such a path is refused, naming why."""
    bracketed = tmp_path / "db[1]"
    shutil.copytree(shipped_copy / "h200", bracketed / "h200")
    with pytest.raises(DatabaseError, match="reads as a file pattern"):
        Database("h200", bracketed)
    Database("h200", shipped_copy)


def test_two_hundred_random_bit_flips_are_all_caught(shipped_copy: Path) -> None:
    base = shipped_copy / "h200"
    rels = manifest.tracked_files(base)
    rng = random.Random(2026)
    caught = 0
    for _ in range(200):
        rel = rng.choice(rels)
        p = base / rel
        data = bytearray(p.read_bytes())
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        original = p.read_bytes()
        p.write_bytes(bytes(data))
        try:
            with pytest.raises(DatabaseError, match="checksum mismatch") as e:
                Database("h200", shipped_copy)
            assert rel in str(e.value)
            caught += 1
        finally:
            p.write_bytes(original)
    assert caught == 200
    Database("h200", shipped_copy)  # restored: clean again


@pytest.mark.parametrize("fault", ["foreign_copy", "truncated_comm", "missing_file", "no_manifest", "latency_x1000",
                                   "cpu_rows_adopted", "negative_calibration", "calibration_list",
                                   "negative_latency", "nan_latency", "zero_warm_latency", "negative_comm",
                                   "warm_latency_1e12", "null_latency", "negative_flops",
                                   "nan_framework", "damaged_framework_page", "h100_rows_in_h200_file",
                                   "two_torch_stacks_in_comm", "calibration_out_of_bounds", "calibration_unknown_key",
                                   "comm_copied_in", "comm_over_pcie", "status_column_dropped", "zero_overlap_time",
                                   "negative_comm_bytes", "one_rank_comm", "negative_concurrent_time",
                                   "zero_concurrent_comm_time", "negative_shape_key"])
def test_foreign_or_damaged_data_is_named(shipped_copy: Path, tmp_path: Path, fault: str) -> None:
    root = tmp_path / "db"
    shutil.copytree(shipped_copy / "h200", root / "h200")
    base = root / "h200"
    ops = sorted((base / "ops").glob("*.parquet"))
    if fault == "foreign_copy":
        shutil.copy(ops[0], base / "ops" / "zz-copy.parquet")
        match = "zz-copy.parquet: not in the manifest"
    elif fault == "truncated_comm":
        c = sorted((base / "comm").glob("*.parquet"))[0]
        c.write_bytes(c.read_bytes()[:1000])
        match = f"{c.name}: checksum mismatch"
    elif fault == "missing_file":
        ops[1].unlink()
        match = f"{ops[1].name}: listed in the manifest but missing"
    elif fault == "no_manifest":
        (base / manifest.MANIFEST_NAME).unlink()
        match = "manifest.json is missing"
    elif fault == "latency_x1000":  # a tampered copy re-adopted into the manifest still duplicates keys
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        t = pq.read_table(ops[0])
        t = t.set_column(t.schema.get_field_index("latency_us"), "latency_us",
                         pc.multiply(t.column("latency_us"), 1000.0))
        pq.write_table(t, base / "ops" / "zz-scaled.parquet")
        manifest.adopt(base, "h200")
        match = "duplicate measurements"
    elif fault == "cpu_rows_adopted":
        from tp_query.collector.store import write_table
        from tp_query.schema.tables import OPS_SCHEMA, Provenance

        prov = Provenance("cpu", "cpu", "", "", "2.13", "")
        write_table(base / "ops" / "zz-cpu.parquet", [], OPS_SCHEMA, prov)
        manifest.adopt(base, "h200")
        match = "measured on 'cpu'"
    elif fault in ("negative_latency", "nan_latency", "zero_warm_latency", "negative_comm", "warm_latency_1e12",
                   "null_latency", "negative_flops"):
        # values edited in place and the files re-adopted: the checksums agree, the values cannot be times (a
        # successful row without its latency was a TypeError in predict; a negative FLOP count moved the answer)
        import pyarrow as pa
        import pyarrow.parquet as pq

        f = sorted((base / "comm").glob("*.parquet"))[0] if fault == "negative_comm" else ops[0]
        t = pq.read_table(f)
        col = "latency_warm_us" if fault in ("zero_warm_latency", "warm_latency_1e12") else \
            "flops" if fault == "negative_flops" else "latency_us"
        vals = t.column(col).to_pylist()
        if fault == "null_latency":
            assert t.column("status").to_pylist()[len(vals) // 2] == "ok"
        vals[len(vals) // 2] = {"nan_latency": float("nan"), "zero_warm_latency": 0.0, "null_latency": None,
                                "negative_flops": -1e9,
                                "warm_latency_1e12": 1e12}.get(fault, -abs(vals[0] or 1.0))
        t = t.set_column(t.schema.get_field_index(col), col, pa.array(vals, t.schema.field(col).type))
        pq.write_table(t, f)
        manifest.adopt(base, "h200")
        match = f"a measured {col} of"
    elif fault in ("nan_framework", "h100_rows_in_h200_file", "two_torch_stacks_in_comm"):
        # re-adopted edits the checksums cannot see: a NaN host cost (it never ends a timeline), rows of another
        # GPU under an h200 file's metadata, a second torch stack blended into the communication table
        import pyarrow as pa
        import pyarrow.parquet as pq

        table, col, value, match = {
            "nan_framework": ("framework", "value_us", float("nan"), "a measured value_us of nan"),
            "h100_rows_in_h200_file": ("comm", "gpu", "h100", "rows measured on 'h100'"),
            "two_torch_stacks_in_comm": ("comm", "torch", "2.9.0+cu128", "rows measured under torch 2.11.0+cu130 and "
                                                                         "2.9.0+cu128")}[fault]
        f = sorted((base / table).glob("*.parquet"))[0]
        pf = pq.ParquetFile(f)
        t = pf.read()
        vals = t.column(col).to_pylist()
        vals[len(vals) // 2] = value
        t = t.set_column(t.schema.get_field_index(col), col, pa.array(vals, t.schema.field(col).type))
        pq.write_table(t.replace_schema_metadata(pf.schema_arrow.metadata), f)
        manifest.adopt(base, "h200")
    elif fault in ("comm_copied_in", "comm_over_pcie", "status_column_dropped", "zero_overlap_time"):
        # re-adopted files a checksum cannot see through: a comm file copied in again (its rows were medianed), one
        # measured over another link (blended into NVLink's tables), an ops file without its status column (every
        # row read as null, so filtered away), an overlap time of zero (a division by zero)
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        table = {"comm_copied_in": "comm", "comm_over_pcie": "comm", "status_column_dropped": "ops",
                 "zero_overlap_time": "overlap"}[fault]
        f = sorted((base / table).glob("*.parquet"))[0]
        pf = pq.ParquetFile(f)
        t = pf.read()
        if fault == "comm_over_pcie":
            t = t.set_column(t.schema.get_field_index("link"), "link", pa.array(["pcie"] * len(t), pa.string()))
            t = t.set_column(t.schema.get_field_index("latency_us"), "latency_us",
                             pc.multiply(t.column("latency_us"), 10.0))
        elif fault == "status_column_dropped":
            t = t.drop(["status"])
        elif fault == "zero_overlap_time":
            vals = t.column("compute_alone_us").to_pylist()
            vals[0] = 0.0
            t = t.set_column(t.schema.get_field_index("compute_alone_us"), "compute_alone_us",
                             pa.array(vals, pa.float64()))
        out = f if fault in ("status_column_dropped", "zero_overlap_time") else f.with_name("zz-" + f.name)
        pq.write_table(t.replace_schema_metadata(pf.schema_arrow.metadata), out)
        manifest.adopt(base, "h200")
        match = {"comm_copied_in": "2 rows of one measurement", "comm_over_pcie": "measured over nvlink and pcie",
                 "status_column_dropped": "it has no status column",
                 "zero_overlap_time": "a measured compute_alone_us of 0.0"}[fault]
    elif fault in ("negative_comm_bytes", "one_rank_comm", "negative_concurrent_time", "zero_concurrent_comm_time",
                   "negative_shape_key"):
        # re-adopted edits of columns the value check did not read: a comm table of negative message sizes priced
        # every gradient all-reduce at nothing (dp comm 40.1 -> 0.0 ms, no warning); overlap times of zero or below
        # under-priced the slowed collectives (23.8 -> 5.4 ms); integer keys are sizes and counts
        import pyarrow as pa
        import pyarrow.parquet as pq

        table, col, value = {"negative_comm_bytes": ("comm", "bytes", -1024),
                             "one_rank_comm": ("comm", "ranks", 1),
                             "negative_concurrent_time": ("overlap", "compute_concurrent_us", -100.0),
                             "zero_concurrent_comm_time": ("overlap", "comm_concurrent_us", 0.0),
                             "negative_shape_key": ("ops", "m", -4096)}[fault]
        f, i = next((f, i) for f in sorted((base / table).glob("*.parquet"))  # a successful row that has the column
                    for i, (v, st) in enumerate(zip(pq.read_table(f).column(col).to_pylist(),
                                                    pq.read_table(f).column("status").to_pylist(), strict=True))
                    if v is not None and st == "ok")
        pf = pq.ParquetFile(f)
        t = pf.read()
        vals = t.column(col).to_pylist()
        vals[i] = value
        t = t.set_column(t.schema.get_field_index(col), col, pa.array(vals, t.schema.field(col).type))
        pq.write_table(t.replace_schema_metadata(pf.schema_arrow.metadata), f)
        manifest.adopt(base, "h200")
        match = f"a measured {col} of {value!r}"
    elif fault == "damaged_framework_page":  # the first page's header overwritten, then adopted: the table was
        f = sorted((base / "framework").glob("*.parquet"))[0]  # dropped as if absent (-21% at DP=2 TP=2)
        raw = bytearray(f.read_bytes())
        raw[4:12] = b"\xff" * 8
        f.write_bytes(bytes(raw))
        manifest.adopt(base, "h200")
        match = "framework table"
    elif fault in ("calibration_out_of_bounds", "calibration_unknown_key"):
        cal = json.loads((base / "calibration.json").read_text())
        extra = {"per_iteration_us": 1e9} if fault == "calibration_out_of_bounds" else {"fwd_us_typo": 3.0}
        (base / "calibration.json").write_text(json.dumps({**cal, **extra}))
        manifest.adopt(base, "h200")
        match = "per_iteration_us must be within" if fault == "calibration_out_of_bounds" else "fwd_us_typo"
    elif fault == "negative_calibration":
        cal = json.loads((base / "calibration.json").read_text())
        (base / "calibration.json").write_text(json.dumps({**cal, "per_tensor_us": -3.0}))
        manifest.adopt(base, "h200")
        match = "per_tensor_us must be a finite number >= 0"
    else:
        (base / "calibration.json").write_text("[]")
        manifest.adopt(base, "h200")
        match = "not a JSON object"
    r = _cli(["predict", "examples/llama3.1-8b.json", "--dp", "2", "--tp", "2", "--db", str(root)])
    assert r.returncode == 2 and match in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    v = _cli(["db", "verify", "--db", str(root)])  # what predict refuses, db verify refuses (it passed some)
    assert v.returncode == 2 and len(v.stderr.strip().splitlines()) == 1, v.stdout + v.stderr


def test_adopting_over_a_manifest_the_files_do_not_match_needs_force(shipped_copy: Path, tmp_path: Path) -> None:
    """`db manifest --adopt` re-recorded a manifest that `db verify` refused, trusting whatever had changed, with
    no word of it: now it names the mismatch and asks for --force."""
    root = tmp_path / "db"
    shutil.copytree(shipped_copy / "h200", root / "h200")
    adopt = ["db", "manifest", "--adopt", "--root", str(root)]
    r = _cli(adopt)
    assert r.returncode == 2 and "every file matches it: nothing to adopt" in r.stderr, r.stderr
    ops = sorted((root / "h200" / "ops").glob("*.parquet"))
    shutil.copy(ops[0], root / "h200" / "ops" / "zz-copy.parquet")
    r = _cli(adopt)
    assert r.returncode == 2 and "zz-copy.parquet" in r.stderr and "--force" in r.stderr, r.stderr
    assert _cli([*adopt, "--force"]).returncode == 0
    r = _cli(["db", "verify", "--db", str(root)])  # adopted, the copy is still caught by its content
    assert r.returncode == 2 and "duplicate measurements" in r.stderr, r.stderr


def test_db_path_with_a_quote_works(shipped_copy: Path, tmp_path: Path) -> None:
    root = tmp_path / "it's a db"
    shutil.copytree(shipped_copy / "h200", root / "h200")
    r = _cli(["sql", "SELECT count(*) AS n FROM ops_ok", "--db", str(root), "--format", "json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["n"] > 10_000


def test_sql_reads_the_database_and_nothing_else(shipped_copy: Path) -> None:
    d = Database("h200", shipped_copy)
    assert d.user_sql("WITH k AS (SELECT kind FROM ops_ok) SELECT count(*) AS n FROM k").to_pylist()[0]["n"] > 0
    for q in ("SELECT * FROM read_parquet('/etc/passwd')", "COPY ops TO '/tmp/x.csv'", "EXPORT DATABASE '/tmp/x'"):
        with pytest.raises(DatabaseError):
            d.user_sql(q)


def test_sql_parses_on_the_locked_connection_and_names_each_column(shipped_copy: Path, tmp_path: Path) -> None:
    """A statement is parsed where nothing can load (DuckDB's default connection would fetch the fts extension
    for a PRAGMA, or read an IMPORT DATABASE folder, before the SELECT check); a self-join's two columns of one name
    are two columns (the table and JSON showed the first value twice); a remote database runs no ad-hoc SQL
    (reading it needs external access); --limit holds in every format, and JSON has null for NaN."""
    d = Database("h200", shipped_copy)
    (tmp_path / "imp").mkdir()
    (tmp_path / "imp" / "schema.sql").write_text("CREATE TABLE t(i INTEGER);")
    (tmp_path / "imp" / "load.sql").write_text("")
    for q in ("PRAGMA create_fts_index('ops','key','op')", f"IMPORT DATABASE '{tmp_path / 'imp'}'"):
        with pytest.raises(DatabaseError):
            d.user_sql(q)
    t = d.user_sql("SELECT a.latency_us, b.latency_us, 1 AS latency_us_2 FROM ops a JOIN ops b ON a.key = b.key "
                   "AND a.run = 1 AND b.run = 2 WHERE a.latency_us <> b.latency_us LIMIT 3")
    assert len(set(t.column_names)) == 3 and t.column_names[0] == "latency_us"
    assert all(r[t.column_names[0]] != r[t.column_names[1]] for r in t.to_pylist())
    remote = Database("h200", shipped_copy)
    remote.remote, remote.root = True, "s3://bucket/prefix"  # (reading a real bucket needs the network)
    with pytest.raises(DatabaseError, match="local database folder"):
        remote.user_sql("SELECT 1")
    r = _cli(["sql", "SELECT range AS i, 'nan'::DOUBLE AS x FROM range(10)", "--db", str(shipped_copy), "--format",
              "json", "--limit", "3"])
    assert r.returncode == 0 and json.loads(r.stdout) == [{"i": i, "x": None} for i in range(3)], r.stderr
    r = _cli(["sql", "SELECT range AS i FROM range(10)", "--db", str(shipped_copy), "--format", "csv", "--limit", "2"])
    assert r.returncode == 0 and r.stdout.split() == ['"i"', "0", "1"], r.stdout


def test_a_snapshot_payload_is_one_line_per_file_and_a_malformed_one_is_unused(tmp_path: Path) -> None:
    """The payload keeps each file's JSON as bytes (parsed only when read, cached as shipped); names that would
    break its lines are refused when written, and a payload with a line of no name, or a name twice, reads as
    no snapshot rather than as part of one."""
    import hashlib

    from tp_query.engine.dbcache import SHIPPED_FORMAT, decode_files, encode_files, read_shipped

    files = {"exact": {"k": [1.5, None]}, "table-comm": [{"a": "x\ty\nz"}]}
    body = encode_files(files)
    assert body.count(b"\n") == 1 and {k: json.loads(v) for k, v in decode_files(body).items()} == files
    with pytest.raises(ValueError, match="without a tab"):
        encode_files({"a\tb": []})
    for bad in (body + b"\nexact\t{}", body + b"\nno-tab", b"\t[]"):
        with pytest.raises(ValueError, match="malformed"):
            decode_files(bad)
        head = json.dumps({"format": SHIPPED_FORMAT, "fingerprint": "f", "files_sha256": hashlib.sha256(bad).hexdigest()})
        (tmp_path / "s.gz").write_bytes(gzip.compress(head.encode() + b"\n" + bad))
        assert read_shipped(tmp_path / "s.gz", "f") is None
    head = json.dumps({"format": SHIPPED_FORMAT, "fingerprint": "f", "files_sha256": hashlib.sha256(body).hexdigest()})
    (tmp_path / "s.gz").write_bytes(gzip.compress(head.encode() + b"\n" + body))
    assert read_shipped(tmp_path / "s.gz", "f") == decode_files(body)
    assert read_shipped(tmp_path / "s.gz", "other") is None


def test_an_edited_snapshot_is_never_read_and_db_verify_names_it(shipped_copy: Path, tmp_path: Path) -> None:
    """The shipped snapshot answers only when its payload is the bytes its header hashed (an edit that keeps the
    header is ignored: the answer is the files'); one whose header was rewritten to match is caught by `db verify`,
    which derives every read from the files again."""
    import gzip
    import hashlib

    from tp_query.engine.dbcache import SHIPPED_NAME, decode_files, encode_files

    root = tmp_path / "db"
    shutil.copytree(shipped_copy / "h200", root / "h200")
    snap = root / "h200" / SHIPPED_NAME
    if not snap.exists():
        pytest.skip("no shipped snapshot")
    raw = gzip.decompress(snap.read_bytes())
    head, _, body = raw.partition(b"\n")
    files = {k: json.loads(v) for k, v in decode_files(body).items()}
    files["exact"] = {k: [x * 3 if isinstance(x, float) else x for x in v] for k, v in files["exact"].items()}
    edited = encode_files(files)
    clean = _cli(["predict", "examples/llama3.1-8b.json", "--tp", "2", "--json"])
    assert clean.returncode == 0, clean.stderr
    want = json.loads(clean.stdout)["iteration_ms"]
    snap.write_bytes(gzip.compress(head + b"\n" + edited))
    r = _cli(["predict", "examples/llama3.1-8b.json", "--tp", "2", "--json", "--db", str(root)])
    assert r.returncode == 0 and json.loads(r.stdout)["iteration_ms"] == pytest.approx(want, rel=1e-9), r.stderr
    h = json.loads(head)
    h["files_sha256"] = hashlib.sha256(edited).hexdigest()
    snap.write_bytes(gzip.compress(json.dumps(h).encode() + b"\n" + edited))
    v = _cli(["db", "verify", "--db", str(root)])
    assert v.returncode == 2 and "altered" in v.stderr and len(v.stderr.strip().splitlines()) == 1, v.stderr


def test_an_ad_hoc_query_is_bounded_in_time_and_memory(shipped_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A query past its time is interrupted; one past its memory fails inside DuckDB's limit (no spill to disk)."""
    import tp_query.engine.db as dbm

    monkeypatch.setattr(dbm, "USER_SQL_TIMEOUT_S", 0.5)
    d = Database("h200", shipped_copy)
    with pytest.raises(DatabaseError, match=r"ran past 0\.5 s"):
        d.user_sql("SELECT count(*) FROM range(1000000000000) a")
    with pytest.raises(DatabaseError, match=r"(?i)out of memory"):
        d.user_sql("SELECT list(repeat('x', 1000000)) FROM range(100000)")
    assert d.user_sql("SELECT count(*) AS n FROM ops_ok").to_pylist()[0]["n"] > 0  # and the connection still answers


def test_an_ad_hoc_result_is_streamed_and_bounded(shipped_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows past those printed are counted, not held (a 100M-row result reached 3.5 GB); the rows a query hands
    back are bounded, and a process running one bounds its address space (a 2 GB repeat() reached 4 GB)."""
    import tp_query.engine.db as dbm

    d = Database("h200", shipped_copy)
    t, n = d.user_sql_rows("SELECT range AS i FROM range(1000000)", 5)
    assert n == 1_000_000 and t.column("i").to_pylist() == [0, 1, 2, 3, 4]
    monkeypatch.setattr(dbm, "USER_SQL_RESULT_MB", 1)
    with pytest.raises(DatabaseError, match=r"over 1 MB \(\d+ rows read\): add a LIMIT"):
        d.user_sql("SELECT range AS i FROM range(1000000)")  # 8 MB of int64
    assert d.user_sql_rows("SELECT range AS i FROM range(1000000)", 10)[1] == 1_000_000
    r = _cli(["sql", "SELECT range AS i FROM range(100000000)", "--db", str(shipped_copy)])
    assert r.returncode == 0 and r.stdout.strip().endswith("... 99999950 more rows"), r.stderr[-300:]
    probe = ("import resource; from tp_query.engine.cli import _bound_address_space; _bound_address_space(); "
             "vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) << 10; "
             "print(resource.getrlimit(resource.RLIMIT_AS)[0] - vm)")
    headroom = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                  timeout=60).stdout)
    assert 0 < headroom <= (dbm.USER_SQL_MEMORY_MB + 4 * 256 + 512) << 20


def test_a_report_refuses_runs_measured_on_another_gpu(tmp_path: Path) -> None:
    """Validation runs of another GPU (by their rows or their file's provenance) are named, never compared with
    this GPU's database."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tp_query.engine.validation import load_rows
    from tp_query.schema.tables import METADATA_KEY

    src = sorted((ROOT / "data" / "validation").glob("validation-*.parquet"))[0]
    t = pq.read_table(src)
    assert load_rows(src.parent, "h200")
    rows = tmp_path / "rows"
    rows.mkdir()
    i = t.schema.get_field_index("gpu")
    pq.write_table(t.set_column(i, "gpu", pa.array(["h100"] * len(t), t.schema.field("gpu").type)),
                   rows / "validation-00000.parquet")
    with pytest.raises(ValueError, match="measured on 'h100', not 'h200'"):
        load_rows(rows, "h200")
    prov = tmp_path / "prov"
    prov.mkdir()
    meta = dict(t.schema.metadata or {})
    meta[METADATA_KEY] = json.dumps({**json.loads(meta[METADATA_KEY]), "gpu": "h100"}).encode()
    pq.write_table(t.replace_schema_metadata(meta), prov / "validation-00000.parquet")
    with pytest.raises(ValueError, match="measured on 'h100'"):
        load_rows(prov, "h200")


def test_each_gpu_keeps_its_runs_in_its_own_folder() -> None:
    """The H100 runs came back into the H200's folder and the report refused the folder; each GPU's runs now
    live apart (the reference GPU's at the top), and neither report reads the other's."""
    from tp_query.engine.validation import load_rows
    from tp_query.schema.gpus import REFERENCE_GPU, validation_folder

    assert validation_folder(REFERENCE_GPU) == "data/validation"
    h100 = load_rows(ROOT / validation_folder("h100"), "h100")
    assert h100 and {r["gpu"] for r in h100} == {"h100"}
    h200 = load_rows(ROOT / validation_folder("h200"), "h200")
    assert {r["gpu"] for r in h200} == {"h200"}


def test_a_report_says_what_it_read_and_whether_it_fitted(tmp_path: Path) -> None:
    """`report --no-fit` over another folder of runs said it fitted, on the committed measurements (helper audit);
    the header now names the folder read and the host model as given."""
    val = tmp_path / "val"
    val.mkdir()
    for src in sorted((ROOT / "data" / "validation").glob("validation-*.parquet"))[:2]:
        shutil.copy(src, val / src.name)
    out = tmp_path / "rep.md"
    r = _cli(["report", "--validation", str(val), "--out", str(out), "--no-fit"])
    assert r.returncode == 0 and "2 cases" in r.stdout, r.stderr
    text = out.read_text()
    assert f"measurements in `{val}/`" in text and "operator database in `data/h200/`" in text
    assert "not fitted by this report" in text and "fitted on the calibration split" not in text
    assert json.loads(out.with_suffix(".json").read_text())["cases"]


def test_a_gpu_without_a_probed_calibration_run_fits_no_host_constants(tmp_path: Path) -> None:
    """The H100's calibration runs were measured on hosts whose per-operator host costs were not probed (its one
    probe came later, on another instance): fitted to them, its four GPU-bound runs had driven every host constant to
    zero (per_tensor_us 3e-15) and held-out GPT-2 from -13% to -20%. Nothing is fitted; the report says so, writes
    no calibration file, and names what it used: the probe's per-operator costs and the engine's defaults."""
    val = tmp_path / "val"
    val.mkdir()
    for src in sorted((ROOT / "data" / "validation" / "h100").glob("validation-*.parquet"))[:2]:
        shutil.copy(src, val / src.name)
    out, cal = tmp_path / "rep.md", tmp_path / "cal.json"
    r = _cli(["report", "--gpu", "h100", "--validation", str(val), "--out", str(out), "--calibration-out", str(cal)])
    assert r.returncode == 0 and "2 cases" in r.stdout, r.stderr
    assert "no calibration run was measured on a host whose per-operator host costs are measured" in r.stderr
    assert not cal.exists()
    text = out.read_text()
    assert "data/h100/framework/, not fitted" in text and "the engine's fixed defaults" in text
    assert "fitted on the calibration split" not in text
    assert "per_tensor_us=1, per_iteration_us=300" in text and "(H200)" not in text
    # nothing of its calls measured on this GPU: every run is held out, the reference GPU's calibration cases too
    assert "every run is held out" in text and "| holdout | 2 |" in text and "| calibration | 2 |" not in text


def test_only_the_calibration_campaign_makes_calibration_shapes() -> None:
    """The H100's database gained a gap-filling campaign (the gated-delta fallback's calls at other lengths than the
    cases'): any campaign other than the grid had made the report call LLaMA-3-8B's runs calibration shapes, whose
    calls it never measured. Only the calibration cases' own campaign does."""
    from tp_query.engine.db import Database
    from tp_query.schema.tables import CALIBRATION_CAMPAIGN, GRID_CAMPAIGN

    h100, h200 = Database("h100"), Database("h200")
    assert h100.has_campaign("linear-attention") and h100.has_campaign(GRID_CAMPAIGN)
    assert not h100.has_campaign(CALIBRATION_CAMPAIGN)
    assert h200.has_campaign(CALIBRATION_CAMPAIGN)


def test_a_cached_read_of_the_wrong_shape_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache file that parses but is not the shape its reader returns (versions.json holding [1, 2]) crashed every
    run with an AttributeError and was never rebuilt; it is read again from the database."""
    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path))
    first = _cli(["predict", "examples/llama3.1-8b.json", "--json"])
    assert first.returncode == 0, first.stderr
    (versions,) = tmp_path.rglob("versions.json")
    versions.write_text("[1, 2]")
    again = _cli(["predict", "examples/llama3.1-8b.json", "--json"])
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["iteration_ms"] == json.loads(first.stdout)["iteration_ms"]
    from tp_query.engine.dbcache import _read_json

    assert _read_json(versions)[0]["torch"]


@pytest.mark.parametrize("table", ["table-framework", "table-comm", "table-overlap"])
def test_a_cache_file_changed_in_place_is_derived_again(table: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache file holding valid JSON of the right shape (an empty table, `[]`) changed a prediction by 10-20% in
    silence, and its warnings blamed the database ('not measured in this database'). Every cache file is sealed
    with a digest of its name and bytes: one changed, or copied under another name, is derived again."""
    monkeypatch.setenv("TP_QUERY_CACHE", str(tmp_path))
    args = ["predict", "examples/llama3.1-8b.json", "--dp", "4", "--zero", "3", "--tp", "2", "--precision", "bf16",
            "--json"]
    first = _cli(args)
    assert first.returncode == 0, first.stderr
    (f,) = tmp_path.rglob(f"{table}.json")
    sealed = f.read_bytes()
    for damage in (b"[]", sealed.split(b"\n", 1)[0] + b"\n[]",
                   next(tmp_path.rglob("versions.json")).read_bytes()):  # plain, resealed-header, another file's
        f.write_bytes(damage)
        again = _cli(args)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout) == json.loads(first.stdout), damage[:40]
        assert f.read_bytes() == sealed  # derived again and rewritten
