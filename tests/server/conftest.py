"""Fixtures of the server tests: one real ComfyUI server per session (see tests/server_harness.py).

Every test in this folder talks to the server over HTTP (and a websocket) only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from server_harness import ComfyServer, start_server

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def model_cache(pytestconfig) -> Path:
    return Path(pytestconfig.cache.mkdir("host-models"))


@pytest.fixture(scope="session")
def server(host_path, tmp_path_factory, model_cache) -> ComfyServer:
    base = tmp_path_factory.mktemp("comfy-server")
    running = start_server(host_path, base, model_cache)
    try:
        yield running
    finally:
        running.stop()
