"""Measuring the peak memory and the wall time of a training step.

Every memory or time figure the pack shows comes from here, never from a formula.

Two ways of measuring memory, chosen by the device:

- ``cuda``: the caching allocator's own counters (``torch.cuda.memory_allocated`` and
  ``max_memory_allocated``). Exact for what PyTorch allocates on that device; it does not include
  the CUDA context, the allocator's cached-but-free blocks or memory other libraries take directly.
- ``cpu``: a live-tensor tracker (:class:`TensorTracker`). CPU tensors come from ``malloc``, which
  keeps no per-tensor counters, so the tracker watches every operator that runs while it is active
  (a ``TorchDispatchMode``), adds the bytes of each new storage an operator returns, and subtracts
  them when that storage is freed (a ``weakref`` callback). It is a measurement of real storages,
  not an estimate; its limits are listed on the class.

The process's resident set size (``VmRSS``/``VmHWM`` from ``/proc``) is exposed too, as an
independent cross-check of the tracker on Linux.

This module imports only torch and the standard library.
"""

from __future__ import annotations

import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = [
    "METHOD_CUDA",
    "METHOD_NONE",
    "METHOD_TRACKER",
    "CudaAllocatorTracker",
    "MemoryTracker",
    "StepMeasurement",
    "TensorTracker",
    "current_rss_bytes",
    "format_bytes",
    "measure_step",
    "memory_tracker",
    "peak_rss_bytes",
    "reset_peak_rss",
    "synchronize",
]

METHOD_CUDA = "cuda-allocator"
METHOD_TRACKER = "cpu-tensor-tracker"
# measure_step(..., measure_memory=False): the step was timed only; the memory fields are 0.
METHOD_NONE = "none"

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


# --------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class StepMeasurement:
    """What :func:`measure_step` measured for one training step.

    Attributes:
        device: the device measured, e.g. ``"cpu"`` or ``"cuda:0"``.
        method: ``"cuda-allocator"``, ``"cpu-tensor-tracker"``, or ``"none"`` when the call
            asked for time only (``measure_memory=False``); then both byte fields are 0.
        peak_bytes: the peak of live tensor memory during the step, above the memory that was
            already allocated when the step began (the largest such peak over the measured runs).
        baseline_bytes: memory allocated when the step began. On CUDA this is
            ``torch.cuda.memory_allocated`` before the step that gave ``peak_bytes``, so
            ``baseline_bytes + peak_bytes`` is that step's absolute peak. On CPU it is always 0:
            the tracker only sees storages created while it runs, so it cannot know what existed
            before (read :func:`current_rss_bytes` for the whole process instead).
        step_seconds: the median wall time of the timed runs (after warm-up).
        step_seconds_all: every timed run's wall time, in order.
    """

    device: str
    method: str
    peak_bytes: int
    baseline_bytes: int
    step_seconds: float
    step_seconds_all: tuple[float, ...]

    @property
    def memory_measured(self) -> bool:
        """Whether the byte fields hold a measurement (False for ``method == "none"``)."""
        return self.method != METHOD_NONE

    def summary(self) -> str:
        """One line for people, e.g. ``peak 1.23 GiB above baseline, 0.412 s/step (median of 5, cpu-tensor-tracker)``."""
        timing = f"{self.step_seconds:.3g} s/step (median of {len(self.step_seconds_all)}"
        if not self.memory_measured:
            return f"memory not measured, {timing})"
        memory = f"peak {format_bytes(self.peak_bytes)} above baseline"
        if self.method == METHOD_CUDA:
            # On CUDA the baseline is known, and it is what decides whether the step fits.
            memory += f" ({format_bytes(self.baseline_bytes)})"
        return f"{memory}, {timing}, {self.method})"

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (the tuple of times becomes a list)."""
        data = asdict(self)
        data["step_seconds_all"] = list(self.step_seconds_all)
        return data


# --------------------------------------------------------------------------------------------
# Devices


def _resolve_device(device: torch.device | str, argument: str = "device") -> torch.device:
    """The device as a ``torch.device`` that this module can measure, with the CUDA index filled in.

    Raises:
        ValueError: the device is not a device, is CUDA on a machine without CUDA, or is a kind
            (mps, xpu, meta, ...) this module has no real measurement for.
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{argument}={device!r} is not a torch device; pass e.g. 'cpu' or 'cuda:0'") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{argument}={device!r}: CUDA is not available on this machine; measure on 'cpu'")
        if resolved.index is None:
            # The allocator counters are per device; "cuda" means the current one.
            resolved = torch.device("cuda", torch.cuda.current_device())
        return resolved
    if resolved.type == "cpu":
        return resolved
    raise ValueError(
        f"{argument}={device!r}: memory can be measured on 'cpu' (tensor tracker) and 'cuda' "
        f"(allocator counters) only, not on {resolved.type!r}"
    )


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (``torch.cuda.synchronize``) when it is CUDA; else do nothing.

    CUDA kernels run asynchronously, so a wall time taken without this measures the launch, not the work.
    """
    resolved = torch.device(device)
    if resolved.type == "cuda":
        torch.cuda.synchronize(resolved)


# --------------------------------------------------------------------------------------------
# Trackers


class MemoryTracker(AbstractContextManager["MemoryTracker"]):
    """Live and peak memory above the level at entry. Use it once, as a context manager.

    ``with memory_tracker(device) as mt: ...``; then :meth:`current_bytes`, :meth:`peak_bytes`
    and :meth:`reset_peak` inside the block. After the block both figures are frozen at their
    values on exit.
    """

    method: str

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._state = "new"  # new -> active -> closed; a tracker is not reusable
        self._final: tuple[int, int] | None = None  # (current, peak) frozen on exit

    def __enter__(self) -> MemoryTracker:
        if self._state != "new":
            raise RuntimeError("a MemoryTracker can be entered once; create a new one with memory_tracker()")
        self._start()
        self._state = "active"
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._final = (self._live_current(), self._live_peak())
        self._state = "closed"
        self._stop()

    def current_bytes(self) -> int:
        """Bytes allocated since entry that are still alive (never negative)."""
        self._check_entered("current_bytes")
        return self._final[0] if self._final is not None else self._live_current()

    def peak_bytes(self) -> int:
        """The largest :meth:`current_bytes` since entry or since the last :meth:`reset_peak`."""
        self._check_entered("peak_bytes")
        return self._final[1] if self._final is not None else self._live_peak()

    def reset_peak(self) -> None:
        """Start a new peak from the current level (peak := current). Only inside the block."""
        if self._state != "active":
            raise RuntimeError("reset_peak() works only inside the tracker's `with` block")
        self._reset_peak()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Run a block unobserved (to time it): its allocations are not counted, its frees are."""
        if self._state != "active":
            raise RuntimeError("paused() works only inside the tracker's `with` block")
        with self._paused():
            yield

    def _paused(self) -> AbstractContextManager[None]:
        return nullcontext()

    def _check_entered(self, name: str) -> None:
        if self._state == "new":
            raise RuntimeError(f"{name}() needs the tracker entered first: `with memory_tracker(device) as mt:`")

    # Subclasses measure.
    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def _live_current(self) -> int:
        raise NotImplementedError

    def _live_peak(self) -> int:
        raise NotImplementedError

    def _reset_peak(self) -> None:
        raise NotImplementedError


class CudaAllocatorTracker(MemoryTracker):
    """Memory above entry from the CUDA caching allocator's counters.

    current = ``memory_allocated - entry`` (floored at 0: tensors from before entry that are freed
    inside make the net change negative, which is not memory "allocated since entry");
    peak = ``max_memory_allocated - entry``, with the allocator's peak reset at entry and by
    :meth:`reset_peak`.

    Limits: the allocator's peak statistics are per device and process-wide, so two trackers on the
    same device must not overlap, and other code that resets them disturbs this one. The counters
    cover memory PyTorch's allocator hands out, not the CUDA context nor cached free blocks.
    """

    method = METHOD_CUDA

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.entry_bytes = 0  # memory_allocated at entry: the baseline

    def _start(self) -> None:
        synchronize(self.device)  # let queued frees and allocations land before reading
        self.entry_bytes = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def _stop(self) -> None:
        pass

    def _live_current(self) -> int:
        return max(0, torch.cuda.memory_allocated(self.device) - self.entry_bytes)

    def _live_peak(self) -> int:
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.entry_bytes)

    def _reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


@dataclass
class _StorageRecord:
    """One storage the tracker knows, and how many of its bytes it counts."""

    ref: weakref.ref[torch.UntypedStorage]
    base: int  # bytes it had when first seen if it existed before (not ours); 0 for a new storage
    counted: int  # bytes included in the live total: nbytes above base


class _StorageWatch(TorchDispatchMode):
    """The dispatch mode: hands every operator's tensor inputs and outputs to the tracker."""

    # Without this, a higher-order operator (torch.cond, flex_attention, ...) inside the step would
    # raise. With it, the operator's results are counted; the operators inside its body run below
    # this mode and are not seen (see TensorTracker's limits).
    supports_higher_order_operators = True

    def __init__(self, tracker: TensorTracker) -> None:
        super().__init__()
        self._tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        return self._tracker._run_op(func, args, kwargs or {})


# torch.tensor(data) builds its tensor outside the dispatcher, then passes it through lift_fresh:
# that input is a new allocation, not a tensor from before.
_LIFT_FRESH_OPS = frozenset({torch.ops.aten.lift_fresh.default})


class TensorTracker(MemoryTracker):
    """Live bytes of the tensor storages created on ``device`` while the tracker is active.

    How: a ``TorchDispatchMode`` sees every operator that runs on this thread inside the block,
    autograd's backward included (on CPU the engine runs the backward on the calling thread, and
    carries the dispatch mode with it). Each storage an operator returns that the tracker has not
    seen is new: its ``nbytes()`` is added, and a ``weakref`` to its Python storage object removes
    it again. PyTorch keeps one Python object per storage alive for as long as the storage lives,
    whoever holds it (Python, autograd's saved tensors), so the weakref fires exactly when the
    memory is freed.

    - Storages that existed before entry (parameters, the batch, ...) are recognised when they are
      an operator's input and not counted, so views of them and in-place writes to them add nothing
      and freeing them inside does not make the figure negative: it is memory above baseline.
    - A view shares its base's storage and is counted once; an in-place op allocates nothing.
    - A storage that grows (``resize_``, ``out=``) is re-read each time an operator touches it,
      and only the growth is counted for storages from before entry.
    - Meta tensors, tensors on other devices, sparse and nested tensors, and tensor subclasses
      without a plain storage are ignored.

    Limits (what it cannot see, so the real peak may be higher):

    - memory that does not come from an operator's result: scratch buffers a kernel frees before
      it returns (oneDNN workspaces), tensors made outside the dispatcher (``torch.from_numpy``,
      ``UntypedStorage.resize_`` called directly), work on other threads (data-loader workers),
      code compiled by ``torch.compile`` (its buffers bypass the dispatcher), the operators inside
      a higher-order operator's body (``torch.cond``; its results are counted);
    - the allocator's overhead and fragmentation, and non-tensor memory;
    - peaks inside one operator: the figure is updated once per operator.

    The dispatch mode costs Python time per operator, so never time a step under it. The first
    operator under any ``TorchDispatchMode`` in a process also imports ``torch._dynamo`` (torch
    wraps ``__torch_dispatch__`` to keep the compiler out): about a second and ~150 MiB of
    resident memory once, none of it tensor memory, so none of it in the figures.
    """

    method = METHOD_TRACKER

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # Callbacks may run on any thread that drops the last reference, and may run re-entrantly
        # (a garbage collection triggered while we hold the lock), hence a re-entrant lock.
        self._lock = threading.RLock()
        self._records: dict[int, _StorageRecord] = {}  # id(storage) -> record; ids are unique while alive
        self._live = 0
        self._peak = 0
        self._mode: _StorageWatch | None = None

    def _start(self) -> None:
        self._mode = _StorageWatch(self)
        self._mode.__enter__()

    def _stop(self) -> None:
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self._mode = None
        with self._lock:
            # Dropping the weakrefs drops their callbacks: nothing more to track, and no cycle
            # (record -> weakref -> callback -> tracker) keeps the tracker alive.
            self._records.clear()

    def _live_current(self) -> int:
        with self._lock:
            return self._live

    def _live_peak(self) -> int:
        with self._lock:
            return self._peak

    def _reset_peak(self) -> None:
        with self._lock:
            self._peak = self._live

    def _paused(self) -> AbstractContextManager[None]:
        # Takes the dispatch mode (and any above it) off the stack for the block.
        return _disable_current_modes()

    # -- called by the dispatch mode ----------------------------------------------------------

    def _run_op(self, func: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        """Run one operator and account for the storages it creates, grows or reuses."""
        inputs = [] if func in _LIFT_FRESH_OPS else self._storages_in((args, kwargs))
        self._note_existing(inputs)
        out = func(*args, **kwargs)
        self._note_after_op(inputs, self._storages_in(out))
        return out

    def _storages_in(self, tree: object) -> list[torch.UntypedStorage]:
        """The distinct storages on this tracker's device among the tensors (and storages) in ``tree``."""
        found: dict[int, torch.UntypedStorage] = {}
        for item in _leaves(tree):
            storage = item if isinstance(item, torch.UntypedStorage) else _plain_storage(item)
            if storage is not None and storage.device.type == self.device.type:
                found.setdefault(id(storage), storage)
        return list(found.values())

    def _note_existing(self, inputs: list[torch.UntypedStorage]) -> None:
        """Mark inputs not seen before as existing (from before entry), before the op can grow them."""
        with self._lock:
            for storage in inputs:
                if id(storage) not in self._records:
                    self._register(storage, base=storage.nbytes())

    def _note_after_op(self, inputs: list[torch.UntypedStorage], outputs: list[torch.UntypedStorage]) -> None:
        """Re-read the sizes of the op's storages and count the outputs that are new."""
        with self._lock:
            for storage in inputs + outputs:
                record = self._records.get(id(storage))
                if record is None:
                    self._register(storage, base=0)
                else:
                    self._recount(record, storage.nbytes())
            self._peak = max(self._peak, self._live)

    def _register(self, storage: torch.UntypedStorage, base: int) -> None:
        key = id(storage)

        def forget(ref: weakref.ref[torch.UntypedStorage]) -> None:
            self._on_freed(key, ref)

        record = _StorageRecord(ref=weakref.ref(storage, forget), base=base, counted=0)
        self._records[key] = record
        self._recount(record, storage.nbytes())

    def _recount(self, record: _StorageRecord, nbytes: int) -> None:
        counted = max(0, nbytes - record.base)
        self._live += counted - record.counted
        record.counted = counted

    def _on_freed(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        with self._lock:
            record = self._records.get(key)
            if record is not None and record.ref is ref:  # not a newer storage that reuses the id
                del self._records[key]
                self._live -= record.counted


def _leaves(tree: object) -> Iterator[object]:
    """The leaves of nested tuples, lists and dict values (operator arguments and results)."""
    if isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _leaves(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _leaves(item)
    else:
        yield tree


def _plain_storage(value: object) -> torch.UntypedStorage | None:
    """The storage behind a dense tensor, or None for anything without one we can count."""
    if not isinstance(value, torch.Tensor) or value.is_meta or value.is_nested or value.layout != torch.strided:
        return None
    try:
        return value.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # wrapper subclasses (fake, functional, distributed) have no real storage


def memory_tracker(device: torch.device | str) -> MemoryTracker:
    """A tracker of the memory allocated on ``device`` above the level at entry.

    CUDA devices get the allocator's counters (:class:`CudaAllocatorTracker`), the CPU gets the
    live-tensor tracker (:class:`TensorTracker`).

    Raises:
        ValueError: the device is not CPU or an available CUDA device.
    """
    resolved = _resolve_device(device)
    if resolved.type == "cuda":
        return CudaAllocatorTracker(resolved)
    return TensorTracker(resolved)


# --------------------------------------------------------------------------------------------
# Measuring a step


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _timed_run(step_fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call, with the device's queued work finished on both sides."""
    synchronize(device)
    start = time.perf_counter()
    step_fn()
    synchronize(device)
    return time.perf_counter() - start


def measure_step(
    step_fn: Callable[[], object],
    *,
    device: torch.device | str,
    warmup: int = 1,
    repeats: int = 3,
    measure_memory: bool = True,
) -> StepMeasurement:
    """Measure the peak memory and the wall time of ``step_fn()`` on ``device``.

    Runs ``step_fn`` ``warmup`` times untimed (first-call costs: kernel selection, lazy
    allocations, optimizer state), then:

    - CUDA: ``repeats`` timed runs, each with the allocator's peak reset just before it (outside
      the timed span); ``peak_bytes`` is the largest per-run peak above that run's own baseline.
    - CPU: one run under :class:`TensorTracker` for the peak (if ``measure_memory``), then
      ``repeats`` timed runs without it, because its per-operator overhead would distort the time.

    ``step_fn`` is called ``warmup + repeats`` times (+1 on CPU when measuring memory), so it must
    be repeatable; its return value is dropped at once. ``step_seconds`` is the median of the
    timed runs.

    Raises:
        TypeError: ``step_fn`` is not callable, or ``warmup``/``repeats`` is not an int.
        ValueError: ``warmup < 0``, ``repeats < 1``, or a device that cannot be measured.
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
    _check_count("warmup", warmup, minimum=0)
    _check_count("repeats", repeats, minimum=1)
    resolved = _resolve_device(device)

    for _ in range(warmup):
        step_fn()

    if resolved.type == "cuda":
        times, peak, baseline = _timed_runs_cuda(step_fn, resolved, repeats, measure_memory)
    else:
        peak, baseline = _tracked_peak_cpu(step_fn, resolved) if measure_memory else (0, 0)
        times = [_timed_run(step_fn, resolved) for _ in range(repeats)]

    return StepMeasurement(
        device=str(resolved),
        method=_method_for(resolved) if measure_memory else METHOD_NONE,
        peak_bytes=peak,
        baseline_bytes=baseline,
        step_seconds=statistics.median(times),
        step_seconds_all=tuple(times),
    )


def _method_for(device: torch.device) -> str:
    return METHOD_CUDA if device.type == "cuda" else METHOD_TRACKER


def _tracked_peak_cpu(step_fn: Callable[[], object], device: torch.device) -> tuple[int, int]:
    """(peak, baseline) of one run under the tensor tracker; the baseline is unknown there: 0."""
    with memory_tracker(device) as tracker:
        step_fn()
    return tracker.peak_bytes(), 0


def _timed_runs_cuda(
    step_fn: Callable[[], object], device: torch.device, repeats: int, measure_memory: bool
) -> tuple[list[float], int, int]:
    """Times of ``repeats`` runs, and the (peak, baseline) of the run with the largest peak."""
    times: list[float] = []
    peak, baseline = 0, 0
    for _ in range(repeats):
        # The tracker's entry (synchronize, read, reset) happens before the timed span starts.
        tracker: AbstractContextManager[Any] = memory_tracker(device) if measure_memory else nullcontext()
        with tracker:
            times.append(_timed_run(step_fn, device))
        if isinstance(tracker, CudaAllocatorTracker) and tracker.peak_bytes() >= peak:
            peak, baseline = tracker.peak_bytes(), tracker.entry_bytes
    return times, peak, baseline


# --------------------------------------------------------------------------------------------
# Formatting


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int) -> str:
    """Bytes for people, binary units, three significant digits: ``512 B``, ``1.5 KiB``, ``12.3 MiB``, ``1.23 GiB``.

    Whole bytes below 1 KiB; trailing zeros are dropped (``2 KiB``, not ``2.00 KiB``); negative
    values keep their sign.
    """
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1024:
        return f"{int(n)} B"
    value, unit = float(n), 0
    while unit < len(_UNITS) - 1 and value >= 1024:
        value /= 1024
        unit += 1
    text = _three_digits(value)
    if float(text) >= 1024 and unit < len(_UNITS) - 1:  # 1023.9 KiB rounds to 1024: say 1 MiB
        value, unit = value / 1024, unit + 1
        text = _three_digits(value)
    return f"{text} {_UNITS[unit]}"


def _three_digits(value: float) -> str:
    decimals = 2 if value < 10 else 1 if value < 100 else 0
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


# --------------------------------------------------------------------------------------------
# Process memory (Linux /proc)


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` in bytes.

    Raises:
        OSError: not Linux (no ``/proc/self/status``), or the kernel does not report ``field``.
    """
    try:
        text = _PROC_STATUS.read_text()
    except OSError as exc:
        raise OSError(f"reading {field} needs Linux's {_PROC_STATUS}, which is not available here: {exc}") from exc
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == field:
            value, _, unit = rest.strip().partition(" ")
            if unit.strip() != "kB":
                break
            return int(value) * 1024
    raise OSError(f"{_PROC_STATUS} has no '{field}: <n> kB' line on this system")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM``), in bytes. Linux only.

    Raises:
        OSError: ``/proc/self/status`` is not available or does not report ``VmHWM``.
    """
    return _status_bytes("VmHWM")


def current_rss_bytes() -> int:
    """This process's resident set size now (``VmRSS``), in bytes. Linux only.

    Raises:
        OSError: ``/proc/self/status`` is not available or does not report ``VmRSS``.
    """
    return _status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0).

    Returns:
        True if the kernel accepted the write, False if it is not permitted or not available (the
        peak then still includes everything since the process started).
    """
    try:
        with _PROC_CLEAR_REFS.open("w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True
