"""Tiny, real-architecture models and model files, built with the ComfyUI host's own classes.

Everything here is built at test time from random weights: no network, no model hub. The
modules are the host's (``UNetModel``, ``Flux``, the MMDiT of SD3, ``CLIPTextModel``, ``TAESD``),
so the code under test meets the same module tree, the same ``forward`` signatures and the
same ``transformer_options`` plumbing that it meets in a real ComfyUI.

Weights
    The host builds its modules with ``comfy.ops.disable_weight_init``, which skips parameter
    initialisation: a freshly built module holds ``torch.empty`` garbage. Every builder here
    overwrites *every* floating-point entry of the state dict (parameters and persistent
    buffers) with seeded random values (see :func:`random_state_dict`), so outputs are finite
    and reproducible. Each tensor has its own generator, seeded from ``(seed, key)``, so a
    tensor's values do not depend on which other tensors exist. The global RNG is left alone.

Files
    :func:`write_sd15_checkpoint` writes a single-file checkpoint that
    ``comfy.sd.load_checkpoint_guess_config`` (CheckpointLoaderSimple) detects as SD1.5;
    :func:`write_flux_diffusion_model` writes a diffusion-model-only file that
    ``comfy.sd.load_diffusion_model`` (UNETLoader) detects as Flux. Both are cached: an existing
    file is reused when its embedded spec matches and its SHA-256 matches the ``.sha256``
    file written next to it; otherwise it is rebuilt (written to a temporary name, then
    renamed, so a half-written file is never reused).

Import ``comfy`` first (the ``host_path`` fixture does): this module imports it lazily.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

#: Bump when a builder's output changes for the same arguments (invalidates cached files).
BUILDER_VERSION = 1

# --------------------------------------------------------------------------------------------
# Random weights
# --------------------------------------------------------------------------------------------


def _tensor_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def random_tensor(key: str, shape: tuple[int, ...] | torch.Size, seed: int = 0) -> torch.Tensor:
    """A float32 tensor of random values for the state-dict entry ``key``.

    The scale follows the role the key implies, so that a deep network built from these
    values keeps activations of order one:

    - matrices and conv kernels: normal with std ``1/sqrt(fan_in)``;
    - embedding tables (``*embedding.weight``, ``pos_embed``): normal with std 0.02;
    - biases and shifts: normal with std 0.02;
    - other vectors and scalars (norm weights and scales): ``1 +`` normal with std 0.02.
    """
    shape = tuple(shape)
    generator = torch.Generator().manual_seed(_tensor_seed(seed, key))
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if len(shape) >= 2:
        if key.endswith("embedding.weight") or key.endswith("pos_embed"):
            return noise.mul_(0.02)
        fan_in = math.prod(shape[1:])
        return noise.mul_(1.0 / math.sqrt(max(fan_in, 1)))
    if key.endswith("bias") or key.endswith("shift"):
        return noise.mul_(0.02)
    return noise.mul_(0.02).add_(1.0)


def random_state_dict(
    module: torch.nn.Module, seed: int = 0, dtype: torch.dtype | None = None, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Random values for every floating-point entry of ``module.state_dict()``.

    ``module`` may live on the ``meta`` device (only shapes are read). Integer entries are
    skipped. ``dtype`` defaults to each entry's own dtype (float32 on ``meta`` modules built
    without one). Keys are ``prefix + key``; the random values depend on the key *without*
    the prefix, so the same module gives the same values under any prefix.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict().items():
        if not value.is_floating_point():
            continue
        target = dtype if dtype is not None else value.dtype
        out[prefix + key] = random_tensor(key, value.shape, seed).to(target)
    return out


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every floating-point parameter and persistent buffer of ``module`` in place."""
    values = random_state_dict(module, seed)
    with torch.no_grad():
        for key, tensor in module.state_dict(keep_vars=True).items():
            if key in values:
                tensor.copy_(values[key].to(tensor.dtype))
    return module


def _ops():
    import comfy.ops

    # What the host picks (comfy.ops.pick_operations) for float32 weights and no manual cast.
    return comfy.ops.disable_weight_init


def _build(factory, seed: int) -> torch.nn.Module:
    """Build a host module (without touching the global RNG) and give it random weights."""
    with torch.random.fork_rng(devices=[]):
        module = factory()
    return randomize_(module, seed).eval()


def _fresh_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------
# Tiny UNet (SD1.x / SDXL family): comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel
# --------------------------------------------------------------------------------------------

#: Two levels, one res block each, a transformer at every level and in the middle.
#: GroupNorm(32) in ResBlock needs every width (and every skip-concat width) divisible by 32.
TINY_UNET_CONFIG: dict[str, Any] = {
    "image_size": 32,
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 32,
    "num_res_blocks": [1, 1],
    "channel_mult": [1, 2],
    "transformer_depth": [1, 1],
    "transformer_depth_output": [1, 1, 1, 1],
    "transformer_depth_middle": 1,
    "context_dim": 32,
    "num_heads": -1,
    "num_head_channels": 8,
    "use_spatial_transformer": True,
    "use_linear_in_transformer": False,
    "legacy": False,
    "adm_in_channels": None,
    "use_temporal_resblock": False,
    "use_temporal_attention": False,
    "use_checkpoint": False,
    "dropout": 0.0,
}


def tiny_unet(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """ComfyUI's ``UNetModel`` at width 32 (≈0.6 M parameters), float32, CPU, eval mode.

    ``overrides`` replace entries of :data:`TINY_UNET_CONFIG` (for example ``dropout=0.1``,
    ``context_dim=64``, ``adm_in_channels=16`` with ``num_classes="sequential"``).
    """
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    config = {**TINY_UNET_CONFIG, **overrides}
    return _build(lambda: UNetModel(**config, dtype=torch.float32, device="cpu", operations=_ops()), seed)


def tiny_unet_with_dropout(p: float = 0.1, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """:func:`tiny_unet` with dropout ``p`` active everywhere the architecture has dropout.

    ``UNetModel(dropout=p)`` only reaches the ResBlocks: it does not pass ``dropout`` on to
    ``SpatialTransformer`` (the host builds those with their default 0.0), although each
    ``BasicTransformerBlock`` holds ``nn.Dropout`` modules (in ``attn1/attn2.to_out`` and
    ``ff.net``). This builder therefore also sets ``p`` on those modules. The module is
    returned in **train** mode, so dropout draws random numbers (the point of the variant:
    RNG-preservation tests of recomputation).
    """
    from comfy.ldm.modules.attention import SpatialTransformer

    model = tiny_unet(seed=seed, dropout=p, **overrides)
    for module in model.modules():
        if isinstance(module, SpatialTransformer):
            for inner in module.modules():
                if isinstance(inner, torch.nn.Dropout):
                    inner.p = p
    return model.train()


def unet_inputs(
    batch: int = 2,
    size: int = 8,
    *,
    model: torch.nn.Module | None = None,
    context_len: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Keyword arguments for ``UNetModel.forward``: ``model(**unet_inputs(...))``.

    ``x`` is ``(batch, in_channels, size, size)``; ``timesteps`` are float timesteps in
    ``[0, 1000)``; ``context`` is ``(batch, context_len, context_dim)``; ``y`` is added when the
    model is class-conditional (``num_classes`` set). ``transformer_options`` is a fresh
    dict (the UNet writes into it).
    """
    in_channels = model.in_channels if model is not None else TINY_UNET_CONFIG["in_channels"]
    context_dim = TINY_UNET_CONFIG["context_dim"]
    if model is not None:
        attn2 = next((m for n, m in model.named_modules() if n.endswith("attn2")), None)
        if attn2 is not None:
            context_dim = attn2.to_k.in_features
    g = _fresh_generator(seed)
    inputs: dict[str, Any] = {
        "x": torch.randn(batch, in_channels, size, size, generator=g),
        "timesteps": torch.rand(batch, generator=g) * 1000.0,
        "context": torch.randn(batch, context_len, context_dim, generator=g),
        "transformer_options": {},
    }
    if model is not None and getattr(model, "num_classes", None) is not None:
        adm = model.label_emb[0][0].in_features
        inputs["y"] = torch.randn(batch, adm, generator=g)
    return inputs


# --------------------------------------------------------------------------------------------
# Tiny Flux: comfy.ldm.flux.model.Flux
# --------------------------------------------------------------------------------------------

#: hidden 64 = 2 heads x 32; axes_dim sums to the head dim (32) and each axis is even (RoPE).
TINY_FLUX_CONFIG: dict[str, Any] = {
    "image_model": "flux",
    "in_channels": 16,
    "out_channels": 16,
    "vec_in_dim": 32,
    "context_in_dim": 32,
    "hidden_size": 64,
    "mlp_ratio": 4.0,
    "num_heads": 2,
    "depth": 2,
    "depth_single_blocks": 2,
    "axes_dim": [8, 12, 12],
    "theta": 10000,
    "patch_size": 2,
    "qkv_bias": True,
    "guidance_embed": True,
    "txt_ids_dims": [],
}


def tiny_flux(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """ComfyUI's ``Flux`` at hidden size 64 (2 double + 2 single blocks), float32, CPU, eval."""
    from comfy.ldm.flux.model import Flux

    config = {**TINY_FLUX_CONFIG, **overrides}
    return _build(lambda: Flux(**config, dtype=torch.float32, device="cpu", operations=_ops()), seed)


def flux_inputs(
    batch: int = 1,
    h: int = 8,
    w: int = 8,
    *,
    model: torch.nn.Module | None = None,
    context_len: int = 8,
    guidance: float = 3.5,
    seed: int = 0,
) -> dict[str, Any]:
    """Keyword arguments for ``Flux.forward``: ``model(**flux_inputs(...))``.

    ``x`` is the latent ``(batch, in_channels, h, w)`` (the model patchifies it); ``timestep``
    is in ``[0, 1]`` (the host's ModelSamplingFlux passes sigma as the timestep); ``context`` is
    ``(batch, context_len, context_in_dim)``; ``y`` (pooled vector) when the model has
    ``vector_in``; ``guidance`` when ``guidance_embed``.
    """
    if model is not None:
        params = model.params
        in_channels, context_in_dim = params.in_channels, params.context_in_dim
        vec_in_dim, guidance_embed = params.vec_in_dim, params.guidance_embed
    else:
        in_channels = TINY_FLUX_CONFIG["in_channels"]
        context_in_dim = TINY_FLUX_CONFIG["context_in_dim"]
        vec_in_dim = TINY_FLUX_CONFIG["vec_in_dim"]
        guidance_embed = TINY_FLUX_CONFIG["guidance_embed"]
    g = _fresh_generator(seed)
    inputs: dict[str, Any] = {
        "x": torch.randn(batch, in_channels, h, w, generator=g),
        "timestep": torch.rand(batch, generator=g),
        "context": torch.randn(batch, context_len, context_in_dim, generator=g),
        "y": torch.randn(batch, vec_in_dim, generator=g) if vec_in_dim is not None else None,
        "transformer_options": {},
    }
    if guidance_embed:
        inputs["guidance"] = torch.full((batch,), float(guidance))
    return inputs


# --------------------------------------------------------------------------------------------
# Tiny SD3 (MMDiT): comfy.ldm.modules.diffusionmodules.mmdit.OpenAISignatureMMDITWrapper
# --------------------------------------------------------------------------------------------

#: The MMDiT fixes the head size at 64 and ties width to depth: hidden = 64 * depth.
#: depth 2 -> hidden 128, 2 heads, 2 joint blocks (the last one is "pre_only" for context).
TINY_SD3_CONFIG: dict[str, Any] = {
    "input_size": None,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "depth": 2,
    "adm_in_channels": 32,
    "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 32, "out_features": 128}},
    "pos_embed_max_size": 16,
    "num_patches": 256,
    "pos_embed_scaling_factor": None,
    "qk_norm": None,
    "x_block_self_attn_layers": [],
}


def tiny_sd3(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The host's SD3 MMDiT at hidden size 128 (depth 2), float32, CPU, eval.

    Latents up to ``2 * pos_embed_max_size`` (32) on a side fit the position embedding.
    """
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper

    config = {**TINY_SD3_CONFIG, **overrides}
    return _build(
        lambda: OpenAISignatureMMDITWrapper(**config, dtype=torch.float32, device="cpu", operations=_ops()), seed
    )


def sd3_inputs(
    batch: int = 1,
    h: int = 8,
    w: int = 8,
    *,
    model: torch.nn.Module | None = None,
    context_len: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Keyword arguments for the MMDiT wrapper's ``forward``: ``model(**sd3_inputs(...))``.

    ``timesteps`` are in ``[0, 1000)`` (the host's ModelSamplingDiscreteFlow multiplies sigma
    by 1000); ``y`` is the pooled vector (``adm_in_channels``).
    """
    if model is not None:
        in_channels = model.in_channels
        embedder = model.context_embedder
        context_dim = embedder.in_features if hasattr(embedder, "in_features") else model.hidden_size
        adm = model.y_embedder.mlp[0].in_features if model.y_embedder is not None else None
    else:
        in_channels = TINY_SD3_CONFIG["in_channels"]
        context_dim = TINY_SD3_CONFIG["context_embedder_config"]["params"]["in_features"]
        adm = TINY_SD3_CONFIG["adm_in_channels"]
    g = _fresh_generator(seed)
    return {
        "x": torch.randn(batch, in_channels, h, w, generator=g),
        "timesteps": torch.rand(batch, generator=g) * 1000.0,
        "context": torch.randn(batch, context_len, context_dim, generator=g),
        "y": torch.randn(batch, adm, generator=g) if adm is not None else None,
        "transformer_options": {},
    }


# --------------------------------------------------------------------------------------------
# Tiny host models wrapped as the host wraps them (BaseModel + ModelPatcher)
# --------------------------------------------------------------------------------------------


def tiny_model_patcher(kind: str = "sd15", model_type: Any = None, seed: int = 0, **overrides: Any):
    """A host ``ModelPatcher`` around a host ``BaseModel`` with a tiny diffusion model.

    ``kind``: ``"sd15"`` (``comfy.model_base.BaseModel`` with the SD15 model config: EPS,
    SD15 latent format, the tiny UNet at context_dim 32) or ``"flux"`` (``comfy.model_base.Flux``
    with the Flux model config and the tiny Flux). ``model_type`` (a ``comfy.model_base.ModelType``)
    overrides the prediction type, e.g. ``ModelType.V_PREDICTION`` or ``ModelType.FLOW``.
    Load and offload device: CPU; weights float32, random and seeded.
    """
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    if kind == "sd15":
        unet_config = {k: v for k, v in TINY_UNET_CONFIG.items() if k != "dropout"}
        unet_config.update(overrides)
        model_config = comfy.supported_models.SD15(unet_config)
        # SD15's unet_extra_config forces num_heads=8, num_head_channels=-1 (head dim = width/8).
        model_type = model_type if model_type is not None else comfy.model_base.ModelType.EPS
        factory = lambda: comfy.model_base.BaseModel(model_config, model_type=model_type, device="cpu")  # noqa: E731
    elif kind == "flux":
        unet_config = {**TINY_FLUX_CONFIG, **overrides}
        model_config = comfy.supported_models.Flux(unet_config)
        model_type = model_type if model_type is not None else comfy.model_base.ModelType.FLUX
        factory = lambda: comfy.model_base.Flux(model_config, model_type=model_type, device="cpu")  # noqa: E731
    else:
        raise ValueError(f"kind={kind!r}: expected 'sd15' or 'flux'")
    model_config.set_inference_dtype(torch.float32, None)
    with torch.random.fork_rng(devices=[]):
        base_model = factory()
    randomize_(base_model.diffusion_model, seed)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(base_model, load_device=cpu, offload_device=cpu)


# --------------------------------------------------------------------------------------------
# Model files
# --------------------------------------------------------------------------------------------

#: SD1.5's fixed widths (model_channels 320, context 768, 8 heads, conv proj_in) with the
#: depth cut down: two levels at multiplier 1 (so Downsample and Upsample exist), one res
#: block per level, a transformer at every level and in the middle. ~44 M parameters.
#: Detection (comfy.model_detection.detect_unet_config) reads everything else from shapes.
SD15_UNET_CONFIG: dict[str, Any] = {
    "image_size": 32,
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 320,
    "num_res_blocks": [1, 1],
    "channel_mult": [1, 1],
    "transformer_depth": [1, 1],
    "transformer_depth_output": [1, 1, 1, 1],
    "transformer_depth_middle": 1,
    "context_dim": 768,
    "num_heads": 8,
    "num_head_channels": -1,
    "use_spatial_transformer": True,
    "use_linear_in_transformer": False,
    "legacy": False,
    "adm_in_channels": None,
    "use_temporal_resblock": False,
    "use_temporal_attention": False,
    "use_checkpoint": False,
}

#: The smallest UNet that the host still detects as SD15 (~13.6 M parameters): one level,
#: one res block with one transformer (detection takes context_dim from the first input-block
#: transformer, so one is required), no middle block, no output transformers.
SD15_UNET_MINIMAL_CONFIG: dict[str, Any] = {
    **SD15_UNET_CONFIG,
    "num_res_blocks": [1],
    "channel_mult": [1],
    "transformer_depth": [1],
    "transformer_depth_output": [0, 0],
    "transformer_depth_middle": -2,
}


def _meta_module(factory) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        return factory()


def sd15_unet_state_dict(
    config: Mapping[str, Any] = SD15_UNET_CONFIG, seed: int = 0, dtype: torch.dtype = torch.float16, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Random weights for an SD1.5-shaped ``UNetModel`` built from ``config`` (keys + ``prefix``)."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    unet = _meta_module(lambda: UNetModel(**config, device="meta", operations=_ops()))
    return random_state_dict(unet, seed, dtype, prefix)


def _clip_l_state_dict(seed: int, dtype: torch.dtype, prefix: str) -> dict[str, torch.Tensor]:
    """Full-shape CLIP-L text encoder (the host's sd1_clip_config.json) in checkpoint layout."""
    import comfy.clip_model
    import comfy.sd1_clip

    config_path = Path(comfy.sd1_clip.__file__).parent / "sd1_clip_config.json"
    config = json.loads(config_path.read_text())
    clip = _meta_module(lambda: comfy.clip_model.CLIPTextModel(config, None, "meta", _ops()))
    values = random_state_dict(clip, seed, dtype)
    # SD1.5 checkpoints carry only text_model.*: SD15.process_clip_state_dict would move any
    # other "cond_stage_model.transformer.*" key under text_model. (text_projection stays
    # unloaded; the host does not use it for SD1.x and does not warn about it.)
    return {prefix + k: v for k, v in values.items() if k.startswith("text_model.")}


def _taesd_state_dict(seed: int, dtype: torch.dtype, prefix: str) -> dict[str, torch.Tensor]:
    """The host's TAESD (64 channels, ~2.4 M parameters) with SD1's latent scale, as nodes.py
    VAELoader.load_taesd lays it out: ``taesd_encoder.*``, ``taesd_decoder.*``, ``vae_scale``,
    ``vae_shift``."""
    import comfy.taesd.taesd

    taesd = _meta_module(lambda: comfy.taesd.taesd.TAESD(latent_channels=4).to("meta"))
    values = random_state_dict(taesd, seed, dtype)
    values["vae_scale"] = torch.tensor(0.18215, dtype=dtype)
    values["vae_shift"] = torch.tensor(0.0, dtype=dtype)
    return {prefix + k: v for k, v in values.items()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _spec_hash(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


_SPEC_KEY = "lowvram_lora.test_model_spec"


def _cached(path: Path, spec_hash: str) -> bool:
    """Whether ``path`` holds a complete file built from ``spec_hash``."""
    sidecar = path.with_name(path.name + ".sha256")
    if not (path.is_file() and sidecar.is_file()):
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get(_SPEC_KEY) != spec_hash:
                return False
    except Exception:
        return False
    return sidecar.read_text().strip() == _sha256(path)


def _write_cached(path: Path, spec: Mapping[str, Any], build) -> Path:
    """Reuse ``path`` when it matches ``spec``; otherwise write ``build()`` there atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    spec_hash = _spec_hash(spec)
    if _cached(path, spec_hash):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    state_dict = build()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        save_file(state_dict, tmp, metadata={_SPEC_KEY: spec_hash})
        del state_dict
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a model file is not secret
        content_hash = _sha256(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    path.with_name(path.name + ".sha256").write_text(content_hash + "\n")
    return path


def write_sd15_checkpoint(
    path: str | os.PathLike,
    *,
    unet_config: Mapping[str, Any] = SD15_UNET_CONFIG,
    seed: int = 0,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write (or reuse) a single-file checkpoint detected as SD1.5 and return its path.

    Layout of an original SD1.5 ``.safetensors``:

    - ``model.diffusion_model.*``: a UNet with SD1.5's widths and a shallow depth
      (:data:`SD15_UNET_CONFIG`); the host detects ``model_config`` class ``SD15``;
    - ``cond_stage_model.transformer.text_model.*``: a full-shape CLIP-L text encoder
      (123 M parameters: the host's SD1 text encoder has a fixed config);
    - ``first_stage_model.*``: a TAESD (``taesd_encoder.*``/``taesd_decoder.*``), which
      ``comfy.sd.VAE`` recognises by ``taesd_decoder.1.weight``; it encodes RGB to 4-channel
      latents at 1/8 size and decodes back.

    ``dtype`` float16 keeps the file at ~340 MB (CLIP-L is ~250 MB of it); the host upcasts
    the UNet to float32 on a CPU. Cached as the module docstring says.
    """
    unet_config = dict(unet_config)
    spec = {
        "builder": "sd15_checkpoint",
        "version": BUILDER_VERSION,
        "unet": unet_config,
        "seed": seed,
        "dtype": str(dtype),
    }

    def build() -> dict[str, torch.Tensor]:
        state_dict = sd15_unet_state_dict(unet_config, seed, dtype, prefix="model.diffusion_model.")
        state_dict.update(_clip_l_state_dict(seed, dtype, prefix="cond_stage_model.transformer."))
        state_dict.update(_taesd_state_dict(seed, dtype, prefix="first_stage_model."))
        return state_dict

    return _write_cached(Path(path), spec, build)


def flux_file_config(depth: int = 1, depth_single_blocks: int = 1, guidance_embed: bool = True) -> dict[str, Any]:
    """The Flux config whose state dict the host detects as Flux (``supported_models.Flux``).

    Detection (``comfy.model_detection.detect_unet_config``) keys on
    ``double_blocks.0.img_attn.norm.key_norm.scale`` and ``img_in.weight``, reads
    ``hidden_size``, ``in_channels``, ``context_in_dim``, ``vec_in_dim`` and the block counts
    from shapes, but hard-codes ``num_heads=24``, ``axes_dim=[16, 56, 56]`` and
    ``mlp_ratio=4``: the head dim must be 128, so ``hidden_size`` must be 24 * 128 = 3072.
    Flux cannot be made narrow and still be detected; only depth and the input widths shrink.
    ``guidance_embed`` picks ``Flux`` (dev) or ``FluxSchnell``.
    """
    return {
        "image_model": "flux",
        "in_channels": 16,
        "out_channels": 16,
        "vec_in_dim": 32,
        "context_in_dim": 64,
        "hidden_size": 3072,
        "mlp_ratio": 4.0,
        "num_heads": 24,
        "depth": depth,
        "depth_single_blocks": depth_single_blocks,
        "axes_dim": [16, 56, 56],
        "theta": 10000,
        "patch_size": 2,
        "qkv_bias": True,
        "guidance_embed": guidance_embed,
        "txt_ids_dims": [],
    }


def write_flux_diffusion_model(
    path: str | os.PathLike,
    *,
    depth: int = 1,
    depth_single_blocks: int = 1,
    guidance_embed: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write (or reuse) a diffusion-model-only Flux file (UNETLoader layout, no prefix).

    The width cannot be small (see :func:`flux_file_config`): with one double and one single
    block it holds ~531 M parameters (~1.06 GB at float16); ``depth_single_blocks=0`` gives
    ~389 M (~780 MB). On a CPU the host loads it as float32 (about twice the file size in RAM).
    ``context_in_dim`` is 64 and ``vec_in_dim`` 32, so the matching text conditioning is
    ``(B, L, 64)`` with a ``pooled_output`` of ``(B, 32)``.
    """
    config = flux_file_config(depth, depth_single_blocks, guidance_embed)
    spec = {
        "builder": "flux_diffusion_model",
        "version": BUILDER_VERSION,
        "config": config,
        "seed": seed,
        "dtype": str(dtype),
    }

    def build() -> dict[str, torch.Tensor]:
        from comfy.ldm.flux.model import Flux

        flux = _meta_module(lambda: Flux(**config, device="meta", operations=_ops()))
        return random_state_dict(flux, seed, dtype)

    return _write_cached(Path(path), spec, build)
