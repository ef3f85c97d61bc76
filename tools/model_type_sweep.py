"""Every causal-LM model type transformers knows, through predict: its default config cut to 2 layers, amp_bf16,
512 tokens. Each answer is a prediction ("ok"), a one-line refusal, a refusal of more than one line or a crash (both
faults); the README's sweep figures come from here.
Usage: `.venv/bin/python tools/model_type_sweep.py OUT.json`"""

import json
import sys
import time

import transformers
from tp_query.engine.api import predict
from tp_query.engine.parallel import PlanError
from tp_query.engine.request import PredictError
from tp_query.schema.model_config import ConfigError
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def answer(mt: str) -> list:
    try:
        cfg = transformers.AutoConfig.for_model(mt).to_dict()
    except Exception as e:  # the model type's own default config does not build
        return ["noconfig", str(e).splitlines()[0][:100]]
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg["model_type"] = mt
    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt]]
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if k in cfg:
            cfg[k] = 2
    for k in ("layer_types", "mlp_layer_types", "no_rope_layers", "num_attention_heads_per_layer"):
        if isinstance(cfg.get(k), list):
            cfg[k] = cfg[k][:2]
    if isinstance(cfg.get("per_layer_config"), dict):  # per-layer overrides of the layers kept (Gemma-4)
        cfg["per_layer_config"] = {k: v for k, v in cfg["per_layer_config"].items() if int(k) < 2}
    if isinstance(cfg.get("layer_types"), list):  # the kinds transformers builds for the cut (Gemma-4: last full)
        try:
            built = transformers.AutoConfig.for_model(mt, **{k: v for k, v in cfg.items() if k != "model_type"})
            cfg["layer_types"] = list(built.layer_types)
        except Exception:  # refused below, in the engine's words
            pass
    try:
        return ["ok", round(predict(cfg, precision="amp_bf16", seq_len=512).iteration_ms, 2)]
    except (ConfigError, PredictError, PlanError, ValueError) as e:
        return ["refused" if "\n" not in str(e) else "MULTILINE", str(e)[:140]]
    except Exception as e:
        return ["CRASH", f"{type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}"]


def main() -> None:
    transformers.logging.set_verbosity_error()
    out = {}
    for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        t0 = time.time()
        out[mt] = [*answer(mt), round(time.time() - t0, 1)]
        print(mt, out[mt], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    print({k: sum(1 for v in out.values() if v[0] == k) for k in dict.fromkeys(v[0] for v in out.values())})


if __name__ == "__main__":
    main()
