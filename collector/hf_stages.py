"""HuggingFace Llama-family models cut into pipeline stages, shared by the one-GPU stage cases and the
distributed pipelining runs (one definition of what a stage holds and runs)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from tp_query.engine.trace.torchargs import torch_dtype
from tp_query.schema.precision import SETTINGS, Setting


def autocast_for(device: torch.device, setting: str) -> Any:
    ac = SETTINGS[Setting(setting)].autocast_dtype
    return torch.autocast(device.type, dtype=torch_dtype(ac)) if ac else contextlib.nullcontext()


class PipeStage(torch.nn.Module):
    """A contiguous range of decoder layers of an HF Llama-family model, plus the embedding on the first
    stage and the final norm and LM head on the last (the loss is the schedule's loss_fn)."""

    def __init__(self, model: Any, lo: int, hi: int, first: bool, last: bool, setting: str) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(list(model.model.layers)[lo:hi])
        self.rotary = model.model.rotary_emb
        self.embed = model.model.embed_tokens if first else None
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.setting = setting

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with autocast_for(x.device, self.setting):
            h = self.embed(x) if self.embed is not None else x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            pe = self.rotary(h, pos)
            for layer in self.layers:
                h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            if self.lm_head is None or self.norm is None:
                return h
            return self.lm_head(self.norm(h))
