"""Gradient checkpointing plans, and applying and removing them.

The policy (which units to checkpoint) is separate from the mechanism (wrapping them):

* :class:`CheckpointConfig` is what the user chooses: ``off``, ``full`` (every unit),
  ``every_n`` (every N-th unit), ``budget`` (a peak-memory target the pack plans for; see
  :mod:`training.budget`), and ``offload`` of the kept tensors to the CPU on any of them.
* :class:`CheckpointPlan` is a decision: the units to checkpoint, and what is expected of it.
* :func:`apply_checkpointing` wraps those units' ``forward`` and returns a handle whose
  :meth:`AppliedCheckpointing.remove` restores the module tree exactly (also usable as a
  context manager). :class:`Checkpointer` ties a model, a config and per-shape plans together
  for the host's patch mechanism and the training loop.

Contract of a wrapped unit:

* Non-reentrant ``torch.utils.checkpoint`` with the RNG state preserved: gradients of a frozen
  base with trainable adapters equal those without checkpointing, dropout included.
* Positional and keyword arguments, nested containers, any output structure. Top-level tensor
  arguments (keyword ones too) are passed to ``checkpoint`` positionally, so that offload hooks
  see them. Dict arguments (ComfyUI's ``transformer_options``) are passed as they are to the
  forward, and recompute gets a copy of what they held at forward time: the model mutates them
  between blocks, and recompute must see what the forward saw.
* With gradients disabled (sampling, inference mode) the original forward runs directly:
  a planned model costs nothing extra outside training.
* Optional recompute verification: a fingerprint of each unit's output in the forward is
  compared with that of its recompute in backward; a mismatch raises
  :class:`RecomputeMismatchError` naming the unit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from . import inplace
from .blocks import CheckpointUnit, UnitSet, UnsupportedArchitectureError, find_units
from .offload import CpuOffload

log = logging.getLogger(__name__)

# A budget above this is not a real device (1 PiB): most likely a unit mix-up (bytes vs GB).
MAX_BUDGET_BYTES = 1 << 50


class Mode(str, Enum):
    OFF = "off"
    FULL = "full"
    EVERY_N = "every_n"
    BUDGET = "budget"


@dataclass(frozen=True)
class CheckpointConfig:
    """What the user chose. Validated on construction, with errors that name the input."""

    mode: Mode | str = Mode.FULL
    interval: int = 2
    budget_bytes: int | None = None
    offload: bool = False
    verify_first_step: bool = True

    def __post_init__(self) -> None:
        try:
            mode = Mode(self.mode)
        except ValueError:
            raise ValueError(
                f"mode must be one of {[m.value for m in Mode]}, got {self.mode!r}"
            ) from None
        object.__setattr__(self, "mode", mode)
        if mode is Mode.EVERY_N:
            if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
                raise ValueError(
                    f"interval must be an integer >= 1 for mode 'every_n' (1 checkpoints every block), "
                    f"got {self.interval!r}"
                )
        if mode is Mode.BUDGET:
            validate_budget(self.budget_bytes)


def validate_budget(budget_bytes: object) -> int:
    if budget_bytes is None:
        raise ValueError("budget_bytes is required for mode 'budget': the peak memory to plan for, in bytes")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or math.isnan(budget_bytes):
        raise ValueError(f"budget_bytes must be a number of bytes, got {budget_bytes!r}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes!r}")
    if budget_bytes > MAX_BUDGET_BYTES:
        raise ValueError(
            f"budget_bytes={budget_bytes!r} is beyond any device (over 1 PiB); give the budget in bytes "
            "(the nodes take gigabytes)"
        )
    return int(budget_bytes)


@dataclass(frozen=True)
class CheckpointPlan:
    """Which units to checkpoint, and what is expected of the choice."""

    mode: Mode
    architecture: str
    all_units: tuple[str, ...]
    checkpointed: tuple[str, ...]
    offload: bool = False
    interval: int | None = None
    budget_bytes: int | None = None
    expected_peak_bytes: int | None = None
    expected_extra_seconds: float | None = None
    shape_key: tuple | None = None
    note: str = ""

    def describe(self) -> str:
        from .memory import format_bytes

        total = len(self.all_units)
        head = {
            Mode.OFF: "checkpointing off",
            Mode.FULL: f"checkpointing all {total} blocks",
            Mode.EVERY_N: f"checkpointing every {self.interval}th block ({len(self.checkpointed)} of {total})",
            Mode.BUDGET: f"budget {format_bytes(self.budget_bytes or 0)}: checkpointing {len(self.checkpointed)} of {total} blocks",
        }[self.mode]
        parts = [f"{head} of {self.architecture}"]
        if self.offload:
            parts.append("kept tensors offloaded to CPU")
        if self.expected_peak_bytes is not None:
            parts.append(f"expected peak {format_bytes(self.expected_peak_bytes)}")
        if self.expected_extra_seconds is not None:
            parts.append(f"expected recompute {self.expected_extra_seconds * 1000:.1f} ms/step")
        text = ", ".join(parts)
        return f"{text}. {self.note}" if self.note else text

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "architecture": self.architecture,
            "units": len(self.all_units),
            "checkpointed": list(self.checkpointed),
            "offload": self.offload,
            "interval": self.interval,
            "budget_bytes": self.budget_bytes,
            "expected_peak_bytes": self.expected_peak_bytes,
            "expected_extra_seconds": self.expected_extra_seconds,
            "shape": list(self.shape_key) if self.shape_key is not None else None,
            "description": self.describe(),
        }


def plan_off(units: UnitSet) -> CheckpointPlan:
    """Nothing checkpointed (so nothing kept to offload either)."""
    return CheckpointPlan(Mode.OFF, units.architecture, units.names(), ())


def plan_full(units: UnitSet, *, offload: bool = False) -> CheckpointPlan:
    return CheckpointPlan(Mode.FULL, units.architecture, units.names(), units.names(), offload=offload)


def plan_every_n(units: UnitSet, interval: int, *, offload: bool = False) -> CheckpointPlan:
    CheckpointConfig(Mode.EVERY_N, interval=interval)  # validates
    chosen = tuple(name for index, name in enumerate(units.names()) if index % interval == 0)
    return CheckpointPlan(
        Mode.EVERY_N, units.architecture, units.names(), chosen, offload=offload, interval=interval
    )


# ----------------------------------------------------------------------------------------------
# The mechanism


class RecomputeMismatchError(RuntimeError):
    """A unit's recompute in backward produced another output than its forward."""


class PlanNotEffectiveError(RuntimeError):
    """A planned unit was never called by the model's forward, so checkpointing it did nothing."""


class CheckpointObserver(Protocol):
    """Receives the events of a planned forward and backward (used by the budget probe)."""

    def before_forward(self, name: str, run_plain: Callable[[], Any]) -> None: ...

    def after_forward(self, name: str) -> None: ...

    def before_recompute(self, name: str) -> None: ...


@dataclass(frozen=True)
class VerifyTolerance:
    """Recompute must match the forward to ``ulps`` units in the last place at the output's scale.

    Recompute on the same inputs with the same kernels is normally bit-identical; a few ulps of
    slack forgives a kernel that reduces in another order, not a different result.
    """

    ulps: float = 4.0
    sample_size: int = 4096


@dataclass
class UnitCalls:
    forward: int = 0
    recompute: int = 0


class _Fingerprint:
    """Shape, dtype, a strided sample and float64 sums of every tensor in an output."""

    def __init__(self, output: Any, sample_size: int) -> None:
        self.entries: list[tuple[tuple[int, ...], torch.dtype, torch.Tensor, float, float]] = []
        for tensor in tensors_in(output):
            flat = tensor.detach().reshape(-1)
            if flat.dtype == torch.bool:
                flat = flat.to(torch.uint8)
            stride = max(1, flat.numel() // sample_size)
            sample = flat[::stride][:sample_size].float().cpu()
            total = float(torch.sum(flat, dtype=torch.float64)) if flat.numel() else 0.0
            magnitude = float(torch.sum(flat.abs(), dtype=torch.float64)) if flat.numel() else 0.0
            self.entries.append((tuple(tensor.shape), tensor.dtype, sample, total, magnitude))

    def mismatch(self, other: "_Fingerprint", tolerance: VerifyTolerance) -> str | None:
        if len(self.entries) != len(other.entries):
            return f"{len(self.entries)} output tensors in forward, {len(other.entries)} in recompute"
        for index, (a, b) in enumerate(zip(self.entries, other.entries)):
            if a[0] != b[0] or a[1] != b[1]:
                return f"output {index}: {a[0]} {a[1]} in forward, {b[0]} {b[1]} in recompute"
            eps = torch.finfo(a[1]).eps if a[1].is_floating_point else 0.0
            scale = float(a[2].abs().max()) if a[2].numel() else 0.0
            sample_error = float((a[2] - b[2]).abs().max()) if a[2].numel() else 0.0
            if sample_error > tolerance.ulps * eps * scale:
                return f"output {index}: sampled values differ by up to {sample_error:.3g} (scale {scale:.3g})"
            if abs(a[3] - b[3]) > tolerance.ulps * eps * max(a[4], 1e-30) + 1e-30:
                return f"output {index}: sums differ ({a[3]:.8g} in forward, {b[3]:.8g} in recompute)"
        return None


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested list/tuple/dict) value."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


class _CallPlan:
    """How one call's arguments travel through ``checkpoint``.

    Top-level tensors become positional checkpoint inputs (so that saved-tensor hooks, i.e.
    offload, see them); dicts are snapshotted so recompute sees what the forward saw.
    """

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args = list(args)
        self.kwargs = dict(kwargs)
        self.tensor_slots: list[int | str] = []
        self.tensors: list[torch.Tensor] = []
        self.dict_snapshots: dict[int | str, dict] = {}
        for slot, value in [*enumerate(self.args), *self.kwargs.items()]:
            if isinstance(value, torch.Tensor):
                self.tensor_slots.append(slot)
                self.tensors.append(value)
            elif isinstance(value, dict):
                self.dict_snapshots[slot] = dict(value)
        # Neither this object nor the closures may keep the tensors alive: checkpoint holds them
        # (or their offloaded copies) as saved inputs.
        for slot in self.tensor_slots:
            self._set(slot, None)

    def _set(self, slot: int | str, value: Any) -> None:
        if isinstance(slot, int):
            self.args[slot] = value
        else:
            self.kwargs[slot] = value

    def build(self, tensors: Sequence[torch.Tensor], *, fresh_dicts: bool) -> tuple[list, dict]:
        args = list(self.args)
        kwargs = dict(self.kwargs)
        for slot, tensor in zip(self.tensor_slots, tensors):
            if isinstance(slot, int):
                args[slot] = tensor
            else:
                kwargs[slot] = tensor
        if fresh_dicts:
            for slot, snapshot in self.dict_snapshots.items():
                if isinstance(slot, int):
                    args[slot] = dict(snapshot)
                else:
                    kwargs[slot] = dict(snapshot)
        return args, kwargs


class _CheckpointedForward:
    """The callable installed as a unit's ``forward`` while a plan is applied."""

    def __init__(
        self, name: str, kind: str, original: Callable[..., Any], session: "AppliedCheckpointing"
    ) -> None:
        self.name = name
        self.kind = kind
        self.original = original
        self.session = session

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        session = self.session
        calls = session.calls[self.name]
        calls.forward += 1
        call = _CallPlan(args, kwargs)
        observer = session.observer
        if observer is not None:
            def run_plain() -> Any:
                plain_args, plain_kwargs = call.build(call.tensors, fresh_dicts=True)
                return self.original(*plain_args, **plain_kwargs)

            observer.before_forward(self.name, run_plain)
        forward_tensors = call.tensors
        call.tensors = []  # from here on only checkpoint holds the inputs
        state = {"runs": 0, "fingerprint": None}
        verify = session.verify
        tolerance = session.tolerance
        out_of_place = inplace.active()

        def run(*tensors: torch.Tensor) -> Any:
            state["runs"] += 1
            first = state["runs"] == 1
            if not first:
                calls.recompute += 1
                if observer is not None:
                    observer.before_recompute(self.name)
            # The forward gets the caller's own dicts (it mutates them as it would unplanned);
            # recompute gets copies of what they held then.
            run_args, run_kwargs = call.build(tensors, fresh_dicts=not first)
            # Recompute runs in backward, outside the trainer's context: restore what the forward had.
            with inplace.same_as_forward(out_of_place and not first):
                output = self.original(*run_args, **run_kwargs)
            if verify:
                fingerprint = _Fingerprint(output, tolerance.sample_size)
                if first:
                    state["fingerprint"] = fingerprint
                else:
                    problem = state["fingerprint"].mismatch(fingerprint, tolerance)
                    if problem is not None:
                        raise RecomputeMismatchError(
                            f"recompute of checkpointed block {self.name!r} ({self.kind}) "
                            f"differs from its forward: {problem}. Its gradients would be wrong. Something in "
                            "this block depends on state that changes between forward and backward (free memory, "
                            "a global flag, an RNG that checkpointing does not restore). Use mode 'off' for this "
                            "model, or turn verification off if the difference is a known harmless nondeterminism."
                        )
            return output

        stack = contextlib.ExitStack()
        with stack:
            if verify:
                # Early stop would end recompute before the output exists to compare.
                stack.enter_context(set_checkpoint_early_stop(False))
            if session.offload is not None:
                stack.enter_context(session.offload.hooks())
            output = checkpoint(run, *forward_tensors, use_reentrant=False, preserve_rng_state=True)
        if observer is not None:
            observer.after_forward(self.name)
        return output


_MISSING = object()


class AppliedCheckpointing:
    """A plan applied to a module tree. :meth:`remove` (or leaving the ``with``) restores it."""

    _registry_lock = threading.Lock()

    def __init__(
        self,
        units: Sequence[CheckpointUnit],
        *,
        offload: CpuOffload | None = None,
        verify: bool = False,
        tolerance: VerifyTolerance = VerifyTolerance(),
        observer: CheckpointObserver | None = None,
    ) -> None:
        self.units = tuple(units)
        self.offload = offload
        self.verify = verify
        self.tolerance = tolerance
        self.observer = observer
        self.calls: dict[str, UnitCalls] = {unit.name: UnitCalls() for unit in self.units}
        self._saved: list[tuple[nn.Module, object]] = []
        self._removed = False
        with self._registry_lock:
            for unit in self.units:
                module = unit.module
                if isinstance(module.__dict__.get("forward"), _CheckpointedForward):
                    self._restore()
                    raise RuntimeError(
                        f"block {unit.name!r} already has a checkpoint plan applied; remove that plan first"
                    )
                previous = module.__dict__.get("forward", _MISSING)
                # The bound forward as the model would call it now (an earlier instance patch included).
                original = module.forward
                self._saved.append((module, previous))
                module.__dict__["forward"] = _CheckpointedForward(unit.name, unit.kind, original, self)
        if offload is not None:
            offload.new_forward()

    def never_called(self) -> tuple[str, ...]:
        return tuple(name for name, calls in self.calls.items() if calls.forward == 0)

    def check_coverage(self) -> None:
        """Raise :class:`PlanNotEffectiveError` if a planned unit was not called in the forward."""
        missing = self.never_called()
        if missing:
            raise PlanNotEffectiveError(
                f"{len(missing)} planned block(s) were never called by the model's forward while "
                f"gradients were on, so checkpointing them saved nothing: {', '.join(missing[:8])}"
                + (" …" if len(missing) > 8 else "")
                + ". The model calls other modules than the ones planned (for a UNet: the layers "
                "inside each TimestepEmbedSequential, not the sequential)."
            )

    def _restore(self) -> None:
        for module, previous in reversed(self._saved):
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous
        self._saved.clear()

    def remove(self) -> None:
        """Restore every wrapped forward; safe to call twice."""
        if self._removed:
            return
        with self._registry_lock:
            self._restore()
        self._removed = True

    def __enter__(self) -> "AppliedCheckpointing":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply_checkpointing(
    units: UnitSet | Sequence[CheckpointUnit],
    plan: CheckpointPlan | None = None,
    *,
    verify: bool = False,
    tolerance: VerifyTolerance = VerifyTolerance(),
    offload: CpuOffload | None = None,
    observer: CheckpointObserver | None = None,
) -> AppliedCheckpointing:
    """Wrap the units the plan names (all given units when ``plan`` is None).

    ``offload``: a :class:`CpuOffload` to use when the plan asks for offload (one is made if
    the plan asks and none is given).
    """
    all_units = units.units if isinstance(units, UnitSet) else tuple(units)
    if plan is None:
        chosen = all_units
    else:
        by_name = {unit.name: unit for unit in all_units}
        unknown = [name for name in plan.checkpointed if name not in by_name]
        if unknown:
            raise ValueError(f"plan names blocks the model does not have: {unknown[:5]}")
        chosen = tuple(by_name[name] for name in plan.checkpointed)
        if plan.offload and offload is None:
            offload = CpuOffload()
        if not plan.offload:
            offload = None
    return AppliedCheckpointing(chosen, offload=offload, verify=verify, tolerance=tolerance, observer=observer)


# ----------------------------------------------------------------------------------------------
# Per-model, per-shape plans


@dataclass
class _ShapeState:
    plan: CheckpointPlan
    probed: bool  # False for the stand-in used when a budget plan was needed before any probe
    verified: bool = False


ProbeStep = Callable[[], None]


@dataclass
class Checkpointer:
    """A model, the user's config, and the plan for each input shape.

    ``full``/``every_n``/``off`` plans are the same for every shape. A ``budget`` plan belongs to
    an input shape (another resolution bucket has other activation sizes), so it is made by
    :meth:`prepare` with a probe step and cached per shape.
    """

    model: nn.Module
    config: CheckpointConfig
    units: UnitSet | None = None
    tolerance: VerifyTolerance = field(default_factory=VerifyTolerance)
    _shapes: dict[tuple, _ShapeState] = field(default_factory=dict, init=False, repr=False)
    _offload: CpuOffload | None = field(default=None, init=False, repr=False)
    # Set while a plan (or the budget probe's own) is applied: a nested ``active`` (the host's
    # model wrapper inside the trainer's step) must not apply a second one.
    _busy: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.units is None:
            try:
                self.units = find_units(self.model)
            except UnsupportedArchitectureError:
                if self.config.mode is not Mode.OFF:
                    raise
                # Nothing to plan: 'off' is what the error message tells the user to choose.
                self.units = UnitSet(type(self.model).__name__, "none", ())
        if self.config.offload:
            self._offload = CpuOffload()

    def static_plan(self) -> CheckpointPlan | None:
        """The plan when it does not depend on the input shape (None for ``budget``)."""
        assert self.units is not None
        mode = self.config.mode
        if mode is Mode.OFF:
            return plan_off(self.units)
        if mode is Mode.FULL:
            return plan_full(self.units, offload=self.config.offload)
        if mode is Mode.EVERY_N:
            return plan_every_n(self.units, self.config.interval, offload=self.config.offload)
        return None

    def plan_for(self, shape_key: tuple) -> CheckpointPlan | None:
        state = self._shapes.get(shape_key)
        if state is not None:
            return state.plan
        plan = self.static_plan()
        return replace(plan, shape_key=shape_key) if plan is not None else None

    def prepare(self, shape_key: tuple, probe_step: ProbeStep, *, device: torch.device | str | None = None) -> CheckpointPlan:
        """The plan for this shape, probing once per shape in ``budget`` mode.

        ``probe_step`` runs one forward and backward of the real batch; its gradients are the
        caller's to discard.
        """
        state = self._shapes.get(shape_key)
        if state is not None and state.probed:
            return state.plan
        plan = self.static_plan()
        if plan is None:
            from .budget import plan_budget, probe_units

            assert self.units is not None and self.config.budget_bytes is not None
            self._busy = True
            try:
                probe = probe_units(
                    self.units, probe_step, device=device or _model_device(self.model), offload=self._offload
                )
            finally:
                self._busy = False
            plan = plan_budget(probe, self.config.budget_bytes, offload=self.config.offload)
        plan = replace(plan, shape_key=shape_key)
        self._shapes[shape_key] = _ShapeState(plan, probed=True)
        log.info("gradient checkpointing for shape %s: %s", shape_key, plan.describe())
        return plan

    @contextlib.contextmanager
    def active(self, shape_key: tuple) -> Iterator[AppliedCheckpointing | None]:
        """Apply this shape's plan for one forward (and its backward's recompute) while grad is on.

        The first application of each shape's plan verifies recompute and that every planned unit
        is called, when ``verify_first_step`` is set. Nested inside another ``active`` (or the
        budget probe) it applies nothing and yields None.
        """
        if not torch.is_grad_enabled() or self.config.mode is Mode.OFF or self._busy:
            yield None
            return
        state = self._shapes.get(shape_key)
        if state is None:
            plan = self.plan_for(shape_key)
            probed = plan is not None
            if plan is None:
                assert self.units is not None
                log.warning(
                    "no budget plan was probed for input shape %s; checkpointing every block for it",
                    shape_key,
                )
                plan = replace(plan_full(self.units, offload=self.config.offload), shape_key=shape_key)
            state = self._shapes.setdefault(shape_key, _ShapeState(plan, probed=probed))
        verify = self.config.verify_first_step and not state.verified
        assert self.units is not None
        applied = apply_checkpointing(
            self.units, state.plan, verify=verify, tolerance=self.tolerance, offload=self._offload
        )
        self._busy = True
        try:
            yield applied
            if verify:
                applied.check_coverage()
                state.verified = True
        finally:
            self._busy = False
            applied.remove()


def _model_device(model: nn.Module) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")
