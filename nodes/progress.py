"""Live progress of a training run: the host's progress bar, text on the node, and the pack's
own ``lowvram_lora.progress`` events for the web monitor (rate-limited, last step always sent).

Every event has the same fields (see :meth:`ProgressReporter.event`); ``points`` holds the steps
since the previous event. The whole history of the latest run of each node stays here
(:func:`latest_run`) for a page that reloads during or after a run (``nodes/routes.py``).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from ..training.loop import StepReport
from ..training.memory import format_bytes

EVENT = "lowvram_lora.progress"
MIN_INTERVAL_SECONDS = 0.25  # at most ~4 events a second, whatever the step rate
KEPT_RUNS = 32  # the latest run of this many node ids stays available to a reloaded page

_RUNS: OrderedDict[str, "ProgressReporter"] = OrderedDict()


def _server() -> Any:
    try:
        from server import PromptServer
    except ImportError:  # no server (tests driving the executor directly)
        return None
    return getattr(PromptServer, "instance", None)


def _send(event: str, data: dict[str, Any]) -> None:
    server = _server()
    if server is not None:
        server.send_sync(event, data, getattr(server, "client_id", None))


def _send_text(text: str, node_id: str | None) -> None:
    server = _server()
    if server is not None and node_id is not None:
        server.send_progress_text(text, node_id)


def _prompt_id() -> str | None:
    """The prompt being executed, from the host's executing context (or the server's last one)."""
    try:
        from comfy_execution.utils import get_executing_context

        context = get_executing_context()
        if context is not None and context.prompt_id is not None:
            return str(context.prompt_id)
    except ImportError:
        pass
    prompt_id = getattr(_server(), "last_prompt_id", None)
    return str(prompt_id) if prompt_id is not None else None


def running_prompts(server: Any) -> list[tuple] | None:
    """The host's running queue items ``(number, prompt_id, prompt, extra_data, ...)``; None if unknown."""
    queue = getattr(server, "prompt_queue", None)
    running = getattr(queue, "currently_running", None)
    if running is None:
        return None
    with queue.mutex:
        return list(running.values())


def _workflow_id(prompt_id: str | None) -> str | None:
    """The frontend's id of the workflow that queued ``prompt_id`` (from its extra_pnginfo), if any."""
    for item in running_prompts(_server()) or []:
        if len(item) > 3 and str(item[1]) == prompt_id and isinstance(item[3], dict):
            workflow = (item[3].get("extra_pnginfo") or {}).get("workflow")
            if isinstance(workflow, dict) and workflow.get("id"):
                return str(workflow["id"])
    return None


def latest_run(node_id: str) -> dict[str, Any] | None:
    """The latest run of a node with its whole history (``points``), or None if it never ran here."""
    reporter = _RUNS.get(str(node_id))
    return reporter.event(reporter.history) if reporter is not None else None


def _remember(reporter: "ProgressReporter") -> None:
    key = str(reporter.node_id)
    _RUNS.pop(key, None)
    _RUNS[key] = reporter
    while len(_RUNS) > KEPT_RUNS:
        _RUNS.popitem(last=False)


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
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    prompt_id: str | None = None
    workflow_id: str | None = None
    started_at: float | None = None  # wall-clock seconds, to tell which of two records is newer
    status: str = "started"
    step: int = 0
    first_step: int = 0
    plan: str | None = None
    memory_method: str | None = None
    _last_sent: float = field(default=-1e9, init=False)
    _unsent: int = field(default=0, init=False)
    _started: float | None = field(default=None, init=False)
    _progress_bar: Any = field(default=None, init=False)

    def event(self, points: list[dict[str, Any]]) -> dict[str, Any]:
        """One ``lowvram_lora.progress`` event: the run's state now and ``points``."""
        return {
            "node": self.node_id,
            "run": self.run_id,
            "prompt_id": self.prompt_id,
            "workflow": self.workflow_id,
            "started_at": self.started_at,
            "status": self.status,
            "step": self.step,
            "first_step": self.first_step,
            "total_steps": self.total_steps,
            "points": list(points),
            "eta_seconds": self.eta_seconds(self.step),
            "plan": self.plan,
            "memory_method": self.memory_method,
            "budget_bytes": self.budget_bytes,
        }

    def start(self, first_step: int) -> None:
        self._started = self.clock()
        self.first_step = self.step = first_step
        self.status = "started"
        self.started_at = time.time()
        if self.prompt_id is None:
            self.prompt_id = _prompt_id()
        if self.workflow_id is None:
            self.workflow_id = _workflow_id(self.prompt_id)
        if self.node_id is not None:
            _remember(self)
        try:
            import comfy.utils

            self._progress_bar = comfy.utils.ProgressBar(self.total_steps, node_id=self.node_id)
            self._progress_bar.update_absolute(first_step, self.total_steps)
        except ImportError:
            self._progress_bar = None
        self.send(EVENT, self.event([]))

    def eta_seconds(self, step: int) -> float | None:
        if self._started is None or step <= self.first_step:
            return None
        rate = (self.clock() - self._started) / (step - self.first_step)
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
        self.step = report.step
        self.plan = report.plan
        if report.memory_method is not None:
            self.memory_method = report.memory_method
        last = report.step >= self.total_steps
        self.status = "finished" if last else "running"
        if self._progress_bar is not None:
            self._progress_bar.update_absolute(report.step, self.total_steps)
        self._unsent += 1
        now = self.clock()
        if not last and now - self._last_sent < MIN_INTERVAL_SECONDS:
            return
        points, self._unsent = self.history[-self._unsent :], 0
        self._last_sent = now
        event = self.event(points)
        self.send(EVENT, event)
        eta = event["eta_seconds"]
        peak = f", peak {format_bytes(report.peak_bytes)}" if report.peak_bytes is not None else ""
        eta_text = f", ETA {eta:.0f} s" if eta is not None else ""
        self.send_text(
            f"step {report.step}/{self.total_steps}: loss {report.loss:.4f}{peak}, "
            f"{report.step_seconds:.2f} s/step{eta_text}\n{report.plan}",
            self.node_id,
        )
