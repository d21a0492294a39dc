"""Finding the ComfyUI host for the benchmark, and importing it.

Looked up in order: ``$COMFYUI_PATH``; ``bench/.host/ComfyUI`` (a copy laid out by
``bench/prepare_device.sh`` so that it travels with the repository to a GPU machine); then the
places the tests look (the folder above ``custom_nodes/``, ``~/comfy/ComfyUI``; see
tests/hostenv.py, whose import preparation is reused here).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLED_HOST = ROOT / "bench" / ".host" / "ComfyUI"


def _hostenv():
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import hostenv

    return hostenv


def find_host() -> Path | None:
    """The ComfyUI folder to use, or None."""
    hostenv = _hostenv()
    if not os.environ.get("COMFYUI_PATH") and hostenv._is_comfyui(BUNDLED_HOST):
        return BUNDLED_HOST.resolve()
    return hostenv.find_host()


def prepare(host: Path) -> None:
    """Make ``import comfy`` work in this process (on the CPU when there is no GPU)."""
    _hostenv().prepare_host_imports(host)


def host_version(host: Path) -> str:
    try:
        text = (host / "comfyui_version.py").read_text()
    except OSError:
        return "unknown"
    for line in text.splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    return "unknown"
