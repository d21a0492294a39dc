// Drawing of the live training monitor into a 2D canvas context (CSS pixels).
// Layout, top to bottom: status line (step/total, ETA), loss chart (raw and smoothed),
// memory strip (measured peak per step against the budget, when either is known), figures
// (peak memory, step time, learning rate) and the checkpointing plan.

import {
  etaNow, formatBytes, formatDuration, formatNumber, formatSeconds, isLive, lastOf, maxOf,
  smooth, smoothingWeight,
} from "./monitor_state.js";

export const MIN_HEIGHT = 240;
const PAD = 6;
const LINE = 14;
const MEMORY_HEIGHT = 34;

function cssVar(style, name, fallback) {
  const value = style.getPropertyValue(name).trim();
  return value || fallback;
}

// Colours from the host's theme variables (dark and light themes), with fallbacks.
export function themeOf(element) {
  const style = getComputedStyle(element);
  return {
    fg: cssVar(style, "--fg-color", "#ddd"),
    muted: cssVar(style, "--descrip-text", "#999"),
    panel: cssVar(style, "--comfy-input-bg", "#222"),
    border: cssVar(style, "--border-color", "#4e4e4e"),
    raw: "rgba(110, 160, 255, 0.45)",
    smooth: "#5b9dff",
    memory: "#e0a43c",
    budget: "#e05a5a",
    font: getComputedStyle(document.body).fontFamily || "sans-serif",
  };
}

function fit(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let lo = 0;
  let hi = text.length;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (ctx.measureText(text.slice(0, mid) + "…").width <= width) lo = mid;
    else hi = mid - 1;
  }
  return text.slice(0, lo) + "…";
}

function wrap(ctx, text, width, lines) {
  const words = text.split(/\s+/).filter(Boolean);
  const out = [];
  let line = "";
  for (let i = 0; i < words.length; i++) {
    const candidate = line ? `${line} ${words[i]}` : words[i];
    if (ctx.measureText(candidate).width <= width || !line) {
      line = candidate;
      continue;
    }
    if (out.length === lines - 1) {
      out.push(fit(ctx, [line, ...words.slice(i)].join(" "), width));
      return out;
    }
    out.push(line);
    line = words[i];
  }
  if (line) out.push(fit(ctx, line, width));
  return out;
}

function statusText(record) {
  const total = record.total_steps ?? "?";
  switch (record.status) {
    case "started":
      return `started · step ${record.step ?? 0} / ${total}`;
    case "running":
      return `step ${record.step} / ${total}`;
    case "finished":
      return `finished · ${record.step} / ${total} steps`;
    case "stopped":
      return `stopped at step ${record.step} / ${total}`;
    default:
      return `step ${record.step ?? "?"} / ${total}`;
  }
}

function rightText(record, now) {
  if (isLive(record)) {
    const eta = etaNow(record, now);
    return eta == null ? "ETA after the first step" : `ETA ${formatDuration(eta)}`;
  }
  const seconds = record.points.reduce((sum, p) => sum + (p.step_seconds || 0), 0);
  return seconds > 0 ? `trained in ${formatDuration(seconds)}` : "";
}

// Per pixel column, the min and max of the raw values (a long run stays one stroke per column).
function columns(xs, ys, x0, x1, width) {
  const span = x1 - x0 || 1;
  const cols = new Map();
  for (let i = 0; i < xs.length; i++) {
    const c = Math.round(((xs[i] - x0) / span) * width);
    const entry = cols.get(c);
    if (!entry) cols.set(c, [ys[i], ys[i]]);
    else {
      entry[0] = Math.min(entry[0], ys[i]);
      entry[1] = Math.max(entry[1], ys[i]);
    }
  }
  return [...cols.entries()].sort((a, b) => a[0] - b[0]);
}

function drawLoss(ctx, box, record, theme) {
  const { x, y, w, h } = box;
  ctx.fillStyle = theme.panel;
  ctx.fillRect(x, y, w, h);
  ctx.strokeStyle = theme.border;
  ctx.lineWidth = 1;
  ctx.strokeRect(x + 0.5, y + 0.5, w - 1, h - 1);
  const points = record.points.filter((p) => p.loss != null && Number.isFinite(p.loss));
  ctx.font = `10px ${theme.font}`;
  if (points.length === 0) {
    ctx.fillStyle = theme.muted;
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    ctx.fillText(isLive(record) ? "waiting for the first step…" : "no loss recorded", x + w / 2, y + h / 2);
    return { drawn: 0, smoothed: null };
  }
  const steps = points.map((p) => p.step);
  const losses = points.map((p) => p.loss);
  const smoothed = smooth(losses, smoothingWeight(losses.length));
  let lo = Math.min(...losses);
  let hi = Math.max(...losses);
  if (losses.length > 50) {
    // ignore the rare spike when scaling: 1st to 99th percentile, widened to the smoothed curve
    const sorted = [...losses].sort((a, b) => a - b);
    lo = Math.min(sorted[Math.floor(sorted.length * 0.01)], ...smoothed);
    hi = Math.max(sorted[Math.ceil(sorted.length * 0.99) - 1], ...smoothed);
  }
  if (hi - lo < 1e-12) {
    hi += Math.abs(hi) * 0.05 + 1e-6;
    lo -= Math.abs(lo) * 0.05 + 1e-6;
  }
  const margin = (hi - lo) * 0.08;
  lo -= margin;
  hi += margin;
  const first = record.first_step ?? steps[0] - 1;
  const x0 = Math.min(first, steps[0]);
  const x1 = Math.max(record.total_steps ?? steps[steps.length - 1], steps[steps.length - 1], x0 + 1);
  const inner = { x: x + 4, y: y + 14, w: w - 8, h: h - 26 };
  const px = (s) => inner.x + ((s - x0) / (x1 - x0)) * inner.w;
  const py = (v) => inner.y + (1 - (Math.min(hi, Math.max(lo, v)) - lo) / (hi - lo)) * inner.h;

  // grid: the middle line
  ctx.strokeStyle = theme.border;
  ctx.setLineDash([2, 3]);
  ctx.beginPath();
  ctx.moveTo(inner.x, Math.round(inner.y + inner.h / 2) + 0.5);
  ctx.lineTo(inner.x + inner.w, Math.round(inner.y + inner.h / 2) + 0.5);
  ctx.stroke();
  ctx.setLineDash([]);

  ctx.save();
  ctx.beginPath();
  ctx.rect(inner.x, inner.y - 1, inner.w, inner.h + 2);
  ctx.clip();
  // raw
  ctx.strokeStyle = theme.raw;
  ctx.fillStyle = theme.raw;
  ctx.lineWidth = 1;
  ctx.beginPath();
  if (points.length > inner.w * 2) {
    for (const [c, [mn, mx]] of columns(steps, losses, x0, x1, inner.w)) {
      ctx.moveTo(inner.x + c + 0.5, py(mx));
      ctx.lineTo(inner.x + c + 0.5, py(mn) + 0.5);
    }
  } else {
    points.forEach((p, i) => (i ? ctx.lineTo(px(p.step), py(p.loss)) : ctx.moveTo(px(p.step), py(p.loss))));
  }
  ctx.stroke();
  if (points.length <= 60) {
    for (const p of points) ctx.fillRect(px(p.step) - 1.5, py(p.loss) - 1.5, 3, 3);
  }
  // smoothed
  if (points.length >= 3) {
    ctx.strokeStyle = theme.smooth;
    ctx.lineWidth = 2;
    ctx.lineJoin = "round";
    ctx.beginPath();
    const stride = Math.max(1, Math.floor(points.length / (inner.w * 2)));
    for (let i = 0; i < points.length; i += stride) {
      const X = px(steps[i]);
      const Y = py(smoothed[i]);
      if (i === 0) ctx.moveTo(X, Y);
      else ctx.lineTo(X, Y);
    }
    ctx.lineTo(px(steps[steps.length - 1]), py(smoothed[smoothed.length - 1]));
    ctx.stroke();
  }
  ctx.restore();

  // labels
  ctx.fillStyle = theme.muted;
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillText(`loss ${formatNumber(hi - margin)}`, x + 4, y + 2);
  ctx.textBaseline = "bottom";
  ctx.fillText(formatNumber(lo + margin), x + 4, y + h - 1);
  ctx.textAlign = "right";
  ctx.fillText(`step ${x0} – ${x1}`, x + w - 4, y + h - 1);
  ctx.textBaseline = "top";
  const last = losses[losses.length - 1];
  const legend = points.length >= 3
    ? `last ${formatNumber(last)} · smoothed ${formatNumber(smoothed[smoothed.length - 1])}`
    : `last ${formatNumber(last)}`;
  ctx.fillStyle = theme.fg;
  ctx.fillText(legend, x + w - 4, y + 2);
  return { drawn: points.length, smoothed: smoothed[smoothed.length - 1] };
}

function drawMemory(ctx, box, record, theme) {
  const { x, y, w, h } = box;
  const measured = record.points.filter((p) => p.peak_bytes != null);
  const budget = record.budget_bytes;
  const peak = maxOf(measured, "peak_bytes") ?? record.peak_max ?? null;
  const top = Math.max(budget || 0, peak || 0) * 1.1 || 1;
  const bar = { x, y: y + 13, w, h: h - 13 };
  ctx.fillStyle = theme.panel;
  ctx.fillRect(bar.x, bar.y, bar.w, bar.h);
  ctx.strokeStyle = theme.border;
  ctx.lineWidth = 1;
  ctx.strokeRect(bar.x + 0.5, bar.y + 0.5, bar.w - 1, bar.h - 1);
  const over = budget != null && peak != null && peak > budget;
  ctx.font = `10px ${theme.font}`;
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  ctx.fillStyle = over ? theme.budget : theme.muted;
  let label = peak != null ? `peak memory ${formatBytes(peak)}` : "peak memory not measured yet";
  if (budget != null) {
    label += ` of budget ${formatBytes(budget)}`;
    if (peak != null) label += ` (${((peak / budget) * 100).toFixed(peak / budget < 0.1 ? 1 : 0)}%)`;
    if (over) label += " — over budget";
  }
  ctx.fillText(fit(ctx, label, w), x, y);
  const py = (v) => bar.y + bar.h - 2 - (v / top) * (bar.h - 4);
  if (budget != null) {
    ctx.strokeStyle = theme.budget;
    ctx.setLineDash([4, 3]);
    ctx.beginPath();
    ctx.moveTo(bar.x + 1, Math.round(py(budget)) + 0.5);
    ctx.lineTo(bar.x + bar.w - 1, Math.round(py(budget)) + 0.5);
    ctx.stroke();
    ctx.setLineDash([]);
  }
  if (measured.length) {
    const x0 = Math.min(record.first_step ?? measured[0].step - 1, measured[0].step);
    const x1 = Math.max(record.total_steps ?? 0, measured[measured.length - 1].step, x0 + 1);
    const px = (s) => bar.x + 2 + ((s - x0) / (x1 - x0)) * (bar.w - 4);
    ctx.strokeStyle = theme.memory;
    ctx.fillStyle = theme.memory;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    measured.forEach((p, i) => (i ? ctx.lineTo(px(p.step), py(p.peak_bytes)) : ctx.moveTo(px(p.step), py(p.peak_bytes))));
    ctx.stroke();
    if (measured.length <= 60) for (const p of measured) ctx.fillRect(px(p.step) - 1.5, py(p.peak_bytes) - 1.5, 3, 3);
  }
}

// Draws `record` (or the empty state) into a width x height box; returns what it drew.
export function drawMonitor(ctx, width, height, record, theme, now = Date.now()) {
  ctx.clearRect(0, 0, width, height);
  ctx.font = `11px ${theme.font}`;
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  const w = width - 2 * PAD;
  if (!record) {
    ctx.fillStyle = theme.muted;
    const lines = wrap(ctx, "Loss, memory, step time and the checkpointing plan appear here while this node trains.", w, 3);
    lines.forEach((line, i) => ctx.fillText(line, PAD, PAD + i * LINE));
    return { drawn: 0 };
  }
  // status line
  ctx.fillStyle = record.status === "stopped" ? theme.budget : theme.fg;
  ctx.font = `bold 11px ${theme.font}`;
  const left = statusText(record);
  ctx.fillText(fit(ctx, left, w * 0.6), PAD, PAD);
  ctx.font = `11px ${theme.font}`;
  ctx.textAlign = "right";
  ctx.fillStyle = theme.fg;
  ctx.fillText(fit(ctx, rightText(record, now), w * 0.4), width - PAD, PAD);
  ctx.textAlign = "left";
  // figures and plan
  const hasMemory = record.budget_bytes != null || record.points.some((p) => p.peak_bytes != null) || record.peak_max != null;
  const textRows = 3;
  const bottom = height - PAD - textRows * LINE;
  const memoryTop = hasMemory ? bottom - MEMORY_HEIGHT - 4 : bottom;
  const chartTop = PAD + LINE + 4;
  const chart = drawLoss(ctx, { x: PAD, y: chartTop, w, h: Math.max(40, memoryTop - chartTop - 4) }, record, theme);
  if (hasMemory) drawMemory(ctx, { x: PAD, y: memoryTop, w, h: MEMORY_HEIGHT }, record, theme);

  const seconds = lastOf(record.points, "step_seconds");
  const lr = lastOf(record.points, "lr");
  const peak = maxOf(record.points, "peak_bytes") ?? record.peak_max ?? null;
  const figures = [
    peak != null ? `peak ${formatBytes(peak)}${record.memory_method ? ` (${record.memory_method})` : ""}` : null,
    seconds != null ? `${formatSeconds(seconds)}/step` : null,
    lr != null ? `lr ${formatNumber(lr)}` : null,
  ].filter(Boolean).join(" · ");
  ctx.font = `11px ${theme.font}`;
  ctx.fillStyle = theme.fg;
  ctx.fillText(fit(ctx, figures || "no step measured yet", w), PAD, bottom + 2);
  ctx.fillStyle = theme.muted;
  const plan = record.plan ? `plan: ${record.plan}` : "plan: chosen on the first step";
  wrap(ctx, plan, w, textRows - 1).forEach((line, i) => ctx.fillText(line, PAD, bottom + 2 + (i + 1) * LINE));
  return { drawn: chart.drawn, smoothed: chart.smoothed };
}
