"""torchao float8 training on a model's Linear layers, as the fp8 settings define it: one conversion for
the tracer (fake tensors) and the validation harness (a real model on the GPU)."""

from __future__ import annotations

import torch
from tp_query.schema.precision import fp8_linear_filter

from .hf_models import quiet_imports


def convert_fp8(model: torch.nn.Module, recipe: str) -> None:
    """Convert every Linear `fp8_linear_filter` selects (dims multiples of 16, not the LM head) to torchao's
    Float8Linear with the recipe's scaling (tensorwise or rowwise). ImportError when torchao is missing.
    Only plain nn.Linear modules: a subclass has a forward of its own (Phi-MoE's router returns the routing as
    three tensors), which Float8Linear's would replace; such modules stay in bf16, as torchtitan leaves routers."""
    quiet_imports()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda m, fqn: type(m) is torch.nn.Linear
                               and fp8_linear_filter(fqn, m.in_features, m.out_features))
