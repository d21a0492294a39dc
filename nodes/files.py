"""Where the pack writes: LoRAs into models/loras (LoraLoader lists them at once), training states
into models/training_states, recovered runs into the output folder. Never over an existing file,
never outside its folder, always atomically (see :mod:`..training.safefile`)."""

from __future__ import annotations

import os
from pathlib import Path

import folder_paths

from ..training.lora import save_lora_file
from ..training.safefile import unique_path
from ..training.state import TrainingState, save_state
from .types import TrainedLoRA

STATES_FOLDER = "training_states"
RECOVERY_SUBFOLDER = "lowvram_lora_recovered"
MAX_NAME_RACES = 20


def register_folders() -> None:
    """Add models/training_states to the host's model folders (idempotent)."""
    if STATES_FOLDER not in folder_paths.folder_names_and_paths:
        path = os.path.join(folder_paths.models_dir, STATES_FOLDER)
        folder_paths.folder_names_and_paths[STATES_FOLDER] = ([path], {".safetensors"})


def loras_folder() -> Path:
    return Path(folder_paths.get_folder_paths("loras")[0])


def states_folder() -> Path:
    register_folders()
    return Path(folder_paths.get_folder_paths(STATES_FOLDER)[0])


def _write_unique(folder: Path, prefix: str, write) -> Path:
    """Write to the first free ``<prefix>_NNNNN_.safetensors``; another writer taking the name
    first (FileExistsError from the atomic write) just moves us to the next one."""
    for _ in range(MAX_NAME_RACES):
        path = unique_path(folder, prefix, ".safetensors", field="filename_prefix")
        try:
            return write(path)
        except FileExistsError:
            continue
    raise RuntimeError(f"could not find a free file name for {prefix!r} in {folder}")


def save_lora(lora: TrainedLoRA, prefix: str) -> Path:
    return _write_unique(loras_folder(), prefix, lambda path: save_lora_file(path, lora.tensors, lora.metadata))


def save_training_state(state: TrainingState, prefix: str) -> Path:
    return _write_unique(states_folder(), prefix, lambda path: save_state(path, state))


def save_recovery(lora: TrainedLoRA, state: TrainingState) -> list[Path]:
    """After a failed run: the last good LoRA and state, in the output folder."""
    folder = Path(folder_paths.get_output_directory()) / RECOVERY_SUBFOLDER
    stem = f"step_{state.step}"
    return [
        _write_unique(folder, stem + "_lora", lambda path: save_lora_file(path, lora.tensors, lora.metadata)),
        _write_unique(folder, stem + "_state", lambda path: save_state(path, state)),
    ]
