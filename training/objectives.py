"""The diffusion training objective: noise levels, noisy inputs, prediction targets and the loss.

Parameterisation (ComfyUI's, which follows k-diffusion):

* ``eps`` and ``v`` models: ``x_t = x0 + sigma * noise``; the model sees ``x_t`` scaled by its
  ``c_in`` (the host does that). Targets: ``eps = noise``;
  ``v = (sigma_data**2 * noise - sigma * x0) / (sigma_data * sqrt(sigma**2 + sigma_data**2))``.
* ``flow`` models (SD3, Flux, Wan…): ``x_t = (1 - sigma) * x0 + sigma * noise``, target
  ``noise - x0``.

Noise levels are drawn as ``u`` in (0, 1) (0 clean, 1 pure noise) and mapped to sigma by the
model's own schedule, supplied by the caller: uniform ``u`` for ``eps``/``v`` (uniform
timesteps, as Kohya does), logit-normal ``u`` for ``flow`` (as SD3 and Kohya's Flux training do;
the model's schedule applies its shift).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

PREDICTION_TYPES = ("eps", "v", "flow")
LOSSES = ("mse", "l1", "huber")
TIMESTEP_SAMPLINGS = ("auto", "uniform", "logit_normal")

# Keep u away from the ends: sigma at u=1 is infinite for eps models, and u=0 trains nothing.
U_MIN, U_MAX = 1e-4, 1.0 - 1e-4


@dataclass(frozen=True)
class NoiseSchedule:
    """What the trainer needs from the model's sampling: supplied by the host, plain functions."""

    prediction: str
    sigma_from_level: Callable[[torch.Tensor], torch.Tensor]  # u (B,) in (0,1) -> sigma (B,)
    sigma_data: float = 1.0

    def __post_init__(self) -> None:
        if self.prediction not in PREDICTION_TYPES:
            raise ValueError(f"prediction must be one of {PREDICTION_TYPES}, got {self.prediction!r}")


@dataclass(frozen=True)
class ObjectiveConfig:
    loss: str = "mse"
    huber_delta: float = 1.0
    min_snr_gamma: float | None = None
    timestep_sampling: str = "auto"
    logit_mean: float = 0.0
    logit_std: float = 1.0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if not self.huber_delta > 0:
            raise ValueError(f"huber_delta must be > 0, got {self.huber_delta!r}")
        if self.min_snr_gamma is not None and not self.min_snr_gamma > 0:
            raise ValueError(f"min_snr_gamma must be > 0 (or None to turn it off), got {self.min_snr_gamma!r}")
        if self.timestep_sampling not in TIMESTEP_SAMPLINGS:
            raise ValueError(
                f"timestep_sampling must be one of {TIMESTEP_SAMPLINGS}, got {self.timestep_sampling!r}"
            )
        if not self.logit_std > 0:
            raise ValueError(f"logit_std must be > 0, got {self.logit_std!r}")

    def check_compatible(self, prediction: str) -> None:
        if self.min_snr_gamma is not None and prediction == "flow":
            raise ValueError(
                "min_snr_gamma is defined for eps and v models; this model is a flow model: set "
                "min_snr_gamma to 0/None (flow training weights timesteps through logit-normal sampling)"
            )


def sample_levels(
    config: ObjectiveConfig, prediction: str, count: int, generator: torch.Generator
) -> torch.Tensor:
    """``count`` noise levels u in (0, 1), float64 on the CPU, from ``generator``."""
    sampling = config.timestep_sampling
    if sampling == "auto":
        sampling = "logit_normal" if prediction == "flow" else "uniform"
    if sampling == "uniform":
        u = torch.rand(count, generator=generator, dtype=torch.float64)
    else:
        normal = torch.randn(count, generator=generator, dtype=torch.float64)
        u = torch.sigmoid(normal * config.logit_std + config.logit_mean)
    return u.clamp(U_MIN, U_MAX)


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.reshape(-1, *([1] * (like.ndim - 1))).to(like)


def noisy_input(prediction: str, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    s = _per_sample(sigma, x0)
    if prediction == "flow":
        return (1.0 - s) * x0 + s * noise
    return x0 + s * noise


def prediction_target(
    prediction: str, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor, sigma_data: float = 1.0
) -> torch.Tensor:
    if prediction == "eps":
        return noise
    if prediction == "flow":
        return noise - x0
    s = _per_sample(sigma, x0)
    return (sigma_data**2 * noise - s * x0) / (sigma_data * torch.sqrt(s**2 + sigma_data**2))


def snr(prediction: str, sigma: torch.Tensor, sigma_data: float = 1.0) -> torch.Tensor:
    if prediction == "flow":
        return ((1.0 - sigma) / sigma) ** 2
    return (sigma_data / sigma) ** 2


def min_snr_weights(prediction: str, sigma: torch.Tensor, gamma: float, sigma_data: float = 1.0) -> torch.Tensor:
    """Min-SNR-gamma loss weights (Hang et al. 2023) in the target's own space."""
    ratio = snr(prediction, sigma, sigma_data)
    clipped = torch.clamp(ratio, max=gamma)
    if prediction == "v":
        return clipped / (ratio + 1.0)
    return clipped / ratio


def diffusion_loss(
    config: ObjectiveConfig,
    prediction: str,
    output: torch.Tensor,
    target: torch.Tensor,
    sigma: torch.Tensor,
    sigma_data: float = 1.0,
) -> torch.Tensor:
    """The mean loss over the batch, in float32 whatever the model's output dtype."""
    output = output.float()
    target = target.float()
    if config.loss == "mse":
        elementwise = F.mse_loss(output, target, reduction="none")
    elif config.loss == "l1":
        elementwise = F.l1_loss(output, target, reduction="none")
    else:
        elementwise = F.huber_loss(output, target, reduction="none", delta=config.huber_delta)
    per_sample = elementwise.reshape(elementwise.shape[0], -1).mean(dim=1)
    if config.min_snr_gamma is not None:
        per_sample = per_sample * min_snr_weights(prediction, sigma.double(), config.min_snr_gamma, sigma_data).to(per_sample)
    return per_sample.mean()


def is_finite(value: float) -> bool:
    return math.isfinite(value)
