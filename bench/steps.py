"""Measuring a training loop from the outside: peak memory, step time and a memory timeline.

A trainer is measured through one call at the start of each of its optimizer steps
(:meth:`StepProbe.boundary`; the pack's ``LoRATrainer`` calls ``should_stop`` there, and the
benchmark wraps the built-in trainer's per-step method). The span from one boundary to the next
is one step: data, forward, backward and the optimizer step, whoever the trainer is. So both
trainers are measured by the same code at the same points, and neither reports on itself.

What each step of a run is for (:class:`StepSchedule`):

- ``warmup``: untouched (first-call costs: kernel selection, optimizer state, a budget plan's
  probe, the first step's recompute verification).
- CPU: one ``tracked`` step under :func:`training.memory.memory_tracker` (the dispatch-mode
  tensor tracker) for the peak and the timeline, then ``timed`` steps with no tracker at all,
  because the tracker's per-operator bookkeeping would distort the time.
- CUDA: ``timed`` steps, each with the allocator's peak reset at its start (the counters cost
  nothing, so the same steps give the time and the peak), then one ``timeline`` step.
- a ``trailing`` step, whose only job is to end the span of the last measured one.

Peaks are above the memory allocated when the step starts (the model, the LoRA, the optimizer
state): on CUDA that baseline is known and reported; on CPU the tracker only sees what is
created inside the step, so it is reported as 0.

The timeline is the live memory above the step's start after every operator of one step,
recorded by a dispatch mode stacked on the tracker. Its time axis is that step's own time
(slowed by the recording), stretched to the median untracked step time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..training.memory import MemoryTracker, memory_tracker, synchronize

WARMUP = "warmup"
TRACKED = "tracked"  # CPU: the tracker's peak and the timeline; not timed
TIMED = "timed"  # CPU: time only; CUDA: time and the allocator's peak
TIMELINE = "timeline"  # CUDA: the timeline; not timed
TRAILING = "trailing"  # only closes the last measured step

DEFAULT_TIMELINE_POINTS = 400


@dataclass(frozen=True)
class StepSchedule:
    """How many steps warm up and how many are timed; the rest follows from the device."""

    warmup: int = 1
    timed: int = 3

    def __post_init__(self) -> None:
        for name, minimum in (("warmup", 0), ("timed", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

    def phases(self, device: torch.device | str) -> tuple[str, ...]:
        """What each step of the run is for, in order."""
        if torch.device(device).type == "cuda":
            return (WARMUP,) * self.warmup + (TIMED,) * self.timed + (TIMELINE, TRAILING)
        return (WARMUP,) * self.warmup + (TRACKED,) + (TIMED,) * self.timed + (TRAILING,)

    def total_steps(self, device: torch.device | str) -> int:
        """The optimizer steps the trainer must run for a complete measurement."""
        return len(self.phases(device))


@dataclass(frozen=True)
class StepFigures:
    """What a :class:`StepProbe` measured. JSON-ready through :meth:`as_dict`."""

    device: str
    method: str
    peak_bytes: int | None  # None when the measured steps did not all run
    baseline_bytes: int
    step_seconds: float | None  # median of the timed steps
    step_seconds_all: tuple[float, ...]
    timeline: tuple[tuple[float, int], ...] = field(default=())  # (seconds into the step, bytes)
    complete: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "method": self.method,
            "peak_bytes": self.peak_bytes,
            "baseline_bytes": self.baseline_bytes,
            "step_seconds": self.step_seconds,
            "step_seconds_all": list(self.step_seconds_all),
            "timeline": [list(point) for point in self.timeline],
            "complete": self.complete,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepFigures":
        return cls(
            device=data["device"],
            method=data["method"],
            peak_bytes=data.get("peak_bytes"),
            baseline_bytes=int(data.get("baseline_bytes") or 0),
            step_seconds=data.get("step_seconds"),
            step_seconds_all=tuple(data.get("step_seconds_all") or ()),
            timeline=tuple((float(t), int(b)) for t, b in data.get("timeline") or ()),
            complete=bool(data.get("complete")),
        )


class _Timeline(TorchDispatchMode):
    """Records the tracker's live bytes after every operator (stacked above the tracker)."""

    supports_higher_order_operators = True

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.points: list[tuple[float, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        out = func(*args, **(kwargs or {}))
        self.points.append((time.perf_counter(), self.tracker.current_bytes()))
        return out


_primed = False


def _prime_dispatch_modes() -> None:
    """The first operator under a dispatch mode in a process imports ``torch._dynamo`` (about a
    second): pay that here, not inside a recorded step."""
    global _primed
    if not _primed:
        with memory_tracker("cpu"):
            torch.zeros(1).add_(1)
        _primed = True


class StepProbe:
    """Measures the steps of a training loop from calls at their boundaries.

    Call :meth:`boundary` at the start of every optimizer step (or pass :meth:`should_stop` to
    the pack's trainer, which calls it there), run ``schedule.total_steps(device)`` steps, then
    read :meth:`figures`. Call :meth:`close` in a ``finally``: a step that raised leaves its
    tracker entered, and :meth:`close` takes it off the dispatch stack.
    """

    def __init__(
        self,
        device: torch.device | str,
        schedule: StepSchedule = StepSchedule(),
        *,
        timeline_points: int = DEFAULT_TIMELINE_POINTS,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.schedule = schedule
        self.phases = schedule.phases(self.device)
        self.timeline_points = timeline_points
        self.steps_started = 0
        self._phase: str | None = None
        self._tracker: MemoryTracker | None = None
        self._recorder: _Timeline | None = None
        self._started = 0.0
        self._times: list[float] = []
        self._peaks: list[tuple[int, int]] = []  # (peak above start, bytes at start)
        self._timeline: list[tuple[float, int]] = []
        self._timeline_seconds = 0.0
        self._method = "cuda-allocator" if self.device.type == "cuda" else "cpu-tensor-tracker"
        _prime_dispatch_modes()

    # -- the hooks a trainer calls ----------------------------------------------------------

    def boundary(self) -> None:
        """A step starts: end the span of the previous one, and start this one's measurement."""
        self._end_step()
        phase = self.phases[self.steps_started] if self.steps_started < len(self.phases) else TRAILING
        self.steps_started += 1
        self._begin_step(phase)

    def should_stop(self) -> bool:
        """``LoRATrainer.run(should_stop=probe.should_stop)``: a boundary; never asks to stop."""
        self.boundary()
        return False

    def close(self) -> None:
        """Leave any open measurement without recording it (the trailing step, or a failure)."""
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None
        self._phase = None

    # -- results ----------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """Whether every measured step ran (the boundary of the trailing step was reached)."""
        return self.steps_started >= len(self.phases)

    def figures(self) -> StepFigures:
        times = tuple(self._times)
        median = statistics.median(times) if times else None
        if self._peaks:
            peak, baseline = max(self._peaks)
        else:
            peak, baseline = None, 0
        return StepFigures(
            device=str(self.device),
            method=self._method,
            peak_bytes=peak if self.complete else None,
            baseline_bytes=baseline,
            step_seconds=median if self.complete else None,
            step_seconds_all=times,
            timeline=self._scaled_timeline(median),
            complete=self.complete,
        )

    # -- internals ----------------------------------------------------------------------------

    def _begin_step(self, phase: str) -> None:
        self._phase = phase
        if phase in (TRACKED, TIMELINE):
            self._tracker = memory_tracker(self.device).__enter__()
            self._recorder = _Timeline(self._tracker).__enter__()
        elif phase == TIMED and self.device.type == "cuda":
            self._tracker = memory_tracker(self.device).__enter__()  # synchronizes, resets the peak
        synchronize(self.device)
        self._started = time.perf_counter()

    def _end_step(self) -> None:
        phase = self._phase
        if phase is None:
            return
        synchronize(self.device)
        ended = time.perf_counter()
        tracker, recorder = self._tracker, self._recorder
        self.close()
        if phase == TIMED:
            self._times.append(ended - self._started)
        if tracker is not None and phase in (TRACKED, TIMED):
            entry = getattr(tracker, "entry_bytes", 0)
            self._peaks.append((tracker.peak_bytes(), entry))
        if recorder is not None:
            self._timeline = [(t - self._started, b) for t, b in recorder.points]
            self._timeline_seconds = max(ended - self._started, 1e-12)

    def _scaled_timeline(self, median: float | None) -> tuple[tuple[float, int], ...]:
        if not self._timeline:
            return ()
        span = self._timeline_seconds
        scale = (median / span) if median else 1.0
        points = [(0.0, 0)] + [(max(0.0, t) * scale, b) for t, b in self._timeline]
        return tuple(decimate(points, self.timeline_points))


def decimate(points: list[tuple[float, int]], limit: int) -> list[tuple[float, int]]:
    """At most ``limit`` points of a (time, bytes) series, keeping each time bucket's highest
    point (so the peak survives), in time order."""
    if limit < 2 or len(points) <= limit:
        return list(points)
    start, end = points[0][0], points[-1][0]
    span = max(end - start, 1e-12)
    buckets: dict[int, tuple[float, int]] = {}
    for t, b in points:
        key = min(limit - 1, int((t - start) / span * limit))
        if key not in buckets or b > buckets[key][1]:
            buckets[key] = (t, b)
    return [buckets[key] for key in sorted(buckets)]
