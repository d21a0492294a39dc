// Live training monitor on the Train LoRA node (LowVRAMLoRA_TrainLoRAStep): loss curve (raw and
// smoothed), step / total and ETA, measured peak memory against the budget, step time, and the
// checkpointing plan in effect. Fed by the server's `lowvram_lora.progress` events
// (nodes/progress.py); after a page reload it asks GET /lowvram_lora/progress/<node id>
// (nodes/routes.py) for the run's history, and a finished run is kept in the node's
// properties, so a saved workflow carries its last curve.
//
// Test hooks: every monitored node has `node.lowvramMonitor` (`.record.points`, `.drawn`); its
// element `.lowvram-lora-monitor` carries data-node, data-run, data-status, data-step,
// data-total-steps, data-points (points held) and data-drawn (loss points drawn).

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { MIN_HEIGHT, drawMonitor, themeOf } from "./monitor_draw.js";
import { PROPERTY, applyEvent, fromSaved, isLive, markStopped, newer, toSaved } from "./monitor_state.js";

const NODE_TYPE = "LowVRAMLoRA_TrainLoRAStep";
const EVENT = "lowvram_lora.progress";
const WIDGET = "lowvram_lora_monitor";
const MIN_WIDTH = 380;
const NO_WORKFLOW = "00000000-0000-0000-0000-000000000000";
// The pack's web folder can be registered under two names (its folder and its pyproject name):
// run once per page.
const LOADED = Symbol.for("lowvram_lora.monitor.loaded");

const runs = new Map(); // execution id of a Train LoRA node -> its latest run on this page
const monitors = new Set();
const fetching = new Set();

// [execution id, node] of every node, subgraphs included ("12:5" is node 5 inside subgraph node 12).
function* graphNodes(graph, prefix = "") {
  for (const node of graph?.nodes ?? []) {
    const id = prefix + String(node.id);
    yield [id, node];
    if (node.subgraph && node.isSubgraphNode?.()) yield* graphNodes(node.subgraph, `${id}:`);
  }
}

function executionIdOf(node) {
  for (const [id, candidate] of graphNodes(app.rootGraph)) if (candidate === node) return id;
  return String(node.id);
}

function workflowMatches(record) {
  const current = app.rootGraph?.id;
  return !record?.workflow || !current || current === NO_WORKFLOW || record.workflow === current;
}

// What a node shows: its saved run or the page's latest run of its id, whichever is newer.
function recordFor(node, id) {
  const live = runs.get(id);
  const saved = fromSaved(node.properties?.[PROPERTY]);
  return newer(saved, live && workflowMatches(live) ? live : null);
}

function save(node, record) {
  if (!record || isLive(record) || !node.properties) return;
  const saved = node.properties[PROPERTY];
  if (saved && saved.run === record.run && saved.status === record.status && saved.points_total === record.points.length) return;
  node.properties[PROPERTY] = toSaved(record);
}

class Monitor {
  constructor(node) {
    this.node = node;
    this.record = null;
    this.drawn = 0;
    this.draws = 0;
    this.element = document.createElement("div");
    this.element.className = "lowvram-lora-monitor";
    Object.assign(this.element.style, { width: "100%", height: "100%", minHeight: `${MIN_HEIGHT}px`, boxSizing: "border-box", overflow: "hidden" });
    this.canvas = document.createElement("canvas");
    Object.assign(this.canvas.style, { display: "block", width: "100%", height: "100%" });
    this.element.append(this.canvas);
    this.widget = node.addDOMWidget(WIDGET, "lowvram_lora_monitor", this.element, {
      serialize: false, // not an input: neither in the prompt nor in widgets_values
      getMinHeight: () => MIN_HEIGHT,
    });
    this.widget.serialize = false;
    this.resizeObserver = new ResizeObserver(() => this.draw());
    this.resizeObserver.observe(this.element);
    monitors.add(this);
  }

  show(record) {
    this.record = record;
    this.draw();
  }

  refresh(id = executionIdOf(this.node)) {
    this.show(recordFor(this.node, id));
    if (this.record && this.record === runs.get(id)) save(this.node, this.record);
  }

  draw() {
    const record = this.record;
    const data = this.element.dataset;
    data.node = String(this.node.id);
    data.run = record?.run ?? "";
    data.status = record?.status ?? "none";
    data.step = String(record?.step ?? "");
    data.totalSteps = String(record?.total_steps ?? "");
    data.points = String(record?.points.length ?? 0);
    const width = this.element.clientWidth;
    const height = this.element.clientHeight;
    if (!width || !height) return; // not on screen (zoomed out, collapsed, other graph)
    const ratio = window.devicePixelRatio || 1;
    const pixelWidth = Math.round(width * ratio);
    const pixelHeight = Math.round(height * ratio);
    if (this.canvas.width !== pixelWidth || this.canvas.height !== pixelHeight) {
      this.canvas.width = pixelWidth;
      this.canvas.height = pixelHeight;
    }
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    const result = drawMonitor(ctx, width, height, record, themeOf(this.element));
    this.drawn = result.drawn;
    this.draws += 1;
    data.drawn = String(result.drawn);
    data.draws = String(this.draws);
  }

  remove() {
    this.resizeObserver.disconnect();
    monitors.delete(this);
  }
}

function refreshNodes(id) {
  for (const [nodeId, node] of graphNodes(app.rootGraph)) {
    if (node.lowvramMonitor && (id === undefined || nodeId === id)) node.lowvramMonitor.refresh(nodeId);
  }
  app.graph?.setDirtyCanvas?.(true, false);
}

async function fetchHistory(id) {
  if (fetching.has(id)) return;
  fetching.add(id);
  try {
    const response = await api.fetchApi(`/lowvram_lora/progress/${encodeURIComponent(id)}`, { cache: "no-store" });
    if (!response.ok) return;
    const history = await response.json();
    if (!history?.run) return; // this node has not trained since the server started
    const current = runs.get(id);
    const fetched = applyEvent(current?.run === history.run ? current : null, history);
    runs.set(id, newer(current, fetched));
    refreshNodes(id);
  } catch (error) {
    console.debug("[lowvram_lora] no training history for node", id, error);
  } finally {
    fetching.delete(id);
  }
}

function onProgress(event) {
  const data = event.detail;
  if (!data || data.node == null || !data.run) return;
  const id = String(data.node);
  const record = applyEvent(runs.get(id), data);
  runs.set(id, record);
  refreshNodes(id);
  if (record.missing) fetchHistory(id); // this page missed the run's first steps
}

function onExecutionEnded(event) {
  const promptId = event.detail?.prompt_id;
  for (const [id, record] of runs) {
    if (isLive(record) && (!promptId || record.prompt_id === promptId)) {
      runs.set(id, markStopped(record));
      refreshNodes(id);
    }
  }
}

function fetchAll() {
  for (const [id, node] of graphNodes(app.rootGraph)) if (node.lowvramMonitor) fetchHistory(id);
}

function attach(node) {
  if (node.lowvramMonitor) return node.lowvramMonitor;
  node.lowvramMonitor = new Monitor(node);
  const [width, height] = node.computeSize();
  node.setSize([Math.max(node.size[0], width, MIN_WIDTH), Math.max(node.size[1], height)]);
  return node.lowvramMonitor;
}

function register() {
  api.addEventListener(EVENT, onProgress);
  api.addEventListener("execution_error", onExecutionEnded);
  api.addEventListener("execution_interrupted", onExecutionEnded);
  api.addEventListener("reconnected", fetchAll);
  // the ETA counts down between steps
  setInterval(() => {
    for (const monitor of monitors) if (isLive(monitor.record)) monitor.draw();
  }, 1000);

  app.registerExtension({
    name: "lowvram_lora.monitor",
    async beforeRegisterNodeDef(nodeType, nodeData) {
      if (nodeData?.name !== NODE_TYPE) return;
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const result = onNodeCreated?.apply(this, arguments);
        attach(this).refresh();
        return result;
      };
      const onConfigure = nodeType.prototype.onConfigure;
      nodeType.prototype.onConfigure = function () {
        const result = onConfigure?.apply(this, arguments);
        const monitor = attach(this);
        // the saved size may predate the monitor: keep room for it
        const [, height] = this.computeSize();
        if (this.size[1] < height) this.setSize([Math.max(this.size[0], MIN_WIDTH), height]);
        queueMicrotask(() => {
          monitor.refresh();
          fetchHistory(executionIdOf(this));
        });
        return result;
      };
      const onRemoved = nodeType.prototype.onRemoved;
      nodeType.prototype.onRemoved = function () {
        this.lowvramMonitor?.remove();
        return onRemoved?.apply(this, arguments);
      };
    },
  });
}

if (!globalThis[LOADED]) {
  globalThis[LOADED] = true;
  register();
}
