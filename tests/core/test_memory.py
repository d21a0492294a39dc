"""Tests of training/memory.py: the CPU tensor tracker against known allocations, theory and RSS,
the CUDA arithmetic against a fake allocator, and measure_step's contract."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lowvram_lora.training import memory

MiB = 1 << 20
FLOAT = 4  # bytes per float32
MEMORY_PY = Path(memory.__file__).resolve()
_HAS_PROC = Path("/proc/self/status").exists()  # Linux: VmRSS and VmHWM


def _cpu_tracker() -> memory.MemoryTracker:
    return memory.memory_tracker("cpu")


# --------------------------------------------------------------------------------------------
# The tracker against allocations we know


def test_tracker_sees_a_known_allocation_exactly():
    with _cpu_tracker() as tracker:
        assert tracker.current_bytes() == 0
        block = torch.empty(MiB)  # 1 Mi float32 = 4 MiB, a fresh storage
        assert tracker.current_bytes() == 4 * MiB
        del block
        assert tracker.current_bytes() == 0
        assert tracker.peak_bytes() == 4 * MiB
        tracker.reset_peak()
        assert tracker.peak_bytes() == 0
        small = torch.empty(256)
        assert tracker.peak_bytes() == 256 * FLOAT
        del small
    assert tracker.method == memory.METHOD_TRACKER


def test_view_counted_once_and_preentry_tensor_freed_inside_does_not_go_negative():
    before = torch.randn(1000)
    with _cpu_tracker() as tracker:
        base = torch.empty(1000)
        view = base[10:].view(-1, 10)
        view.add_(1.0)  # in place on a view: allocates nothing
        assert tracker.current_bytes() == 1000 * FLOAT
        del base
        assert tracker.current_bytes() == 1000 * FLOAT  # the view keeps the storage alive
        del view
        assert tracker.current_bytes() == 0

        alias = before[:10]  # a view of a pre-entry storage: not ours
        before.mul_(2.0)
        assert tracker.current_bytes() == 0
        del before, alias
        assert tracker.current_bytes() == 0


def test_resize_lift_fresh_meta_and_sparse():
    with _cpu_tracker() as tracker:
        grown = torch.empty(0)
        grown.resize_(1000)  # the same storage grows: re-read on sight
        assert tracker.current_bytes() == 1000 * FLOAT
        del grown

        literal = torch.tensor([1.0, 2.0, 3.0])  # built outside the dispatcher, then lift_fresh
        assert tracker.current_bytes() == 3 * FLOAT
        del literal

        on_meta = torch.empty(MiB, device="meta")  # no memory behind it
        assert tracker.current_bytes() == 0
        sparse = torch.eye(64).to_sparse() * 2.0  # no plain storage: ignored, without an error
        assert tracker.current_bytes() == 0  # the dense eye was a temporary
        assert tracker.peak_bytes() == 64 * 64 * FLOAT
        dense = sparse.to_dense()
        assert tracker.current_bytes() == 64 * 64 * FLOAT
    del on_meta, sparse, dense


def test_storage_freed_on_another_thread_is_subtracted():
    box: list[torch.Tensor] = []
    with _cpu_tracker() as tracker:
        box.append(torch.empty(1024))
        assert tracker.current_bytes() == 1024 * FLOAT
        worker = threading.Thread(target=box.clear)  # the last reference dies on that thread
        worker.start()
        worker.join()
        assert tracker.current_bytes() == 0


def test_backward_runs_through_the_tracker():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    inputs = torch.randn(16, 32)
    with _cpu_tracker() as tracker:
        model(inputs).square().mean().backward()
        # The graph and the activations are gone; what remains is exactly the new .grad tensors,
        # which only the backward pass allocates.
        assert tracker.current_bytes() == sum(p.grad.nbytes for p in model.parameters())


# --------------------------------------------------------------------------------------------
# The tracker against theory


def _linear_chain(depth: int, width: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def test_mlp_training_step_peak_matches_saved_activations():
    depth, batch, width = 8, 512, 128
    model = _linear_chain(depth, width)
    inputs = torch.randn(batch, width)
    # Each Linear saves its input for the weight gradient: the outputs of layers 1..depth-1, plus
    # the last output, which the loss saves. About depth activations of batch x width.
    saved_activations = depth * batch * width * FLOAT
    with _cpu_tracker() as tracker:
        model(inputs).square().mean().backward()
    assert 0.8 * saved_activations <= tracker.peak_bytes() <= 3 * saved_activations


def test_inference_forward_frees_as_it_goes():
    depth, batch, width = 8, 512, 128
    model = _linear_chain(depth, width)
    inputs = torch.randn(batch, width)
    with torch.no_grad(), _cpu_tracker() as tracker:
        model(inputs)
    # Nothing is saved: at most a layer's input and its output are alive at once.
    activation = batch * width * FLOAT
    assert activation <= tracker.peak_bytes() <= 2 * activation


class _MLPBlock(torch.nn.Module):
    """A transformer-style MLP block: saves its input, the 4x hidden and its GELU (9 x input)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def test_checkpointing_lowers_the_measured_peak():
    depth, batch, width = 8, 512, 128
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([_MLPBlock(width) for _ in range(depth)])
    inputs = torch.randn(batch, width)

    def peak(use_checkpoint: bool) -> int:
        blocks.zero_grad(set_to_none=True)  # both runs allocate their .grad tensors
        with _cpu_tracker() as tracker:
            hidden = inputs
            for block in blocks:
                hidden = checkpoint(block, hidden, use_reentrant=False) if use_checkpoint else block(hidden)
            hidden.square().mean().backward()
        return tracker.peak_bytes()

    plain, checkpointed = peak(False), peak(True)
    # Theory (in batch x width activations): plain ~ 9 per block = 72; checkpointed ~ 1 per block
    # plus one block recomputed = 17; both + 16 of parameter gradients.
    assert checkpointed < 0.6 * plain, (memory.format_bytes(checkpointed), memory.format_bytes(plain))


# --------------------------------------------------------------------------------------------
# measure_step


def test_measure_step_cpu_median_and_calls():
    durations = iter([0.0, 0.0, 0.004, 0.012, 0.008])  # warm-up, tracked run, then three timed
    calls: list[int] = []

    def step() -> torch.Tensor:
        calls.append(1)
        time.sleep(next(durations))
        return torch.empty(1024)

    result = memory.measure_step(step, device="cpu", warmup=1, repeats=3)
    assert len(calls) == 5
    assert len(result.step_seconds_all) == 3
    assert result.step_seconds == statistics.median(result.step_seconds_all)
    # The timed runs are the last three calls, in order: 4 ms, 12 ms, 8 ms -> median ~ 8 ms.
    assert all(t >= d for t, d in zip(result.step_seconds_all, (0.004, 0.012, 0.008)))
    assert result.step_seconds_all[1] == max(result.step_seconds_all)
    assert result.method == memory.METHOD_TRACKER and result.device == "cpu"
    assert result.peak_bytes == 1024 * FLOAT and result.baseline_bytes == 0


def test_measure_step_time_only():
    calls: list[int] = []
    result = memory.measure_step(lambda: calls.append(1), device="cpu", warmup=2, repeats=4, measure_memory=False)
    assert len(calls) == 6  # no tracked run
    assert result.method == memory.METHOD_NONE and not result.memory_measured
    assert result.peak_bytes == 0 and len(result.step_seconds_all) == 4
    assert "memory not measured" in result.summary()


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"repeats": 0}, ValueError, "repeats"),
        ({"warmup": -1}, ValueError, "warmup"),
        ({"repeats": 2.5}, TypeError, "repeats"),
        ({"warmup": True}, TypeError, "warmup"),
        ({"device": "mps"}, ValueError, "device"),
        ({"device": "not-a-device"}, ValueError, "device"),
    ],
)
def test_measure_step_argument_errors(kwargs, error, name):
    arguments = {"device": "cpu", **kwargs}
    with pytest.raises(error, match=name):
        memory.measure_step(lambda: None, **arguments)


def test_measure_step_rejects_a_non_callable():
    with pytest.raises(TypeError, match="step_fn"):
        memory.measure_step(42, device="cpu")  # type: ignore[arg-type]


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        memory.memory_tracker("cuda")


def test_tracker_misuse_is_reported():
    tracker = _cpu_tracker()
    with pytest.raises(RuntimeError, match="entered"):
        tracker.peak_bytes()
    with tracker:
        kept = torch.empty(10)
    assert tracker.current_bytes() == 10 * FLOAT  # frozen on exit
    with pytest.raises(RuntimeError, match="once"):
        tracker.__enter__()
    with pytest.raises(RuntimeError, match="inside"):
        tracker.reset_peak()
    del kept


# --------------------------------------------------------------------------------------------
# The CUDA path's arithmetic, against a fake allocator (no GPU needed)


class _FakeAllocator:
    def __init__(self, allocated: int) -> None:
        self.allocated = allocated
        self.peak = allocated
        self.syncs = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def reset(device=None):
            self.peak = self.allocated

        def sync(device=None):
            self.syncs += 1

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
        monkeypatch.setattr(torch.cuda, "synchronize", sync)


def test_cuda_tracker_arithmetic(monkeypatch):
    fake = _FakeAllocator(allocated=1000)
    fake.install(monkeypatch)
    with memory.memory_tracker("cuda") as tracker:
        assert tracker.device == torch.device("cuda", 0) and tracker.method == memory.METHOD_CUDA
        fake.alloc(500)
        assert (tracker.current_bytes(), tracker.peak_bytes()) == (500, 500)
        fake.alloc(-300)
        tracker.reset_peak()
        assert (tracker.current_bytes(), tracker.peak_bytes()) == (200, 200)
        fake.alloc(-1200)  # frees memory from before entry
        assert tracker.current_bytes() == 0


def test_measure_step_cuda_uses_the_allocator_per_run(monkeypatch):
    fake = _FakeAllocator(allocated=1000)
    fake.install(monkeypatch)
    sizes = iter([999, 100, 300, 200])  # warm-up, then three timed runs

    def step() -> None:
        size = next(sizes)
        fake.alloc(size)
        fake.alloc(-size + 10)  # each step leaks 10 bytes: the baseline moves

    result = memory.measure_step(step, device="cuda", warmup=1, repeats=3)
    assert result.method == memory.METHOD_CUDA and result.device == "cuda:0"
    assert len(result.step_seconds_all) == 3
    assert result.peak_bytes == 300  # above the baseline of the run that peaked ...
    assert result.baseline_bytes == 1020  # ... which began after two leaky runs
    assert fake.syncs >= 6  # before and after every timed run
    assert "(1020 B)" in result.summary()


# --------------------------------------------------------------------------------------------
# Presentation


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (int(12.3 * MiB), "12.3 MiB"),
        (int(12.34 * MiB), "12.3 MiB"),  # three significant digits
        (int(123.4 * MiB), "123 MiB"),
        (int(1.23 * 1024 * MiB), "1.23 GiB"),
        (1024 * MiB - 1, "1 GiB"),  # rounds up into the next unit
        (300 * MiB, "300 MiB"),
        (-1536, "-1.5 KiB"),
    ],
)
def test_format_bytes(n, text):
    assert memory.format_bytes(n) == text


def test_summary_and_as_dict():
    result = memory.StepMeasurement(
        device="cpu",
        method=memory.METHOD_TRACKER,
        peak_bytes=int(1.23 * 1024 * MiB),
        baseline_bytes=0,
        step_seconds=0.412,
        step_seconds_all=(0.41, 0.412, 0.5, 0.4, 0.45),
    )
    assert result.summary() == "peak 1.23 GiB above baseline, 0.412 s/step (median of 5, cpu-tensor-tracker)"
    data = json.loads(json.dumps(result.as_dict()))
    assert data["step_seconds_all"] == [0.41, 0.412, 0.5, 0.4, 0.45]
    assert data["peak_bytes"] == result.peak_bytes and data["method"] == "cpu-tensor-tracker"


# --------------------------------------------------------------------------------------------
# The tracker against the kernel's resident set size, in a fresh process

_RSS_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys
    import torch
    spec = importlib.util.spec_from_file_location("lowvram_memory", sys.argv[1])
    memory = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = memory
    spec.loader.exec_module(memory)

    torch.manual_seed(0)
    # 163840 x 64 float32 = 40 MiB per activation: above glibc's largest mmap threshold (32 MiB),
    # so every activation is its own mapping, returned to the kernel when freed, and RSS follows.
    width, batch, depth = 64, 163840, 3
    layers = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])

    def step(x):
        layers.zero_grad(set_to_none=True)
        layers(x).square().mean().backward()

    # Warm up under a tracker: loads kernels and the ~150 MiB of modules that the first
    # dispatch-mode call imports, so they are in the baseline, not in the step.
    with memory.memory_tracker("cpu"):
        step(torch.randn(64, width))
    x = torch.randn(batch, width)
    reset = memory.reset_peak_rss()
    baseline = memory.current_rss_bytes() if reset else memory.peak_rss_bytes()
    with memory.memory_tracker("cpu") as tracker:
        step(x)
    print(json.dumps({"reset": reset, "rss_increase": memory.peak_rss_bytes() - baseline,
                      "tracker_peak": tracker.peak_bytes()}))
    """
)


_RSS_TEST = "test_tracker_peak_agrees_with_rss_in_a_fresh_process"


@pytest.fixture(scope="module", autouse=True)
def rss_probe(request: pytest.FixtureRequest):
    """The fresh-process probe, started when this module starts, when the RSS test is selected.

    Its ~4 s (a torch import, the dynamo import of the first dispatch mode, a 280 MiB step) then
    overlap the in-process tests instead of adding to them. The RSS figures are per process, so
    the overlap does not disturb them.
    """
    if not _HAS_PROC or not any(item.name == _RSS_TEST for item in request.session.items):
        yield None
        return
    probe = subprocess.Popen(
        [sys.executable, "-c", _RSS_SCRIPT, str(MEMORY_PY)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield probe
    if probe.poll() is None:  # the test did not collect it (deselected, or failed first)
        probe.kill()
        probe.communicate()


@pytest.mark.skipif(not _HAS_PROC, reason="needs Linux /proc/self/status for VmRSS and VmHWM")
def test_tracker_peak_agrees_with_rss_in_a_fresh_process(rss_probe):
    stdout, stderr = rss_probe.communicate(timeout=120)
    assert rss_probe.returncode == 0, stderr
    figures = json.loads(stdout.strip().splitlines()[-1])
    tracker_peak, rss_increase = figures["tracker_peak"], figures["rss_increase"]
    assert tracker_peak > 200 * MiB  # the step really allocates what the comparison is about
    tolerance = max(0.3 * tracker_peak, 40 * MiB)
    assert abs(rss_increase - tracker_peak) <= tolerance, figures


def test_rss_readings():
    if not _HAS_PROC:
        with pytest.raises(OSError, match="/proc"):
            memory.peak_rss_bytes()
        return
    current = memory.current_rss_bytes()
    assert 0 < current <= memory.peak_rss_bytes()
    assert isinstance(memory.reset_peak_rss(), bool)


def test_paused_block_is_not_counted_but_its_frees_are():
    with memory.memory_tracker("cpu") as tracker:
        kept = torch.zeros(256, 1024)  # 1 MiB, counted
        with tracker.paused():
            unobserved = torch.zeros(512, 1024)  # 2 MiB, not counted
            del kept  # a counted storage freed while paused still leaves the count
        assert tracker.current_bytes() == 0
        assert tracker.peak_bytes() == 1024 * 1024
        del unobserved
        assert tracker.current_bytes() == 0
