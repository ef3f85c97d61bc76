"""A user's request, step by step, as notes section 31 quotes it (LLaMA-3.1-8B, DP=2 TP=4, amp_bf16, in a fresh
process with the cache folder given): imports, Engine(), the graph, the costed stages, the prediction, the host
range over every measured instance; then rebuilding the full model's optimizer step for four new ZeRO degrees.
Milliseconds; run it several times (the first run of a cache folder fills it).
    .venv/bin/python tools/request_path.py CACHE_DIR"""
import os
import sys
import time

t0 = time.perf_counter()
os.environ["TP_QUERY_CACHE"] = sys.argv[1]
import json  # noqa: E402

from tp_query.engine.parallel import ParallelConfig  # noqa: E402
from tp_query.engine.predict import Engine, PredictRequest  # noqa: E402
from tp_query.schema.precision import Setting  # noqa: E402

t1 = time.perf_counter()
eng = Engine("h200")
t2 = time.perf_counter()
cfg = json.load(open("examples/llama3.1-8b.json"))
req = PredictRequest(model=cfg, model_name="8b", gpu="h200", setting=Setting.AMP_BF16,
                     parallel=ParallelConfig(dp=2, tp=4))
g = eng.graph(req)
t3 = time.perf_counter()
asm = eng.assemble(req, g)
t4 = time.perf_counter()
asm.run(host_range=False)
t5 = time.perf_counter()
eng.assemble(req, g).run(host_range=True)
t6 = time.perf_counter()
comp = eng.composer(g)
params = comp.stage_params(True, True, int(cfg.get("num_hidden_layers", 32)), 0)
t7 = time.perf_counter()
for n in (3, 5, 6, 7):
    comp.optimizer_items(params, n)
t8 = time.perf_counter()
print(f"imports {1e3 * (t1 - t0):.0f}  Engine() {1e3 * (t2 - t1):.0f}  graph {1e3 * (t3 - t2):.0f}  "
      f"costed stages {1e3 * (t4 - t3):.0f}  prediction {1e3 * (t5 - t4):.0f}  "
      f"with host range {1e3 * (t6 - t5):.0f}  optimizer rebuild per ZeRO degree {1e3 * (t8 - t7) / 4:.1f}")
