"""Write schema/hf_config_defaults.json: transformers' config-class defaults of the keys the config parser reads.

A config.json may leave a key out (the Hub's Gemma-3 `text_config` states six of its keys); transformers then
builds the model with its config class's default, which for some model types is not what the key derives to
(Gemma's head_dim is 256, not hidden_size / heads; Mistral's num_key_value_heads is 8). The parser reads the
same defaults from this table, so a config means what transformers would build from it. Run with the
transformers version the project pins (`.venv/bin/python tools/hf_config_defaults.py`); tests check the table
against the installed transformers when the versions agree.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "schema" / "hf_config_defaults.json"


def table() -> dict[str, Any]:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    sys.path.insert(0, str(OUT.parents[1]))
    from schema.model_config import DEFAULTED_KEYS

    types: dict[str, dict[str, Any]] = {}
    aliases: dict[str, dict[str, str]] = {}
    for mt in sorted(CONFIG_MAPPING_NAMES):
        try:
            cls = CONFIG_MAPPING[mt]
        except Exception:  # a model type whose module needs an optional package
            continue
        params = inspect.signature(cls.__init__).parameters
        row: dict[str, Any] = {}
        for k in DEFAULTED_KEYS:
            p = params.get(k)
            if p is None or p.default is inspect.Parameter.empty or p.default is None:
                continue
            v = p.default
            if isinstance(v, bool | int | str) or (isinstance(v, float) and math.isfinite(v)):
                row[k] = v
            elif isinstance(v, list | tuple) and all(isinstance(x, bool | int | str) for x in v):
                row[k] = list(v)
        theta = next((vars(c)["default_theta"] for c in cls.__mro__ if "default_theta" in vars(c)
                      and c.__name__ != "PreTrainedConfig"), None)
        if isinstance(theta, int | float) and not isinstance(theta, bool) and "rope_theta" not in row:
            row["rope_theta"] = float(theta)
        if row:
            types[mt] = row
        # the other name of a key the parser reads (attribute_map: alias -> the attribute a saved config writes)
        amap = {a: c for a, c in getattr(cls, "attribute_map", {}).items()
                if isinstance(a, str) and isinstance(c, str) and (a in DEFAULTED_KEYS or c in DEFAULTED_KEYS)}
        if amap:
            aliases[mt] = amap
    return {"format": "tp-query-hf-config-defaults/2", "transformers": transformers.__version__,
            "model_types": types, "aliases": aliases}


def main() -> None:
    OUT.write_text(json.dumps(table(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
