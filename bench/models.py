"""The benchmark's models: the host's own classes (UNetModel, Flux) with random weights, and a
plain-torch DiT for the core-only fallback when no host is found.

Every model is built on the ``meta`` device, moved with ``to_empty`` to where it runs, and
filled there from one seeded generator, so a 12 B-parameter Flux is built on a GPU in seconds
and every configuration of a run trains the very same weights. No file, no network.

Sizes:

- ``small``: seconds on a CPU (tests, ``--quick``, dry runs of the GPU script);
- ``cpu``: the CPU benchmark (SD1.5 widths at three levels, a narrow Flux);
- ``full``: the GPU benchmark at real sizes (SD1.5 at 512², SDXL and full Flux at 1024²).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SIZES = ("small", "cpu", "full")
MODELS_FOR_SIZE = {"small": ("sd15", "flux"), "cpu": ("sd15", "flux"), "full": ("sd15", "sdxl", "flux")}


@dataclass(frozen=True)
class ModelSpec:
    key: str  # "sd15", "sdxl", "flux"
    title: str  # for people: what the model is, at what size
    family: str  # the host's model config class: "SD15", "SDXL", "Flux"
    config: dict[str, Any] = field(repr=False)  # the diffusion model's constructor arguments
    latent: tuple[int, int, int]  # (C, H, W) of the one training latent
    context: tuple[int, int]  # (tokens, width) of the text conditioning
    pooled: int | None = None  # width of the pooled text vector (SDXL, Flux)
    options: dict[str, Any] = field(default_factory=dict, repr=False)  # further conditioning options

    @property
    def short(self) -> str:
        """The model column of the table."""
        return SHORT_NAMES.get(self.key, self.key)


SHORT_NAMES = {"sd15": "SD1.5 UNet", "sdxl": "SDXL UNet", "flux": "Flux DiT", "core_dit": "core DiT"}


def _unet_config(
    *,
    model_channels: int,
    channel_mult: list[int],
    num_res_blocks: int,
    transformer_depth: list[int],
    transformer_depth_output: list[int],
    transformer_depth_middle: int,
    context_dim: int,
    **extra: Any,
) -> dict[str, Any]:
    config = {
        "image_size": 32,
        "in_channels": 4,
        "out_channels": 4,
        "model_channels": model_channels,
        "num_res_blocks": [num_res_blocks] * len(channel_mult),
        "channel_mult": channel_mult,
        "transformer_depth": transformer_depth,
        "transformer_depth_output": transformer_depth_output,
        "transformer_depth_middle": transformer_depth_middle,
        "context_dim": context_dim,
        "use_spatial_transformer": True,
        "use_linear_in_transformer": False,
        "legacy": False,
        "adm_in_channels": None,
        "use_temporal_resblock": False,
        "use_temporal_attention": False,
        "use_checkpoint": False,
    }
    config.update(extra)
    return config


def _flux_config(*, hidden: int, heads: int, depth: int, single: int, axes: list[int], context_dim: int, vec_dim: int) -> dict[str, Any]:
    assert sum(axes) == hidden // heads, "Flux's rotary axes must add up to the head width"
    return {
        "image_model": "flux",
        "in_channels": 16,
        "out_channels": 16,
        "vec_in_dim": vec_dim,
        "context_in_dim": context_dim,
        "hidden_size": hidden,
        "mlp_ratio": 4.0,
        "num_heads": heads,
        "depth": depth,
        "depth_single_blocks": single,
        "axes_dim": axes,
        "theta": 10000,
        "patch_size": 2,
        "qkv_bias": True,
        "guidance_embed": True,
        "txt_ids_dims": [],
    }


def _spec_table() -> dict[tuple[str, str], ModelSpec]:
    specs: dict[tuple[str, str], ModelSpec] = {}
    # SD1.5 family. SD15's config forces 8 heads (head width = channels / 8).
    specs[("sd15", "small")] = ModelSpec(
        "sd15",
        "SD1.5-shaped UNet (small: 64 ch, 3 levels, 16² latent)",
        "SD15",
        _unet_config(
            model_channels=64, channel_mult=[1, 2, 2], num_res_blocks=1, transformer_depth=[1, 1, 1],
            transformer_depth_output=[1] * 6, transformer_depth_middle=1, context_dim=64,
        ),
        latent=(4, 16, 16),
        context=(16, 64),
    )
    specs[("sd15", "cpu")] = ModelSpec(
        "sd15",
        "SD1.5-shaped UNet (320 ch, ×1/2/4, 1 res block per level, 24² latent)",
        "SD15",
        _unet_config(
            model_channels=320, channel_mult=[1, 2, 4], num_res_blocks=1, transformer_depth=[1, 1, 1],
            transformer_depth_output=[1] * 6, transformer_depth_middle=1, context_dim=768,
        ),
        latent=(4, 24, 24),
        context=(77, 768),
    )
    specs[("sd15", "full")] = ModelSpec(
        "sd15",
        "SD1.5 UNet (860 M) at 512²",
        "SD15",
        _unet_config(
            model_channels=320, channel_mult=[1, 2, 4, 4], num_res_blocks=2, transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
            transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], transformer_depth_middle=1, context_dim=768,
        ),
        latent=(4, 64, 64),
        context=(77, 768),
    )
    sdxl_extra = {"use_linear_in_transformer": True, "adm_in_channels": 2816, "num_classes": "sequential"}
    specs[("sdxl", "small")] = ModelSpec(
        "sdxl",
        "SDXL-shaped UNet (small: 64 ch, depths 0/1/2, 16² latent)",
        "SDXL",
        _unet_config(
            model_channels=64, channel_mult=[1, 2, 2], num_res_blocks=1, transformer_depth=[0, 1, 2],
            transformer_depth_output=[0, 0, 1, 1, 2, 2], transformer_depth_middle=2, context_dim=64,
            **{**sdxl_extra, "adm_in_channels": 32 + 6 * 256},
        ),
        latent=(4, 16, 16),
        context=(16, 64),
        pooled=32,
        options={"width": 128, "height": 128},
    )
    specs[("sdxl", "full")] = ModelSpec(
        "sdxl",
        "SDXL UNet (2.6 B) at 1024²",
        "SDXL",
        _unet_config(
            model_channels=320, channel_mult=[1, 2, 4], num_res_blocks=2, transformer_depth=[0, 0, 2, 2, 10, 10],
            transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], transformer_depth_middle=10, context_dim=2048,
            **sdxl_extra,
        ),
        latent=(4, 128, 128),
        context=(77, 2048),
        pooled=1280,
        options={"width": 1024, "height": 1024},
    )
    specs[("flux", "small")] = ModelSpec(
        "flux",
        "Flux-shaped DiT (small: hidden 64, 1+2 blocks, 8² latent)",
        "Flux",
        _flux_config(hidden=64, heads=2, depth=1, single=2, axes=[8, 12, 12], context_dim=32, vec_dim=32),
        latent=(16, 8, 8),
        context=(8, 32),
        pooled=32,
        options={"guidance": 3.5},
    )
    specs[("flux", "cpu")] = ModelSpec(
        "flux",
        "Flux-shaped DiT (hidden 768, 3 double + 6 single blocks, 32² latent)",
        "Flux",
        _flux_config(hidden=768, heads=6, depth=3, single=6, axes=[16, 56, 56], context_dim=4096, vec_dim=768),
        latent=(16, 32, 32),
        context=(128, 4096),
        pooled=768,
        options={"guidance": 3.5},
    )
    specs[("flux", "full")] = ModelSpec(
        "flux",
        "Flux (12 B: hidden 3072, 19 double + 38 single) at 1024²",
        "Flux",
        _flux_config(hidden=3072, heads=24, depth=19, single=38, axes=[16, 56, 56], context_dim=4096, vec_dim=768),
        latent=(16, 128, 128),
        context=(512, 4096),
        pooled=768,
        options={"guidance": 3.5},
    )
    return specs


SPECS = _spec_table()


def spec(key: str, size: str) -> ModelSpec:
    try:
        return SPECS[(key, size)]
    except KeyError:
        sizes = sorted(s for k, s in SPECS if k == key)
        raise ValueError(f"no bench model {key!r} at size {size!r}; sizes for it: {sizes}") from None


# --------------------------------------------------------------------------------------------
# Weights and data


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every floating-point parameter and buffer in place, on its own device, from one seeded
    generator in state-dict order: matrices and kernels ~ N(0, 1/fan_in), biases and shifts
    ~ N(0, 0.02²), other vectors (norm scales) ~ 1 + N(0, 0.02²). Keeps activations of order one
    through a deep network, so losses and gradients are finite."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for key, tensor in module.state_dict(keep_vars=True).items():
            if not tensor.is_floating_point():
                continue
            device = tensor.device
            if device not in generators:
                generators[device] = torch.Generator(device=device).manual_seed(seed)
            generator = generators[device]
            if tensor.ndim >= 2:
                tensor.normal_(0.0, 1.0 / math.sqrt(max(1, math.prod(tensor.shape[1:]))), generator=generator)
            elif key.endswith(("bias", "shift")):
                tensor.normal_(0.0, 0.02, generator=generator)
            else:
                tensor.normal_(1.0, 0.02, generator=generator)
    return module


def training_data(model: ModelSpec, seed: int = 0) -> tuple[torch.Tensor, list]:
    """One latent ``(1, C, H, W)`` and its CONDITIONING (the host's list of ``[tensor, options]``)."""
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn((1, *model.latent), generator=generator)
    context = torch.randn((1, *model.context), generator=generator)
    options: dict[str, Any] = dict(model.options)
    if model.pooled is not None:
        options["pooled_output"] = torch.randn((1, model.pooled), generator=generator)
    return latent, [[context, options]]


# --------------------------------------------------------------------------------------------
# Host models


def build_host_patcher(model: ModelSpec, device: torch.device | str, dtype: torch.dtype, seed: int = 0):
    """A host ``ModelPatcher`` around a host ``BaseModel`` holding ``model``, random and seeded.

    Import ``comfy`` first (see :mod:`bench.host`).
    """
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    device = torch.device(device)
    config_class = {
        "SD15": comfy.supported_models.SD15,
        "SDXL": comfy.supported_models.SDXL,
        "Flux": comfy.supported_models.Flux,
    }[model.family]
    model_config = config_class(dict(model.config))
    model_config.set_inference_dtype(dtype, None)
    if model.family == "SD15":
        factory = lambda: comfy.model_base.BaseModel(model_config, model_type=comfy.model_base.ModelType.EPS, device="meta")  # noqa: E731
    elif model.family == "SDXL":
        factory = lambda: comfy.model_base.SDXL(model_config, model_type=comfy.model_base.ModelType.EPS, device="meta")  # noqa: E731
    else:
        factory = lambda: comfy.model_base.Flux(model_config, model_type=comfy.model_base.ModelType.FLUX, device="meta")  # noqa: E731
    with torch.random.fork_rng(devices=[]):
        base_model = factory()
    base_model.diffusion_model.to_empty(device=device)
    randomize_(base_model.diffusion_model, seed)
    base_model.device = device
    offload = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(base_model, load_device=device, offload_device=offload)


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------------------------
# The core-only fallback: a plain-torch DiT shaped like Flux's single-stream blocks


def _timestep_features(t: torch.Tensor, width: int = 256) -> torch.Tensor:
    half = width // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = t.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class CoreBlock(nn.Module):
    """Modulated norm, then attention and MLP in parallel from one projection (as Flux's single blocks)."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.heads = heads
        self.mlp_width = int(hidden * mlp_ratio)
        self.modulation = nn.Linear(hidden, 3 * hidden)
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear1 = nn.Linear(hidden, 3 * hidden + self.mlp_width)
        self.linear2 = nn.Linear(hidden + self.mlp_width, hidden)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.modulation(F.silu(vec))[:, None].chunk(3, dim=-1)
        qkv, mlp = self.linear1(self.norm(x) * (1 + scale) + shift).split([3 * x.shape[-1], self.mlp_width], dim=-1)
        b, n, _ = qkv.shape
        q, k, v = qkv.view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1)
        return x + gate * self.linear2(torch.cat([attention, F.gelu(mlp, approximate="tanh")], dim=-1))


class CoreDiT(nn.Module):
    """Patchified latent and text tokens through a list of :class:`CoreBlock` (a flow model)."""

    def __init__(self, *, in_channels: int, hidden: int, heads: int, depth: int, context_dim: int, patch: int = 2) -> None:
        super().__init__()
        self.patch = patch
        self.img_in = nn.Linear(in_channels * patch * patch, hidden)
        self.txt_in = nn.Linear(context_dim, hidden)
        self.time_in = nn.Sequential(nn.Linear(256, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.blocks = nn.ModuleList([CoreBlock(hidden, heads) for _ in range(depth)])
        self.norm_out = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final = nn.Linear(hidden, in_channels * patch * patch)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.patch
        tokens = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)
        vec = self.time_in(_timestep_features(sigma).to(x.dtype))
        hidden = torch.cat([self.txt_in(context), self.img_in(tokens)], dim=1)
        for block in self.blocks:
            hidden = block(hidden, vec)
        out = self.final(self.norm_out(hidden[:, context.shape[1] :]))
        return out.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


CORE_SPECS: dict[str, dict[str, Any]] = {
    "small": {"hidden": 128, "heads": 2, "depth": 6, "context_dim": 64, "latent": (16, 16, 16), "tokens": 16},
    "cpu": {"hidden": 512, "heads": 4, "depth": 8, "context_dim": 768, "latent": (16, 32, 32), "tokens": 128},
    "full": {"hidden": 3072, "heads": 24, "depth": 38, "context_dim": 4096, "latent": (16, 128, 128), "tokens": 512},
}


def core_spec(size: str) -> ModelSpec:
    values = CORE_SPECS[size]
    return ModelSpec(
        "core_dit",
        f"plain-torch DiT (hidden {values['hidden']}, {values['depth']} blocks, "
        f"{values['latent'][1]}² latent; no host)",
        "CoreDiT",
        {k: values[k] for k in ("hidden", "heads", "depth", "context_dim")},
        latent=values["latent"],
        context=(values["tokens"], values["context_dim"]),
    )


def build_core_model(model: ModelSpec, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> CoreDiT:
    with torch.device("meta"):
        core = CoreDiT(in_channels=model.latent[0], **model.config)
    core.to_empty(device=device)
    core.to(dtype)
    return randomize_(core, seed).eval()
