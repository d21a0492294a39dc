"""LoRA adapters for diffusion models: attach, detach, save in Kohya's format, merge.

An adapter sits beside a frozen ``Linear`` or convolution layer and adds
``scale * up(down(dropout(x)))`` to the layer's output, with ``scale = alpha / rank``. It is
attached with a forward hook (bypass style): the base layer runs unchanged, its weights are
never copied or written, and :meth:`AttachedLoRA.detach` removes the hooks so the model is
exactly what it was (same outputs bit for bit, same ``__dict__`` keys, no attribute left).
Layers are matched with ``isinstance`` against torch's classes, so ComfyUI's ``comfy.ops``
subclasses of ``nn.Linear`` / ``nn.Conv2d`` are covered without importing the host.

Convolution adapters use Kohya's LoCon layout: ``down`` is a convolution with the layer's
kernel, stride, padding and dilation (``groups=1``) to ``rank`` channels, ``up`` a 1x1
convolution back to the layer's output channels. Saved tensors are then ``down: (rank, in,
*kernel)`` and ``up: (out, rank, 1, ...)``, which ComfyUI's loader multiplies into a weight delta.

Files are saved in Kohya's key format (``<key>.lora_down.weight``, ``<key>.lora_up.weight``,
``<key>.alpha``) with ``<key> = "lora_unet_" + module path with "_" for "."``, the one name
form ComfyUI's ``LoraLoader`` maps for every architecture. For SD1.x UNets the node layer can
pass diffusers module names instead (see :func:`diffusers_unet_key_map`), as Kohya's SD1.x
trainer writes them; Kohya's SDXL and Flux trainers write the original module paths, which
is what the default key already is.

Why not PEFT/LyCORIS: both were considered (PEFT is on PyPI, not shipped with ComfyUI; neither
is installed here). PEFT matches ``nn.Linear``/``nn.Conv2d`` subclasses by ``isinstance`` and has
a LoCon-like conv layout, so the maths would fit the host's ``comfy.ops`` layers; but it attaches
by *replacing* each target module with a wrapper that holds the original as ``base_layer``, so
while training every target weight of the shared model is renamed (``...to_q.base_layer.weight``).
ComfyUI's ``ModelPatcher`` addresses weights by path (patches, low-VRAM weight functions,
backups), as does ``blocks.py``; its unload puts the modules back, but detaching then means
rebuilding the module tree, its file format (``lora_A``/``lora_B`` under ``base_model.model.``)
needs converting anyway, and the pack would depend on PEFT and its own requirements (accelerate
among them). LyCORIS (like Kohya's ``networks.lora``) attaches by assigning the adapter's bound
method to the layer's ``forward`` attribute, and restores by assigning the old bound method back:
an instance ``forward`` entry stays in the layer's ``__dict__``, and two tools patching
``forward`` that way must detach in reverse order or one of them is lost. A forward hook has
neither problem: torch keeps it in the hook dictionaries every module already has, and removing
the handle empties them again. The adapter is ~100 lines, less than the glue either library
would need.

Nothing here imports ComfyUI.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from . import blocks
from .safefile import atomic_write_safetensors

# --------------------------------------------------------------------------------------------
# Configuration and targets
# --------------------------------------------------------------------------------------------

#: Class names of the transformer containers in ComfyUI's UNets (SD1.x, SD2.x, SDXL, SVD).
UNET_TRANSFORMER_CLASSES = ("SpatialTransformer", "BasicTransformerBlock", "SpatialVideoTransformer")
#: Class names of the UNet's residual blocks, whose convolutions ``include_conv`` adds.
UNET_RESBLOCK_CLASSES = ("ResBlock",)  # VideoResBlock subclasses ResBlock (matched along the MRO)

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class LoRAConfig:
    """What to train: the adapters' rank, scale, dropout and the layers they attach to.

    ``alpha`` ``None`` means ``alpha = rank`` (scale 1). ``targets`` are regular expressions
    searched (``re.search``) in each layer's dotted module path; ``None`` picks the layers of the
    model's transformer blocks (see :func:`find_target_layers`). ``include_conv`` adds
    convolutions (LoCon).
    """

    rank: int = 16
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None
    include_conv: bool = False

    @property
    def effective_alpha(self) -> float:
        return float(self.rank if self.alpha is None else self.alpha)

    @property
    def scale(self) -> float:
        return self.effective_alpha / self.rank

    def validate(self) -> "LoRAConfig":
        """Raise ``ValueError`` naming the field, its value and the fix; return ``self`` when valid."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(
                f"rank must be a whole number >= 1, got {self.rank!r}: use e.g. 4, 8, 16 or 32 "
                "(higher learns more detail and costs more memory)."
            )
        if self.alpha is not None:
            alpha = self.alpha
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
                raise ValueError(
                    f"alpha must be a number > 0 (or None for alpha = rank), got {alpha!r}: "
                    f"use e.g. {self.rank if isinstance(self.rank, int) and self.rank >= 1 else 16} "
                    "(scale = alpha / rank)."
                )
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (0.0 <= dropout < 1.0):
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}: use 0 (off) or e.g. 0.1.")
        if self.targets is not None:
            if isinstance(self.targets, str) or not all(isinstance(t, str) for t in self.targets):
                raise ValueError(
                    f"targets must be a tuple of regular expressions (or None for the default), got "
                    f"{self.targets!r}: e.g. (r'attn\\d\\.to_[qkv]$',)."
                )
            if len(self.targets) == 0:
                raise ValueError("targets is an empty tuple: give at least one pattern, or None for the default.")
            for pattern in self.targets:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ValueError(f"targets pattern {pattern!r} is not a valid regular expression: {exc}") from None
        return self


def find_target_layers(model: nn.Module, config: LoRAConfig) -> list[tuple[str, nn.Module]]:
    """The ``(module path, layer)`` pairs ``config`` selects in ``model``, in module order.

    Default (``targets is None``):

    * a UNet (a module whose class, along its MRO, is ``UNetModel`` or one of
      :data:`UNET_TRANSFORMER_CLASSES`): every ``nn.Linear`` inside the ``SpatialTransformer`` /
      ``BasicTransformerBlock`` / ``SpatialVideoTransformer`` modules (attention ``to_q/k/v/out``,
      feed-forward projections, linear ``proj_in``/``proj_out``); with ``include_conv`` also the
      convolutions of the ``ResBlock``s and of the transformers (conv ``proj_in``/``proj_out``);
    * a DiT: every ``nn.Linear`` (and with ``include_conv`` every convolution) inside the
      checkpoint units of :func:`blocks.find_units` (``double_blocks``, ``blocks``, ...).

    With ``targets``: every ``nn.Linear`` (and with ``include_conv`` convolution) whose path
    matches one of the patterns; a pattern that matches no layer raises ``ValueError``.
    Grouped convolutions are never targets (a LoCon delta cannot express them).
    """
    config.validate()
    if config.targets is not None:
        return _explicit_targets(model, config)

    if _is_unet(model):
        containers = _paths_of_classes(model, UNET_TRANSFORMER_CLASSES)
        resblocks = _paths_of_classes(model, UNET_RESBLOCK_CLASSES) if config.include_conv else []
        found = []
        for path, module in model.named_modules():
            inside_transformer = _inside_any(path, containers)
            if isinstance(module, nn.Linear) and inside_transformer:
                found.append((path, module))
            elif config.include_conv and _is_supported_conv(module) and (inside_transformer or _inside_any(path, resblocks)):
                found.append((path, module))
        where = "the UNet's transformer blocks (" + ", ".join(UNET_TRANSFORMER_CLASSES) + ")"
    else:
        try:
            units = blocks.find_units(model)
        except blocks.UnsupportedArchitectureError as exc:
            raise ValueError(
                f"targets is None, but the default targets cannot be found: {exc} Pass explicit "
                "targets (regular expressions on module paths), e.g. targets=(r'attn', r'mlp')."
            ) from None
        prefixes = [unit.name for unit in units.units]
        found = [
            (path, module)
            for path, module in model.named_modules()
            if _inside_any(path, prefixes, include_self=True)
            and (isinstance(module, nn.Linear) or (config.include_conv and _is_supported_conv(module)))
        ]
        where = f"the {units.architecture} blocks ({units.source})"
    if not found:
        kinds = "Linear or convolution" if config.include_conv else "Linear"
        raise ValueError(
            f"targets is None and no {kinds} layer was found in {where} of "
            f"{type(model).__name__}: pass explicit targets, e.g. targets=(r'to_q$',), "
            + ("" if config.include_conv else "or set include_conv=True, ")
            + f"among these paths: {_example_paths(model, config.include_conv)}"
        )
    return found


def _explicit_targets(model: nn.Module, config: LoRAConfig) -> list[tuple[str, nn.Module]]:
    assert config.targets is not None
    candidates = [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) or (config.include_conv and _is_supported_conv(module))
    ]
    compiled = [(pattern, re.compile(pattern)) for pattern in config.targets]
    unmatched = [pattern for pattern, regex in compiled if not any(regex.search(path) for path, _ in candidates)]
    if unmatched:
        kinds = "Linear or convolution" if config.include_conv else "Linear"
        raise ValueError(
            f"targets pattern(s) {unmatched!r} match no {kinds} layer of {type(model).__name__}; "
            f"patterns are searched in dotted module paths such as: {_example_paths(model, config.include_conv)}"
        )
    return [(path, module) for path, module in candidates if any(regex.search(path) for _, regex in compiled)]


def _is_unet(model: nn.Module) -> bool:
    if any(cls.__name__ in blocks.UNET_CLASSES for cls in type(model).__mro__):
        return True
    return any(_class_matches(module, UNET_TRANSFORMER_CLASSES) for module in model.modules())


def _class_matches(module: nn.Module, names: tuple[str, ...]) -> bool:
    return any(cls.__name__ in names for cls in type(module).__mro__)


def _paths_of_classes(model: nn.Module, names: tuple[str, ...]) -> list[str]:
    return [path for path, module in model.named_modules() if _class_matches(module, names)]


def _inside_any(path: str, prefixes: list[str], include_self: bool = False) -> bool:
    for prefix in prefixes:
        if prefix == "":
            return True
        if path.startswith(prefix + ".") or (include_self and path == prefix):
            return True
    return False


def _is_supported_conv(module: nn.Module) -> bool:
    return isinstance(module, _CONV_TYPES) and module.groups == 1


def _example_paths(model: nn.Module, include_conv: bool, count: int = 6) -> str:
    paths = [
        path
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) or (include_conv and _is_supported_conv(module))
    ]
    if not paths:
        return "(the model has no such layer)"
    shown = paths[:: max(1, len(paths) // count)][:count]
    return ", ".join(repr(p) for p in shown) + (f" ... ({len(paths)} in all)" if len(paths) > len(shown) else "")


# --------------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------------


class LoRAAdapter(nn.Module):
    """The trainable pair beside one frozen layer: ``delta(x) = scale * up(down(dropout(x)))``.

    Holds its weights in its own dtype; :meth:`forward` casts the input to that dtype and the
    caller casts the delta back to the layer's output dtype.
    """

    def __init__(
        self,
        layer: nn.Module,
        rank: int,
        alpha: float,
        dropout: float,
        *,
        generator: torch.Generator,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if device is None:
            device = layer.weight.device
        self.rank = rank
        self.alpha = float(alpha)
        self.scale = self.alpha / rank
        self.dropout = float(dropout)
        if isinstance(layer, nn.Linear):
            self.kind = "linear"
            self.down = nn.Linear(layer.in_features, rank, bias=False, device="meta")
            self.up = nn.Linear(rank, layer.out_features, bias=False, device="meta")
        elif isinstance(layer, _CONV_TYPES):
            if layer.groups != 1:
                raise ValueError(f"grouped convolutions (groups={layer.groups}) cannot take a LoCon adapter")
            conv_cls = next(cls for cls in _CONV_TYPES if isinstance(layer, cls))
            self.kind = conv_cls.__name__.lower()
            self.down = conv_cls(
                layer.in_channels,
                rank,
                kernel_size=layer.kernel_size,
                stride=layer.stride,
                padding=layer.padding,
                dilation=layer.dilation,
                groups=1,
                bias=False,
                padding_mode=layer.padding_mode,
                device="meta",
            )
            self.up = conv_cls(rank, layer.out_channels, kernel_size=1, bias=False, device="meta")
        else:
            raise TypeError(f"LoRA adapters attach to nn.Linear or nn.Conv1d/2d/3d, not {type(layer).__name__}")
        # Initialise on the CPU from the caller's generator (the same numbers on every device),
        # then move: down ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (torch's kaiming_uniform_(a=sqrt(5))
        # default for Linear/Conv), up = 0 so the attached model starts equal to the base model.
        down_shape = tuple(self.down.weight.shape)
        fan_in = math.prod(down_shape[1:])
        bound = 1.0 / math.sqrt(fan_in)
        down = torch.empty(down_shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        self.down.weight = nn.Parameter(down.to(device=device, dtype=dtype))
        self.up.weight = nn.Parameter(torch.zeros(self.up.weight.shape, device=device, dtype=dtype))

    @property
    def dtype(self) -> torch.dtype:
        return self.down.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.down.weight.dtype)
        if self.dropout > 0.0 and self.training:
            # torch's global RNG on purpose: non-reentrant checkpointing saves and restores the
            # global (CPU and device) RNG state around the recompute, so the recomputed forward
            # draws the same mask. A private torch.Generator is not restored: the recompute would
            # draw a different mask than the forward and the gradients would be wrong.
            x = F.dropout(x, p=self.dropout, training=True)
        return self.up(self.down(x)) * self.scale

    def delta_weight(self) -> torch.Tensor:
        """``scale * up @ down`` in the base layer's weight layout (fp32, detached)."""
        return _delta(self.up.weight.detach(), self.down.weight.detach(), self.scale)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, rank={self.rank}, alpha={self.alpha:g}, dropout={self.dropout:g}"


class _LoRAHook:
    """The forward hook that adds an adapter's delta to a layer's output (recognisable by type)."""

    def __init__(self, adapter: LoRAAdapter, path: str) -> None:
        self.adapter = adapter
        self.path = path

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        x = args[0] if args else kwargs["input"]
        adapter = self.adapter
        if x.device != adapter.down.weight.device:
            raise RuntimeError(
                f"LoRA adapter of {self.path!r} is on {adapter.down.weight.device} but the layer ran on "
                f"{x.device}: attach the LoRA with device={x.device!s} (or move it there with .to())."
            )
        return output + adapter(x).to(output.dtype)


class AttachedLoRA:
    """Adapters attached to a model by forward hooks; detach to leave the model as it was.

    ``adapters`` maps each target's module path to its :class:`LoRAAdapter`. Usable as a
    context manager (detaches on exit). The adapters stay usable after :meth:`detach` (for
    :func:`kohya_state_dict`), they just no longer act on the model.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, adapters: dict[str, LoRAAdapter], handles: list) -> None:
        self.model_class = type(model).__name__
        self.config = config
        self.adapters = adapters
        self._handles = handles

    # -- state ------------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def parameters(self) -> Iterator[nn.Parameter]:
        for adapter in self.adapters.values():
            yield from adapter.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for path, adapter in self.adapters.items():
            yield f"{path}.lora_down.weight", adapter.down.weight
            yield f"{path}.lora_up.weight", adapter.up.weight

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def train(self, mode: bool = True) -> "AttachedLoRA":
        """Dropout on (``True``) or off; the base model's own mode is not touched."""
        for adapter in self.adapters.values():
            adapter.train(mode)
        return self

    def eval(self) -> "AttachedLoRA":
        return self.train(False)

    def to(self, *args: Any, **kwargs: Any) -> "AttachedLoRA":
        for adapter in self.adapters.values():
            adapter.to(*args, **kwargs)
        return self

    def state(self) -> dict[str, torch.Tensor]:
        """Exact copies of every adapter tensor, by ``<path>.lora_down.weight`` / ``.lora_up.weight``."""
        return {name: param.detach().clone() for name, param in self.named_parameters()}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy tensors saved by :meth:`state` into the adapters (same keys and shapes required)."""
        own = dict(self.named_parameters())
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(
                "LoRA state does not fit these adapters: "
                + (f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''} " if missing else "")
                + (f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''} " if unexpected else "")
                + "(was it saved with another rank, targets or model?)"
            )
        for name, param in own.items():
            value = state[name]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"LoRA state {name!r} has shape {tuple(value.shape)}, the adapter has {tuple(param.shape)} "
                    "(was it saved with another rank?)"
                )
        with torch.no_grad():
            for name, param in own.items():
                param.copy_(state[name].to(device=param.device, dtype=param.dtype))

    # -- lifetime ---------------------------------------------------------------------------
    def detach(self) -> None:
        """Remove every hook; idempotent. The model is then exactly as before :func:`attach_lora`."""
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> "AttachedLoRA":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        state = "attached" if self.attached else "detached"
        return (
            f"AttachedLoRA({len(self.adapters)} layers of {self.model_class}, rank={self.config.rank}, "
            f"alpha={self.config.effective_alpha:g}, {self.num_parameters()} parameters, {state})"
        )


def attach_lora(
    model: nn.Module,
    config: LoRAConfig,
    *,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> AttachedLoRA:
    """Attach one adapter to each layer :func:`find_target_layers` selects.

    ``generator`` (a CPU ``torch.Generator``) initialises the ``down`` weights, in module
    order; ``up`` starts at zero, so the model's output is unchanged until training moves it.
    Adapter weights are ``dtype`` on ``device`` (default: each layer's weight device). The base
    parameters' ``requires_grad`` is left as it is: freezing the base is the caller's job.
    Raises ``ValueError`` when a target layer already has a LoRA attached.
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (seeded by the caller), got {type(generator).__name__}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
    config.validate()
    targets = find_target_layers(model, config)
    for path, layer in targets:
        if any(isinstance(hook, _LoRAHook) for hook in layer._forward_hooks.values()):
            raise ValueError(
                f"layer {path!r} of {type(model).__name__} already has a LoRA attached: detach the "
                "first one (AttachedLoRA.detach()) before attaching another."
            )
    adapters: dict[str, LoRAAdapter] = {}
    handles = []
    try:
        for path, layer in targets:
            adapter = LoRAAdapter(
                layer,
                config.rank,
                config.effective_alpha,
                config.dropout,
                generator=generator,
                dtype=dtype,
                device=device,
            )
            adapters[path] = adapter
            handles.append(layer.register_forward_hook(_LoRAHook(adapter, path), with_kwargs=True))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return AttachedLoRA(model, config, adapters, handles)


# --------------------------------------------------------------------------------------------
# Kohya key format
# --------------------------------------------------------------------------------------------


def default_kohya_key(path: str) -> str:
    """``lora_unet_`` + the module path with ``_`` for ``.``: the key ComfyUI maps for every model."""
    return "lora_unet_" + path.replace(".", "_")


def diffusers_unet_key_map(unet_to_diffusers: Mapping[str, str]) -> dict[str, str]:
    """Comfy module path -> diffusers module path, from the host's ``comfy.utils.unet_to_diffusers``.

    ``unet_to_diffusers(unet_config)`` maps diffusers parameter names to ComfyUI parameter names
    (``"down_blocks.0.attentions.0.proj_in.weight" -> "input_blocks.1.1.proj_in.weight"``). This
    inverts its ``.weight`` entries into module paths; where two diffusers names map to one
    ComfyUI layer (``class_embedding``/``add_embedding``) the alphabetically first is kept, so
    the result does not depend on set order. Pass it to :func:`key_function_from_map`.
    """
    inverse: dict[str, str] = {}
    for diffusers_name, comfy_name in sorted(unet_to_diffusers.items()):
        if not (diffusers_name.endswith(".weight") and comfy_name.endswith(".weight")):
            continue
        comfy_path = comfy_name[: -len(".weight")]
        inverse.setdefault(comfy_path, diffusers_name[: -len(".weight")])
    return inverse


def key_function_from_map(comfy_to_diffusers: Mapping[str, str]) -> Callable[[str], str]:
    """A ``key_for_path`` that names mapped layers ``lora_unet_<diffusers path>`` and others by default."""
    mapping = dict(comfy_to_diffusers)

    def key_for_path(path: str) -> str:
        mapped = mapping.get(path)
        return default_kohya_key(path) if mapped is None else "lora_unet_" + mapped.replace(".", "_")

    return key_for_path


def kohya_state_dict(
    attached: AttachedLoRA,
    key_for_path: Callable[[str], str] = default_kohya_key,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The adapters as Kohya LoRA tensors on the CPU: ``<key>.lora_down.weight``, ``.lora_up.weight``, ``.alpha``.

    Module paths must be relative to the diffusion model itself (ComfyUI's
    ``model.model.diffusion_model``, the module :func:`attach_lora` was given), as the host's
    key map expects: ``input_blocks.1.1...``, ``double_blocks.0...``, not ``diffusion_model....``.

    ``dtype`` converts the weights (e.g. ``torch.float16`` for a smaller file); ``None`` keeps
    the adapters' dtype. ``alpha`` is a 0-dim fp32 tensor. Raises ``ValueError`` when two
    paths get one key.
    """
    out: dict[str, torch.Tensor] = {}
    owner: dict[str, str] = {}
    for path, adapter in attached.adapters.items():
        key = key_for_path(path)
        if key in owner:
            raise ValueError(f"key_for_path gives {key!r} for both {owner[key]!r} and {path!r}")
        owner[key] = path
        down = adapter.down.weight.detach()
        up = adapter.up.weight.detach()
        if dtype is not None:
            down, up = down.to(dtype), up.to(dtype)
        out[f"{key}.lora_down.weight"] = down.to("cpu", copy=True).contiguous()
        out[f"{key}.lora_up.weight"] = up.to("cpu", copy=True).contiguous()
        out[f"{key}.alpha"] = torch.tensor(adapter.alpha, dtype=torch.float32)
    return out


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------

METADATA_PREFIX = "lowvram_lora."
FORMAT_VERSION = "1"


def lora_metadata(
    config: LoRAConfig,
    *,
    architecture: str,
    base_model_version: str | None = None,
    steps: int | None = None,
    checkpointing: Mapping[str, Any] | None = None,
    training: Mapping[str, Any] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The file's metadata, all strings: Kohya's ``ss_*`` keys plus this pack's ``lowvram_lora.*``.

    ``architecture`` is the model class (``UNetModel``, ``Flux``, ...); ``base_model_version``
    Kohya's name for the base (``sd_v1``, ``sdxl_base_v1-0``, ``flux1``; defaults to
    ``architecture``). ``checkpointing`` (the plan) and ``training`` (learning rate, batch,
    seed, ...) are stored as JSON strings.
    """
    config.validate()
    meta: dict[str, str] = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(config.rank),
        "ss_network_alpha": _number(config.effective_alpha),
        "ss_network_dropout": _number(config.dropout),
        "ss_base_model_version": base_model_version or architecture,
        f"{METADATA_PREFIX}format_version": FORMAT_VERSION,
        f"{METADATA_PREFIX}architecture": architecture,
        f"{METADATA_PREFIX}lora_config": json.dumps(asdict(config), sort_keys=True),
    }
    if config.include_conv:
        meta["ss_network_args"] = json.dumps(
            {"conv_dim": str(config.rank), "conv_alpha": _number(config.effective_alpha)}, sort_keys=True
        )
    if steps is not None:
        meta["ss_steps"] = str(int(steps))
    if checkpointing is not None:
        meta[f"{METADATA_PREFIX}checkpointing"] = json.dumps(checkpointing, sort_keys=True, default=str)
    if training is not None:
        meta[f"{METADATA_PREFIX}training"] = json.dumps(training, sort_keys=True, default=str)
    for key, value in (extra or {}).items():
        meta[str(key)] = value
    for key, value in meta.items():
        if not isinstance(value, str):
            raise TypeError(f"metadata[{key!r}] must be a string, got {type(value).__name__}")
    return meta


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def save_lora_file(
    path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write a LoRA safetensors file atomically; ``FileExistsError`` (naming it) if ``path`` exists."""
    return atomic_write_safetensors(path, tensors, metadata or {}, overwrite=False)


def load_lora_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors LoRA file (safetensors only: nothing is unpickled)."""
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        metadata = dict(handle.metadata() or {})
        for key in handle.keys():
            tensors[key] = handle.get_tensor(key)
    return tensors, metadata


# --------------------------------------------------------------------------------------------
# Merging
# --------------------------------------------------------------------------------------------


def _delta(up: torch.Tensor, down: torch.Tensor, scale: float) -> torch.Tensor:
    up32 = up.to(torch.float32)
    down32 = down.to(torch.float32)
    delta = up32.flatten(1) @ down32.flatten(1)
    return (delta * scale).reshape((up.shape[0],) + tuple(down.shape[1:]))


def lora_delta_weights(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kohya LoRA key -> ``scale * up @ down`` (fp32, in the base weight's layout).

    ``scale = alpha / rank``, with ``alpha = rank`` when the file has no ``.alpha``.
    """
    deltas: dict[str, torch.Tensor] = {}
    for name in tensors:
        if not name.endswith(".lora_down.weight"):
            continue
        key = name[: -len(".lora_down.weight")]
        up_name = f"{key}.lora_up.weight"
        if up_name not in tensors:
            raise ValueError(f"LoRA tensors have {name!r} but no {up_name!r}")
        down, up = tensors[name], tensors[up_name]
        rank = down.shape[0]
        alpha_t = tensors.get(f"{key}.alpha")
        alpha = float(alpha_t.item()) if alpha_t is not None else float(rank)
        deltas[key] = _delta(up, down, alpha / rank)
    return deltas


def merge_lora(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    key_for_path: Callable[[str], str] = default_kohya_key,
    strength: float = 1.0,
) -> None:
    """Add ``strength * scale * up @ down`` into the weights of ``model``'s layers, in place.

    Each ``nn.Linear``/convolution of ``model`` is looked up by ``key_for_path(path)``. Raises
    ``ValueError`` (before changing anything) when a LoRA key matches no layer or a shape does
    not fit.
    """
    deltas = lora_delta_weights(tensors)
    layers = {}
    for path, module in model.named_modules():
        if isinstance(module, (nn.Linear,) + _CONV_TYPES):
            key = key_for_path(path)
            if key in deltas:
                layers[key] = (path, module)
    unknown = sorted(set(deltas) - set(layers))
    if unknown:
        raise ValueError(
            f"{len(unknown)} LoRA key(s) match no layer of {type(model).__name__} under this key_for_path, e.g. "
            f"{unknown[:3]}: was the file made for another model or with another key format?"
        )
    for key, (path, module) in layers.items():
        if tuple(deltas[key].shape) != tuple(module.weight.shape):
            raise ValueError(
                f"LoRA {key!r} gives a weight delta of shape {tuple(deltas[key].shape)}, but {path!r} has "
                f"{tuple(module.weight.shape)}"
            )
    with torch.no_grad():
        for key, (_path, module) in layers.items():
            weight = module.weight
            merged = weight.to(torch.float32) + strength * deltas[key].to(weight.device)
            weight.copy_(merged.to(weight.dtype))
