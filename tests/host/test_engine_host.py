"""The checkpointing engine on the host's own architectures: ComfyUI's UNetModel, Flux and SD3's
MMDiT at tiny widths, frozen, with trainable LoRA adapters."""

from __future__ import annotations

import copy

import pytest
import torch

from host_models import flux_inputs, sd3_inputs, tiny_flux, tiny_sd3, tiny_unet, tiny_unet_with_dropout, unet_inputs
from lowvram_lora.training.blocks import find_units, units_by_name
from lowvram_lora.training.budget import probe_units, plan_budget
from lowvram_lora.training.checkpointing import (
    PlanNotEffectiveError,
    apply_checkpointing,
    plan_every_n,
    plan_full,
)
from lowvram_lora.nodes.host_compat import enable_training_kernels
from lowvram_lora.training.inplace import out_of_place_updates
from lowvram_lora.training.lora import LoRAConfig, attach_lora
from lowvram_lora.training.memory import memory_tracker

pytestmark = pytest.mark.host

ARCHITECTURES = {
    "unet": (tiny_unet, lambda model: unet_inputs(batch=2, size=8, model=model)),
    "unet_dropout": (tiny_unet_with_dropout, lambda model: unet_inputs(batch=2, size=8, model=model)),
    "flux": (tiny_flux, lambda model: flux_inputs(batch=1, h=8, w=8, model=model)),
    "sd3": (tiny_sd3, lambda model: sd3_inputs(batch=1, h=8, w=8, model=model)),
}


class Trainable:
    """A frozen host model with LoRA adapters whose up weights are non-zero (so gradients flow
    through them into everything upstream)."""

    def __init__(self, kind: str) -> None:
        enable_training_kernels()  # the host's RoPE kernel has no backward of its own
        build, make_inputs = ARCHITECTURES[kind]
        self.model = build()
        self.model.requires_grad_(False)
        self.lora = attach_lora(self.model, LoRAConfig(rank=4), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            for name, parameter in self.lora.named_parameters():
                if "lora_up" in name:
                    parameter.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        self.inputs = make_inputs(self.model)
        self.units = find_units(self.model)

    def step(self) -> torch.Tensor:
        inputs = dict(self.inputs, transformer_options={})
        with out_of_place_updates():
            out = self.model(**inputs)
        out.square().mean().backward()
        return out.detach()

    def grads(self, plan=None, *, verify=True, seed=11):
        for parameter in self.lora.parameters():
            parameter.grad = None
        torch.manual_seed(seed)
        if plan is None:
            out = self.step()
        else:
            with apply_checkpointing(self.units, plan, verify=verify) as applied, out_of_place_updates():
                inputs = dict(self.inputs, transformer_options={})
                out = self.model(**inputs)
            out.square().mean().backward()
            applied.check_coverage()
        return {n: p.grad.clone() for n, p in self.lora.named_parameters()}, out


def assert_close(expected: dict, actual: dict, rtol: float = 1e-6) -> None:
    assert expected.keys() == actual.keys() and expected
    for name, value in expected.items():
        scale = value.abs().max().item()
        assert scale > 0, f"{name}: no gradient reached this adapter"
        error = (value - actual[name]).abs().max().item()
        assert error <= rtol * scale, f"{name}: {error:.3g} vs {scale:.3g}"


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_units_are_what_the_model_calls(kind):
    setup = Trainable(kind)
    expected = {
        "unet": ("input_blocks.1.0", "input_blocks.1.1", "middle_block.0", "output_blocks.0.0"),
        "unet_dropout": ("input_blocks.1.0", "input_blocks.1.1"),
        "flux": ("double_blocks.0", "single_blocks.0"),
        "sd3": ("joint_blocks.0", "joint_blocks.1"),
    }[kind]
    assert set(expected) <= set(setup.units.names())
    assert all(".transformer_blocks." not in name for name in setup.units.names())
    _, _ = setup.grads(plan_full(setup.units))  # every planned unit is called (coverage checked)


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
@pytest.mark.parametrize("plan_name", ["full", "every_2", "every_3"])
def test_gradients_equal_without_checkpointing(kind, plan_name):
    setup = Trainable(kind)
    plan = {"full": plan_full, "every_2": lambda u: plan_every_n(u, 2), "every_3": lambda u: plan_every_n(u, 3)}[plan_name](setup.units)
    expected, out_plain = setup.grads()
    actual, out_planned = setup.grads(plan)
    assert torch.equal(out_plain, out_planned)
    assert_close(expected, actual)


@pytest.mark.parametrize("kind", ["unet", "flux"])
def test_budget_plan_gradients_equal_and_fit(kind):
    setup = Trainable(kind)
    probe = probe_units(setup.units, lambda: setup.step(), device="cpu")
    everything = {u.name for u in probe.units}
    budget = (probe.full_peak_bytes + probe.predicted_peak(everything)) // 2
    plan = plan_budget(probe, budget)
    assert 0 < len(plan.checkpointed) < len(setup.units)
    expected, _ = setup.grads()
    actual, _ = setup.grads(plan)
    assert_close(expected, actual)
    with memory_tracker("cpu") as tracker:
        setup.grads(plan)
        peak = tracker.peak_bytes()
    assert peak <= budget * 1.05


def test_dropout_really_draws_random_numbers_in_the_dropout_unet():
    setup = Trainable("unet_dropout")
    a, _ = setup.grads(seed=1)
    b, _ = setup.grads(seed=2)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_full_checkpointing_halves_unet_activation_memory():
    setup = Trainable("unet")
    setup.inputs = unet_inputs(batch=2, size=16, model=setup.model)

    def peak(plan):
        with memory_tracker("cpu") as tracker:
            setup.grads(plan, verify=False)
            return tracker.peak_bytes()

    off = peak(None)
    full = peak(plan_full(setup.units))
    every_2 = peak(plan_every_n(setup.units, 2))
    assert full <= 0.5 * off, (full, off)
    assert full < every_2 < off, (full, every_2, off)


def test_removal_restores_the_host_unet_bit_identically():
    setup = Trainable("unet")
    setup.lora.detach()
    model = setup.model
    before_state = copy.deepcopy(model.state_dict())
    before_dicts = {name: set(m.__dict__) for name, m in model.named_modules()}
    inputs = setup.inputs
    with torch.no_grad():
        before = model(**dict(inputs, transformer_options={}))
    with apply_checkpointing(setup.units, plan_full(setup.units)):
        model(**dict(inputs, transformer_options={})).sum()
    with torch.no_grad():
        after = model(**dict(inputs, transformer_options={}))
    assert torch.equal(before, after)
    assert {name: set(m.__dict__) for name, m in model.named_modules()} == before_dicts
    for key, value in model.state_dict().items():
        assert torch.equal(value, before_state[key])


def test_checkpointing_a_timestep_embed_sequential_is_caught():
    # The UNet iterates the layers of each TimestepEmbedSequential itself: the sequential's own
    # forward is never called, so wrapping it would silently do nothing.
    setup = Trainable("unet")
    sequentials = units_by_name(setup.model, ["input_blocks.1", "middle_block", "output_blocks.0"])
    with apply_checkpointing(sequentials) as applied:
        setup.model(**dict(setup.inputs, transformer_options={})).sum().backward()
    with pytest.raises(PlanNotEffectiveError, match="input_blocks.1"):
        applied.check_coverage()
