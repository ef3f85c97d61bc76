"""torchao float8 training on a model's Linear layers, as the fp8 settings define it: one conversion for
the tracer (fake tensors) and the validation harness (a real model on the GPU)."""

from __future__ import annotations

import torch
from tp_query.schema.precision import fp8_linear_filter

from .hf_models import quiet_imports


def convert_fp8(model: torch.nn.Module, recipe: str) -> tuple[int, list[str]]:
    """Convert every Linear `fp8_linear_filter` selects (dims multiples of 16, not the LM head) to torchao's
    Float8Linear with the recipe's scaling (tensorwise or rowwise). ImportError when torchao is missing.
    Only plain nn.Linear modules: a subclass has a forward of its own (Phi-MoE's router returns the routing as
    three tensors), which Float8Linear's would replace; such modules stay in bf16, as torchtitan leaves routers.
    Returns how many were converted and the class names of the subclasses left in bf16 that the filter would
    otherwise take (torchao's own default, an isinstance test, converts them)."""
    quiet_imports()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def eligible(m: torch.nn.Module, fqn: str) -> bool:
        return isinstance(m, torch.nn.Linear) and fp8_linear_filter(fqn, m.in_features, m.out_features)

    mods = [(fqn, m) for fqn, m in model.named_modules() if eligible(m, fqn)]
    plain = sum(type(m) is torch.nn.Linear for _, m in mods)
    subclasses = sorted({type(m).__name__ for _, m in mods if type(m) is not torch.nn.Linear})
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda m, fqn: type(m) is torch.nn.Linear and eligible(m, fqn))
    return plain, subclasses
