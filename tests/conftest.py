"""Shared test set-up: the pack importable as ``lowvram_lora``, and the ComfyUI host."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from hostenv import PACK_NAME, PACK_ROOT, find_host, host_required, missing_host_reason, prepare_host_imports


def _register_pack() -> None:
    """Import the repository root as the package ``lowvram_lora`` (whatever the folder is called)."""
    if PACK_NAME in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        PACK_NAME, PACK_ROOT / "__init__.py", submodule_search_locations=[str(PACK_ROOT)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = module
    spec.loader.exec_module(module)


_register_pack()


@pytest.fixture(scope="session")
def host_path():
    """The ComfyUI folder; skips (or fails under .ci/run) when there is none."""
    host = find_host()
    if host is None:
        if host_required():
            pytest.fail(missing_host_reason() + " (LOWVRAM_LORA_REQUIRE_HOST is set)")
        pytest.skip(missing_host_reason())
    prepare_host_imports(host)
    return host


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models on a 2-core machine: OpenMP threads waiting on each other cost more than they give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Browser tests last: Playwright's sync API keeps an event loop running on the main thread
    until its session fixture ends, and the host's executor calls asyncio.run()."""
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)
