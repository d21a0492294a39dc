"""Makes the repository importable as the package ``lowvram_lora`` for the bench scripts.

The pack's modules import each other relatively (``from ..training import ...``), so they must be
imported as a package, whatever the repository folder is called (as tests/conftest.py does).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACK_NAME = "lowvram_lora"


def register_pack() -> None:
    if PACK_NAME in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(PACK_NAME, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = module
    spec.loader.exec_module(module)
