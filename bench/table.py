"""The comparison table: one row per (model, configuration), ratios to a reference row.

Plain data in, text out (an aligned text table for the terminal and the node, Markdown for
bench/out/results.md). Nothing here measures: the figures come from :mod:`.steps`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from ..training.memory import format_bytes

OK = "ok"
OOM = "oom"
ERROR = "error"
SKIPPED = "skipped"

_STATUS_TEXT = {OOM: "out of memory", ERROR: "failed", SKIPPED: "not run"}


@dataclass(frozen=True)
class Row:
    """One measured configuration."""

    model: str  # e.g. "SD1.5-shaped UNet"
    config: str  # the configuration's key, e.g. "builtin_on"
    label: str  # for people, e.g. "built-in, checkpointing on"
    status: str = OK
    peak_bytes: int | None = None  # above the step's baseline
    baseline_bytes: int = 0  # memory allocated when the step began (0 on CPU: unknown there)
    step_seconds: float | None = None  # median over the timed steps
    note: str = ""  # the plan, the budget, ...
    detail: str = ""  # why it failed or was not run

    @property
    def measured(self) -> bool:
        return self.status == OK and self.peak_bytes is not None and self.step_seconds is not None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, or None when either is missing or the reference is 0."""
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference


def ratios(rows: Sequence[Row], reference: str) -> dict[tuple[str, str], tuple[float | None, float | None]]:
    """(memory ratio, time ratio) of every row to the row of config ``reference`` of its model."""
    refs = {row.model: row for row in rows if row.config == reference and row.measured}
    out: dict[tuple[str, str], tuple[float | None, float | None]] = {}
    for row in rows:
        ref = refs.get(row.model)
        if ref is None or not row.measured:
            out[(row.model, row.config)] = (None, None)
        else:
            out[(row.model, row.config)] = (ratio(row.peak_bytes, ref.peak_bytes), ratio(row.step_seconds, ref.step_seconds))
    return out


def format_ratio(value: float | None) -> str:
    return "–" if value is None else f"×{value:.2f}"


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 1.0:
        return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.2g} ms"
    return f"{seconds:.2f} s"


def _cells(row: Row, ratio_pair: tuple[float | None, float | None], show_model: bool) -> list[str]:
    if row.measured:
        peak = format_bytes(int(row.peak_bytes))  # type: ignore[arg-type]
        seconds = format_seconds(row.step_seconds)
    else:
        peak = _STATUS_TEXT.get(row.status, row.status)
        seconds = "–"
    note = row.note if row.measured or not row.detail else row.detail
    cells = [row.label, peak, format_ratio(ratio_pair[0]), seconds, format_ratio(ratio_pair[1]), note]
    return ([row.model] if show_model else []) + cells


def headers(reference_label: str, show_model: bool) -> list[str]:
    cells = [
        "configuration",
        "peak above baseline",
        f"memory vs {reference_label}",
        "median step",
        f"time vs {reference_label}",
        "plan",
    ]
    return (["model"] if show_model else []) + cells


def format_table(
    rows: Sequence[Row],
    *,
    reference: str,
    reference_label: str,
    markdown: bool = False,
    show_model: bool | None = None,
) -> str:
    """The rows as one table, with memory and time ratios to each model's ``reference`` row.

    ``show_model`` defaults to whether the rows span more than one model.
    """
    if show_model is None:
        show_model = len({row.model for row in rows}) > 1
    head, body = table_cells(rows, reference=reference, reference_label=reference_label, show_model=show_model)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(_md_rule(i, show_model) for i in range(len(head))) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    numeric = _numeric_columns(show_model)

    def line(cells: Iterable[str]) -> str:
        parts = [cell.rjust(w) if i in numeric else cell.ljust(w) for i, (cell, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(head), rule, *(line(cells) for cells in body)])


def table_cells(
    rows: Sequence[Row], *, reference: str, reference_label: str, show_model: bool
) -> tuple[list[str], list[list[str]]]:
    """The header and the cells of every row, as :func:`format_table` lays them out."""
    pairs = ratios(rows, reference)
    head = headers(reference_label, show_model)
    body = [_cells(row, pairs[(row.model, row.config)], show_model) for row in rows]
    return head, body


def numeric_columns(show_model: bool) -> set[int]:
    """The indices of the right-aligned (number) columns."""
    return _numeric_columns(show_model)


def _numeric_columns(show_model: bool) -> set[int]:
    offset = 1 if show_model else 0
    return {offset + 1, offset + 2, offset + 3, offset + 4}


def _md_rule(index: int, show_model: bool) -> str:
    return "---:" if index in _numeric_columns(show_model) else "---"
