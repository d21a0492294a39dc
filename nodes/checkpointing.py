"""EnableGradientCheckpointing: a MODEL clone that carries a checkpointing plan."""

from __future__ import annotations

from comfy_api.latest import io

from ..training.blocks import UnsupportedArchitectureError
from ..training.checkpointing import CheckpointConfig, Mode
from .model_patch import with_checkpointing

GIB = 1024**3
MODES = {
    "off": Mode.OFF,
    "every block": Mode.FULL,
    "every N-th block": Mode.EVERY_N,
    "memory budget": Mode.BUDGET,
}


def describe_units(checkpointer, config: CheckpointConfig) -> str:
    units = checkpointer.units
    plan = checkpointer.static_plan()
    lines = [f"{units.architecture}: {len(units)} checkpoint blocks ({units.source})"]
    if plan is None:
        lines.append(
            f"memory budget {config.budget_bytes / GIB:.2f} GB: the blocks are chosen on the first training step, "
            "from a measurement of each block on the real batch (see the training report)"
        )
    else:
        lines.append(plan.describe())
        if plan.checkpointed:
            lines.append("checkpointed: " + ", ".join(plan.checkpointed))
    if config.offload and config.mode is not Mode.OFF:
        lines.append("the inputs kept by checkpointed blocks wait in CPU memory (pinned) until backward")
    return "\n".join(lines)


class EnableGradientCheckpointing(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMLoRA_EnableGradientCheckpointing",
            display_name="Enable Gradient Checkpointing",
            category="training/lowvram lora",
            description="Trades training time for memory: checkpointed blocks keep only their input in the "
            "forward pass and are recomputed in backward. Sampling with this MODEL costs nothing extra.",
            inputs=[
                io.Model.Input("model", tooltip="The model to train; the output is a clone, this one is left as it is."),
                io.Combo.Input(
                    "mode",
                    options=list(MODES),
                    default="every block",
                    tooltip="off: fastest, most memory. every block: least memory, about one extra forward pass "
                    "of time (~+30%). every N-th block: in between. memory budget: the pack measures every block "
                    "once and checkpoints the cheapest set that keeps the peak under your budget.",
                ),
                io.Int.Input(
                    "interval",
                    default=2,
                    min=1,
                    max=64,
                    tooltip="For 'every N-th block': checkpoint blocks 0, N, 2N, ... 1 is the same as every block; "
                    "larger saves less memory and less time.",
                ),
                io.Float.Input(
                    "budget_gb",
                    default=6.0,
                    min=0.01,
                    max=1024.0,
                    step=0.05,
                    tooltip="For 'memory budget': the most memory one training step may add above the loaded "
                    "model (weights, LoRA and optimizer stay outside it), in GB of 1024^3 bytes. Too small a "
                    "budget stops with the minimum this model needs.",
                ),
                io.Boolean.Input(
                    "offload_to_cpu",
                    default=False,
                    tooltip="Keep the inputs that checkpointed blocks hold for backward in CPU memory instead of "
                    "VRAM. Lowers the peak further at the cost of PCIe copies (a few % slower on a fast bus). "
                    "Does nothing on a CPU-only machine or with mode off.",
                ),
                io.Boolean.Input(
                    "verify_recompute",
                    default=True,
                    tooltip="On the first step of each batch shape, check that every block's recomputation "
                    "matches its forward (wrong gradients otherwise) and that every planned block really runs. "
                    "Costs a little time once.",
                ),
            ],
            outputs=[
                io.Model.Output(display_name="MODEL", tooltip="A clone that checkpoints while training."),
                io.String.Output(display_name="plan", tooltip="Which blocks will be checkpointed."),
            ],
        )

    @classmethod
    def execute(
        cls, model, mode: str, interval: int, budget_gb: float, offload_to_cpu: bool, verify_recompute: bool
    ) -> io.NodeOutput:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {list(MODES)}")
        config = CheckpointConfig(
            mode=MODES[mode],
            interval=interval,
            budget_bytes=int(budget_gb * GIB) if MODES[mode] is Mode.BUDGET else None,
            offload=offload_to_cpu,
            verify_first_step=verify_recompute,
        )
        try:
            clone, checkpointer = with_checkpointing(model, config)
        except UnsupportedArchitectureError as error:
            raise ValueError(f"model: {error}") from None
        return io.NodeOutput(clone, describe_units(checkpointer, config))
