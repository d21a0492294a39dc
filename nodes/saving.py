"""SaveLoRA and LoadTrainingState: the LoRA into models/loras, states in and out of
models/training_states."""

from __future__ import annotations

import folder_paths
from comfy_api.latest import io, ui

from ..training.state import load_state
from .files import STATES_FOLDER, loras_folder, register_folders, save_lora, states_folder
from .files import save_training_state as write_training_state
from .types import LoRAType, TrainingStateType


class SaveLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMLoRA_SaveLoRA",
            display_name="Save LoRA (Low VRAM)",
            category="training/lowvram lora",
            description="Writes the LoRA to models/loras (Kohya format: loads in LoraLoader, A1111/Forge and "
            "diffusers) under a new name; never overwrites a file.",
            is_output_node=True,
            inputs=[
                LoRAType.Input("lora", tooltip="The LoRA from a Train LoRA node."),
                io.String.Input(
                    "filename_prefix",
                    default="lowvram_lora/my_lora",
                    tooltip="Name inside models/loras (sub-folders allowed). A counter is added "
                    "(my_lora_00001_.safetensors), so nothing is overwritten. '..' and absolute paths are refused.",
                ),
                io.Boolean.Input(
                    "save_training_state",
                    default=False,
                    tooltip="Also write the training state (LoRA, optimizer, step) to models/training_states, "
                    "to resume later with Load Training State.",
                ),
                TrainingStateType.Input("training_state", optional=True, tooltip="The state to save with the LoRA."),
            ],
            outputs=[
                # Any-typed so it can feed LoraLoader's lora_name in the same graph: the file does not
                # exist when the prompt is validated, only once this node has run.
                io.AnyType.Output(
                    display_name="lora_name",
                    tooltip="The saved file's name inside models/loras: connect it to LoraLoader's lora_name "
                    "to sample with the new LoRA in the same run.",
                ),
            ],
        )

    @classmethod
    def execute(cls, lora, filename_prefix: str, save_training_state: bool, training_state=None) -> io.NodeOutput:
        if save_training_state and training_state is None:
            raise ValueError(
                "save_training_state is on but no training_state is connected: connect the Train LoRA node's "
                "training_state output, or turn save_training_state off"
            )
        path = save_lora(lora, filename_prefix)
        lora_name = path.relative_to(loras_folder()).as_posix()
        lines = [f"LoRA: {path}", lora.describe()]
        if save_training_state:
            state_path = write_training_state(training_state, filename_prefix)
            lines.append(f"training state: {state_path}")
        return io.NodeOutput(lora_name, ui=ui.PreviewText("\n".join(lines)))


class LoadTrainingState(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        register_folders()
        return io.Schema(
            node_id="LowVRAMLoRA_LoadTrainingState",
            display_name="Load Training State",
            category="training/lowvram lora",
            description="Reads a training state saved by Save LoRA, to continue that run in Train LoRA.",
            inputs=[
                io.Combo.Input(
                    "state_file",
                    options=folder_paths.get_filename_list(STATES_FOLDER),
                    tooltip="A file in models/training_states (safetensors only: loading it runs no code).",
                ),
            ],
            outputs=[TrainingStateType.Output(display_name="training_state", tooltip="For the training_state input of Train LoRA.")],
        )

    @classmethod
    def execute(cls, state_file: str) -> io.NodeOutput:
        register_folders()
        path = folder_paths.get_full_path(STATES_FOLDER, state_file)
        if path is None:
            raise ValueError(f"state_file {state_file!r} is not in {states_folder()}; pick one from the list")
        return io.NodeOutput(load_state(path))
