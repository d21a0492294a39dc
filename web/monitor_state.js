// The live training monitor's data: one record per training run, built from the server's
// `lowvram_lora.progress` events (nodes/progress.py), a history fetched again after a page
// reload (nodes/routes.py), or the compact copy saved in the node's properties.
// Pure functions: no host imports, no DOM.

export const PROPERTY = "lowvram_lora_monitor";
export const SAVED_POINTS = 400; // points kept in a saved workflow (evenly spaced, the last exact)
const LIVE = new Set(["started", "running"]);

export function isLive(record) {
  return !!record && LIVE.has(record.status);
}

function point(p) {
  return {
    step: Number(p.step),
    loss: p.loss == null ? null : Number(p.loss),
    lr: p.lr == null ? null : Number(p.lr),
    peak_bytes: p.peak_bytes == null ? null : Number(p.peak_bytes),
    step_seconds: p.step_seconds == null ? null : Number(p.step_seconds),
  };
}

// Points sorted by step, one per step; `incoming` wins where both have a step.
export function mergePoints(points, incoming) {
  if (!incoming || incoming.length === 0) return points;
  const last = points.length ? points[points.length - 1].step : -Infinity;
  const fresh = incoming.map(point);
  if (fresh.every((p, i) => p.step > (i ? fresh[i - 1].step : last))) return points.concat(fresh);
  const byStep = new Map(points.map((p) => [p.step, p]));
  for (const p of fresh) byStep.set(p.step, p);
  return [...byStep.values()].sort((a, b) => a.step - b.step);
}

const SCALARS = [
  "node", "run", "prompt_id", "workflow", "started_at", "status", "step", "first_step",
  "total_steps", "plan", "memory_method", "budget_bytes",
];

// The record after one event (or a fetched history, which is an event holding every point).
// A different `run` starts a new record. `missing` says that points before the first one
// received were never seen here (a page opened or reloaded during a run).
export function applyEvent(record, event, now = Date.now()) {
  const same = record && record.run === event.run;
  const next = same ? { ...record } : { points: [] };
  for (const key of SCALARS) {
    const value = event[key];
    if (value === undefined) continue;
    if (value === null && same && (key === "plan" || key === "memory_method")) continue;
    next[key] = value;
  }
  next.points = mergePoints(next.points, event.points || []);
  if (event.eta_seconds !== undefined) {
    next.eta_seconds = event.eta_seconds;
    next.eta_received = now;
  }
  next.received = now;
  const first = next.points.length ? next.points[0].step : null;
  const expectedFirst = (next.first_step || 0) + 1;
  next.missing = next.step > (next.first_step || 0) && (first === null || first > expectedFirst);
  return next;
}

// A run that ended without its last step (an error or an interrupt).
export function markStopped(record) {
  return isLive(record) ? { ...record, status: "stopped", eta_seconds: null } : record;
}

// Which of two records of the same node to show: the newer run.
export function newer(a, b) {
  if (!a) return b;
  if (!b) return a;
  if (a.run === b.run) return (b.points?.length || 0) >= (a.points?.length || 0) ? b : a;
  return (b.started_at || 0) > (a.started_at || 0) ? b : a;
}

// The saved form: scalars and points as [step, loss, lr, peak_bytes, step_seconds] rows,
// at most SAVED_POINTS of them.
export function toSaved(record) {
  const saved = {};
  for (const key of SCALARS) if (record[key] !== undefined) saved[key] = record[key];
  const points = record.points || [];
  let kept = points;
  if (points.length > SAVED_POINTS) {
    const stride = (points.length - 1) / (SAVED_POINTS - 1);
    kept = Array.from({ length: SAVED_POINTS }, (_, i) => points[Math.round(i * stride)]);
  }
  saved.points_total = points.length;
  saved.points = kept.map((p) => [p.step, p.loss, p.lr, p.peak_bytes, p.step_seconds]);
  saved.peak_max = maxOf(points, "peak_bytes");
  saved.version = 1;
  return saved;
}

export function fromSaved(saved) {
  if (!saved || typeof saved !== "object" || !Array.isArray(saved.points) || !saved.run) return null;
  const record = { ...saved, eta_seconds: null, received: 0 };
  record.points = saved.points
    .filter((row) => Array.isArray(row) && row.length >= 2)
    .map(([step, loss, lr, peak_bytes, step_seconds]) => point({ step, loss, lr, peak_bytes, step_seconds }));
  if (isLive(record)) record.status = "stopped"; // saved mid-run: that run is not running here
  record.missing = false;
  return record;
}

// ---------------------------------------------------------------------------------------------
// Figures

export function maxOf(points, key) {
  let best = null;
  for (const p of points) if (p[key] != null && (best === null || p[key] > best)) best = p[key];
  return best;
}

export function lastOf(points, key) {
  for (let i = points.length - 1; i >= 0; i--) if (points[i][key] != null) return points[i][key];
  return null;
}

// Exponential moving average with bias correction (as TensorBoard smooths), over `values`.
export function smooth(values, weight) {
  const out = new Array(values.length);
  let acc = 0;
  let norm = 0;
  for (let i = 0; i < values.length; i++) {
    acc = acc * weight + (1 - weight) * values[i];
    norm = norm * weight + (1 - weight);
    out[i] = acc / norm;
  }
  return out;
}

// Heavier smoothing for longer runs: ~n/10 steps of memory, between 0 and 0.98.
export function smoothingWeight(n) {
  if (n < 3) return 0;
  return Math.min(0.98, Math.max(0.5, 1 - 10 / n));
}

// The ETA now: the server's figure less the time since it arrived.
export function etaNow(record, now = Date.now()) {
  if (!isLive(record) || record.eta_seconds == null) return null;
  return Math.max(0, record.eta_seconds - (now - (record.eta_received || now)) / 1000);
}

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

function threeDigits(value) {
  const decimals = value < 10 ? 2 : value < 100 ? 1 : 0;
  let text = value.toFixed(decimals);
  if (text.includes(".")) text = text.replace(/0+$/, "").replace(/\.$/, "");
  return text;
}

// As training/memory.py format_bytes: binary units, three significant digits.
export function formatBytes(n) {
  if (n == null || !Number.isFinite(n)) return "–";
  if (n < 0) return "-" + formatBytes(-n);
  if (n < 1024) return `${Math.trunc(n)} B`;
  let value = n;
  let unit = 0;
  while (unit < UNITS.length - 1 && value >= 1024) {
    value /= 1024;
    unit += 1;
  }
  let text = threeDigits(value);
  if (Number(text) >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
    text = threeDigits(value);
  }
  return `${text} ${UNITS[unit]}`;
}

export function formatDuration(seconds) {
  if (seconds == null || !Number.isFinite(seconds)) return "–";
  const s = Math.round(seconds);
  if (s < 60) return `${s} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min ${String(s % 60).padStart(2, "0")} s`;
  return `${Math.floor(m / 60)} h ${String(m % 60).padStart(2, "0")} min`;
}

export function formatSeconds(seconds) {
  if (seconds == null || !Number.isFinite(seconds)) return "–";
  if (seconds < 1) return `${(seconds * 1000).toFixed(seconds < 0.01 ? 1 : 0)} ms`;
  return `${seconds.toFixed(seconds < 10 ? 2 : 1)} s`;
}

export function formatNumber(x) {
  if (x == null || !Number.isFinite(x)) return "–";
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return x.toExponential(2);
  return x.toPrecision(4).replace(/(\.\d*?)0+$/, "$1").replace(/\.$/, "");
}
