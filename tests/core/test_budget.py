"""The budget plan: the probe, the knapsack, and the measured peak against the budget."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lowvram_lora.training.blocks import find_units
from lowvram_lora.training.budget import BudgetTooSmallError, ProbeResult, Stretch, UnitProfile, plan_budget, probe_units
from lowvram_lora.training.checkpointing import (
    CheckpointConfig,
    Checkpointer,
    Mode,
    apply_checkpointing,
    plan_full,
)
from lowvram_lora.training.memory import memory_tracker
from toy_models import make_toy_dit, toy_dit_batch


def synthetic_probe(rng: random.Random, n: int) -> ProbeResult:
    units = tuple(UnitProfile(f"u{i}", rng.randint(0, 100), rng.uniform(0.1, 1.0)) for i in range(n))
    stretches = [Stretch("start", 0, rng.randint(0, 50))]
    stretches += [Stretch(f"forward u{i}", i + 1, rng.randint(20, 120)) for i in range(n)]
    stretches += [Stretch(f"recompute u{i}", i, rng.randint(20, 200)) for i in reversed(range(n))]
    return ProbeResult("synthetic", units, tuple(stretches), max(s.peak_bytes for s in stretches), 1.0)


def brute_force_best_time(probe: ProbeResult, budget: int) -> float:
    best = -1.0
    names = [u.name for u in probe.units]
    seconds = {u.name: u.forward_seconds for u in probe.units}
    for size in range(len(names) + 1):
        for kept in itertools.combinations(names, size):
            if probe.predicted_peak(set(kept)) <= budget:
                best = max(best, sum(seconds[k] for k in kept))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_knapsack_is_optimal_feasible_and_maximal(seed):
    rng = random.Random(seed)
    probe = synthetic_probe(rng, rng.randint(1, 9))
    everything = {u.name for u in probe.units}
    lo, hi = probe.full_peak_bytes, probe.predicted_peak(everything)
    for budget in sorted({lo, (lo + hi) // 2, hi, rng.randint(lo, hi)}):
        plan = plan_budget(probe, budget)
        kept = everything - set(plan.checkpointed)
        assert plan.expected_peak_bytes == probe.predicted_peak(kept) <= budget
        # Optimal: as much recompute time avoided as the best subset (quantisation is finer than
        # these integer sizes, so the result is exact here).
        kept_time = sum(u.forward_seconds for u in probe.units if u.name in kept)
        assert kept_time == pytest.approx(brute_force_best_time(probe, budget))
        # Maximal: no checkpointed unit could have been kept within the budget.
        for name in plan.checkpointed:
            assert probe.predicted_peak(kept | {name}) > budget
        assert plan.expected_extra_seconds == pytest.approx(
            sum(u.forward_seconds for u in probe.units if u.name in plan.checkpointed)
        )


def test_budget_below_full_is_refused_with_the_minimum():
    probe = synthetic_probe(random.Random(0), 4)
    with pytest.raises(BudgetTooSmallError, match="even with every block checkpointed"):
        plan_budget(probe, probe.full_peak_bytes - 1)


def test_generous_budget_checkpoints_nothing():
    probe = synthetic_probe(random.Random(1), 5)
    plan = plan_budget(probe, probe.predicted_peak({u.name for u in probe.units}))
    assert plan.checkpointed == ()


class ToyStep:
    """One forward+backward of the toy DiT, as the probe and the measured runs use it."""

    def __init__(self, depth=8, width=64, tokens=192):
        self.model = make_toy_dit(depth=depth, width=width).train()
        self.x, self.context = toy_dit_batch(tokens=tokens, width=width)

    def __call__(self):
        self.model(self.x, self.context, {}).square().mean().backward()
        for parameter in self.model.parameters():
            parameter.grad = None


def measured_peak(step: ToyStep, plan) -> int:
    units = find_units(step.model)
    with memory_tracker("cpu") as tracker:
        if plan is None:
            step()
        else:
            with apply_checkpointing(units, plan):
                step.model(step.x, step.context, {}).square().mean().backward()
            for parameter in step.model.parameters():
                parameter.grad = None
        return tracker.peak_bytes()


def test_probe_measures_every_unit_and_matches_the_full_step():
    step = ToyStep()
    units = find_units(step.model)
    probe = probe_units(units, step, device="cpu")
    assert [u.name for u in probe.units] == list(units.names())
    assert all(u.saved_bytes > 0 and u.forward_seconds > 0 for u in probe.units)
    full = measured_peak(step, plan_full(units))
    assert probe.full_peak_bytes == pytest.approx(full, rel=0.05)
    off = measured_peak(step, None)
    everything = {u.name for u in probe.units}
    # Keeping everything is predicted to cost what the unplanned step measures.
    assert probe.predicted_peak(everything) == pytest.approx(off, rel=0.05)


@pytest.mark.parametrize("fraction", [0.15, 0.4, 0.7])
def test_measured_peak_stays_within_budget(fraction):
    step = ToyStep()
    units = find_units(step.model)
    full = measured_peak(step, plan_full(units))
    off = measured_peak(step, None)
    budget = int(full + fraction * (off - full))
    checkpointer = Checkpointer(step.model, CheckpointConfig(Mode.BUDGET, budget_bytes=budget))
    plan = checkpointer.prepare(("toy",), step, device="cpu")
    assert 0 < len(plan.checkpointed) < len(units)
    peak = measured_peak(step, plan)
    assert peak <= budget * 1.05, (peak, budget)
    assert plan.expected_peak_bytes <= budget
    assert peak == pytest.approx(plan.expected_peak_bytes, rel=0.1)


def test_budget_plan_is_cached_per_shape_and_probed_once():
    step = ToyStep(depth=4, tokens=64)
    calls = []

    def counting_step():
        calls.append(1)
        step()

    units = find_units(step.model)
    huge = measured_peak(step, None) * 4
    checkpointer = Checkpointer(step.model, CheckpointConfig(Mode.BUDGET, budget_bytes=huge), units=units)
    first = checkpointer.prepare((1, 64), counting_step, device="cpu")
    again = checkpointer.prepare((1, 64), counting_step, device="cpu")
    other = checkpointer.prepare((1, 128), counting_step, device="cpu")
    assert first is again and len(calls) == 2 and other.shape_key == (1, 128)


def test_unprobed_budget_shape_falls_back_to_full_then_probes_when_prepared():
    step = ToyStep(depth=3, tokens=32)
    checkpointer = Checkpointer(step.model, CheckpointConfig(Mode.BUDGET, budget_bytes=10**9))
    with checkpointer.active(("s",)) as applied:
        step.model(step.x, step.context, {}).sum().backward()
    assert len(applied.units) == 3
    plan = checkpointer.prepare(("s",), step, device="cpu")
    assert plan.mode is Mode.BUDGET and plan.checkpointed == ()
    assert torch.is_grad_enabled()
