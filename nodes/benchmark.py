"""BenchmarkCheckpointing: every checkpointing plan for a few steps on the user's own model and data.

Each plan runs as a short real training run (``train_lora`` on a MODEL clone that carries the
plan, exactly what Train LoRA does), measured from the outside at its step boundaries by the
benchmark's :class:`~..bench.steps.StepProbe`: on CUDA the allocator's peak is reset at the start
of every timed step, on the CPU each plan gets a fresh tensor tracker for one step and its
timed steps run untracked. Between plans the CUDA cache is emptied. ``train_lora`` detaches
its adapters and restores ``requires_grad`` in ``finally``, and the plan lives only on a clone,
so the MODEL comes back as it went in, also when a plan runs out of memory.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import numpy as np
import torch
from comfy_api.latest import io, ui

from ..bench import plot
from ..bench.configs import budget_levels
from ..bench.steps import StepFigures, StepProbe, StepSchedule
from ..bench.table import ERROR, OK, OOM, Row, format_table, numeric_columns, table_cells
from ..training.checkpointing import CheckpointConfig, Mode
from ..training.lora import LoRAConfig
from ..training.loop import TrainConfig
from ..training.memory import format_bytes
from ..training.optim import OptimizerConfig
from .host_training import TrainRequest, flatten_dataset, raise_if_interrupted, train_lora
from .model_patch import with_checkpointing
from .training import PRECISIONS, parse_targets

log = logging.getLogger(__name__)

REFERENCE = "off"


@dataclass(frozen=True)
class Plan:
    key: str
    label: str
    config: CheckpointConfig


@dataclass
class Measured:
    plan: Plan
    row: Row
    figures: StepFigures | None


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def fixed_plans(interval: int) -> list[Plan]:
    """The plans that need no measurement first: off, every block, every N-th block."""
    return [
        Plan("off", "off", CheckpointConfig(Mode.OFF)),
        Plan("full", "every block", CheckpointConfig(Mode.FULL)),
        Plan("every_n", f"every {_ordinal(interval)} block", CheckpointConfig(Mode.EVERY_N, interval=interval)),
    ]


def budget_plans(full_peak: int | None, off_peak: int | None, count: int) -> list[Plan]:
    """``count`` memory budgets evenly between the measured every-block and off peaks."""
    if count <= 0:
        return []
    fractions = [(i + 1) / (count + 1) for i in range(count)]
    plans = []
    for index, budget in enumerate(budget_levels(full_peak, off_peak, fractions)):
        if budget is not None:
            plans.append(
                Plan(f"budget{index + 1}", f"memory budget {format_bytes(budget)}", CheckpointConfig(Mode.BUDGET, budget_bytes=budget))
            )
    return plans


def _free_cached(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_plan(model, dataset, lora_config: LoRAConfig, train_config: TrainConfig, plan: Plan, schedule: StepSchedule) -> Measured:
    """Train a few steps of ``plan`` on a clone of ``model`` and measure them; never raises for OOM."""
    device = torch.device(model.load_device)
    clone, _ = with_checkpointing(model, plan.config)
    _free_cached(device)
    probe = StepProbe(device, schedule)

    def at_step_start() -> bool:
        probe.boundary()
        raise_if_interrupted()
        return False

    status, detail, note = OK, "", ""
    try:
        outcome = train_lora(clone, dataset, TrainRequest(lora_config, train_config), should_stop=at_step_start)
        if outcome.error is not None:
            status, detail = ERROR, str(outcome.error).split(":")[0]
        plans = outcome.state.settings.get("plan") or []
        if plans:
            first = plans[0]
            note = f"{len(first.get('checkpointed') or ())}/{first.get('units')} blocks"
            if first.get("expected_peak_bytes"):
                note += f", expects {format_bytes(int(first['expected_peak_bytes']))}"
    except torch.OutOfMemoryError:
        status, detail = OOM, "out of memory"
    finally:
        probe.close()
        del clone
        _free_cached(device)
    figures = probe.figures()
    if status == OK and not figures.complete:
        status, detail = ERROR, "stopped early"
    row = Row(
        model="",
        config=plan.key,
        label=plan.label,
        status=status,
        peak_bytes=figures.peak_bytes,
        baseline_bytes=figures.baseline_bytes,
        step_seconds=figures.step_seconds,
        note=note,
        detail=detail,
    )
    return Measured(plan, row, figures)


def render(measured: list[Measured], title: str):
    rows = [m.row for m in measured]
    head, body = table_cells(rows, reference=REFERENCE, reference_label=REFERENCE, show_model=False)
    table = plot.table_image(head, body, numeric=numeric_columns(False), title=title)
    series = [(m.plan.label, list(m.figures.timeline) if m.figures and m.row.measured else []) for m in measured]
    timeline = plot.timeline_panel("memory above the step's start, within one training step", series, width=max(900, table.width))
    image = plot.stack([table, timeline])
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)[None]


class BenchmarkCheckpointing(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMLoRA_BenchmarkCheckpointing",
            display_name="Benchmark Gradient Checkpointing",
            category="training/lowvram lora",
            description="Runs a few real training steps of every checkpointing plan (off, every block, every N-th "
            "block, memory budgets, CPU offload) on your model and data, and measures each plan's peak memory and "
            "step time on this machine, so you can pick a plan before a long run. The model is left unchanged.",
            is_output_node=True,
            inputs=[
                io.Model.Input("model", tooltip="The model you will train. Its weights and settings are not changed."),
                io.Latent.Input(
                    "latent",
                    tooltip="Training latents at the resolution you will train at (memory grows with resolution). "
                    "Only the shape matters for the figures; the first batch_size images are used per step.",
                ),
                io.Conditioning.Input(
                    "conditioning", tooltip="A caption's conditioning for the latents: one for all, or one per image."
                ),
                io.Int.Input(
                    "steps",
                    default=3,
                    min=1,
                    max=50,
                    tooltip="Timed steps per plan; the median is shown. Each plan also runs warm-up steps and one "
                    "measured step, so the node takes about (steps + warmup + 2) x plans training steps.",
                ),
                io.Int.Input(
                    "warmup_steps",
                    default=1,
                    min=0,
                    max=20,
                    tooltip="Untimed steps before measuring each plan (first-call costs, optimizer state, the budget "
                    "plan's one-time probe).",
                ),
                io.Int.Input("rank", default=16, min=1, max=256, tooltip="LoRA rank, as in Train LoRA. Barely changes memory."),
                io.Combo.Input(
                    "precision",
                    options=list(PRECISIONS),
                    default="bf16",
                    tooltip="Compute precision, as in Train LoRA: bf16 and fp16 use about half the activation memory of fp32.",
                ),
                io.Int.Input(
                    "batch_size",
                    default=1,
                    min=1,
                    max=256,
                    tooltip="Images per step, as in Train LoRA. Activation memory grows linearly with it.",
                ),
                io.Int.Input(
                    "interval",
                    default=2,
                    min=2,
                    max=64,
                    tooltip="N of the 'every N-th block' plan that is measured (every block is always measured).",
                ),
                io.Int.Input(
                    "budget_levels",
                    default=2,
                    min=0,
                    max=4,
                    tooltip="How many memory-budget plans to measure, evenly spaced between the 'every block' and "
                    "'off' peaks measured here. Each runs one extra probe step. 0 skips them.",
                ),
                io.Boolean.Input(
                    "offload",
                    default=True,
                    tooltip="Also measure every block with its kept tensors offloaded to CPU memory (no effect on a "
                    "CPU-only machine).",
                ),
                io.String.Input(
                    "targets",
                    default="",
                    tooltip="Which layers get a LoRA, as in Train LoRA (regular expressions); empty: the default layers.",
                ),
                io.Boolean.Input(
                    "include_conv", default=False, tooltip="Also adapt UNet ResBlock convolutions (LoCon), as in Train LoRA."
                ),
            ],
            outputs=[
                io.String.Output(display_name="table", tooltip="Peak memory and median step time of every plan, with ratios to 'off'."),
                io.Image.Output(display_name="image", tooltip="The table and each plan's memory over one step, as an image."),
            ],
        )

    @classmethod
    def execute(
        cls,
        model,
        latent,
        conditioning,
        steps: int,
        warmup_steps: int,
        rank: int,
        precision: str,
        batch_size: int,
        interval: int,
        budget_levels: int,
        offload: bool,
        targets: str,
        include_conv: bool,
    ) -> io.NodeOutput:
        dataset = flatten_dataset([latent], [conditioning])
        if batch_size > len(dataset.latents):
            raise ValueError(
                f"batch_size={batch_size} but the latent holds {len(dataset.latents)} image(s): lower batch_size or "
                "pass a larger latent batch"
            )
        lora_config = LoRAConfig(rank=rank, targets=parse_targets(targets), include_conv=include_conv).validate()
        schedule = StepSchedule(warmup=warmup_steps, timed=steps)
        device = torch.device(model.load_device)
        train_config = TrainConfig(
            steps=schedule.total_steps(device),
            batch_size=batch_size,
            precision=precision,
            seed=0,
            # The trainer's own CPU tracker only on its first (warm-up) step, never in a timed one.
            measure_memory_every=10**9,
            optimizer=OptimizerConfig(name="adamw"),
        )
        measured: list[Measured] = []
        for plan in fixed_plans(interval):
            measured.append(measure_plan(model, dataset, lora_config, train_config, plan, schedule))
        peaks = {m.plan.key: m.row.peak_bytes if m.row.measured else None for m in measured}
        later = budget_plans(peaks.get("full"), peaks.get("off"), budget_levels)
        if offload:
            later.append(Plan("full_offload", "every block + offload", CheckpointConfig(Mode.FULL, offload=True)))
        for plan in later:
            measured.append(measure_plan(model, dataset, lora_config, train_config, plan, schedule))

        method = measured[0].figures.method if measured and measured[0].figures else "?"
        shape = "x".join(str(d) for d in dataset.latents[0].shape)
        title = (
            f"{type(model.model.diffusion_model).__name__} on {device}, latent {shape}, batch {batch_size}, rank {rank}, "
            f"{precision}; peak above the step's start ({method}), median of {steps} step(s)"
        )
        table = format_table([m.row for m in measured], reference=REFERENCE, reference_label=REFERENCE, show_model=False)
        text = title + "\n\n" + table
        if budget_levels and not any(m.plan.key.startswith("budget") for m in measured):
            text += "\n\nno budget plan was measured: the 'off' and 'every block' peaks were not both measured"
        log.info("%s", text)
        image = render(measured, title)
        return io.NodeOutput(text, image, ui=ui.PreviewImage(image, cls=cls))
