"""The prediction targets: the raw output that makes each parameterisation's denoiser return x0."""

from __future__ import annotations

import pytest
import torch

from lowvram_lora.training.objectives import ObjectiveConfig, min_snr_weights, noisy_input, prediction_target, sample_levels


def denoised(prediction: str, raw: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """How a k-diffusion-style sampler (ComfyUI's model_sampling) turns the raw output into x0."""
    s = sigma.reshape(-1, 1, 1, 1)
    if prediction == "eps":
        return x_t - s * raw
    if prediction == "flow":
        return x_t - s * raw
    return x_t * sigma_data**2 / (s**2 + sigma_data**2) - raw * s * sigma_data / (s**2 + sigma_data**2) ** 0.5


@pytest.mark.parametrize("prediction", ["eps", "v", "flow"])
@pytest.mark.parametrize("sigma_data", [1.0, 0.5])
def test_the_target_is_the_output_that_denoises_to_x0(prediction, sigma_data):
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 4, 8, 8, generator=generator, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=generator, dtype=torch.float64)
    sigma = torch.tensor([0.05, 0.3, 0.7, 0.95] if prediction == "flow" else [0.03, 1.0, 5.0, 14.0], dtype=torch.float64)
    x_t = noisy_input(prediction, x0, noise, sigma)
    target = prediction_target(prediction, x0, noise, sigma, sigma_data)
    torch.testing.assert_close(denoised(prediction, target, x_t, sigma, sigma_data), x0)


def test_noise_levels_are_uniform_for_eps_and_logit_normal_for_flow():
    uniform = sample_levels(ObjectiveConfig(), "eps", 20000, torch.Generator().manual_seed(1))
    logit = sample_levels(ObjectiveConfig(), "flow", 20000, torch.Generator().manual_seed(1))
    assert abs(float(uniform.mean()) - 0.5) < 0.01 and abs(float(uniform.std()) - (1 / 12) ** 0.5) < 0.01
    assert abs(float(logit.mean()) - 0.5) < 0.01 and float(logit.std()) < 0.25  # concentrated mid-range
    assert float(uniform.min()) > 0 and float(uniform.max()) < 1


def test_min_snr_weights_clip_high_snr_levels_only():
    sigma = torch.tensor([0.01, 1.0, 10.0], dtype=torch.float64)  # SNR 10000, 1, 0.01
    weights = min_snr_weights("eps", sigma, gamma=5.0)
    torch.testing.assert_close(weights, torch.tensor([5.0 / 10000, 1.0, 1.0], dtype=torch.float64))
