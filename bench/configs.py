"""The configurations the benchmark compares, the budget levels, and the targets it checks.

Host-free: the worker turns a :class:`Configuration` into a real run, the node reuses the
budget levels and the plan labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..training.memory import format_bytes
from .table import Row, ratios

BUILTIN = "builtin"
PACK = "pack"

# The reference row of every ratio in the benchmark's table.
REFERENCE = "builtin_on"
REFERENCE_LABEL = "built-in on"
# Without the host (the core-only fallback) there is no built-in trainer: ratios to pack off.
CORE_REFERENCE = "pack_off"
CORE_REFERENCE_LABEL = "pack off"

# Budget levels, as fractions of the way from the `full` peak to the `off` peak.
BUDGET_FRACTIONS = (1 / 3, 2 / 3)


@dataclass(frozen=True)
class Configuration:
    key: str
    label: str
    trainer: str  # BUILTIN or PACK
    checkpointing: bool = True  # built-in: its gradient_checkpointing switch
    mode: str = "full"  # pack: off / full / every_n / budget
    interval: int = 2
    budget_index: int | None = None  # pack budget: index into the measured budget levels
    offload: bool = False
    targets: str = "matched"  # pack: "matched" (the layers the built-in adapts) or "default"


CONFIGURATIONS: tuple[Configuration, ...] = (
    Configuration("builtin_off", "built-in, checkpointing off", BUILTIN, checkpointing=False),
    Configuration("builtin_on", "built-in, checkpointing on", BUILTIN, checkpointing=True),
    Configuration("pack_off", "pack off", PACK, mode="off"),
    Configuration("pack_full", "pack full", PACK, mode="full"),
    Configuration("pack_every2", "pack every 2", PACK, mode="every_n", interval=2),
    Configuration("pack_budget1", "pack budget 1/3", PACK, mode="budget", budget_index=0),
    Configuration("pack_budget2", "pack budget 2/3", PACK, mode="budget", budget_index=1),
    Configuration("pack_full_offload", "pack full + offload", PACK, mode="full", offload=True),
    Configuration("pack_full_default", "pack full, pack's default layers", PACK, mode="full", targets="default"),
)
BY_KEY = {config.key: config for config in CONFIGURATIONS}

# The order they run in: the reference and the rows the budget levels need first, so that a run
# cut short by its time limit still has the main comparison.
RUN_ORDER = (
    "builtin_on",
    "pack_full",
    "pack_off",
    "pack_every2",
    "builtin_off",
    "pack_budget1",
    "pack_budget2",
    "pack_full_offload",
    "pack_full_default",
)


def budget_levels(full_peak: int | None, off_peak: int | None, fractions: Sequence[float] = BUDGET_FRACTIONS) -> list[int | None]:
    """Budgets between the measured ``full`` and ``off`` peaks (None where either is missing)."""
    if full_peak is None or off_peak is None or off_peak <= full_peak:
        return [None for _ in fractions]
    return [int(full_peak + (off_peak - full_peak) * fraction) for fraction in fractions]


def comparator(rows_by_key: dict[str, Row], budget: int) -> Row | None:
    """The every-N plan (every block, every 2nd) with the largest measured peak at or below ``budget``."""
    candidates = [rows_by_key.get(key) for key in ("pack_full", "pack_every2")]
    fitting = [row for row in candidates if row is not None and row.measured and row.peak_bytes <= budget]
    return max(fitting, key=lambda row: row.peak_bytes) if fitting else None


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def target_lines(rows: Sequence[Row], budgets: dict[tuple[str, str], int]) -> list[str]:
    """The issue's targets, checked on the measured rows, one line each.

    - pack ``full`` against built-in on: peak <= 0.8x and step time <= 1.0x;
    - each budget: measured peak <= the budget, and step time <= that of the every-N plan with
      the nearest peak at or below the budget.
    """
    lines: list[str] = []
    pairs = ratios(rows, REFERENCE)
    to_off = ratios(rows, "pack_off")
    models = list(dict.fromkeys(row.model for row in rows))
    for model in models:
        by_key = {row.config: row for row in rows if row.model == model}
        full = by_key.get("pack_full")
        if full is not None and "pack_off" in by_key:
            memory, seconds = to_off[(model, "pack_full")]
            if memory is not None and seconds is not None:
                lines.append(
                    f"{model}: pack full vs pack off (the engine's target): memory ×{memory:.2f} "
                    f"(target ≤ 0.40: {_verdict(memory <= 0.4)}), time ×{seconds:.2f} (target ≤ 1.50: {_verdict(seconds <= 1.5)})"
                )
        if full is not None and REFERENCE in by_key:
            memory, seconds = pairs[(model, "pack_full")]
            if memory is None or seconds is None:
                lines.append(f"{model}: pack full vs built-in on: not measured")
            else:
                lines.append(
                    f"{model}: pack full vs built-in on: memory ×{memory:.2f} (target ≤ 0.80: {_verdict(memory <= 0.8)}), "
                    f"time ×{seconds:.2f} (target ≤ 1.00: {_verdict(seconds <= 1.0)})"
                )
        for key in ("pack_budget1", "pack_budget2"):
            row = by_key.get(key)
            budget = budgets.get((model, key))
            if row is None or budget is None:
                continue
            if not row.measured:
                lines.append(f"{model}: {row.label} ({format_bytes(budget)}): not measured")
                continue
            fits = row.peak_bytes <= budget
            text = (
                f"{model}: {row.label}: budget {format_bytes(budget)}, measured {format_bytes(row.peak_bytes)} "
                f"(≤ budget: {_verdict(fits)})"
            )
            other = comparator(by_key, budget)
            if other is None:
                text += "; no every-N plan fits the budget to compare the time with"
            else:
                faster = row.step_seconds <= other.step_seconds
                text += (
                    f"; {row.step_seconds:.3g} s/step vs {other.label} {other.step_seconds:.3g} s/step "
                    f"(≤: {_verdict(faster)})"
                )
            lines.append(text)
    return lines
