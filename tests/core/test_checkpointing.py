"""The checkpointing engine on plain torch models: gradients, memory, removal, verification, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowvram_lora.training import checkpointing as ckpt
from lowvram_lora.training.blocks import UnsupportedArchitectureError, find_units, units_by_name
from lowvram_lora.training.checkpointing import (
    CheckpointConfig,
    Checkpointer,
    Mode,
    PlanNotEffectiveError,
    RecomputeMismatchError,
    apply_checkpointing,
    plan_every_n,
    plan_full,
    plan_off,
)
from lowvram_lora.training.memory import memory_tracker
from lowvram_lora.training.offload import CpuOffload
from toy_models import ToyUNet, freeze_base, make_toy_dit, toy_dit_batch


def adapter_grads(model, x, context, plan=None, *, seed=123, offload=None, verify=False):
    """Forward + backward once under ``plan`` (None: unplanned); return adapter grads and the loss."""
    for parameter in model.parameters():
        parameter.grad = None
    units = find_units(model)
    torch.manual_seed(seed)
    if plan is None:
        out = model(x, context, {})
        out.square().mean().backward()
    else:
        with apply_checkpointing(units, plan, offload=offload, verify=verify) as applied:
            out = model(x, context, {})
        out.square().mean().backward()
        applied.check_coverage()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, out.detach()


def assert_grads_equal(expected, actual, rtol=1e-6):
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        scale = expected[name].abs().max().item() + 1e-12
        error = (expected[name] - actual[name]).abs().max().item()
        assert error <= rtol * scale, f"{name}: max error {error:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("make_plan", ["full", "every_2", "every_3"])
def test_gradients_equal_unplanned(dropout, make_plan):
    model = make_toy_dit(dropout=dropout).train()
    x, context = toy_dit_batch()
    units = find_units(model)
    plan = {
        "full": lambda: plan_full(units),
        "every_2": lambda: plan_every_n(units, 2),
        "every_3": lambda: plan_every_n(units, 3),
    }[make_plan]()
    expected, out_plain = adapter_grads(model, x, context)
    actual, out_planned = adapter_grads(model, x, context, plan, verify=True)
    assert torch.equal(out_plain, out_planned)
    assert_grads_equal(expected, actual)


def test_dropout_differs_between_seeds_so_the_rng_test_has_teeth():
    model = make_toy_dit(dropout=0.2).train()
    x, context = toy_dit_batch()
    a, _ = adapter_grads(model, x, context, seed=1)
    b, _ = adapter_grads(model, x, context, seed=2)
    assert any(not torch.allclose(a[k], b[k]) for k in a)


def test_offload_path_gives_the_same_gradients_and_shares_copies():
    model = make_toy_dit(dropout=0.1).train()
    x, context = toy_dit_batch()
    units = find_units(model)
    offload = CpuOffload(min_bytes=0, should_offload=lambda t: True)
    expected, _ = adapter_grads(model, x, context)
    actual, _ = adapter_grads(model, x, context, plan_full(units, offload=True), offload=offload)
    assert_grads_equal(expected, actual)
    assert offload.stats.tensors >= len(units)  # each block's hidden state went to the host
    assert offload.stats.shared >= len(units) - 1  # the shared context was copied once
    assert offload.stats.restored >= len(units)


def test_transformer_options_seen_by_recompute_are_those_of_the_forward():
    # Each block reads options["block_index"], which the model overwrites before the next block.
    # If recompute saw the live dict, every block would recompute with the last index.
    model = make_toy_dit(depth=4).train()
    x, context = toy_dit_batch()
    expected, _ = adapter_grads(model, x, context)
    actual, _ = adapter_grads(model, x, context, plan_full(find_units(model)), verify=True)
    assert_grads_equal(expected, actual)


def test_checkpointing_lowers_measured_activation_memory():
    model = make_toy_dit(depth=8, width=64).train()
    x, context = toy_dit_batch(tokens=256, width=64)
    units = find_units(model)

    def peak(plan):
        with memory_tracker("cpu") as tracker:
            adapter_grads(model, x, context, plan)
            return tracker.peak_bytes()

    off, full, every_2 = peak(None), peak(plan_full(units)), peak(plan_every_n(units, 2))
    assert full <= 0.5 * off, (full, off)
    assert full < every_2 < off, (full, every_2, off)


def test_remove_restores_module_tree_forwards_and_outputs_bit_identically():
    model = make_toy_dit().eval()
    x, context = toy_dit_batch()
    units = find_units(model)
    before_out = model(x, context, {})
    before_dicts = {name: dict(m.__dict__) for name, m in model.named_modules()}
    with apply_checkpointing(units, plan_full(units)):
        assert all("forward" in unit.module.__dict__ for unit in units.units)
        model(x, context, {}).sum().backward()
    for name, module in model.named_modules():
        assert module.__dict__.keys() == before_dicts[name].keys(), name
        assert type(module).forward is module.forward.__func__
    assert torch.equal(model(x, context, {}), before_out)


def test_exception_inside_a_step_still_removes_the_plan():
    model = make_toy_dit()
    x, context = toy_dit_batch()
    checkpointer = Checkpointer(model, CheckpointConfig(Mode.FULL))
    with pytest.raises(KeyboardInterrupt):
        with checkpointer.active(("shape",)):
            model(x, context, {})
            raise KeyboardInterrupt  # what a cancel does
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_an_earlier_instance_patch_is_called_and_restored():
    model = make_toy_dit(depth=2)
    block = model.blocks[0]
    calls = []
    original = block.forward

    def patched(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    block.forward = patched
    x, context = toy_dit_batch()
    units = find_units(model)
    with apply_checkpointing(units, plan_full(units)):
        model(x, context, {}).sum().backward()
    assert calls and block.__dict__["forward"] is patched


def test_applying_twice_is_refused_and_leaves_no_trace():
    model = make_toy_dit(depth=2)
    units = find_units(model)
    with apply_checkpointing(units, plan_full(units)):
        with pytest.raises(RuntimeError, match="already has a checkpoint plan"):
            apply_checkpointing(units, plan_full(units))
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_no_op_when_gradients_are_off(monkeypatch):
    model = make_toy_dit()
    x, context = toy_dit_batch()
    calls = []
    monkeypatch.setattr(ckpt, "checkpoint", lambda *a, **k: calls.append(1))
    units = find_units(model)
    expected = model(x, context, {})
    with apply_checkpointing(units, plan_full(units)):
        with torch.no_grad():
            assert torch.equal(model(x, context, {}), expected)
        with torch.inference_mode():
            assert torch.equal(model(x, context, {}), expected)
    assert calls == []


class FlakyBlock(nn.Module):
    """Returns other values on its second call, as a recompute that depends on hidden state would."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.linear(x)
        return out * 1.001 if self.calls % 2 == 0 else out


class FlakyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.blocks[1] = FlakyBlock(8)  # a list of mixed classes: name the units explicitly

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_verification_names_a_block_whose_recompute_differs():
    model = FlakyModel()
    x = torch.randn(2, 8, requires_grad=True)
    units = units_by_name(model, ["blocks.0", "blocks.1"])
    with apply_checkpointing(units, verify=True):
        out = model(x)
    with pytest.raises(RecomputeMismatchError, match=r"'blocks\.1'.*FlakyBlock"):
        out.sum().backward()


def test_without_verification_the_flaky_block_goes_unnoticed():
    model = FlakyModel()
    x = torch.randn(2, 8, requires_grad=True)
    units = units_by_name(model, ["blocks.1"])
    with apply_checkpointing(units, verify=False):
        out = model(x)
    out.sum().backward()  # silently wrong gradients: what verification exists to catch


def test_a_plan_on_a_sequential_the_model_never_calls_is_caught():
    model = ToyUNet()
    freeze_base(model)
    x, t = torch.randn(1, 4, 8, 8), torch.ones(1)
    sequentials = units_by_name(model, [f"input_blocks.{i}" for i in range(3)])
    with apply_checkpointing(sequentials) as applied:
        model(x, t).sum().backward()
    assert applied.never_called() == tuple(u.name for u in sequentials)
    with pytest.raises(PlanNotEffectiveError, match="never called"):
        applied.check_coverage()
    layers = units_by_name(model, [f"input_blocks.{i}.{j}" for i in range(3) for j in range(2)])
    with apply_checkpointing(layers) as applied:
        model(x, t).sum().backward()
    applied.check_coverage()


def test_checkpointer_verifies_coverage_on_the_first_step_only():
    model = ToyUNet()
    freeze_base(model)
    x, t = torch.randn(1, 4, 8, 8), torch.ones(1)
    bad = units_by_name(model, ["input_blocks.0"])
    from lowvram_lora.training.blocks import UnitSet

    checkpointer = Checkpointer(model, CheckpointConfig(Mode.FULL), units=UnitSet("ToyUNet", "test", bad))
    with pytest.raises(PlanNotEffectiveError):
        with checkpointer.active(("s",)):
            model(x, t)


def test_every_n_chooses_every_nth_unit_from_the_first():
    model = make_toy_dit(depth=7)
    units = find_units(model)
    assert plan_every_n(units, 3).checkpointed == ("blocks.0", "blocks.3", "blocks.6")
    assert plan_every_n(units, 1).checkpointed == units.names()
    assert plan_off(units).checkpointed == ()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(mode="every_n", interval=0), "interval"),
        (dict(mode="every_n", interval=-3), "interval"),
        (dict(mode="every_n", interval=1.5), "interval"),
        (dict(mode="budget", budget_bytes=None), "budget_bytes"),
        (dict(mode="budget", budget_bytes=-1), "budget_bytes"),
        (dict(mode="budget", budget_bytes=0), "budget_bytes"),
        (dict(mode="budget", budget_bytes=float("nan")), "budget_bytes"),
        (dict(mode="budget", budget_bytes=10**20), "budget_bytes"),
        (dict(mode="sometimes"), "mode"),
    ],
)
def test_bad_config_names_the_input(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CheckpointConfig(**kwargs)


def test_model_without_blocks_is_refused_with_its_class_name():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)

    with pytest.raises(UnsupportedArchitectureError, match="'Tiny'"):
        find_units(Tiny())


def test_generic_fallback_finds_the_longest_uniform_block_list():
    units = find_units(make_toy_dit(depth=5))
    assert units.source == "generic: blocks"
    assert units.names() == tuple(f"blocks.{i}" for i in range(5))
