"""Fixtures of the browser tests: headless Chromium (driven by Playwright) against one real ComfyUI
server per session with this pack installed (see tests/server_harness.py).

Chromium is the system browser (Debian's ``chromium`` package, or ``$LOWVRAM_LORA_CHROMIUM``);
Playwright never downloads one. Without Chromium or Playwright the tests skip with the reason;
with ``LOWVRAM_LORA_REQUIRE_BROWSER=1`` (as ``.ci/run`` sets it) that is a failure instead.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hostenv import PACK_ROOT
from server_harness import ComfyServer, start_server

HERE = Path(__file__).resolve().parent
ARTIFACTS = PACK_ROOT / "tests" / "artifacts" / "browser"
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Playwright gives every launch a fresh temporary profile (it refuses --user-data-dir in launch()).


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.browser)


def browser_required() -> bool:
    return os.environ.get("LOWVRAM_LORA_REQUIRE_BROWSER", "") not in ("", "0")


def _unavailable(reason: str):
    if browser_required():
        pytest.fail(reason + " (LOWVRAM_LORA_REQUIRE_BROWSER is set)")
    pytest.skip(reason)


def find_chromium() -> str | None:
    explicit = os.environ.get("LOWVRAM_LORA_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None  # the reason names the variable
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="session")
def chromium():
    """A headless Chromium (Playwright's Browser); skips, or fails under .ci/run, without one."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright for Python is not installed: `pip install playwright` (no `playwright install` needed)")
    executable = find_chromium()
    if executable is None:
        explicit = os.environ.get("LOWVRAM_LORA_CHROMIUM")
        looked = f"$LOWVRAM_LORA_CHROMIUM={explicit}" if explicit else "on PATH: " + ", ".join(CHROMIUM_CANDIDATES)
        _unavailable(f"no Chromium found ({looked}): `apt-get install -y chromium`")
    playwright = sync_playwright().start()
    try:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS, timeout=60_000)
    except Exception as error:  # a browser that does not start is a broken set-up, not a skip
        playwright.stop()
        pytest.fail(f"Chromium at {executable} did not start: {error}")
    try:
        yield browser
    finally:
        browser.close()
        playwright.stop()


@pytest.fixture(scope="session")
def model_cache(pytestconfig) -> Path:
    return Path(pytestconfig.cache.mkdir("host-models"))


@pytest.fixture(scope="session")
def comfy_server(chromium, host_path, tmp_path_factory, model_cache) -> ComfyServer:
    """One ComfyUI server for every browser test (started after the browser is known to work)."""
    running = start_server(host_path, tmp_path_factory.mktemp("comfy-browser"), model_cache)
    try:
        # The first-run templates dialog would cover the graph.
        response = running.post("/settings/Comfy.TutorialCompleted", True)
        assert response.status_code == 200, response.text
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def open_page(chromium, comfy_server):
    """Opens the server's frontend in a fresh browser context (its own storage and client id).

    ``open_page(without_pack_frontend=True)`` hides the pack's web/ files from the frontend's
    extension list: the same host, as it would be without this pack's frontend extension.
    """
    from comfy_page import ComfyPage, is_ours

    contexts = []

    def open_(without_pack_frontend: bool = False) -> ComfyPage:
        context = chromium.new_context(viewport={"width": 1400, "height": 1000})
        contexts.append(context)
        # Chromium's own favicon request (at a time of its choosing): the host serves none.
        context.route("**/favicon.ico", lambda route: route.fulfill(status=204, body=b""))
        page = context.new_page()
        if without_pack_frontend:

            def hide_pack(route):
                response = route.fetch()
                route.fulfill(response=response, json=[url for url in response.json() if not is_ours(url)])

            page.route("**/api/extensions", hide_pack)
        return ComfyPage(page, comfy_server).open()

    yield open_
    for context in contexts:
        context.close()
