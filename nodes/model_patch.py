"""A checkpointing plan carried by a MODEL clone, through the host's patch mechanism.

The plan lives on a ``ModelPatcher`` clone as an APPLY_MODEL wrapper plus an attachment (the
:class:`~..training.checkpointing.Checkpointer`). The wrapper applies the plan for the length of
one ``apply_model`` call while gradients are on, and removes it in ``finally``; the shared torch
module is never left changed. The original MODEL, and any sampler run (gradients off), behave
exactly as before. APPLY_MODEL (not DIFFUSION_MODEL) because every architecture's BaseModel
goes through it; some diffusion models (SD3's MMDiT) have no DIFFUSION_MODEL wrapper point.
"""

from __future__ import annotations

from typing import Any

import torch

import comfy.patcher_extension as patcher_extension

from ..training.checkpointing import CheckpointConfig, Checkpointer

KEY = "lowvram_lora.checkpointing"


def shape_key(x: torch.Tensor, c_crossattn: Any) -> tuple:
    context = tuple(c_crossattn.shape) if isinstance(c_crossattn, torch.Tensor) else ()
    return (*x.shape, *context)


class CheckpointWrapper:
    """The APPLY_MODEL wrapper: the plan is in effect for this call's forward and its backward."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer

    def __call__(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):
        with self.checkpointer.active(shape_key(x, c_crossattn)):
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)


def with_checkpointing(model_patcher: Any, config: CheckpointConfig) -> tuple[Any, Checkpointer]:
    """A clone of ``model_patcher`` that checkpoints under ``config`` (replacing an earlier plan)."""
    clone = model_patcher.clone()
    clone.remove_wrappers_with_key(patcher_extension.WrappersMP.APPLY_MODEL, KEY)
    checkpointer = Checkpointer(clone.model.diffusion_model, config)
    if config.mode.value != "off":
        clone.add_wrapper_with_key(patcher_extension.WrappersMP.APPLY_MODEL, KEY, CheckpointWrapper(checkpointer))
    clone.set_attachments(KEY, checkpointer)
    return clone, checkpointer


def checkpointer_of(model_patcher: Any) -> Checkpointer | None:
    """The plan a MODEL carries, if it went through EnableGradientCheckpointing."""
    attachment = model_patcher.get_attachment(KEY)
    return attachment if isinstance(attachment, Checkpointer) else None
