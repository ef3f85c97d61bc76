"""The traced cut against the whole model's own trace, for every one-GPU validation model: a cut holds a leading
layer and one template of each layer kind, and the composer rebuilds the whole model's step from it. This compares
what the rebuilt step runs with what the whole model's trace runs: every later layer's operators (each layer's
template counted for it; layer 0 is both traces' leading layer), the parameters, and the optimizer step's
per-parameter lists (their lengths and elements), where a cut that stands for its model wrongly goes unseen by
operator tests (ERNIE-4.5-MoE's and AFMoE's lists had kept the cut's layers: notes section 42).
    .venv/bin/python tools/cut_vs_whole.py [SETTING ...] [--only=MODEL,...]   (default bf16 amp_bf16; one line per model)"""

import json
import sys
from collections import Counter

from tp_query.collector.validate import default_cases
from tp_query.engine.compose import Composer
from tp_query.engine.graph import Phase, Section, layer_template_of
from tp_query.engine.parallel import ParallelConfig
from tp_query.engine.trace.capture import TraceRequest, trace_config
from tp_query.schema.model_config import ConfigError, parse_config
from tp_query.schema.precision import Setting
from tp_query.schema.signature import OpCall, TensorSpec


def lists(calls: list[OpCall]) -> Counter:
    return Counter((c.op, tuple((len(a), sum(t.numel for t in a if isinstance(t, TensorSpec)))
                                for a in c.args if isinstance(a, list)))
                   for c in calls if any(isinstance(a, list) for a in c.args))


def layer_ops(g, layers: list[int]) -> Counter:  # type: ignore[no-untyped-def]
    return Counter((o.op, o.sig, o.phase.value) for o in g.ops if o.section == Section.LAYER and o.layer in layers)


def main() -> int:
    only = [a.removeprefix("--only=") for a in sys.argv[1:] if a.startswith("--only=")]
    settings = [Setting(s) for s in sys.argv[1:] if not s.startswith("--")] or [Setting.BF16, Setting.AMP_BF16]
    seen: set[str] = set()
    bad = 0
    for case in default_cases():
        if case.tp_shard != 1 or case.model in seen or (only and not any(o in case.model for o in only[0].split(","))):
            continue
        seen.add(case.model)
        try:
            spec = parse_config(case.config)
        except ConfigError as e:
            print(f"{case.model}: refused ({e})")
            continue
        if len(set(spec.layer_kinds())) <= 1 and spec.num_layers <= 1:
            continue
        for st in settings:
            try:
                cut = trace_config(TraceRequest(spec, st, 1, 64))
                whole = trace_config(TraceRequest(spec, st, 1, 64, traced_layers=spec.num_layers))
            except Exception as e:  # noqa: BLE001 (a model that does not trace is reported, not compared)
                print(f"{case.model} {st.value}: no trace ({str(e)[:80]})")
                continue
            stage, = Composer(cut, allow_tf32=st == Setting.TF32).stages(ParallelConfig())
            want = lists([OpCall.from_json_str(o.op, o.sig) for o in whole.ops if o.phase == Phase.OPT])
            got = lists([it.call for it in stage.opt])
            n_whole = sum(p.numel for p in whole.params)
            template = layer_template_of(cut.meta)  # (a cut of 3 layers of a 3-layer model is still a cut)
            composed: Counter = Counter()
            for i in range(1, spec.num_layers):
                composed.update(layer_ops(cut, [template[i]]))
            same_layers = composed == layer_ops(whole, list(range(1, spec.num_layers)))
            ok = got == want and stage.param_numel == n_whole and same_layers
            bad += not ok
            print(f"{case.model:40s} {st.value:9s} traced {cut.meta.traced_layers}/{spec.num_layers} "
                  f"params {stage.param_numel}/{n_whole} lists {'same' if got == want else 'DIFFER'} "
                  f"layers {'same' if same_layers else 'DIFFER'}"
                  + ("" if ok else f"  {json.dumps(sorted(map(str, (want - got) + (got - want))))[:300]}"))
    print(f"{len(seen)} models, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
