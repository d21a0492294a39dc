"""The LoRA training loop: micro-batches, accumulation, mixed precision, the optimizer step.

The model is reached through a :class:`Denoiser`, a plain callable the host supplies (ComfyUI's
``apply_model`` with the batch's conditioning), so this module never sees the host. One
optimizer step:

1. for each of ``grad_accumulation`` micro-batches (see :mod:`training.data` for the order):
   draw per-sample noise and noise levels from generators seeded by the run's seed, build the
   noisy input and the target of the model's prediction type, run the model under autocast
   with the checkpoint plan for the batch's shape, and back-propagate ``loss / k``; dropout runs
   under the global RNG forked and seeded per micro-batch;
2. unscale (fp16), check that the loss and the gradients are finite, clip, set the learning rate
   of this step, step the optimizer.

A non-finite loss stops the run before the optimizer step: the adapters keep their last good
values and :class:`NonFiniteLossError` carries the state up to the last good step.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from .checkpointing import CheckpointPlan, Checkpointer
from .data import MicroBatch, TrainingData, derive_seed, generator_for
from .inplace import out_of_place_updates
from .memory import memory_tracker, synchronize
from .objectives import NoiseSchedule, ObjectiveConfig, diffusion_loss, noisy_input, prediction_target, sample_levels
from .optim import OptimizerConfig, learning_rate_at, make_optimizer, set_learning_rate

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Denoiser(Protocol):
    """The model as the trainer calls it: raw output (eps, v or flow velocity) for ``x_t``."""

    def __call__(self, x_t: torch.Tensor, sigma: torch.Tensor, conditions: Sequence[int]) -> torch.Tensor: ...


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int = 1
    grad_accumulation: int = 1
    precision: str = "fp32"
    max_grad_norm: float | None = 1.0
    seed: int = 0
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # CPU memory tracking slows a step; on CUDA the allocator's counters are free.
    measure_memory_every: int = 10

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accumulation", "measure_memory_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {self.precision!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 (or None for no clipping), got {self.max_grad_norm!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")


@dataclass(frozen=True)
class StepReport:
    step: int  # optimizer steps done, counting from the start of training (resumes included)
    total_steps: int  # where this run ends
    loss: float
    learning_rate: float
    step_seconds: float
    peak_bytes: int | None  # measured above the step's baseline; None when not measured this step
    memory_method: str | None
    plan: str  # description of the checkpoint plan in effect

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TrainingResult:
    reports: list[StepReport]
    plans: dict[tuple, CheckpointPlan]
    start_step: int
    end_step: int
    optimizer_state: dict[str, Any]
    scaler_state: dict[str, Any] | None

    @property
    def losses(self) -> list[float]:
        return [report.loss for report in self.reports]


class NonFiniteLossError(RuntimeError):
    def __init__(self, message: str, result: TrainingResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class ResumePoint:
    """Where a previous run stopped (see :mod:`training.state`)."""

    step: int
    optimizer_state: dict[str, Any] | None = None
    scaler_state: dict[str, Any] | None = None


class LoRATrainer:
    """Trains ``parameters`` (the adapters) of a model reached through ``denoiser``."""

    def __init__(
        self,
        *,
        parameters: Sequence[torch.nn.Parameter],
        denoiser: Denoiser,
        schedule: NoiseSchedule,
        data: TrainingData,
        config: TrainConfig,
        device: torch.device | str,
        latent_dtype: torch.dtype = torch.float32,
        checkpointer: Checkpointer | None = None,
        shape_key: Callable[[MicroBatch], tuple] | None = None,
        resume: ResumePoint | None = None,
    ) -> None:
        config.objective.check_compatible(schedule.prediction)
        self.parameters = [p for p in parameters if p.requires_grad]
        self.denoiser = denoiser
        self.schedule = schedule
        self.data = data
        self.config = config
        self.device = torch.device(device)
        self.latent_dtype = latent_dtype
        self.checkpointer = checkpointer
        self.shape_key = shape_key or (lambda batch: (len(batch.indices), *batch.bucket))
        self.optimizer = make_optimizer(config.optimizer, self.parameters)
        self.autocast_dtype = PRECISIONS[config.precision]
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if config.precision == "fp16" else None
        )
        self.start_step = 0
        if resume is not None:
            self.start_step = resume.step
            if resume.optimizer_state:
                self.optimizer.load_state_dict(resume.optimizer_state)
            if resume.scaler_state and self.scaler is not None:
                self.scaler.load_state_dict(resume.scaler_state)
        self.end_step = self.start_step + config.steps

    # -- one micro-batch -------------------------------------------------------------------

    def _micro_loss(self, batch: MicroBatch) -> torch.Tensor:
        """Forward of one micro-batch: the mean loss, with the graph for backward."""
        config, schedule = self.config, self.schedule
        x0 = self.data.stacked(batch, self.device, self.latent_dtype)
        noises, levels = [], []
        for image in batch.indices:
            generator = generator_for(config.seed, "sample", batch.epoch, image)
            levels.append(sample_levels(config.objective, schedule.prediction, 1, generator))
            noises.append(torch.randn(x0.shape[1:], generator=generator, dtype=torch.float32))
        noise = torch.stack(noises).to(device=self.device, dtype=x0.dtype)
        sigma = schedule.sigma_from_level(torch.cat(levels)).to(device=self.device, dtype=torch.float32)
        x_t = noisy_input(schedule.prediction, x0, noise, sigma)
        target = prediction_target(schedule.prediction, x0, noise, sigma, schedule.sigma_data)
        conditions = [self.data.condition_index(i) for i in batch.indices]
        # Model code written for inference updates activations in place (x += ...), which
        # autograd and checkpoint recompute cannot follow: see training/inplace.py.
        with self._autocast(), out_of_place_updates():
            output = self.denoiser(x_t, sigma, conditions)
        return diffusion_loss(config.objective, schedule.prediction, output, target, sigma, schedule.sigma_data)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @contextlib.contextmanager
    def _dropout_rng(self, number: int) -> Iterator[None]:
        devices = []
        if self.device.type == "cuda":
            devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()]
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed(self.config.seed, "dropout", number))
            yield

    def _backward(self, loss: torch.Tensor) -> None:
        scaled = loss / self.config.grad_accumulation
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()

    def _plan(self, batch: MicroBatch, number: int) -> tuple[tuple, CheckpointPlan | None]:
        key = self.shape_key(batch)
        if self.checkpointer is None:
            return key, None

        def probe_step() -> None:
            saved = [p.grad for p in self.parameters]
            for p in self.parameters:
                p.grad = None
            try:
                with self._dropout_rng(number):
                    self._micro_loss(batch).backward()
            finally:
                for p, grad in zip(self.parameters, saved):
                    p.grad = grad

        return key, self.checkpointer.prepare(key, probe_step, device=self.device)

    # -- the run ---------------------------------------------------------------------------

    def run(
        self,
        on_step: Callable[[StepReport], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> TrainingResult:
        config = self.config
        result = TrainingResult([], {}, self.start_step, self.start_step, {}, None)
        for step in range(self.start_step, self.end_step):
            if should_stop is not None and should_stop():
                break
            report = self._optimizer_step(step, result)
            result.reports.append(report)
            result.end_step = step + 1
            if on_step is not None:
                on_step(report)
        result.optimizer_state = self.optimizer.state_dict()
        result.scaler_state = self.scaler.state_dict() if self.scaler is not None else None
        return result

    def _optimizer_step(self, step: int, result: TrainingResult) -> StepReport:
        config = self.config
        measure = (step - self.start_step) % config.measure_memory_every == 0 or self.device.type == "cuda"
        numbers = [step * config.grad_accumulation + micro for micro in range(config.grad_accumulation)]
        batches = [self.data.micro_batch(config.seed, number, config.batch_size) for number in numbers]
        # Plans first (a budget plan probes a new shape once): neither timed nor measured.
        keys = []
        plan_text = "checkpointing off"
        for batch, number in zip(batches, numbers):
            key, plan = self._plan(batch, number)
            keys.append(key)
            if plan is not None:
                result.plans[key] = plan
                plan_text = plan.describe()
        synchronize(self.device)
        started = time.perf_counter()
        losses: list[float] = []
        tracker_context = memory_tracker(self.device) if measure else contextlib.nullcontext()
        with tracker_context as tracker:
            for batch, number, key in zip(batches, numbers, keys):
                active = self.checkpointer.active(key) if self.checkpointer is not None else contextlib.nullcontext()
                with self._dropout_rng(number):
                    with active:
                        loss = self._micro_loss(batch)
                    value = float(loss.detach())
                    if not math.isfinite(value):
                        self.optimizer.zero_grad(set_to_none=True)
                        raise NonFiniteLossError(
                            f"the loss became {value} at step {step + 1} (micro-batch of images "
                            f"{list(batch.indices)}): training stopped before applying it, and the LoRA "
                            "keeps its last good values. Lower the learning rate, use bf16 or fp32 instead "
                            "of fp16, or check the latents.",
                            self._partial(result),
                        )
                    self._backward(loss)
                losses.append(value)
            self._apply_step(step, result)
            synchronize(self.device)
            peak = tracker.peak_bytes() if tracker is not None else None
        seconds = time.perf_counter() - started
        return StepReport(
            step=step + 1,
            total_steps=self.end_step,
            loss=sum(losses) / len(losses),
            learning_rate=learning_rate_at(config.optimizer, step, self.start_step, self.end_step),
            step_seconds=seconds,
            peak_bytes=peak,
            memory_method=None if tracker is None else tracker.method,
            plan=plan_text,
        )

    def _apply_step(self, step: int, result: TrainingResult) -> None:
        config = self.config
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, config.max_grad_norm or math.inf)
        if self.scaler is None and not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"the gradients became non-finite at step {step + 1}: training stopped before applying "
                "them, and the LoRA keeps its last good values. Lower the learning rate or use fp32.",
                self._partial(result),
            )
        set_learning_rate(self.optimizer, learning_rate_at(config.optimizer, step, self.start_step, self.end_step))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the step itself on inf/nan gradients
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _partial(self, result: TrainingResult) -> TrainingResult:
        result.optimizer_state = self.optimizer.state_dict()
        result.scaler_state = self.scaler.state_dict() if self.scaler is not None else None
        return result
