"""Augmented assignments in model code, under training and checkpoint recompute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowvram_lora.training.blocks import units_by_name
from lowvram_lora.training.checkpointing import apply_checkpointing
from lowvram_lora.training.inplace import active, out_of_place_updates


class ResidualInPlace(nn.Module):
    """Like ComfyUI's Flux blocks: the input is normalised (and so saved), then updated in place."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        h = F.layer_norm(x, x.shape[-1:])
        x += self.linear(h)
        x[:, :1] *= 2.0  # a sliced update too
        return x


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResidualInPlace() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def make():
    torch.manual_seed(0)
    model = Stack()
    return model, torch.randn(4, 8, requires_grad=True)


def grads(model, x, plan_units=None):
    model.zero_grad()
    x.grad = None
    with out_of_place_updates():
        if plan_units is None:
            out = model(x * 1.0)
        else:
            with apply_checkpointing(plan_units, verify=True):
                out = model(x * 1.0)
    out.square().sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def test_in_place_residual_fails_without_and_trains_with():
    model, x = make()
    with pytest.raises(RuntimeError, match="inplace"):
        model(x * 1.0).square().sum().backward()
    assert all(g.abs().sum() > 0 for g in grads(model, x))


def test_values_are_unchanged():
    model, x = make()
    with torch.no_grad():
        expected = model(x.detach().clone())
    with out_of_place_updates(), torch.enable_grad():
        assert torch.equal(model(x.detach().clone()), expected)


def test_checkpoint_recompute_runs_under_the_same_updates():
    model, x = make()
    plain = grads(model, x)
    units = units_by_name(model, ["blocks.0", "blocks.1", "blocks.2"])
    checkpointed = grads(model, x, units)
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_inputs_of_a_block_without_grad_are_not_mutated():
    block = ResidualInPlace()
    block.requires_grad_(False)
    x = torch.randn(2, 8)
    before = x.clone()
    with out_of_place_updates(), torch.enable_grad():
        block(x)
    assert torch.equal(x, before)


def test_explicit_in_place_calls_keep_their_meaning():
    def explicit(t):
        out = t * 1.0
        out.add_(1.0)  # result ignored on purpose
        out.mul_(2.0)
        return out

    t = torch.randn(3, requires_grad=True)
    with out_of_place_updates():
        assert torch.allclose(explicit(t), (t + 1) * 2)


def test_active_reflects_nesting():
    assert not active()
    with out_of_place_updates():
        assert active()
        with out_of_place_updates():
            assert active()
        assert active()
    assert not active()
