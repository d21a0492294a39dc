"""Training a LoRA on the host's MODEL, LATENT and CONDITIONING: the glue between them and
``training/``.

:func:`train_lora` loads the MODEL as the sampler would, attaches adapters to its diffusion
model, runs :class:`~..training.loop.LoRATrainer` with a denoiser that calls the host's own
``apply_model``, and in ``finally`` detaches the adapters and restores ``requires_grad``: a
cancelled or failed run leaves the MODEL as it found it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

import comfy.model_management
import comfy.utils

from ..training.checkpointing import Checkpointer
from ..training.data import MicroBatch, TrainingData
from ..training.lora import (
    LoRAConfig,
    attach_lora,
    diffusers_unet_key_map,
    default_kohya_key,
    key_function_from_map,
    kohya_state_dict,
    lora_metadata,
)
from ..training.loop import LoRATrainer, NonFiniteLossError, ResumePoint, StepReport, TrainConfig, TrainingResult
from ..training.objectives import NoiseSchedule
from ..training.report import TrainingReport
from ..training.state import TrainingState
from .host_compat import enable_training_kernels
from .conditioning import PreparedConditioning, prepare_conditioning, prediction_type, raw_model_output, sigma_data
from .model_patch import checkpointer_of
from .types import TrainedLoRA

log = logging.getLogger(__name__)

# Kohya's ss_base_model_version for the host's model families (others: the family's name).
KOHYA_BASE_VERSIONS = {
    "SD15": "sd_v1",
    "SD20": "sd_v2",
    "SD21UnclipL": "sd_v2",
    "SDXL": "sdxl_base_v1-0",
    "SDXLRefiner": "sdxl_refiner_v1-0",
    "SD3": "sd3",
    "Flux": "flux1",
    "FluxSchnell": "flux1",
}

# Settings a training state must share with the run that continues it: what the adapters are,
# and the optimizer whose state it holds.
RESUME_SETTINGS = ("architecture", "rank", "alpha", "targets", "include_conv", "optimizer")


@dataclass
class Dataset:
    """The training images (model-space latents, one per image) and their conditionings."""

    latents: list[torch.Tensor]
    conditioning: list[list]  # host CONDITIONING per image, or exactly one for all


def flatten_dataset(latent_inputs: Sequence[Any], conditioning_inputs: Sequence[Any]) -> Dataset:
    """From what the host's dataset nodes send (lists of LATENT and of CONDITIONING) to one
    latent and one single-entry CONDITIONING per image. Errors name the input and the fix.

    Two layouts are accepted: one entry per image of each latent batch (Make Training Dataset
    sends one single-entry CONDITIONING per one-image LATENT; ResolutionBucket sends, per bucket,
    a list with one entry per image), or single-entry conditionings, one per image or one for all.
    A CONDITIONING with several entries for one image (Conditioning Combine) is refused: the
    sampler averages two model calls for it, which is not one training target.
    """
    batch_sizes: list[int] = []
    latents: list[torch.Tensor] = []
    for index, latent in enumerate(latent_inputs):
        samples = latent.get("samples") if isinstance(latent, dict) else None
        if not isinstance(samples, torch.Tensor) or samples.ndim < 4:
            raise ValueError(
                f"latents[{index}] is not a LATENT batch ({type(latent).__name__}); connect a LATENT, "
                "e.g. from Make Training Dataset or VAE Encode"
            )
        batch_sizes.append(samples.shape[0])
        latents.extend(samples[i] for i in range(samples.shape[0]))
    if not latents:
        raise ValueError("latents: the dataset is empty; connect at least one image latent")
    groups: list[list] = []
    for index, conditioning in enumerate(conditioning_inputs):
        if not isinstance(conditioning, (list, tuple)) or not conditioning:
            raise ValueError(f"conditioning[{index}] is empty or not a CONDITIONING")
        groups.append([conditioning] if isinstance(conditioning[0], torch.Tensor) else list(conditioning))
    if not groups:
        raise ValueError("conditioning: none given; connect the CONDITIONING of the captions")
    entries: list = []
    for group in groups:
        entries.extend(group)
    if [len(group) for group in groups] == batch_sizes:
        pass  # one entry per image of each latent batch
    elif any(len(group) != 1 for group in groups):
        raise ValueError(
            f"conditioning: {len(entries)} entries in {len(groups)} conditionings do not match the latents "
            f"({len(latents)} images in batches of {batch_sizes}). Give each image exactly one conditioning "
            "(Conditioning Combine makes two for one image, which cannot be trained on), or one for all"
        )
    elif len(entries) not in (1, len(latents)):
        raise ValueError(
            f"conditioning has {len(entries)} entries for {len(latents)} images: give one conditioning per "
            "image (in the same order as the latents) or a single one for all of them"
        )
    return Dataset(latents, [[entry] for entry in entries])


def make_autograd_safe(module: torch.nn.Module) -> int:
    """Replace parameters and buffers created under ``torch.inference_mode`` by normal copies.

    ComfyUI loads models inside node execution, under inference mode; autograd refuses to save
    such tensors for backward, and a frozen base weight is saved whenever the activation it
    multiplies needs a gradient. On a GPU the host's load to the device already makes normal
    copies; on the CPU (or a model moved there earlier under inference mode) we make them here,
    one tensor at a time, so the peak is one tensor, not a second model. The values are equal,
    so the model's outputs do not change. Returns how many tensors were replaced.
    """
    replaced = 0
    with torch.inference_mode(False):
        for submodule in module.modules():
            for name, parameter in list(submodule._parameters.items()):
                if parameter is not None and parameter.is_inference():
                    submodule._parameters[name] = torch.nn.Parameter(parameter.clone(), requires_grad=parameter.requires_grad)
                    replaced += 1
            for name, buffer in list(submodule._buffers.items()):
                if buffer is not None and buffer.is_inference():
                    submodule._buffers[name] = buffer.clone()
                    replaced += 1
    return replaced


def noise_schedule(model_patcher: Any) -> NoiseSchedule:
    sampling = model_patcher.get_model_object("model_sampling")

    def sigma_from_level(u: torch.Tensor) -> torch.Tensor:
        # percent_to_sigma(p): p=0 is pure noise, p=1 clean; our u is the other way round.
        return torch.tensor([float(sampling.percent_to_sigma(1.0 - float(level))) for level in u], dtype=torch.float32)

    return NoiseSchedule(prediction_type(model_patcher), sigma_from_level, sigma_data(model_patcher))


class HostDenoiser:
    """The trainer's denoiser: the host's ``apply_model`` with each image's own conditioning."""

    def __init__(self, model_patcher: Any, data: TrainingData, conditioning: list[list], device: torch.device) -> None:
        self.model_patcher = model_patcher
        # One prepared conditioning per latent shape (resolution bucket), with image index maps.
        self._prepared: dict[tuple[int, ...], tuple[PreparedConditioning, dict[int, int]]] = {}
        broadcast = len(conditioning) == 1
        for shape, images in data.buckets.items():
            local = {image: position for position, image in enumerate(images)}
            conds = conditioning if broadcast else [conditioning[image] for image in images]
            prepared = prepare_conditioning(model_patcher, conds, (len(images), *shape), device)
            self._prepared[shape] = (prepared, local)

    def shape_key(self, batch: MicroBatch) -> tuple:
        """What a checkpoint plan depends on: batch size, latent shape and text length (the
        attention over the context grows with it; captions of other lengths get their own plan)."""
        prepared, local = self._prepared[batch.bucket]
        tokens = 0
        for image in batch.indices:
            conds = prepared.model_conds[0 if len(prepared.model_conds) == 1 else local[image]]
            context = getattr(conds.get("c_crossattn"), "cond", None)
            if isinstance(context, torch.Tensor) and context.ndim >= 2:
                tokens = max(tokens, context.shape[1])
        return (len(batch.indices), *batch.bucket, tokens)

    def __call__(self, x_t: torch.Tensor, sigma: torch.Tensor, conditions: Sequence[int]) -> torch.Tensor:
        prepared, local = self._prepared[tuple(x_t.shape[1:])]
        # ``conditions`` are image indices (or 0 for a shared conditioning): map to the bucket.
        rows = [local.get(c, 0) for c in conditions]
        kwargs = prepared.model_kwargs(rows, x_t)
        return raw_model_output(self.model_patcher, x_t, sigma, kwargs)


def kohya_key_function(model_patcher: Any) -> Callable[[str], str]:
    """SD1.x/SD2.x LoRAs carry diffusers names (what Kohya, A1111 and Forge write); every other
    architecture the host's module paths, which is Kohya's format for SDXL and the DiTs."""
    config = model_patcher.model.model_config
    family = type(config).__name__
    if family.startswith(("SD15", "SD20", "SD21")):
        return key_function_from_map(diffusers_unet_key_map(comfy.utils.unet_to_diffusers(config.unet_config)))
    return default_kohya_key


@dataclass
class TrainRequest:
    lora: LoRAConfig
    train: TrainConfig
    state: TrainingState | None = None
    extra_settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainOutcome:
    lora: TrainedLoRA
    state: TrainingState
    report: TrainingReport
    error: NonFiniteLossError | None = None


def _architecture(model_patcher: Any) -> str:
    return type(model_patcher.model.model_config).__name__


def train_lora(
    model_patcher: Any,
    dataset: Dataset,
    request: TrainRequest,
    *,
    on_step: Callable[[StepReport], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> TrainOutcome:
    """Train a LoRA on ``model_patcher``; see the module docstring for the guarantees."""
    lora_config = request.lora.validate()
    architecture = _architecture(model_patcher)
    settings = {
        "architecture": architecture,
        "rank": lora_config.rank,
        "alpha": lora_config.effective_alpha,
        "targets": list(lora_config.targets) if lora_config.targets else None,
        "include_conv": lora_config.include_conv,
        **request.extra_settings,
    }
    if request.state is not None:
        request.state.check_compatible(settings, RESUME_SETTINGS)
    base_model = model_patcher.model
    enable_training_kernels()
    with torch.inference_mode(False):
        latents = [base_model.process_latent_in(latent.unsqueeze(0).clone().float())[0] for latent in dataset.latents]
        data = TrainingData(tuple(latents), conditioning_count=len(dataset.conditioning))
        comfy.model_management.load_models_gpu([model_patcher], force_full_load=True)
        device = model_patcher.load_device
        diffusion_model = base_model.diffusion_model
        make_autograd_safe(diffusion_model)
        grad_flags = {name: p.requires_grad for name, p in diffusion_model.named_parameters()}
        diffusion_model.requires_grad_(False)
        generator = torch.Generator().manual_seed(request.train.seed)
        attached = attach_lora(diffusion_model, lora_config, generator=generator)
        try:
            if request.state is not None:
                attached.load_state(request.state.adapters)
            denoiser = HostDenoiser(model_patcher, data, dataset.conditioning, device)
            checkpointer: Checkpointer | None = checkpointer_of(model_patcher)
            resume = None
            if request.state is not None:
                resume = ResumePoint(request.state.step, request.state.optimizer, request.state.scaler)
            trainer = LoRATrainer(
                parameters=list(attached.parameters()),
                denoiser=denoiser,
                schedule=noise_schedule(model_patcher),
                data=data,
                config=request.train,
                device=device,
                checkpointer=checkpointer,
                shape_key=denoiser.shape_key,
                resume=resume,
            )
            error: NonFiniteLossError | None = None
            try:
                result = trainer.run(on_step=on_step, should_stop=should_stop)
            except NonFiniteLossError as failure:
                error, result = failure, failure.result
            key_for_path = kohya_key_function(model_patcher)
            steps_done = result.end_step
            settings["plan"] = [plan.as_dict() for plan in result.plans.values()]
            metadata = lora_metadata(
                lora_config,
                architecture=architecture,
                base_model_version=KOHYA_BASE_VERSIONS.get(architecture, architecture),
                steps=steps_done,
                checkpointing={"plans": settings["plan"]},
                training=request.extra_settings,
            )
            lora = TrainedLoRA(
                kohya_state_dict(attached, key_for_path), metadata, architecture, lora_config.rank, steps_done
            )
            state = TrainingState(
                step=steps_done,
                adapters={k: v.cpu() for k, v in attached.state().items()},
                settings=settings,
                optimizer=_to_cpu(result.optimizer_state),
                scaler=result.scaler_state,
            )
            report = TrainingReport.from_result(result, architecture=architecture, device=str(device), settings=settings)
            return TrainOutcome(lora, state, report, error)
        finally:
            attached.detach()
            for name, parameter in diffusion_model.named_parameters():
                parameter.requires_grad_(grad_flags.get(name, False))


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def interrupted() -> bool:
    return comfy.model_management.processing_interrupted()


def raise_if_interrupted() -> None:
    comfy.model_management.throw_exception_if_processing_interrupted()


def apply_to_model(model_patcher: Any, lora: TrainedLoRA, strength: float = 1.0) -> Any:
    """A clone of the MODEL with the trained LoRA applied as the host's weight patches."""
    import comfy.sd

    patched, _ = comfy.sd.load_lora_for_models(model_patcher, None, lora.tensors, strength, 0)
    return patched

