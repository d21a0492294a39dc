"""LoadModelForTraining: a checkpoint or diffusion-model file through the host's own loaders."""

from __future__ import annotations

import torch
from comfy_api.latest import io

import comfy.sd
import folder_paths

CHECKPOINT_PREFIX = "checkpoints/"
DIFFUSION_PREFIX = "diffusion_models/"

WEIGHT_DTYPES = {
    "default": None,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3fn": torch.float8_e4m3fn,
}
DEVICES = ("auto", "cpu")


def model_files() -> list[str]:
    """Every checkpoint and diffusion-model file the host knows, with its folder as a prefix."""
    return [CHECKPOINT_PREFIX + name for name in folder_paths.get_filename_list("checkpoints")] + [
        DIFFUSION_PREFIX + name for name in folder_paths.get_filename_list("diffusion_models")
    ]


class LoadModelForTraining(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMLoRA_LoadModelForTraining",
            display_name="Load Model for Training",
            category="training/lowvram lora",
            description="Loads a model with ComfyUI's own loaders (every architecture ComfyUI loads) for LoRA training.",
            inputs=[
                io.Combo.Input(
                    "model_file",
                    options=model_files(),
                    tooltip="A full checkpoint (models/checkpoints: MODEL, CLIP and VAE) or a diffusion model "
                    "alone (models/diffusion_models, e.g. Flux: MODEL only; load CLIP and VAE with their loaders).",
                ),
                io.Combo.Input(
                    "weight_dtype",
                    options=list(WEIGHT_DTYPES),
                    default="default",
                    tooltip="Precision of the frozen base weights. default: what ComfyUI picks for your device. "
                    "fp32 doubles the weights' memory against fp16/bf16 and is the slowest; fp8_e4m3fn halves it "
                    "again. The LoRA itself always trains in fp32.",
                ),
                io.Combo.Input(
                    "device",
                    options=list(DEVICES),
                    default="auto",
                    tooltip="auto: the device ComfyUI uses (your GPU). cpu: train on the processor (very slow, "
                    "for trying a workflow without a GPU).",
                ),
            ],
            outputs=[
                io.Model.Output(display_name="MODEL", tooltip="The diffusion model, for Enable Gradient Checkpointing or Train LoRA."),
                io.Clip.Output(display_name="CLIP", tooltip="None for a diffusion-model-only file."),
                io.Vae.Output(display_name="VAE", tooltip="None for a diffusion-model-only file."),
            ],
        )

    @classmethod
    def execute(cls, model_file: str, weight_dtype: str, device: str) -> io.NodeOutput:
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype {weight_dtype!r} is not one of {list(WEIGHT_DTYPES)}")
        if device not in DEVICES:
            raise ValueError(f"device {device!r} is not one of {list(DEVICES)}")
        options = {} if WEIGHT_DTYPES[weight_dtype] is None else {"dtype": WEIGHT_DTYPES[weight_dtype]}
        clip = vae = None
        if model_file.startswith(CHECKPOINT_PREFIX):
            path = folder_paths.get_full_path_or_raise("checkpoints", model_file[len(CHECKPOINT_PREFIX) :])
            model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(
                path,
                output_vae=True,
                output_clip=True,
                embedding_directory=folder_paths.get_folder_paths("embeddings"),
                model_options=options,
            )
        elif model_file.startswith(DIFFUSION_PREFIX):
            path = folder_paths.get_full_path_or_raise("diffusion_models", model_file[len(DIFFUSION_PREFIX) :])
            model = comfy.sd.load_diffusion_model(path, model_options=options)
        else:
            raise ValueError(
                f"model_file {model_file!r} must start with {CHECKPOINT_PREFIX!r} or {DIFFUSION_PREFIX!r}; "
                "pick a file from the list"
            )
        if model is None:
            raise ValueError(f"model_file {model_file!r} holds no diffusion model ComfyUI recognises")
        if device == "cpu":
            model.load_device = torch.device("cpu")
        return io.NodeOutput(model, clip, vae)
