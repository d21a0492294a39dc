"""The live training monitor (web/) in the real ComfyUI frontend, against a real server.

One server for the session (tests/browser/conftest.py). Every run trains with a different
number of steps, so the host's cache never skips the training node.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from comfy_page import MONITOR, PACK_EXTENSION, TRAIN_NODE, is_ours
from make_example_workflow import EXAMPLE, example_prompt

pytestmark = pytest.mark.browser

EXTENSION = "lowvram_lora.monitor"
WEB_FILES = ("lowvram_lora_monitor.js", "monitor_draw.js", "monitor_state.js")
GIB = 1024**3
BUDGET = {"LowVRAMLoRA_EnableGradientCheckpointing": {"mode": "memory budget", "budget_gb": 0.25}}
EVENT_KEYS = {
    "node", "run", "prompt_id", "workflow", "started_at", "status", "step", "first_step", "total_steps",
    "points", "eta_seconds", "plan", "memory_method", "budget_bytes",
}
POINT_KEYS = {"step", "loss", "lr", "peak_bytes", "step_seconds"}


# The host frontend's handler of progress text (which Train LoRA sends with each step, as the
# host's own nodes do) asks for its canvas before the canvas exists when the text arrives while a
# page is still loading: a reload during a run can throw this from the host's own code.
HOST_LOADING_RACE = "getCanvas: canvas is null"


def assert_no_errors_of_ours(page) -> None:
    log = page.log
    unexpected = [
        (message, stack)
        for message, stack in zip(log.page_errors, log.page_error_stacks)
        if is_ours(stack) or HOST_LOADING_RACE not in message
    ]
    assert not unexpected, f"uncaught errors in the page: {unexpected}"
    ours = [e for e in log.errors + log.warnings if is_ours(e["url"]) or "lowvram" in e["text"].lower()]
    assert not ours, f"console errors or warnings of the pack: {ours}"
    assert not [url for url in log.failed_requests if is_ours(url)], f"failed requests: {log.failed_requests}"


def with_budget(steps: int, **train) -> dict:
    return {**BUDGET, TRAIN_NODE: {"steps": steps, **train}}


def test_extension_loads_without_errors_and_leaves_other_graphs_alone(open_page, comfy_server):
    listed = comfy_server.get("/extensions").json()
    for name in WEB_FILES:
        url = f"/extensions/{PACK_EXTENSION}/{name}"
        assert url in listed, f"{url} not in the frontend's extension list {listed}"
        response = comfy_server.get(url)
        assert response.status_code == 200 and "javascript" in response.headers["Content-Type"]

    # The same host without the pack's frontend extension: its console noise and its default graph.
    bare = open_page(without_pack_frontend=True)
    assert EXTENSION not in bare.extensions()
    bare.load_graph(None)
    bare_prompt = bare.graph_to_prompt()

    page = open_page()
    assert EXTENSION in page.extensions()
    page.load_graph(None)  # the host's default graph: no node of this pack
    prompt = page.graph_to_prompt()
    assert prompt["output"] == bare_prompt["output"]
    assert prompt["workflow"]["nodes"] == bare_prompt["workflow"]["nodes"]
    assert prompt["workflow"]["links"] == bare_prompt["workflow"]["links"]
    assert page.monitor() is None
    assert page.page.locator(MONITOR).count() == 0

    assert_no_errors_of_ours(page)
    # What the console shows besides is the host's own noise (user.css, favicon, no network to
    # api.comfy.org...): it shows the same without the pack's frontend.
    unexplained = page.log.error_keys() - bare.log.error_keys()
    assert not unexplained, f"console errors that the page without the pack does not show: {unexplained}"


def test_the_example_loads_with_the_values_it_was_written_with(open_page):
    """examples/*.json holds widget values by position: the real frontend must read them back as
    the values make_example_workflow.py wrote (a widget the frontend adds, such as the control
    after an INT input named seed, shifts every later value)."""
    page = open_page()
    page.load_graph(json.loads(Path(EXAMPLE).read_text()))
    loaded = page.widget_values()
    wrong = [
        f"node {node_id} {node['class_type']}.{name}: written {value!r}, loaded {loaded.get(node_id, {}).get(name)!r}"
        for node_id, node in example_prompt().items()
        for name, value in node["inputs"].items()
        if not isinstance(value, list) and loaded.get(node_id, {}).get(name) != value
    ]
    assert not wrong, "the example loads with other values than it was written with:\n" + "\n".join(wrong)
    assert_no_errors_of_ours(page)


def test_monitor_draws_the_live_loss_curve_memory_and_plan(open_page, artifacts):
    steps = 8
    page = open_page()
    page.load_example(with_budget(steps))
    page.show_node()  # at the zoom that fits the whole graph, the host hides DOM widgets
    before = page.monitor()
    assert before["data"]["status"] == "none" and before["steps"] == []
    # The monitor is no input: neither in the API prompt nor among the widget values.
    prompt = page.graph_to_prompt()
    train_id = next(i for i, node in prompt["output"].items() if node["class_type"] == TRAIN_NODE)
    assert all("lowvram" not in name for name in prompt["output"][train_id]["inputs"])
    saved_node = next(n for n in prompt["workflow"]["nodes"] if n["type"] == TRAIN_NODE)
    widgets = page.evaluate(f"() => window.app.graph.nodes.find((n) => n.type === '{TRAIN_NODE}').widgets.map((w) => w.name)")
    assert widgets[-1] == "lowvram_lora_monitor"
    assert len(saved_node["widgets_values"]) == len(widgets) - 1

    page.record_events()
    entry = page.wait_prompt(page.queue())
    assert entry["status"]["status_str"] == "success", entry["status"]
    monitor = page.wait_monitor("d.status === 'finished'", timeout=30)

    # The events as the page received them.
    events = page.events()
    assert events[0]["status"] == "started" and events[0]["points"] == [] and events[0]["step"] == 0
    assert events[-1]["status"] == "finished" and events[-1]["step"] == steps
    assert all(set(event) == EVENT_KEYS for event in events), events[0].keys()
    assert all(set(point) == POINT_KEYS for event in events for point in event["points"])
    assert [p["step"] for event in events for p in event["points"]] == list(range(1, steps + 1))
    assert len({event["run"] for event in events}) == 1
    assert events[-1]["budget_bytes"] == int(0.25 * GIB)
    assert "budget" in events[-1]["plan"]

    # What the monitor holds, drew, and saved in the node's properties.
    data = monitor["data"]
    assert (data["status"], data["step"], data["totalSteps"], data["points"]) == ("finished", str(steps), str(steps), str(steps))
    assert monitor["drawn"] == steps and data["drawn"] == str(steps)
    assert monitor["steps"] == list(range(1, steps + 1))
    assert monitor["losses"] == [p["loss"] for event in events for p in event["points"]]
    assert monitor["record"]["plan"] == events[-1]["plan"]
    assert page.curve_pixels() > 40, "no smoothed loss curve on the monitor's canvas"
    saved = monitor["saved"]
    assert saved["run"] == events[-1]["run"] and saved["status"] == "finished"
    assert [row[0] for row in saved["points"]] == list(range(1, steps + 1))

    page.screenshot_node(artifacts / "train_lora_node.png")
    page.page.locator(MONITOR).screenshot(path=str(artifacts / "train_lora_monitor.png"))
    assert_no_errors_of_ours(page)


def test_the_figures_come_back_after_a_reload_during_and_after_the_run(open_page, comfy_server, artifacts):
    steps = 24
    page = open_page()
    page.load_example(with_budget(steps))
    page.show_node()
    prompt_id = page.queue()
    page.wait_monitor("d.status === 'running' && Number(d.step) >= 2 && Number(d.drawn) >= 2", timeout=120)
    page.page.locator(MONITOR).screenshot(path=str(artifacts / "train_lora_monitor_running.png"))
    during = comfy_server.get("/lowvram_lora/progress/5").json()
    assert during["status"] == "running" and during["step"] < steps, "the run ended before the reload"

    asked = []
    page.page.on("request", lambda request: "/lowvram_lora/progress/" in request.url and asked.append(request.url))
    page.reload()
    after_reload = page.monitor()
    assert after_reload is not None, "the reloaded page lost the training node"
    entry = page.wait_prompt(prompt_id)
    assert entry["status"]["status_str"] == "success", entry["status"]
    monitor = page.wait_monitor(f"d.status === 'finished' && d.points === '{steps}'", timeout=30)
    assert monitor["steps"] == list(range(1, steps + 1)), "steps before the reload are missing"
    assert asked, "the reloaded page did not ask the server for the run's history"
    page.show_node()
    assert page.wait_monitor(f"d.drawn === '{steps}'", timeout=10)["drawn"] == steps

    # After the run: from the server's history again.
    page.reload()
    monitor = page.wait_monitor(f"d.status === 'finished' && d.points === '{steps}'", timeout=30)
    assert monitor["steps"] == list(range(1, steps + 1))
    run = monitor["record"]["run"]

    # A restarted server knows no run: the figures come from the node's properties, saved with the
    # workflow (the browser keeps it at the next change the user makes; here, the change tracker's).
    page.persist_workflow()
    page.page.route("**/lowvram_lora/progress/**", lambda route: route.fulfill(json={"node": "5", "run": None}))
    page.reload()
    monitor = page.wait_monitor(f"d.status === 'finished' && d.points === '{steps}'", timeout=30)
    assert monitor["record"]["run"] == run
    assert monitor["steps"] == list(range(1, steps + 1))
    page.show_node()
    page.wait_monitor(f"d.drawn === '{steps}'", timeout=10)
    assert page.curve_pixels() > 40
    assert_no_errors_of_ours(page)


def test_an_interrupted_run_reads_stopped(open_page, comfy_server):
    page = open_page()
    page.load_example(with_budget(500))
    prompt_id = page.queue()
    page.wait_monitor("d.status === 'running' && Number(d.step) >= 1", timeout=120)
    assert comfy_server.post("/interrupt", {}).status_code == 200
    entry = page.wait_prompt(prompt_id)
    assert entry["status"]["status_str"] == "error"
    monitor = page.wait_monitor("d.status === 'stopped'", timeout=30)
    assert 1 <= int(monitor["data"]["step"]) < 500
    assert monitor["saved"]["status"] == "stopped"
    assert comfy_server.get("/lowvram_lora/progress/5").json()["status"] == "stopped"
    assert_no_errors_of_ours(page)
