"""What a training run reports to the user: plain data, JSON-ready, built from measurements."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from .loop import StepReport, TrainingResult
from .memory import METHOD_TRACKER, format_bytes


@dataclass(frozen=True)
class TrainingReport:
    """Loss per step, measured peak memory and step time, and the checkpointing plan used."""

    architecture: str
    device: str
    memory_method: str | None
    steps: tuple[StepReport, ...]
    plans: tuple[str, ...]  # descriptions of the plans in effect (one per input shape)
    settings: dict[str, Any] = field(default_factory=dict)
    start_step: int = 0
    end_step: int = 0

    @classmethod
    def from_result(
        cls, result: TrainingResult, *, architecture: str, device: str, settings: dict[str, Any] | None = None
    ) -> "TrainingReport":
        methods = [r.memory_method for r in result.reports if r.memory_method]
        return cls(
            architecture=architecture,
            device=device,
            memory_method=methods[0] if methods else None,
            steps=tuple(result.reports),
            plans=tuple(plan.describe() for plan in result.plans.values()),
            settings=dict(settings or {}),
            start_step=result.start_step,
            end_step=result.end_step,
        )

    @property
    def losses(self) -> list[float]:
        return [step.loss for step in self.steps]

    @property
    def peak_bytes(self) -> int | None:
        peaks = [s.peak_bytes for s in self.steps if s.peak_bytes is not None]
        return max(peaks) if peaks else None

    @property
    def median_step_seconds(self) -> float | None:
        """Median over the steps after the first, leaving out steps timed under the CPU memory
        tracker (its per-operator bookkeeping slows them) whenever others exist."""
        steps = self.steps[1:] or self.steps
        clean = [s for s in steps if s.memory_method != METHOD_TRACKER] or steps
        times = sorted(s.step_seconds for s in clean)
        return times[len(times) // 2] if times else None

    def summary(self) -> str:
        lines = [f"LoRA training on {self.architecture} ({self.device}): steps {self.start_step + 1}-{self.end_step}"]
        if self.steps:
            losses = self.losses
            tail = losses[-min(10, len(losses)) :]
            lines.append(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}, mean of last {len(tail)} {statistics.fmean(tail):.4f}")
        peak = self.peak_bytes
        if peak is not None:
            lines.append(f"peak memory above baseline: {format_bytes(peak)} (measured, {self.memory_method})")
        median = self.median_step_seconds
        if median is not None:
            lines.append(f"step time: {median:.3f} s (median)")
        for plan in self.plans or ("checkpointing off",):
            lines.append(f"plan: {plan}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "device": self.device,
            "memory_method": self.memory_method,
            "steps": [step.as_dict() for step in self.steps],
            "plans": list(self.plans),
            "settings": self.settings,
            "peak_bytes": self.peak_bytes,
            "median_step_seconds": self.median_step_seconds,
        }
