"""The ``budget`` plan: measure each unit once, then checkpoint the fewest seconds' worth that fits.

The probe runs one real training step (forward and backward of the caller's batch) with every
unit checkpointed, so it needs no more memory than ``full`` plus one unit's activations. Before
each unit's checkpointed forward it also runs that unit once more without checkpointing, on the
same inputs, to measure:

* ``saved_bytes``: what the unit keeps for backward when it is *not* checkpointed (the memory
  its forward leaves allocated, less its output), and
* ``forward_seconds``: what recomputing it costs.

It also records the peak live memory of each stretch of the step between two unit events (the
start and the end of a unit's forward, the start of a unit's recompute in backward).
Un-checkpointing unit ``i`` adds ``saved_bytes[i]`` to every stretch during which unit ``i``'s
activations would be alive: from the end of its forward to its backward (during its own forward
and its own recompute they are in the measured peak already). With the units in call order,
those are prefix sets. So the peak of any plan is predicted as::

    max over stretches s of  peak_full[s] + sum(saved_bytes[i] for kept units i alive in s)

:func:`plan_budget` keeps (does not checkpoint) the set of units with the largest total
recompute time such that this prediction fits the budget: a 0/1 knapsack with nested prefix
capacities, solved by dynamic programming over memory quantised to 1/4096 of the largest
capacity, with sizes rounded up (so the prediction never exceeds the budget), then completed
greedily with exact sizes (so no unit is checkpointed that could be kept).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .blocks import UnitSet
from .checkpointing import CheckpointPlan, Mode, apply_checkpointing, plan_full, tensors_in, validate_budget
from .memory import format_bytes, memory_tracker, synchronize
from .offload import CpuOffload

QUANTA = 4096


class BudgetTooSmallError(ValueError):
    """Even checkpointing every unit does not fit the budget."""

    def __init__(self, message: str, budget_bytes: int, minimum_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes


@dataclass(frozen=True)
class UnitProfile:
    name: str
    saved_bytes: int
    forward_seconds: float


@dataclass(frozen=True)
class Stretch:
    """A part of the probe step between two unit events, and its measured peak."""

    label: str  # "start", "forward <unit>", "after <unit>", "recompute <unit>"
    alive: int  # units[0:alive] (call order) would hold their activations here if kept
    peak_bytes: int


@dataclass(frozen=True)
class ProbeResult:
    architecture: str
    units: tuple[UnitProfile, ...]  # call order
    stretches: tuple[Stretch, ...]
    full_peak_bytes: int
    step_seconds: float

    def predicted_peak(self, kept: set[str] | frozenset[str]) -> int:
        sizes = [unit.saved_bytes if unit.name in kept else 0 for unit in self.units]
        prefix = [0]
        for size in sizes:
            prefix.append(prefix[-1] + size)
        return max(stretch.peak_bytes + prefix[stretch.alive] for stretch in self.stretches)


class _Recorder:
    """Observer of the probe step: per-unit measurements and per-stretch peaks."""

    def __init__(self, tracker: Any, device: torch.device) -> None:
        self.tracker = tracker
        self.device = device
        self.order: list[str] = []
        self.profiles: dict[str, UnitProfile] = {}
        self.stretches: list[Stretch] = []
        self._label = "start"
        self._alive = 0
        self.repeated = False

    def _close_stretch(self) -> None:
        self.stretches.append(Stretch(self._label, self._alive, self.tracker.peak_bytes()))

    def before_forward(self, name: str, run_plain: Callable[[], Any]) -> None:
        self._close_stretch()
        if name in self.profiles:
            self.repeated = True
        saved, seconds = self._measure(run_plain)
        self.profiles[name] = UnitProfile(name, saved, seconds)
        if name not in self.order:
            self.order.append(name)
        # The measuring run is an artefact of the probe: its peak must not count.
        self.tracker.reset_peak()
        # While the unit runs, its own intermediates are in the measured peak either way.
        self._label = f"forward {name}"
        self._alive = self.order.index(name)

    def after_forward(self, name: str) -> None:
        self._close_stretch()
        self.tracker.reset_peak()
        self._label = f"after {name}"
        self._alive = self.order.index(name) + 1

    def before_recompute(self, name: str) -> None:
        self._close_stretch()
        self.tracker.reset_peak()
        self._label = f"recompute {name}"
        self._alive = self.order.index(name) if name in self.order else 0

    def finish(self) -> None:
        self._close_stretch()

    def _measure(self, run_plain: Callable[[], Any]) -> tuple[int, float]:
        """The unit's kept activations (one observed run) and its forward time (two timed runs,
        the faster one: the first may pay one-time costs; timed unobserved, since the CPU
        tracker's per-operator bookkeeping would inflate it)."""
        before = self.tracker.current_bytes()
        with torch.enable_grad():
            output = run_plain()
        saved = max(0, self.tracker.current_bytes() - before - _output_bytes(output))
        del output
        seconds = math.inf
        with self.tracker.paused():
            for _ in range(2):
                synchronize(self.device)
                start = time.perf_counter()
                with torch.enable_grad():
                    output = run_plain()
                synchronize(self.device)
                seconds = min(seconds, time.perf_counter() - start)
                del output
        return saved, seconds


def _output_bytes(output: Any) -> int:
    """Bytes of the distinct storages behind the tensors of ``output``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors_in(output)}
    return sum(storages.values())


def probe_units(
    units: UnitSet,
    probe_step: Callable[[], None],
    *,
    device: torch.device | str,
    offload: CpuOffload | None = None,
) -> ProbeResult:
    """Run ``probe_step`` once with every unit checkpointed, measuring as described above."""
    device = torch.device(device)
    plan = plan_full(units, offload=offload is not None)
    with memory_tracker(device) as tracker:
        recorder = _Recorder(tracker, device)
        start = time.perf_counter()
        with apply_checkpointing(units, plan, offload=offload, observer=recorder) as applied:
            probe_step()
        synchronize(device)
        seconds = time.perf_counter() - start
        recorder.finish()
    applied.check_coverage()
    profiles = tuple(recorder.profiles[name] for name in recorder.order)
    stretches = tuple(recorder.stretches)
    if recorder.repeated:
        # A unit called twice per step breaks the prefix structure: fall back to the plain
        # upper bound (every kept unit alive in every stretch).
        stretches = tuple(Stretch(s.label, len(profiles), s.peak_bytes) for s in stretches)
    full_peak = max(stretch.peak_bytes for stretch in stretches)
    return ProbeResult(units.architecture, profiles, stretches, full_peak, seconds)


def plan_budget(probe: ProbeResult, budget_bytes: int, *, offload: bool = False) -> CheckpointPlan:
    """The plan that fits ``budget_bytes`` (peak above the step's baseline) at the least recompute time."""
    budget = validate_budget(budget_bytes)
    if budget < probe.full_peak_bytes:
        raise BudgetTooSmallError(
            f"budget_bytes: the memory budget {format_bytes(budget)} is below what this model needs at this "
            f"batch shape even with every block checkpointed ({format_bytes(probe.full_peak_bytes)} measured). "
            "Raise the budget to at least that, or lower the batch size or resolution"
            + ("" if offload else ", or turn on offload (on a GPU)")
            + ".",
            budget,
            probe.full_peak_bytes,
        )
    kept = _solve(probe, budget)
    names = [unit.name for unit in probe.units]
    checkpointed = tuple(name for name in names if name not in kept)
    extra = sum(unit.forward_seconds for unit in probe.units if unit.name not in kept)
    return CheckpointPlan(
        Mode.BUDGET,
        probe.architecture,
        tuple(names),
        checkpointed,
        offload=offload,
        budget_bytes=budget,
        expected_peak_bytes=probe.predicted_peak(kept),
        expected_extra_seconds=extra,
        note=f"measured: {format_bytes(probe.full_peak_bytes)} with every block checkpointed",
    )


def _capacities(probe: ProbeResult, budget: int) -> list[float]:
    """capacity[p]: the most the kept units among the first p may hold (inf when unconstrained)."""
    capacity = [math.inf] * (len(probe.units) + 1)
    for stretch in probe.stretches:
        capacity[stretch.alive] = min(capacity[stretch.alive], budget - stretch.peak_bytes)
    return capacity


def _solve(probe: ProbeResult, budget: int) -> set[str]:
    units = probe.units
    capacity = _capacities(probe, budget)
    finite = [c for c in capacity if c != math.inf]
    largest = max(finite) if finite else sum(u.saved_bytes for u in units)
    quantum = max(1, math.ceil(max(largest, 1) / QUANTA))
    size = [math.ceil(u.saved_bytes / quantum) for u in units]
    limit = [QUANTA + 1 if c == math.inf else math.floor(c / quantum) for c in capacity]
    width = QUANTA + 2
    # best[w]: the most recompute seconds kept (not re-run) with quantised kept size w.
    best = torch.full((width,), -math.inf, dtype=torch.float64)
    best[0] = 0.0
    took = torch.zeros((len(units), width), dtype=torch.bool)
    for index, unit in enumerate(units):
        candidate = torch.full_like(best, -math.inf)
        if size[index] < width:
            candidate[size[index]:] = best[: width - size[index]] + max(unit.forward_seconds, 1e-9)
        take = candidate > best
        took[index] = take
        best = torch.where(take, candidate, best)
        cap = limit[index + 1]
        if cap < width - 1:
            best[max(cap + 1, 0):] = -math.inf
    kept: set[str] = set()
    if torch.isfinite(best).any():
        weight = int(torch.argmax(best).item())
        for index in range(len(units) - 1, -1, -1):
            if took[index, weight]:
                kept.add(units[index].name)
                weight -= size[index]
    # Quantisation rounds sizes up; keep any further unit that still fits exactly.
    for unit in sorted(units, key=lambda u: -u.forward_seconds):
        if unit.name not in kept and probe.predicted_peak(kept | {unit.name}) <= budget:
            kept.add(unit.name)
    return kept
