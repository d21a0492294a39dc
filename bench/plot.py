"""Drawing the benchmark with PIL (the host ships it; matplotlib is not assumed).

- :func:`timeline_figure`: live memory against time within one training step, one line per
  configuration, one panel per model;
- :func:`table_image`: a table of cells (from :func:`.table.table_cells`) as an image;
- :func:`stack`: images one above the other.
"""

from __future__ import annotations

from typing import Sequence

from PIL import Image, ImageDraw, ImageFont

from ..training.memory import format_bytes

PALETTE = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)
TEXT = (20, 20, 20)
GRID = (225, 225, 225)
AXIS = (120, 120, 120)

Series = tuple[str, Sequence[tuple[float, int]]]  # (label, [(seconds, bytes), ...])


def _font() -> ImageFont.ImageFont:
    return ImageFont.load_default()


def _plain(text: str) -> str:
    """The default font has no glyph for some signs the text table uses."""
    return str(text).replace("×", "x").replace("–", "-").replace("²", "^2")


def _text_width(draw: ImageDraw.ImageDraw, text: str, font) -> float:
    return draw.textlength(text, font=font)


def _seconds_label(seconds: float) -> str:
    if seconds == 0:
        return "0"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s"


def timeline_panel(title: str, series: Sequence[Series], *, width: int = 900, height: int = 340) -> Image.Image:
    """Memory above the step's start against time in the step, a line per configuration.

    ``width`` is the whole image's; the legend takes what its labels need on the right.
    """
    font = _font()
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    drawn = [(label, list(points)) for label, points in series if points]
    legends = [_plain(f"{label} ({format_bytes(max(b for _, b in points))})") for label, points in drawn]
    legend_width = int(max([_text_width(probe, text, font) for text in legends] + [80])) + 44
    width = max(width, 78 + 360 + legend_width)
    height = max(height, 28 + 16 * len(drawn) + 40)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    left, right, top, bottom = 78, width - legend_width, 28, height - 34
    draw.text((left, 8), _plain(title), fill=TEXT, font=font)
    if not drawn:
        draw.text((left + 8, top + 8), "no timeline measured", fill=AXIS, font=font)
        return image
    t_max = max(t for _, points in drawn for t, _ in points) or 1.0
    b_max = max(b for _, points in drawn for _, b in points) or 1
    for k in range(5):
        y = bottom - (bottom - top) * k / 4
        draw.line([(left, y), (right, y)], fill=GRID)
        label = format_bytes(int(b_max * k / 4))
        draw.text((left - 6 - _text_width(draw, label, font), y - 6), label, fill=TEXT, font=font)
        x = left + (right - left) * k / 4
        draw.line([(x, top), (x, bottom)], fill=GRID)
        t_label = _seconds_label(t_max * k / 4)
        draw.text((x - _text_width(draw, t_label, font) / 2, bottom + 6), t_label, fill=TEXT, font=font)
    draw.rectangle((left, top, right, bottom), outline=AXIS)
    draw.text((right - 80, bottom + 18), "time in step", fill=AXIS, font=font)

    def xy(t: float, b: int) -> tuple[float, float]:
        return left + (right - left) * t / t_max, bottom - (bottom - top) * b / b_max

    for index, (label, points) in enumerate(drawn):
        color = PALETTE[index % len(PALETTE)]
        line = [xy(t, b) for t, b in points]
        if len(line) == 1:
            x, y = line[0]
            draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=color)
        else:
            draw.line(line, fill=color, width=2)
        y = top + 4 + 16 * index
        draw.rectangle((right + 12, y + 2, right + 24, y + 12), fill=color)
        draw.text((right + 30, y), legends[index], fill=TEXT, font=font)
    return image


def timeline_figure(panels: Sequence[tuple[str, Sequence[Series]]], *, width: int = 900) -> Image.Image:
    """One :func:`timeline_panel` per (title, series), stacked."""
    return stack([timeline_panel(title, series, width=width) for title, series in panels])


def table_image(
    head: Sequence[str], body: Sequence[Sequence[str]], *, numeric: set[int] = frozenset(), title: str = ""
) -> Image.Image:
    """A table drawn cell by cell (the default font is not monospaced, so columns are measured)."""
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    font = _font()
    pad, row_h = 10, 18
    columns = len(head)
    head = [_plain(cell) for cell in head]
    body = [[_plain(cell) for cell in cells] for cells in body]
    title = _plain(title)
    widths = [max(_text_width(probe, line[i], font) for line in [head, *body]) for i in range(columns)]
    width = int(sum(widths) + pad * (columns + 1)) + 2
    top = 28 if title else 8
    height = top + row_h * (len(body) + 1) + 12
    image = Image.new("RGB", (max(width, 200), height), "white")
    draw = ImageDraw.Draw(image)
    if title:
        draw.text((pad, 8), title, fill=TEXT, font=font)
    for r, cells in enumerate([head, *body]):
        y = top + r * row_h
        if r == 1:
            draw.line([(pad, y - 2), (width - pad, y - 2)], fill=AXIS)
        x = pad
        for i, cell in enumerate(cells):
            text = str(cell)
            offset = widths[i] - _text_width(draw, text, font) if i in numeric else 0
            draw.text((x + offset, y), text, fill=TEXT, font=font)
            x += widths[i] + pad
    return image


def stack(images: Sequence[Image.Image], *, gap: int = 8) -> Image.Image:
    """Images one above the other on white, left-aligned."""
    images = list(images)
    if not images:
        return Image.new("RGB", (200, 40), "white")
    width = max(image.width for image in images)
    height = sum(image.height for image in images) + gap * (len(images) - 1)
    out = Image.new("RGB", (width, height), "white")
    y = 0
    for image in images:
        out.paste(image, (0, y))
        y += image.height + gap
    return out
