"""Host CONDITIONING -> the diffusion model's call inputs, outside the sampler.

The trainer calls the host model on a training batch directly, not through a sampler. To
get exactly the prediction ComfyUI makes while sampling, this module reuses the sampler's
own machinery instead of re-deriving it per architecture:

- ``comfy.sampler_helpers.convert_cond`` turns a CONDITIONING entry ``[tensor, dict]`` into
  the sampler's cond dict (``cross_attn`` + the dict's options);
- ``comfy.samplers.encode_model_conds`` calls the model's ``extra_conds``, which knows what
  each architecture wants (``c_crossattn``; SDXL's ``y`` from ``pooled_output``, width,
  height; Flux's ``guidance``; ``c_concat``; attention masks; reference latents; ...);
- per batch, each image's model conds are ``process_cond``-ed to batch size 1 and joined with
  ``comfy.samplers.cond_cat``, as ``comfy.samplers._calc_cond_batch`` does;
- ``transformer_options`` come from the MODEL's ``model_options`` plus its wrappers and
  callbacks (as ``comfy.sampler_helpers.prepare_model_patcher`` merges them), with the
  per-call entries ``cond_or_uncond``, ``uuids`` and ``sigmas`` that the sampler adds;
- :func:`raw_model_output` calls ``BaseModel.apply_model`` (so APPLY_MODEL and
  DIFFUSION_MODEL wrappers, input scaling and timestep conversion are the host's) and
  returns the diffusion model's raw prediction.

What the sampler does and this does not: areas, masks, timestep ranges, ControlNets, GLIGEN
and hooks are sampler-time features that mix several model calls; a conditioning that uses
them is refused with a clear error (see :data:`SAMPLER_ONLY_OPTIONS`). A CONDITIONING must
hold exactly one entry (``ConditioningCombine`` makes two: the sampler averages two model
calls), as in ComfyUI's own TrainLoraNode. ``strength`` is ignored: with a single entry the
sampler's weighted average cancels it.

Inference tensors: ComfyUI runs nodes under ``torch.inference_mode()``, so CONDITIONING
tensors are inference tensors, which autograd refuses to save for backward ("Inference
tensors cannot be saved for backward"). The cross-attention context is saved by every
``to_k``/``to_v`` whose weight carries a trainable adapter, so :func:`prepare_conditioning`
builds everything under ``torch.inference_mode(False)`` and clones every tensor it keeps,
including those inside the model conds (the host's ``process_cond_list`` in
``comfy_extras/nodes_train.py`` clones the raw dict entries for the same reason, but not the
already-built model conds).
"""

from __future__ import annotations

import operator
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

#: Conditioning options that only the sampler can honour, with the node that sets them.
SAMPLER_ONLY_OPTIONS: dict[str, str] = {
    "area": "an area (ConditioningSetArea)",
    "mask": "a mask (ConditioningSetMask)",
    "control": "a ControlNet (ControlNetApply)",
    "gligen": "GLIGEN boxes (GLIGENTextBoxApply)",
    "hooks": "hooks (CreateHookLora, SetClipHooks, ConditioningSetProperties)",
    "default": "a default conditioning (ConditioningSetDefaultCombine)",
    "timestep_start": "a timestep range",
    "timestep_end": "a timestep range",
}

_PROMPT_TYPE = "positive"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def _validate_conditioning(conditioning_per_image: Any, num_images: int) -> list:
    if not isinstance(conditioning_per_image, (list, tuple)) or len(conditioning_per_image) == 0:
        raise ValueError(
            "conditioning: expected a non-empty list with one CONDITIONING per training image "
            f"(or one for all of them), got {_describe(conditioning_per_image)}."
        )
    count = len(conditioning_per_image)
    if count not in (1, num_images):
        raise ValueError(
            f"conditioning: got {count} conditionings for {num_images} images; give one per "
            "image (in the order of the latent batch) or exactly one for all of them."
        )
    for index, conditioning in enumerate(conditioning_per_image):
        where = f"conditioning[{index}]"
        if not isinstance(conditioning, (list, tuple)) or len(conditioning) == 0:
            raise ValueError(
                f"{where}: expected a CONDITIONING (a list of [tensor, dict] entries, as "
                f"CLIPTextEncode outputs), got {_describe(conditioning)}."
            )
        if len(conditioning) != 1:
            raise ValueError(
                f"{where}: holds {len(conditioning)} entries; training needs exactly one per "
                "image (ConditioningCombine makes several, which the sampler averages). Use "
                "ConditioningConcat, or one prompt per image."
            )
        entry = conditioning[0]
        if (
            not isinstance(entry, (list, tuple))
            or len(entry) != 2
            or not (entry[0] is None or isinstance(entry[0], torch.Tensor))
            or not isinstance(entry[1], dict)
        ):
            raise ValueError(f"{where}: an entry must be [tensor, dict], got {_describe(entry)}.")
        options = entry[1]
        for key, what in SAMPLER_ONLY_OPTIONS.items():
            if key in options and options[key] is not None:
                raise ValueError(
                    f"{where} carries {what} ('{key}'), which only a sampler can apply; "
                    "train on a plain text conditioning."
                )
        start = options.get("start_percent", 0.0)
        end = options.get("end_percent", 1.0)
        if "clip_start_percent" in options or start > 0.0 or end < 1.0:
            raise ValueError(
                f"{where} is limited to part of the schedule (start_percent={start}, "
                f"end_percent={end}); training samples every noise level, so use a "
                "conditioning without ConditioningSetTimestepRange."
            )
    return list(conditioning_per_image)


def _clone_cond_value(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device).clone()
    if isinstance(value, list):
        return [_clone_cond_value(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone_cond_value(v, device) for v in value)
    return value


def _clone_model_conds(model_conds: dict, device: torch.device) -> dict:
    """Copies of the host's CONDRegular objects holding normal (non-inference) tensors."""
    out = {}
    for name, cond in model_conds.items():
        copy_with = getattr(cond, "_copy_with", None)
        out[name] = copy_with(_clone_cond_value(cond.cond, device)) if copy_with else cond
    return out


@dataclass
class PreparedConditioning:
    """Each training image's model conds, ready to batch. Build with :func:`prepare_conditioning`."""

    model_patcher: Any
    #: The latent batch shape it was prepared for: (images, channels, height, width[, ...]).
    latent_shape: tuple[int, ...]
    device: torch.device
    #: One dict name -> host CONDRegular per conditioning (one for all images when broadcast).
    model_conds: list[dict] = field(repr=False)
    uuids: list[uuid.UUID] = field(repr=False)

    @property
    def num_images(self) -> int:
        return self.latent_shape[0]

    @property
    def broadcast(self) -> bool:
        return len(self.model_conds) == 1 and self.num_images != 1

    def _slot(self, index: Any) -> int:
        try:
            position = operator.index(index) if not isinstance(index, bool) else -1
        except TypeError:
            position = -1
        if not 0 <= position < self.num_images:
            raise ValueError(f"indices: {index!r} is not an image index in [0, {self.num_images}).")
        return 0 if len(self.model_conds) == 1 else position

    def model_kwargs(self, indices: Sequence[int], x: torch.Tensor) -> dict:
        """Keyword arguments of ``BaseModel.apply_model(x, sigma, **kwargs)`` for these images.

        ``indices[j]`` is the image whose conditioning goes with ``x[j]``. The result holds
        the model conds batched in that order (``c_crossattn``, ``y``, ``guidance``,
        ``c_concat``, ... as the model's ``extra_conds`` defines them) and a fresh
        ``transformer_options`` built from the MODEL's current ``model_options``, wrappers and
        callbacks. Cross-attention contexts of different lengths are joined as the host joins
        them (repeated to a common length, which leaves attention unchanged); other conds
        that differ in shape between the images cannot share one call and raise ValueError.
        """
        import comfy.conds
        import comfy.model_patcher
        import comfy.patcher_extension
        import comfy.samplers

        indices = list(indices)
        if len(indices) == 0:
            raise ValueError("indices: empty; give the image index of every row of x.")
        if x.shape[0] != len(indices):
            raise ValueError(f"x: batch of {x.shape[0]} rows for {len(indices)} indices; they must match.")
        if tuple(x.shape[1:]) != self.latent_shape[1:]:
            raise ValueError(
                f"x: rows of shape {tuple(x.shape[1:])}, but the conditioning was prepared for latents "
                f"of shape {self.latent_shape[1:]}; prepare each resolution separately."
            )
        slots = [self._slot(i) for i in indices]

        # As get_area_and_mult does for each cond: batch size of the rows it covers, no area.
        per_row = [
            {name: cond.process_cond(batch_size=1, area=None) for name, cond in self.model_conds[slot].items()}
            for slot in slots
        ]
        first = per_row[0]
        for row, conds in zip(indices[1:], per_row[1:]):
            if conds.keys() != first.keys():
                raise ValueError(
                    f"conditioning: image {row} gives model inputs {sorted(conds)} but image "
                    f"{indices[0]} gives {sorted(first)}; they cannot share a batch (use batch size 1)."
                )
            for name, cond in conds.items():
                other = first[name]
                if isinstance(cond, comfy.conds.CONDCrossAttn):
                    same = cond.cond.shape[0] == other.cond.shape[0] and cond.cond.shape[2:] == other.cond.shape[2:]
                else:
                    same = other.can_concat(cond)
                if not same:
                    raise ValueError(
                        f"conditioning: '{name}' of image {row} ({cond.size()}) and of image "
                        f"{indices[0]} ({other.size()}) cannot be batched together; use batch size 1."
                    )
        kwargs = comfy.samplers.cond_cat(per_row)

        patcher = self.model_patcher
        model_options = comfy.model_patcher.create_model_options_clone(patcher.model_options)
        transformer_options = model_options.setdefault("transformer_options", {})
        comfy.patcher_extension.merge_nested_dicts(
            transformer_options.setdefault("wrappers", {}), patcher.wrappers, copy_dict1=False
        )
        comfy.patcher_extension.merge_nested_dicts(
            transformer_options.setdefault("callbacks", {}), patcher.callbacks, copy_dict1=False
        )
        transformer_options["cond_or_uncond"] = [0] * len(indices)
        transformer_options["uuids"] = [self.uuids[s] for s in slots]
        kwargs["transformer_options"] = transformer_options
        return kwargs


def _latent_shape(latent_shape: Any) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in latent_shape)
    except TypeError:
        shape = ()
    if len(shape) < 4 or min(shape) <= 0:
        raise ValueError(
            f"latent_shape: expected the training latent batch's shape (images, channels, "
            f"height, width[, ...]), got {latent_shape!r}."
        )
    return shape


def prepare_conditioning(
    model_patcher: Any,
    conditioning_per_image: list,
    latent_shape: Sequence[int],
    device: torch.device | str,
    *,
    seed: int = 0,
) -> PreparedConditioning:
    """Validate and encode each training image's CONDITIONING for ``model_patcher``'s model.

    ``conditioning_per_image``: one host CONDITIONING (``[[tensor, dict]]``) per image, in
    the order of the latent batch, or exactly one for all images. ``latent_shape``: the shape
    of the whole latent batch ``(images, channels, height, width[, ...])``; every image has
    that per-image shape (prepare each resolution bucket separately). ``device``: where the
    cond tensors are kept (the model's load device). ``seed`` is passed to ``extra_conds``
    as the sampler passes its noise seed (unCLIP's noise augmentation uses it).

    Runs under ``torch.inference_mode(False)`` and clones every tensor, so the result is
    safe in autograd even though the CONDITIONING came from an inference-mode node.
    Raises ValueError naming the input for anything the host sampler would not treat as a
    single, plain conditioning per image.
    """
    import comfy.sampler_helpers
    import comfy.samplers

    shape = _latent_shape(latent_shape)
    num_images = shape[0]
    conditionings = _validate_conditioning(conditioning_per_image, num_images)
    device = torch.device(device)
    base_model = model_patcher.model

    model_conds: list[dict] = []
    uuids: list[uuid.UUID] = []
    with torch.inference_mode(False):
        noise = torch.zeros((1,) + shape[1:], device=device)
        for conditioning in conditionings:
            conds = comfy.sampler_helpers.convert_cond(conditioning)
            conds = comfy.samplers.encode_model_conds(
                base_model.extra_conds,
                conds,
                noise,
                device,
                _PROMPT_TYPE,
                latent_image=None,
                denoise_mask=None,
                seed=seed,
                latent_shapes=[noise.shape],
            )
            (cond,) = conds
            model_conds.append(_clone_model_conds(cond["model_conds"], device))
            uuids.append(cond["uuid"])
    return PreparedConditioning(model_patcher, shape, device, model_conds, uuids)


def raw_model_output(model_patcher: Any, x: torch.Tensor, sigma: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The diffusion model's raw prediction (ε, v or flow velocity) for the noisy batch ``x``.

    ``x`` is the noisy latent as a sampler holds it (``model_sampling.noise_scaling`` of the
    model-space latent, i.e. after ``process_latent_in``); ``sigma`` has one value per row;
    ``kwargs`` come from :meth:`PreparedConditioning.model_kwargs`. The call goes through
    ``BaseModel.apply_model`` (and the MODEL's ``model_function_wrapper``, if it has one, as
    the sampler does), so input scaling, timestep conversion, wrappers and patches are the
    host's. The MODEL must be loaded (``comfy.model_management.load_models_gpu``), as for
    sampling, so that its weight and object patches are applied. Gradients flow through the
    result when autograd is on. Returns float32 (the host upcasts before its last step too).
    """
    base_model = model_patcher.model
    # ModelPatcher.load records whose weight patches the shared torch module now carries;
    # object patches (model_sampling from ModelSamplingDiscrete, ...) are set at load too.
    loaded = getattr(base_model, "current_weight_patches_uuid", None) == model_patcher.patches_uuid
    if not loaded or model_patcher.get_model_object("model_sampling") is not base_model.model_sampling:
        raise RuntimeError(
            "model: this MODEL's patches are not applied to its weights (it is not the loaded "
            "one); call comfy.model_management.load_models_gpu([model]) before computing "
            "model outputs, as the sampler does."
        )
    kwargs = dict(kwargs)
    transformer_options = dict(kwargs.get("transformer_options", {}))
    transformer_options["sigmas"] = sigma
    kwargs["transformer_options"] = transformer_options

    # apply_model returns the *denoised* estimate, model_sampling.calculate_denoised(sigma,
    # raw, x). Inverting it (e.g. (x - denoised) / sigma) loses precision at small sigma and
    # fails at sigma = 0, and each prediction type needs its own inverse. Calling the
    # diffusion model directly would skip apply_model's wrappers, input scaling and timestep
    # conversion. A forward hook on the diffusion model sees the raw output inside the host's
    # own call, autograd graph included; it is removed in `finally` so that it never outlives
    # this call (nor fires again if anything recomputes the forward later).
    captured: list = []
    handle = base_model.diffusion_model.register_forward_hook(lambda _module, _args, output: captured.append(output))
    try:
        model_patcher.prepare_state(sigma)
        wrapper = model_patcher.model_options.get("model_function_wrapper")
        if wrapper is not None:
            cond_or_uncond = transformer_options.get("cond_or_uncond", [0] * x.shape[0])
            wrapper(base_model.apply_model, {"input": x, "timestep": sigma, "c": kwargs, "cond_or_uncond": cond_or_uncond})
        else:
            base_model.apply_model(x, sigma, **kwargs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(
            f"model: the diffusion model ran {len(captured)} times in one apply_model call "
            "(a wrapper or patch calls it itself); its raw output is ambiguous."
        )
    output = captured[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"model: the diffusion model returned {_describe(output)}, not one tensor.")
    return output.float()


def _model_sampling(model_patcher: Any):
    return model_patcher.get_model_object("model_sampling")


def prediction_type(model_patcher: Any) -> str:
    """``"eps"``, ``"v"`` or ``"flow"``: what the MODEL's diffusion model predicts.

    Read from the (possibly patched, e.g. by ModelSamplingDiscrete) ``model_sampling``: the
    class that defines its ``calculate_denoised`` must be the host's ``EPS``,
    ``V_PREDICTION`` or ``CONST``. Subclasses that redefine it (EDM, X0, LCM, IMG_TO_IMG,
    Cosmos' rectified flow, ...) use another parameterisation and raise ValueError.
    """
    import comfy.model_sampling as ms

    sampling = _model_sampling(model_patcher)
    defining = next((cls for cls in type(sampling).__mro__ if "calculate_denoised" in cls.__dict__), None)
    kinds = {ms.EPS: "eps", ms.V_PREDICTION: "v", ms.CONST: "flow"}
    if defining in kinds:
        return kinds[defining]
    base_model = model_patcher.model
    model_type = getattr(getattr(base_model, "model_type", None), "name", "unknown")
    raise ValueError(
        f"model: {type(base_model).__name__} (model type {model_type}) predicts with "
        f"{getattr(defining, '__name__', type(sampling).__name__)}, not eps, v or flow; "
        "training supports only those three objectives."
    )


def sigma_data(model_patcher: Any) -> float:
    """The MODEL's ``model_sampling.sigma_data`` (1.0 for flow samplings, which define none)."""
    return float(getattr(_model_sampling(model_patcher), "sigma_data", 1.0))
