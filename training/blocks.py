"""Which modules of a diffusion model are checkpoint units.

A checkpoint unit is a module whose ``forward`` the model really calls while it runs, and whose
activations are worth recomputing. Wrapping a container the model never calls does nothing: in
ComfyUI's UNet, ``forward_timestep_embed`` iterates the layers of each ``TimestepEmbedSequential``
itself, so the units are those layers, not the sequential.

Architectures are recognised by class name (this module never imports the host), through a
registry of the block lists each model iterates, in call order, with a generic fallback: the
longest list of two or more modules of one class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from torch import nn


@dataclass(frozen=True)
class CheckpointUnit:
    """One module that checkpointing may wrap: its dotted path from the model root and the module."""

    name: str
    module: nn.Module

    @property
    def kind(self) -> str:
        return type(self.module).__name__


@dataclass(frozen=True)
class UnitSet:
    """The checkpoint units of one model, in the order the model calls them."""

    architecture: str
    source: str  # "registry: <entry>" or "generic: <list path>"
    units: tuple[CheckpointUnit, ...]

    def names(self) -> tuple[str, ...]:
        return tuple(unit.name for unit in self.units)

    def __len__(self) -> int:
        return len(self.units)


class UnsupportedArchitectureError(ValueError):
    """The model has no block structure the pack can checkpoint."""


# Block lists by diffusion-model class name (matched along the MRO, so subclasses such as the
# VACE or camera variants of Wan are covered), in the order the model's forward runs them.
DIT_BLOCK_LISTS: dict[str, tuple[str, ...]] = {
    "Flux": ("double_blocks", "single_blocks"),
    "Chroma": ("double_blocks", "single_blocks"),
    "ChromaRadiance": ("double_blocks", "single_blocks"),
    "HunyuanVideo": ("double_blocks", "single_blocks"),
    "Hunyuan3Dv2": ("double_blocks", "single_blocks"),
    "OpenAISignatureMMDITWrapper": ("joint_blocks",),
    "MMDiT": ("joint_blocks", "double_layers", "single_layers"),
    "WanModel": ("blocks",),
    "AsymmDiTJoint": ("blocks",),
    "PixArtMS": ("blocks",),
    "PixArt": ("blocks",),
    "HunYuanDiT": ("blocks",),
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    "LTXVModel": ("transformer_blocks",),
    "LTXAVModel": ("transformer_blocks",),
    "ACEStepTransformer2DModel": ("transformer_blocks",),
    "NextDiT": ("layers",),
    "HiDreamImageTransformer2DModel": ("double_stream_blocks", "single_stream_blocks"),
    "Kandinsky5": ("visual_transformer_blocks",),
}

UNET_CLASSES = ("UNetModel",)
UNET_SEQUENCES = ("input_blocks", "middle_block", "output_blocks")
# Layers inside a UNet sequential whose checkpointing saves nothing: a strided convolution keeps
# only its input, which the previous unit's output already is.
UNET_NO_GAIN_LAYERS = ("Downsample",)


def find_units(model: nn.Module) -> UnitSet:
    """The checkpoint units of ``model`` in call order.

    Raises :class:`UnsupportedArchitectureError`, naming the model class, when the model has
    neither a registered structure nor a list of two or more same-class blocks.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    class_names = [cls.__name__ for cls in type(model).__mro__]
    if any(name in UNET_CLASSES for name in class_names):
        return UnitSet(type(model).__name__, "registry: UNetModel", tuple(_unet_units(model)))
    for name in class_names:
        lists = DIT_BLOCK_LISTS.get(name)
        if lists is None:
            continue
        units = [
            unit
            for list_name in lists
            if isinstance(getattr(model, list_name, None), nn.ModuleList)
            for unit in _list_units(list_name, getattr(model, list_name))
        ]
        if units:
            return UnitSet(type(model).__name__, f"registry: {name}", tuple(units))
    generic = _longest_uniform_list(model)
    if generic is not None:
        path, module_list = generic
        return UnitSet(type(model).__name__, f"generic: {path}", tuple(_list_units(path, module_list)))
    raise UnsupportedArchitectureError(
        f"cannot plan gradient checkpointing for model class {type(model).__name__!r}: it is "
        "not a known architecture (UNetModel, "
        + ", ".join(sorted(DIT_BLOCK_LISTS))
        + ") and has no list of two or more blocks of one class to checkpoint. "
        "Use mode 'off' for this model, or report the architecture so it can be added."
    )


def units_by_name(model: nn.Module, names: Iterable[str]) -> tuple[CheckpointUnit, ...]:
    """Units for explicit module paths (for tests and expert use); raises on an unknown path."""
    modules = dict(model.named_modules())
    units = []
    for name in names:
        if name not in modules:
            raise KeyError(f"no module named {name!r} in {type(model).__name__}")
        units.append(CheckpointUnit(name, modules[name]))
    return tuple(units)


def _list_units(prefix: str, module_list: nn.ModuleList) -> list[CheckpointUnit]:
    return [CheckpointUnit(f"{prefix}.{index}", block) for index, block in enumerate(module_list)]


def _unet_units(model: nn.Module) -> list[CheckpointUnit]:
    units: list[CheckpointUnit] = []
    for attr in UNET_SEQUENCES:
        container = getattr(model, attr, None)
        if container is None:
            continue
        # input_blocks / output_blocks are ModuleLists of sequentials; middle_block is one sequential.
        sequentials = (
            [(f"{attr}.{i}", seq) for i, seq in enumerate(container)]
            if isinstance(container, nn.ModuleList)
            else [(attr, container)]
        )
        for seq_name, sequential in sequentials:
            for layer_name, layer in sequential.named_children():
                if _worth_checkpointing_in_unet(layer):
                    units.append(CheckpointUnit(f"{seq_name}.{layer_name}", layer))
    return units


def _worth_checkpointing_in_unet(layer: nn.Module) -> bool:
    if type(layer).__name__ in UNET_NO_GAIN_LAYERS:
        return False
    # A bare convolution or linear layer keeps only its input: nothing to save by recomputing it.
    is_leaf = next(layer.children(), None) is None
    return not (is_leaf and isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)))


def _longest_uniform_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    best: tuple[str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        classes = {type(child) for child in module}
        if len(classes) != 1 or not _has_parameters(module[0]):
            continue
        if best is None or len(module) > len(best[1]):
            best = (path, module)
    return best


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())

