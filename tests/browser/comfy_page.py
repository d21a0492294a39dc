"""ComfyUI's frontend in a Playwright page: open it, load a workflow, queue it, read the monitor.

Everything goes through the host frontend's own objects (``window.app``, ``window.comfyAPI``),
as a user's actions would: ``app.loadGraphData`` for a workflow, widget values set on the
nodes, ``graphToPrompt`` + ``api.queuePrompt`` to queue it with this page's client id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from host_harness import CHECKPOINT_NAME, DATASET_FOLDER
from make_example_workflow import EXAMPLE, example_prompt
from server_harness import ComfyServer

PACK_EXTENSION = "comfyui-lowvram-lora"  # the project name in pyproject.toml: /extensions/<it>/
TRAIN_NODE = "LowVRAMLoRA_TrainLoRAStep"
MONITOR = ".lowvram-lora-monitor"
READY = "() => !!(window.app && window.app.graph && window.app.extensionManager && window.comfyAPI?.api?.api)"


def is_ours(url: str | None) -> bool:
    return bool(url) and (f"/extensions/{PACK_EXTENSION}/" in url or "/lowvram_lora/" in url)


@dataclass
class ConsoleLog:
    """Console errors and warnings, uncaught page errors and failed requests of one page."""

    errors: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    page_error_stacks: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)

    def attach(self, page) -> None:
        def on_console(message):
            entry = {"text": message.text, "url": message.location.get("url", "")}
            if message.type == "error":
                self.errors.append(entry)
            elif message.type == "warning":
                self.warnings.append(entry)

        page.on("console", on_console)
        def on_page_error(error):
            self.page_errors.append(str(error))
            self.page_error_stacks.append(getattr(error, "stack", None) or "")

        page.on("pageerror", on_page_error)
        page.on("requestfailed", lambda request: self.failed_requests.append(request.url))
        page.on("response", lambda response: response.status >= 400 and self.failed_requests.append(response.url))

    def error_keys(self) -> set[tuple[str, str]]:
        return {(entry["text"], entry["url"]) for entry in self.errors}


class ComfyPage:
    def __init__(self, page, server: ComfyServer):
        self.page = page
        self.server = server
        self.log = ConsoleLog()
        self.log.attach(page)

    # -- the app -------------------------------------------------------------------------

    def open(self) -> "ComfyPage":
        self.page.goto(self.server.url + "/")
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        # window.app is set once the app is set up: extensions loaded, the graph restored or default
        self.page.wait_for_function(READY, timeout=120_000)
        self.page.wait_for_timeout(500)

    def reload(self) -> None:
        self.page.reload()
        self.wait_ready()

    def evaluate(self, script: str, arg: Any = None) -> Any:
        return self.page.evaluate(script, arg)

    def extensions(self) -> list[str]:
        return self.evaluate("() => window.app.extensions.map((e) => e.name)")

    def load_graph(self, workflow: dict | None) -> None:
        """Load a UI-format workflow as the user does (None: the host's default graph)."""
        self.evaluate("async (wf) => { await window.app.loadGraphData(wf ?? undefined); }", workflow)
        self.page.wait_for_timeout(200)

    def load_example(self, settings_by_type: dict[str, dict] | None = None) -> None:
        """The committed example (UI format) loaded as the user loads it, then its widget values set by
        name from ``example_prompt()`` with test-sized settings (as tests/host/test_example_workflow.py)
        and ``settings_by_type`` (node type -> {widget name: value}) on top.

        Setting every value by name keeps these tests about the monitor; whether the file's
        positional values load right is test_the_example_loads_with_the_values_it_was_written_with.
        """
        self.load_graph(json.loads(Path(EXAMPLE).read_text()))
        overrides = {
            "LowVRAMLoRA_LoadModelForTraining": {"model_file": f"checkpoints/{CHECKPOINT_NAME}"},
            "LoadImageTextDataSetFromFolder": {"folder": DATASET_FOLDER},
            TRAIN_NODE: {"precision": "fp32"},
            "KSampler": {"steps": 2},
            "EmptyLatentImage": {"width": 64, "height": 64},
        }
        for node_type, values in (settings_by_type or {}).items():
            overrides.setdefault(node_type, {}).update(values)
        values_by_id = {}
        for node_id, node in example_prompt().items():
            values = {name: value for name, value in node["inputs"].items() if not isinstance(value, list)}
            values.update(overrides.get(node["class_type"], {}))
            values_by_id[node_id] = values
        self.set_widgets(values_by_id)

    def widget_values(self) -> dict[str, dict[str, Any]]:
        """node id -> {widget name: value} of every node in the graph."""
        return self.evaluate(
            """() => Object.fromEntries(window.app.graph.nodes.map((node) => [String(node.id),
                Object.fromEntries((node.widgets ?? []).filter((w) => w.name).map((w) => [w.name, w.value]))]))"""
        )

    def set_widgets(self, values_by_id: dict[str, dict]) -> None:
        """Set widget values by node id and widget name."""
        missing = self.evaluate(
            """(valuesById) => {
                const missing = [];
                for (const [id, values] of Object.entries(valuesById)) {
                  const node = window.app.graph.getNodeById(Number(id));
                  if (!node) { missing.push(`node ${id}`); continue; }
                  for (const [name, value] of Object.entries(values)) {
                    const widget = node.widgets?.find((w) => w.name === name);
                    if (!widget) { missing.push(`${node.type}.${name}`); continue; }
                    widget.value = value;
                  }
                }
                window.app.graph.setDirtyCanvas(true, true);
                return missing;
            }""",
            values_by_id,
        )
        assert not missing, f"the graph has no {missing}"

    def graph_to_prompt(self) -> dict:
        return self.evaluate("async () => { const p = await window.app.graphToPrompt(); return {output: p.output, workflow: p.workflow}; }")

    def queue(self) -> str:
        """Queue the graph from this page (its client id gets the progress events); the prompt id."""
        result = self.evaluate(
            """async () => {
                const prompt = await window.app.graphToPrompt();
                try {
                  const response = await window.comfyAPI.api.api.queuePrompt(0, prompt);
                  return {prompt_id: response.prompt_id};
                } catch (error) {
                  return {error: String(error), response: error.response ?? null, prompt: prompt.output};
                }
            }"""
        )
        assert result.get("prompt_id"), f"the server refused the prompt: {json.dumps(result, indent=1)[:6000]}"
        return result["prompt_id"]

    def record_events(self) -> None:
        """Keep every ``lowvram_lora.progress`` event this page receives in ``window.__lowvramEvents``."""
        self.evaluate(
            """() => {
                window.__lowvramEvents = [];
                window.comfyAPI.api.api.addEventListener("lowvram_lora.progress", (e) => window.__lowvramEvents.push(e.detail));
            }"""
        )

    def events(self) -> list[dict]:
        return self.evaluate("() => window.__lowvramEvents ?? []")

    # -- the monitor ---------------------------------------------------------------------

    def monitor(self) -> dict | None:
        """The monitor's data attributes, its node's record and what it drew (None without one)."""
        return self.evaluate(
            """(selector) => {
                const element = document.querySelector(selector);
                const node = window.app.graph.nodes.find((n) => n.lowvramMonitor);
                if (!element && !node) return null;
                const monitor = node?.lowvramMonitor;
                return {
                  data: element ? {...element.dataset} : null,
                  steps: monitor?.record?.points.map((p) => p.step) ?? [],
                  losses: monitor?.record?.points.map((p) => p.loss) ?? [],
                  drawn: monitor?.drawn ?? 0,
                  record: monitor?.record ? {...monitor.record, points: undefined} : null,
                  saved: node?.properties?.lowvram_lora_monitor ?? null,
                };
            }""",
            MONITOR,
        )

    def wait_monitor(self, condition: str, timeout: float = 120) -> dict:
        """Wait until ``condition`` (JS, over the monitor element's dataset ``d``) holds."""
        self.page.wait_for_function(
            f"""() => {{ const e = document.querySelector({json.dumps(MONITOR)}); if (!e) return false;
                        const d = e.dataset; return !!({condition}); }}""",
            timeout=timeout * 1000,
            polling=100,
        )
        return self.monitor()

    def curve_pixels(self) -> int:
        """Pixels of the smoothed loss curve's colour on the monitor's canvas."""
        return self.evaluate(
            """(selector) => {
                const canvas = document.querySelector(selector + " canvas");
                const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
                let count = 0;
                for (let i = 0; i < data.length; i += 4) {
                  if (Math.abs(data[i] - 91) < 24 && Math.abs(data[i + 1] - 157) < 24 && Math.abs(data[i + 2] - 255) < 24 && data[i + 3] > 200) count++;
                }
                return count;
            }""",
            MONITOR,
        )

    def show_node(self, node_type: str = TRAIN_NODE) -> dict:
        """Scroll the canvas so that the node is fully in view at 100 %; its box on the page."""
        return self.evaluate(
            """(type) => {
                const app = window.app;
                const node = app.graph.nodes.find((n) => n.type === type);
                const ds = app.canvas.ds;
                ds.scale = 1;
                ds.offset[0] = -node.pos[0] + 120;
                ds.offset[1] = -node.pos[1] + 120;
                app.canvas.setDirty(true, true);
                app.canvas.draw(true, true);
                const rect = app.canvas.canvas.getBoundingClientRect();
                const title = 30;
                return {x: rect.left + 120 - 6, y: rect.top + 120 - title - 6, width: node.size[0] + 12, height: node.size[1] + title + 12};
            }""",
            node_type,
        )

    def screenshot_node(self, path: Path) -> None:
        box = self.show_node()
        self.page.wait_for_timeout(400)  # the DOM widgets follow the canvas on the next frame
        self.page.screenshot(path=str(path), clip=box)

    def persist_workflow(self) -> None:
        """What the next click or key press on the graph does: the change tracker saves the workflow."""
        self.evaluate("() => window.app.extensionManager.workflow.activeWorkflow?.changeTracker?.checkState()")

    def wait_prompt(self, prompt_id: str, timeout: float = 240) -> dict:
        """The history entry of the prompt once it ran (successfully or not)."""
        return self.server.wait(prompt_id, timeout)


