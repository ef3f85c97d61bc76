"""Expert parallelism and skewed routing as Megatron-Core runs them: the split is validated once, the
traced MoE layer holds num_experts / EP experts and prices its all-to-alls over the EP group, expert
gradients and optimizer shards follow their own replicas (DP / EP), and a skewed router makes the rank
with the busiest expert do more work. Closed-form checks on tiny models; the CPU database is synthetic."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from tp_query.engine.parallel import ParallelConfig, PlanError
from tp_query.engine.predict import Engine, PredictError, PredictRequest
from tp_query.schema.model_config import parse_config
from tp_query.schema.precision import Setting

from .conftest import TINY_FAMILIES, TINY_LLAMA, run_cli

torch = pytest.importorskip("torch")

MIXTRAL = {**TINY_FAMILIES["mixtral"], "num_local_experts": 8, "num_hidden_layers": 2}


def test_expert_rows_closed_form() -> None:
    from tp_query.engine.trace.megatron_local import expert_rows

    assert expert_rows(64, 8, 2) == [16] * 8
    assert expert_rows(10, 4, 1) == [3, 3, 2, 2]
    rows = expert_rows(64, 8, 2, 3.0)
    assert rows[0] == 48 and sum(rows) == 128 and max(rows[1:]) - min(rows[1:]) <= 1
    assert expert_rows(64, 8, 2, 4.0)[0] == 64  # every token: the most one expert can receive


@pytest.mark.parametrize("kw,msg", [
    ({"dp": 2, "ep": 4, "framework": "megatron"}, "must divide DP"),
    ({"dp": 2, "ep": 2}, "--framework megatron"),
    ({"dp": 2, "ep": 2, "framework": "megatron", "zero": 3}, "--zero 1"),
    ({"dp": 2, "ep": 0, "framework": "megatron"}, "EP must be a positive integer"),
])
def test_parallel_config_refuses_impossible_ep(kw: dict, msg: str) -> None:
    with pytest.raises(PlanError, match=msg):
        ParallelConfig(**kw)


def _trace(ep: int, imbalance: float = 1.0):  # type: ignore[no-untyped-def]
    from tp_query.engine.trace.capture import TraceRequest, trace_config

    spec = parse_config(MIXTRAL, "tiny-mixtral")
    return trace_config(TraceRequest(spec, Setting("mp_bf16"), 1, 64, 1, framework="megatron", ep=ep,
                                     moe_imbalance=imbalance))


def test_traced_moe_layer_splits_experts_and_prices_all_to_all_over_ep() -> None:
    g1, g2 = _trace(1), _trace(2)
    experts = lambda g: {p.name.split(".local_experts.")[1].split(".")[0]  # noqa: E731
                         for p in g.params if ".local_experts." in p.name and p.layer == 0}
    assert len(experts(g1)) == 8 and len(experts(g2)) == 4
    comm = lambda g: Counter((o.op, json.loads(o.sig)["k"]["group"], o.phase.value)  # noqa: E731
                             for o in g.ops if o.op.startswith("comm."))
    c1, c2 = comm(g1), comm(g2)
    assert not any(grp == "ep" for _, grp, _ in c1)
    layers = g2.meta.traced_layers
    # dispatch (tokens, probabilities) and combine, forward and backward, per MoE layer
    assert c2[("comm.all_to_all", "ep", "fwd")] == 3 * layers
    assert c2[("comm.all_to_all", "ep", "bwd")] == 3 * layers
    assert c2[("comm.all_gather", "ep", "fwd")] == layers  # the token counts
    # balanced: each rank sends and receives tokens x top-k rows
    rows = {json.loads(o.sig)["a"][0]["T"][0] for o in g2.ops if o.op == "comm.all_to_all"}
    assert rows == {64 * 2}


def test_skewed_routing_loads_the_rank_with_the_busiest_expert() -> None:
    g = _trace(2, imbalance=3.0)
    rows = {json.loads(o.sig)["a"][0]["T"][0] for o in g.ops if o.op == "comm.all_to_all"}
    # from each of 2 ranks: the hot expert 48 of 128 rows, the other 7 share 80 (12, 12, 12, 11, ...): rank 0
    # receives 2 x (48 + 12 + 12 + 12) rows, and every all-to-all is priced on what it receives
    assert rows == {2 * (48 + 12 + 12 + 12)}
    from tp_query.engine.trace.capture import TraceError

    with pytest.raises(TraceError, match="within"):
        _trace(2, imbalance=5.0)


@pytest.fixture(scope="module")
def eng(cpu_db: Path) -> Engine:
    return Engine("cpu", str(cpu_db))


def _req(**par: object) -> PredictRequest:
    return PredictRequest(model=MIXTRAL, model_name="tiny-mixtral", gpu="cpu", setting=Setting("mp_bf16"), seq_len=64,
                          parallel=ParallelConfig(framework="megatron", **par))  # type: ignore[arg-type]


def test_prediction_splits_expert_memory_and_prices_ep_comm(eng: Engine) -> None:
    p1 = eng.predict(_req(dp=2))
    p2 = eng.predict(_req(dp=2, ep=2))
    assert "ep_comm_ms" not in p1.breakdown and p2.breakdown["ep_comm_ms"] > 0
    assert p2.config["ep"] == 2
    # experts are most of the tiny model's weights: halving them shrinks the weights by more than a third
    assert p2.memory["weights_gib"] < 0.66 * p1.memory["weights_gib"]
    # with EP = DP every expert has one replica: its gradients are not all-reduced
    assert p2.breakdown["dp_comm_ms"] < p1.breakdown["dp_comm_ms"]
    assert "all-to-all over EP=2" in p2.config["model_graph"]["moe_routing"]
    # the distributed optimizer shards dense state over DP and expert state over DP / EP = 1
    z = eng.predict(_req(dp=2, ep=2, zero=1))
    assert z.memory["optimizer_gib"] < p2.memory["optimizer_gib"]


def test_moe_refusals_are_one_line(eng: Engine, tmp_path: Path) -> None:
    with pytest.raises(PredictError, match="mixture-of-experts"):
        eng.predict(PredictRequest(model=TINY_LLAMA, gpu="cpu", seq_len=64, setting=Setting("mp_bf16"),
                                   parallel=ParallelConfig(dp=2, ep=2, framework="megatron")))
    with pytest.raises(PredictError, match="framework megatron"):
        eng.predict(PredictRequest(model=MIXTRAL, gpu="cpu", seq_len=64, moe_imbalance=2.0))
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps(MIXTRAL))
    r = run_cli("predict", str(cfg), "--moe-imbalance", "nan", "--framework", "megatron")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_search_tries_expert_parallel_sizes_for_megatron_moe(eng: Engine) -> None:
    from tp_query.engine.search import SearchError, SearchSpace, launch_command, search

    space = SearchSpace(2, 2, 64, precisions=(Setting("mp_bf16"),), micro_batches=(1,), sequence_parallel=(False,),
                        zero_stages=(0,), recompute=(False,), framework="megatron")
    res = search(eng, MIXTRAL, space, name="tiny-mixtral")
    eps = {o.candidate.parallel.ep for o in res.ranked if o.candidate.parallel.dp == 2}
    assert eps == {1, 2}
    best_ep2 = next(o for o in res.ranked if o.candidate.parallel.ep == 2)
    assert "+EP2" in best_ep2.candidate.label()
    assert "--expert-model-parallel-size 2" in launch_command(best_ep2, "megatron", "m.json", 64)
    # the router and dispatcher priced, also without EP (Megatron-LM's defaults are allgather and no aux loss)
    best_ep1 = next(o for o in res.ranked if o.candidate.parallel.ep == 1)
    for o in (best_ep1, best_ep2):
        line = launch_command(o, "megatron", "m.json", 64, spec=parse_config(MIXTRAL, "m"))
        assert "--moe-token-dispatcher-type alltoall" in line and "--moe-aux-loss-coeff 0.01" in line
    p = eng.predict(PredictRequest(model={**MIXTRAL, "router_jitter_noise": 0.1}, model_name="m", gpu="cpu",
                                   setting=Setting("mp_bf16"), seq_len=64, parallel=ParallelConfig(framework="megatron")))
    assert any("not read from the config: router_jitter_noise 0.1" in w for w in p.warnings)
    # TP > 1 with MoE is refused by the Megatron model, with its reason, not silently dropped
    assert any("TP > 1" in o.reason for o in res.rejected)
    # a skewed router, as predict takes it: the EP2 candidate priced as its predict is, not as balanced
    from dataclasses import replace

    skew = search(eng, MIXTRAL, replace(space, moe_imbalance=2.0), name="tiny-mixtral")
    by = {o.candidate.label(): o.iteration_ms for o in res.ranked}
    one = next(o for o in skew.ranked if o.candidate.parallel.ep == 2)
    p = eng.predict(PredictRequest(model=MIXTRAL, model_name="tiny-mixtral", gpu="cpu", setting=Setting("mp_bf16"),
                                   seq_len=64, parallel=one.candidate.parallel, moe_imbalance=2.0))
    assert one.iteration_ms == pytest.approx(p.iteration_ms, rel=1e-9) and one.iteration_ms != by[one.candidate.label()]
    with pytest.raises(SearchError, match="moe_imbalance must be a number >= 1"):
        search(eng, MIXTRAL, replace(space, moe_imbalance=0.5))


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_megatron_builds_qwen3_and_qwen3_moe_with_qk_layernorm(family: str) -> None:
    """Qwen3's qk-norm is Megatron's qk_layernorm (an RMSNorm over each head's channels on the split query
    and key); Qwen3-MoE's normalised top-k is Megatron's default router. The Megatron graph holds exactly
    the HF model's parameters (untied head), and an EP split divides the experts."""
    from tp_query.engine.flops import parameter_count
    from tp_query.engine.trace.capture import TraceRequest, trace_config

    cfg = {**TINY_FAMILIES[family], "num_hidden_layers": 2}
    spec = parse_config(cfg, family)
    g = trace_config(TraceRequest(spec, Setting("mp_bf16"), 1, 64, 1, framework="megatron",
                                  ep=2 if spec.is_moe else 1))
    names = [p.name for p in g.params]
    assert any("q_layernorm" in n for n in names) and any("k_layernorm" in n for n in names)
    qn = next(p for p in g.params if "q_layernorm" in p.name)
    assert qn.shape == (spec.head_dim,)
    total = sum(p.numel for p in g.params)
    expected = parameter_count(spec.to_dict())
    if spec.is_moe:  # half the routed experts live on this rank
        per_expert = 3 * spec.hidden_size * spec.moe_intermediate_size
        expected -= spec.num_layers * (spec.num_experts // 2) * per_expert
    assert total == expected


def test_ops_takes_the_split_options_of_predict(cpu_db: Path, tmp_path: Path) -> None:
    """`tp-query ops` answers for the same split as `predict` (EP included), not a default one."""
    cfg = tmp_path / "mixtral.json"
    cfg.write_text(json.dumps(MIXTRAL))
    common = [str(cfg), "--gpu", "cpu", "--db", str(cpu_db), "--seq-len", "64", "--dp", "2", "--framework",
              "megatron", "--precision", "mp_bf16", "--json"]
    r1 = run_cli("ops", *common, "--top", "0")
    r2 = run_cli("ops", *common, "--top", "0", "--ep", "2")
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    comm = lambda out: [row for row in json.loads(out) if row["op"] == "comm.all_to_all"]  # noqa: E731
    assert not comm(r1.stdout) and comm(r2.stdout)


def test_megatron_scales_expert_and_dense_buffers_apart_under_ep(eng: Engine) -> None:
    """Under EP > 1 Megatron-Core keeps the routed experts' gradients in a buffer of their own: two in-place
    multiplies by 1/DP (the dense and the expert buffer); with experts replicated (EP=1), one."""
    def scaled(**par: object) -> tuple[list[int], int, int]:
        (st,) = eng.assemble(_req(**par)).stages
        return ([it.call.args[0].shape[0] for it in st.ddp if it.call.op == "aten.mul_.Tensor"], st.param_numel,
                st.expert_numel)

    one, total1, _ = scaled(dp=2)
    assert one == [total1]
    two, total2, expert2 = scaled(dp=2, ep=2)
    assert sorted(two) == sorted([total2 - expert2, expert2]) and expert2 > 0
