"""The pack's own socket types and the values that travel through them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from comfy_api.latest import io

from ..training.memory import format_bytes

# Socket types: a LoRA straight from training, a resumable training state, a training report.
LoRAType = io.Custom("LOWVRAM_LORA")
TrainingStateType = io.Custom("LOWVRAM_TRAINING_STATE")
ReportType = io.Custom("LOWVRAM_TRAINING_REPORT")


@dataclass(frozen=True)
class TrainedLoRA:
    """A trained LoRA in Kohya format (CPU tensors), ready to save or to apply."""

    tensors: dict[str, torch.Tensor] = field(repr=False)
    metadata: dict[str, str] = field(repr=False)
    architecture: str
    rank: int
    steps: int

    def describe(self) -> str:
        size = sum(t.numel() * t.element_size() for t in self.tensors.values())
        modules = sum(1 for key in self.tensors if key.endswith(".lora_down.weight"))
        return f"LoRA rank {self.rank} on {modules} layers of {self.architecture}, {self.steps} steps, {format_bytes(size)}"
