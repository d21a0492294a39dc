"""TrainingReport: the training report as an image (loss, memory, time) and as text."""

from __future__ import annotations

import numpy as np
import torch
from comfy_api.latest import io, ui
from PIL import Image, ImageDraw, ImageFont

from ..training.memory import format_bytes
from ..training.report import TrainingReport
from .types import ReportType

WIDTH, HEIGHT, MARGIN = 900, 620, 56
LOSS_COLOR, SMOOTH_COLOR, MEMORY_COLOR, TIME_COLOR, BUDGET_COLOR = (
    (150, 170, 220),
    (20, 60, 170),
    (200, 90, 30),
    (40, 140, 70),
    (200, 30, 30),
)


def smooth(values: list[float], weight: float = 0.8) -> list[float]:
    """Exponential moving average with bias correction, as TensorBoard draws it."""
    out, average = [], 0.0
    for index, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**index))
    return out


def _panel(draw, box, xs, series, title, fmt, font, hline=None):
    left, top, right, bottom = box
    draw.rectangle(box, outline=(180, 180, 180))
    draw.text((left, top - 16), title, fill=(0, 0, 0), font=font)
    values = [v for _, points in series for v in points if v is not None]
    if hline is not None:
        values.append(hline[0])
    if not values or not xs:
        draw.text((left + 8, top + 8), "not measured", fill=(120, 120, 120), font=font)
        return
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5 * abs(lo or 1), hi + 0.5 * abs(hi or 1)
    x_lo, x_hi = min(xs), max(xs)
    span = max(x_hi - x_lo, 1)

    def point(x, y):
        return (left + (x - x_lo) / span * (right - left), bottom - (y - lo) / (hi - lo) * (bottom - top))

    for color, points in series:
        line = [point(x, y) for x, y in zip(xs, points) if y is not None]
        if len(line) == 1:
            x, y = line[0]
            draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=color)
        elif line:
            draw.line(line, fill=color, width=2)
    if hline is not None:
        y = point(x_lo, hline[0])[1]
        draw.line([(left, y), (right, y)], fill=BUDGET_COLOR, width=1)
        draw.text((right - 120, y - 14), hline[1], fill=BUDGET_COLOR, font=font)
    draw.text((left - MARGIN + 4, top), fmt(hi), fill=(60, 60, 60), font=font)
    draw.text((left - MARGIN + 4, bottom - 12), fmt(lo), fill=(60, 60, 60), font=font)
    draw.text((left, bottom + 4), f"step {x_lo}", fill=(60, 60, 60), font=font)
    draw.text((right - 60, bottom + 4), f"step {x_hi}", fill=(60, 60, 60), font=font)


def render(report: TrainingReport, budget_bytes: int | None = None) -> Image.Image:
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    steps = [s.step for s in report.steps]
    losses = [s.loss for s in report.steps]
    draw.multiline_text((12, 8), report.summary(), fill=(0, 0, 0), font=font, spacing=3)
    top = 8 + 14 * (report.summary().count("\n") + 1) + 24
    plot_h = (HEIGHT - top - 3 * 30) // 3
    boxes = [(MARGIN, top + i * (plot_h + 30), WIDTH - 16, top + i * (plot_h + 30) + plot_h) for i in range(3)]
    _panel(draw, boxes[0], steps, [(LOSS_COLOR, losses), (SMOOTH_COLOR, smooth(losses))],
           "loss (raw, smoothed)", lambda v: f"{v:.3f}", font)
    peaks = [s.peak_bytes for s in report.steps]
    hline = (budget_bytes, f"budget {format_bytes(budget_bytes)}") if budget_bytes else None
    _panel(draw, boxes[1], steps, [(MEMORY_COLOR, peaks)],
           f"measured peak memory above baseline ({report.memory_method or 'not measured'})",
           lambda v: format_bytes(int(v)), font, hline)
    _panel(draw, boxes[2], steps, [(TIME_COLOR, [s.step_seconds for s in report.steps])],
           "step time (s)", lambda v: f"{v:.2f}", font)
    return image


def to_image_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)[None]


class TrainingReportNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMLoRA_TrainingReport",
            display_name="Training Report",
            category="training/lowvram lora",
            description="Shows a training run: loss per step, measured peak memory and step time, the plan.",
            is_output_node=True,
            inputs=[ReportType.Input("report", tooltip="The report output of a Train LoRA node.")],
            outputs=[
                io.Image.Output(display_name="image", tooltip="The report as an image."),
                io.String.Output(display_name="text", tooltip="The figures as text."),
            ],
        )

    @classmethod
    def execute(cls, report: TrainingReport) -> io.NodeOutput:
        budget = report.settings.get("budget_bytes") if isinstance(report.settings, dict) else None
        image = to_image_tensor(render(report, budget))
        text = report.summary()
        return io.NodeOutput(image, text, ui=ui.PreviewImage(image, cls=cls))
