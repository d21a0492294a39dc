"""Resumable training state in one safetensors file: no pickle, so a shared file cannot run code.

Tensors (the adapter weights and the optimizer's tensors) are stored as tensors; everything else
(the step, the settings, the optimizer's scalars and parameter groups, the grad scaler) is JSON
in the file's metadata. The batch order, noise and noise levels are pure functions of the seed
and the step (see :mod:`training.data`), so the step and the seed are the whole RNG state.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from .safefile import atomic_write_safetensors

FORMAT = "lowvram_lora.training_state"
FORMAT_VERSION = 1
_ADAPTER = "adapter/"
_OPTIMIZER = "optimizer/"


@dataclass
class TrainingState:
    step: int
    adapters: dict[str, torch.Tensor]
    settings: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] | None = None  # torch optimizer state_dict
    scaler: dict[str, Any] | None = None

    def check_compatible(self, settings: Mapping[str, Any], keys: tuple[str, ...]) -> None:
        """Refuse to continue with settings that change what the adapters are."""
        for key in keys:
            if key in self.settings and key in settings and self.settings[key] != settings[key]:
                raise ValueError(
                    f"training state was saved with {key}={self.settings[key]!r}, this run has "
                    f"{key}={settings[key]!r}: continue with the same {key}, or start a new LoRA "
                    "without the training state"
                )


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(item) for item in value]
    return value


def _split_optimizer(state_dict: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param_id, entries in state_dict.get("state", {}).items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OPTIMIZER}{param_id}/{key}"] = value.detach().cpu()
            else:
                scalars.setdefault(str(param_id), {})[key] = value
    structure = {"param_groups": state_dict.get("param_groups", []), "scalars": scalars}
    return tensors, structure


def _join_optimizer(tensors: Mapping[str, torch.Tensor], structure: Mapping[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        param_id, key = name[len(_OPTIMIZER) :].split("/", 1)
        state.setdefault(int(param_id), {})[key] = value
    for param_id, entries in structure.get("scalars", {}).items():
        state.setdefault(int(param_id), {}).update(entries)
    return {"state": state, "param_groups": structure.get("param_groups", [])}


def save_state(path: str | Path, state: TrainingState, *, overwrite: bool = False) -> Path:
    """Write ``state`` atomically; an existing file is never replaced unless ``overwrite``."""
    tensors = {f"{_ADAPTER}{name}": value.detach().cpu() for name, value in state.adapters.items()}
    optimizer_structure = None
    if state.optimizer is not None:
        optimizer_tensors, optimizer_structure = _split_optimizer(state.optimizer)
        tensors.update(optimizer_tensors)
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": state.step,
        "settings": state.settings,
        "optimizer": optimizer_structure,
        "scaler": state.scaler,
    }
    metadata = {FORMAT: json.dumps(_json_value(header))}
    return atomic_write_safetensors(path, tensors, metadata, overwrite=overwrite)


def load_state(path: str | Path) -> TrainingState:
    """Read a file written by :func:`save_state`; a clear error for anything else."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"training state {str(path)!r} must be a .safetensors file written by this pack")
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        if FORMAT not in metadata:
            raise ValueError(
                f"{str(path)!r} is not a training state of this pack (it has no {FORMAT!r} metadata); "
                "a LoRA file cannot be resumed from: pass the state file saved next to it"
            )
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    header = _from_json(json.loads(metadata[FORMAT]))
    if header.get("version") != FORMAT_VERSION:
        raise ValueError(f"training state {str(path)!r} has format version {header.get('version')}, expected {FORMAT_VERSION}")
    adapters = {name[len(_ADAPTER) :]: value for name, value in tensors.items() if name.startswith(_ADAPTER)}
    optimizer_tensors = {name: value for name, value in tensors.items() if name.startswith(_OPTIMIZER)}
    optimizer = None
    if header.get("optimizer") is not None:
        optimizer = _join_optimizer(optimizer_tensors, header["optimizer"])
    return TrainingState(
        step=int(header["step"]),
        adapters=adapters,
        settings=header.get("settings") or {},
        optimizer=optimizer,
        scaler=header.get("scaler"),
    )
