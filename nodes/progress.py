"""Live progress of a training run: the host's progress bar, text on the node, and the pack's
own ``lowvram_lora.progress`` events for the web monitor (rate-limited, last step always sent)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..training.loop import StepReport
from ..training.memory import format_bytes

EVENT = "lowvram_lora.progress"
MIN_INTERVAL_SECONDS = 0.25  # at most ~4 events a second, whatever the step rate


def _send(event: str, data: dict[str, Any]) -> None:
    try:
        from server import PromptServer
    except ImportError:  # no server (tests driving the executor directly)
        return
    server = getattr(PromptServer, "instance", None)
    if server is None:
        return
    server.send_sync(event, data, getattr(server, "client_id", None))


def _send_text(text: str, node_id: str | None) -> None:
    try:
        from server import PromptServer
    except ImportError:
        return
    server = getattr(PromptServer, "instance", None)
    if server is not None and node_id is not None:
        server.send_progress_text(text, node_id)


@dataclass
class ProgressReporter:
    """Called after every optimizer step; keeps the history a reloaded page asks for again."""

    node_id: str | None
    total_steps: int
    budget_bytes: int | None = None
    send: Callable[[str, dict[str, Any]], None] = _send
    send_text: Callable[[str, str | None], None] = _send_text
    clock: Callable[[], float] = time.monotonic
    history: list[dict[str, Any]] = field(default_factory=list)
    _last_sent: float = field(default=-1e9, init=False)
    _unsent: int = field(default=0, init=False)
    _started: float | None = field(default=None, init=False)
    _first_step: int = field(default=0, init=False)
    _progress_bar: Any = field(default=None, init=False)

    def start(self, first_step: int) -> None:
        self._started = self.clock()
        self._first_step = first_step
        try:
            import comfy.utils

            self._progress_bar = comfy.utils.ProgressBar(self.total_steps, node_id=self.node_id)
            self._progress_bar.update_absolute(first_step, self.total_steps)
        except ImportError:
            self._progress_bar = None
        self.send(EVENT, {"node": self.node_id, "status": "started", "total_steps": self.total_steps,
                          "budget_bytes": self.budget_bytes})

    def eta_seconds(self, step: int) -> float | None:
        if self._started is None or step <= self._first_step:
            return None
        rate = (self.clock() - self._started) / (step - self._first_step)
        return rate * (self.total_steps - step)

    def __call__(self, report: StepReport) -> None:
        point = {
            "step": report.step,
            "loss": report.loss,
            "lr": report.learning_rate,
            "peak_bytes": report.peak_bytes,
            "step_seconds": report.step_seconds,
        }
        self.history.append(point)
        if self._progress_bar is not None:
            self._progress_bar.update_absolute(report.step, self.total_steps)
        self._unsent += 1
        now = self.clock()
        last = report.step >= self.total_steps
        if not last and now - self._last_sent < MIN_INTERVAL_SECONDS:
            return
        eta = self.eta_seconds(report.step)
        points, self._unsent = self.history[-self._unsent :], 0
        self._last_sent = now
        self.send(
            EVENT,
            {
                "node": self.node_id,
                "status": "running" if not last else "finished",
                "step": report.step,
                "total_steps": self.total_steps,
                "points": points,
                "eta_seconds": eta,
                "plan": report.plan,
                "memory_method": report.memory_method,
                "budget_bytes": self.budget_bytes,
            },
        )
        peak = f", peak {format_bytes(report.peak_bytes)}" if report.peak_bytes is not None else ""
        eta_text = f", ETA {eta:.0f} s" if eta is not None else ""
        self.send_text(
            f"step {report.step}/{self.total_steps}: loss {report.loss:.4f}{peak}, "
            f"{report.step_seconds:.2f} s/step{eta_text}\n{report.plan}",
            self.node_id,
        )
