"""Finding and preparing the ComfyUI host for the host tests.

The host is looked up, in order, at ``$COMFYUI_PATH``, at the folder above ``custom_nodes/``
when this pack sits inside one, and at ``~/comfy/ComfyUI`` (comfy-cli's default place).
With ``LOWVRAM_LORA_REQUIRE_HOST=1`` (as ``.ci/run`` sets it) a missing host is an error,
not a skip.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parent.parent
PACK_NAME = "lowvram_lora"
# The nodes the pack registers: a test that finds one missing catches a lost registration.
PACK_NODE_IDS = (
    "LowVRAMLoRA_LoadModelForTraining",
    "LowVRAMLoRA_EnableGradientCheckpointing",
    "LowVRAMLoRA_TrainLoRAStep",
    "LowVRAMLoRA_SaveLoRA",
    "LowVRAMLoRA_LoadTrainingState",
    "LowVRAMLoRA_TrainingReport",
    "LowVRAMLoRA_BenchmarkCheckpointing",
)


def _is_comfyui(folder: Path) -> bool:
    return (folder / "main.py").is_file() and (folder / "comfy" / "model_patcher.py").is_file()


def host_candidates() -> list[tuple[str, Path]]:
    """Where the host may be, with the rule that names each place."""
    candidates: list[tuple[str, Path]] = []
    env_path = os.environ.get("COMFYUI_PATH")
    if env_path:
        candidates.append(("$COMFYUI_PATH", Path(env_path).expanduser()))
    if PACK_ROOT.parent.name == "custom_nodes":
        candidates.append(("the folder above custom_nodes/", PACK_ROOT.parent.parent))
    candidates.append(("~/comfy/ComfyUI", Path("~/comfy/ComfyUI").expanduser()))
    return candidates


def find_host() -> Path | None:
    for _rule, folder in host_candidates():
        if _is_comfyui(folder):
            return folder.resolve()
    return None


def missing_host_reason() -> str:
    looked = ", ".join(f"{rule} ({folder})" for rule, folder in host_candidates())
    return (
        "no ComfyUI host found; looked at " + looked + ". Lay one out with "
        "`bash ../shared/install-comfyui-host.sh <ComfyUI git dir>` or set COMFYUI_PATH."
    )


def host_required() -> bool:
    return os.environ.get("LOWVRAM_LORA_REQUIRE_HOST", "") not in ("", "0")


def prepare_host_imports(host: Path) -> None:
    """Make ``import comfy`` work in this process, on the CPU when no GPU is present."""
    if str(host) not in sys.path:
        sys.path.insert(0, str(host))
    import torch

    import comfy.options

    comfy.options.enable_args_parsing(False)
    import comfy.cli_args

    if not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True
    # ComfyUI's own utils package must be imported before `nodes`, as main.py does: importing
    # `nodes` first binds the name `utils` to comfy/utils.py and the server cannot import.
    import utils.install_util  # noqa: F401
