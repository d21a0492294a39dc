"""TrainLoRAStep: trains a LoRA on the MODEL with the host's LATENT and CONDITIONING."""

from __future__ import annotations

import logging
import re

import torch

from comfy_api.latest import io

from ..training.budget import BudgetTooSmallError
from ..training.lora import LoRAConfig
from ..training.memory import format_bytes
from ..training.loop import TrainConfig
from ..training.objectives import LOSSES, TIMESTEP_SAMPLINGS, ObjectiveConfig
from ..training.optim import OPTIMIZERS, SCHEDULES, OptimizerConfig
from .files import save_recovery
from .host_training import TrainRequest, apply_to_model, flatten_dataset, interrupted, raise_if_interrupted, train_lora
from .checkpointing import GIB
from .model_patch import checkpointer_of
from .progress import ProgressReporter
from .types import LoRAType, ReportType, TrainingStateType

log = logging.getLogger(__name__)

PRECISIONS = ("bf16", "fp16", "fp32")
RECORDED_SETTINGS = (
    "learning_rate", "optimizer", "batch_size", "grad_accumulation", "precision", "seed", "loss", "lr_schedule",
)


def budget_message(error: BudgetTooSmallError, checkpointer) -> str:
    """The core's error in the terms of the node where the user set the budget."""
    offload = checkpointer is not None and checkpointer.config.offload
    minimum_gb = error.minimum_bytes / GIB
    hint = "" if offload or not torch.cuda.is_available() else " or turn on offload_to_cpu,"
    return (
        f"budget_gb {error.budget_bytes / GIB:.3g} (Enable Gradient Checkpointing, mode 'memory budget') is below "
        f"what this model needs at this batch shape even with every block checkpointed: "
        f"{format_bytes(error.minimum_bytes)} measured. Set budget_gb to at least {minimum_gb:.3g},{hint} "
        "or lower the batch size or resolution."
    )


def parse_targets(text: str) -> tuple[str, ...] | None:
    """Regexes from a comma- or newline-separated field (a comma inside ``{m,n}`` belongs to the
    regex); empty means the default targets."""
    patterns = tuple(part.strip() for part in re.split(r"\n|,(?![^{}]*\})", text or "") if part.strip())
    return patterns or None


class TrainLoRAStep(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMLoRA_TrainLoRAStep",
            display_name="Train LoRA (Low VRAM)",
            category="training/lowvram lora",
            description="Trains a LoRA on the MODEL's diffusion model. Chain several (training_state out -> in) "
            "or resume a saved run. Put Enable Gradient Checkpointing before it to trade time for memory.",
            is_input_list=True,
            inputs=[
                io.Model.Input("model", tooltip="The model to train on; its weights stay frozen and unchanged."),
                io.Latent.Input("latents", tooltip="The training images as latents (a list, e.g. from Make Training Dataset; resolution buckets are fine)."),
                io.Conditioning.Input("conditioning", tooltip="One conditioning per image in the same order, or a single one for all."),
                io.Int.Input("steps", default=200, min=1, max=1_000_000, tooltip="Optimizer steps to run in this node. Time grows linearly."),
                io.Float.Input("learning_rate", default=1e-4, min=1e-8, max=10.0, step=1e-7, tooltip="Step size. 1e-4 is usual for LoRA with AdamW; prodigy expects 1.0."),
                io.Int.Input("rank", default=16, min=1, max=256, tooltip="LoRA rank: capacity and file size grow with it. The adapters and their optimizer state are small next to the model (a few MB to ~100 MB), so memory grows only a little."),
                io.Float.Input("alpha", default=16.0, min=0.0, max=1024.0, step=0.5, tooltip="LoRA alpha; the update is scaled by alpha/rank. 0 means alpha = rank."),
                io.Combo.Input("optimizer", options=list(OPTIMIZERS), default="adamw", tooltip="adamw: the standard. adamw8bit (needs bitsandbytes) and adafactor keep smaller optimizer state; prodigy (needs prodigyopt) sets its own step size; sgd: smallest state."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=False, tooltip="Adapter initialisation, batch order, noise and timesteps all come from this seed: the same seed gives the same LoRA. It stays fixed between runs (no randomize), so re-queuing an unchanged graph reuses the trained result."),
                io.Int.Input("batch_size", default=1, min=1, max=256, tooltip="Images per forward pass (of one resolution). Activation memory grows linearly with it."),
                io.Int.Input("grad_accumulation", default=1, min=1, max=1024, tooltip="Forward passes summed per optimizer step: a larger effective batch at no extra memory, proportionally slower steps."),
                io.Combo.Input("precision", options=list(PRECISIONS), default="bf16", tooltip="Compute precision (autocast); the LoRA weights stay fp32. bf16: half the activation memory of fp32 on GPUs that support it; fp16 adds loss scaling; fp32: exact, slowest, most memory."),
                io.Combo.Input("lr_schedule", options=list(SCHEDULES), default="constant", tooltip="How the learning rate changes over this node's steps, after warm-up."),
                io.Int.Input("warmup_steps", default=0, min=0, max=100_000, tooltip="Steps over which the learning rate ramps up from near zero."),
                io.Combo.Input("loss", options=list(LOSSES), default="mse", tooltip="mse: the standard diffusion loss. l1 and huber are less sensitive to outliers."),
                io.Float.Input("min_snr_gamma", default=0.0, min=0.0, max=100.0, step=0.5, tooltip="Min-SNR weighting for eps/v models (5 is common); 0 turns it off. Not for flow models."),
                io.Combo.Input("timestep_sampling", options=list(TIMESTEP_SAMPLINGS), default="auto", tooltip="auto: uniform for eps/v models, logit-normal for flow models (SD3, Flux), as Kohya does."),
                io.String.Input("targets", default="", multiline=True, tooltip="Which layers get a LoRA: regular expressions searched in module paths (e.g. attn1\\.to_q), one per line or comma separated. Empty: every Linear layer inside the transformer blocks (for UNets the attention, feed-forward and proj_in/out layers; for DiTs also the modulation layers)."),
                io.Boolean.Input("include_conv", default=False, tooltip="Also train convolutions (LoCon): the UNet ResBlocks' convolutions and the transformers' conv proj_in/out (and any conv inside DiT blocks). More capacity, a larger file, a little more memory."),
                io.Float.Input("lora_dropout", default=0.0, min=0.0, max=0.9, step=0.05, tooltip="Dropout on the LoRA input while training."),
                io.Float.Input("max_grad_norm", default=1.0, min=0.0, max=1000.0, step=0.1, tooltip="Gradient clipping norm; 0 turns clipping off."),
                TrainingStateType.Input("training_state", optional=True, tooltip="Continue from this state (from another Train LoRA node or Load Training State): the LoRA, the optimizer and the step count."),
            ],
            outputs=[
                LoRAType.Output(display_name="lora", tooltip="The trained LoRA, for Save LoRA."),
                TrainingStateType.Output(display_name="training_state", tooltip="Everything needed to continue training."),
                ReportType.Output(display_name="report", tooltip="Loss per step, measured peak memory and step time, the checkpointing plan."),
                io.Model.Output(display_name="model", tooltip="The input MODEL with the trained LoRA applied, for sampling right away."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, latents, conditioning, **lists) -> io.NodeOutput:
        values = {name: (value[0] if isinstance(value, list) and value else value) for name, value in lists.items()}
        if len(model) != 1:
            raise ValueError(f"model: connect exactly one MODEL (got {len(model)})")
        model = model[0]
        state = values.get("training_state")
        dataset = flatten_dataset(latents, conditioning)
        alpha = values["alpha"] or None
        lora_config = LoRAConfig(
            rank=values["rank"],
            alpha=alpha,
            dropout=values["lora_dropout"],
            targets=parse_targets(values["targets"]),
            include_conv=values["include_conv"],
        )
        train_config = TrainConfig(
            steps=values["steps"],
            batch_size=values["batch_size"],
            grad_accumulation=values["grad_accumulation"],
            precision=values["precision"],
            max_grad_norm=values["max_grad_norm"] or None,
            seed=values["seed"],
            objective=ObjectiveConfig(
                loss=values["loss"],
                min_snr_gamma=values["min_snr_gamma"] or None,
                timestep_sampling=values["timestep_sampling"],
            ),
            optimizer=OptimizerConfig(
                name=values["optimizer"],
                learning_rate=values["learning_rate"],
                schedule=values["lr_schedule"],
                warmup_steps=values["warmup_steps"],
            ),
        )
        checkpointer = checkpointer_of(model)
        budget = checkpointer.config.budget_bytes if checkpointer is not None else None
        # Recorded in the LoRA's metadata and the training state (resume checks the optimizer).
        extra = {name: values[name] for name in RECORDED_SETTINGS}
        extra.update(images=len(dataset.latents), budget_bytes=budget)
        first_step = state.step if state is not None else 0
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        progress = ProgressReporter(node_id, first_step + train_config.steps, budget)
        progress.start(first_step)

        def on_step(report) -> None:
            progress(report)
            raise_if_interrupted()

        try:
            outcome = train_lora(
                model,
                dataset,
                TrainRequest(lora_config, train_config, state, extra),
                on_step=on_step,
                should_stop=interrupted,
            )
        except BudgetTooSmallError as error:
            raise ValueError(budget_message(error, checkpointer)) from None
        raise_if_interrupted()
        if outcome.error is not None:
            saved = save_recovery(outcome.lora, outcome.state)
            raise RuntimeError(
                f"{outcome.error} The LoRA and training state of the last good step ({outcome.state.step}) "
                f"were saved to {', '.join(str(p) for p in saved)}."
            )
        log.info("%s", outcome.report.summary())
        return io.NodeOutput(outcome.lora, outcome.state, outcome.report, apply_to_model(model, outcome.lora))
