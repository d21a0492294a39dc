"""Fixtures of the host tests: one in-process ComfyUI per session (see tests/host_harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from host_harness import Comfy, build_comfy


@pytest.fixture(scope="session")
def model_cache(pytestconfig) -> Path:
    return Path(pytestconfig.cache.mkdir("host-models"))


@pytest.fixture(scope="session")
def comfy(host_path, tmp_path_factory, model_cache) -> Comfy:
    return build_comfy(tmp_path_factory.mktemp("comfy-base"), model_cache)


@pytest.fixture(autouse=True)
def _needs_host(host_path):
    """Every test here needs ComfyUI: skipped (or failed under .ci/run) without it."""
