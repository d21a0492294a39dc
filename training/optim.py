"""Optimizers and the learning-rate schedule for adapter training.

The schedule is a pure function of the step and of the run's own span (warm-up and decay count
from the step a run starts at to the step it ends at), so nothing but the step needs saving; a
run that continues another one starts its own warm-up and decay.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Iterable

import torch

OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "prodigy", "sgd")
SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine/linear decay to this fraction of the learning rate

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.name!r}")
        if isinstance(self.learning_rate, bool) or not (
            isinstance(self.learning_rate, (int, float)) and math.isfinite(self.learning_rate) and self.learning_rate > 0
        ):
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r} (1e-4 is a usual LoRA value)")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"lr schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")


def learning_rate_at(config: OptimizerConfig, step: int, start_step: int, end_step: int) -> float:
    """The learning rate for optimizer step ``step`` (0-based) of a run covering [start, end).

    Warm-up counts from the run's start; decay runs from the end of warm-up to ``end_step``.
    """
    base = config.learning_rate
    done = step - start_step
    if config.warmup_steps and done < config.warmup_steps:
        return base * (done + 1) / config.warmup_steps
    if config.schedule == "constant":
        return base
    span = max(1, end_step - start_step - config.warmup_steps)
    progress = min(1.0, max(0.0, (done - config.warmup_steps) / span))
    floor = base * config.min_lr_ratio
    if config.schedule == "linear":
        return floor + (base - floor) * (1.0 - progress)
    return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(config: OptimizerConfig, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    params = [p for p in parameters if p.requires_grad]
    if not params:
        raise ValueError("there are no trainable parameters to optimize (no adapter was attached?)")
    lr = config.learning_rate
    if config.name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=config.betas, weight_decay=config.weight_decay)
    if config.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=config.weight_decay)
    if config.name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise ValueError("optimizer 'adafactor' needs torch >= 2.5; choose adamw or update PyTorch")
        return torch.optim.Adafactor(params, lr=lr, weight_decay=config.weight_decay)
    if config.name == "adamw8bit":
        bnb = _optional_module("bitsandbytes", "adamw8bit", "pip install bitsandbytes")
        return bnb.optim.AdamW8bit(params, lr=lr, betas=config.betas, weight_decay=config.weight_decay)
    prodigy = _optional_module("prodigyopt", "prodigy", "pip install prodigyopt")
    # Prodigy adapts the step size itself; the learning rate is its multiplier (1.0 is usual).
    return prodigy.Prodigy(params, lr=lr, betas=config.betas, weight_decay=config.weight_decay)


def _optional_module(module: str, optimizer: str, install: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"optimizer {optimizer!r} needs the {module} package, which is not installed: `{install}` "
            "in ComfyUI's Python, or choose adamw"
        ) from None


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
