"""The benchmark's host-free parts: the table and its ratios, the budget levels and target checks,
the step probe against known allocations and sleeps, and one real (tiny) configuration of
bench/run.py's core path in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lowvram_lora.bench import configs, plot, steps, table
from lowvram_lora.bench.steps import StepProbe, StepSchedule

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _row(model: str, config: str, peak: int | None, seconds: float | None, status: str = table.OK, **extra) -> table.Row:
    return table.Row(model, config, configs.BY_KEY[config].label if config in configs.BY_KEY else config, status, peak, 0, seconds, **extra)


# --------------------------------------------------------------------------------------------
# Table and ratios


def test_ratios_are_to_the_reference_row_of_the_same_model():
    rows = [
        _row("A", "builtin_on", 100 * MiB, 2.0),
        _row("A", "pack_full", 40 * MiB, 1.0),
        _row("B", "builtin_on", 10 * MiB, 4.0),
        _row("B", "pack_full", 20 * MiB, 6.0),
        _row("B", "pack_off", None, None, status=table.OOM),
    ]
    pairs = table.ratios(rows, "builtin_on")
    assert pairs[("A", "pack_full")] == pytest.approx((0.4, 0.5))
    assert pairs[("A", "builtin_on")] == pytest.approx((1.0, 1.0))
    assert pairs[("B", "pack_full")] == pytest.approx((2.0, 1.5))
    assert pairs[("B", "pack_off")] == (None, None)


def test_ratios_are_missing_when_the_reference_was_not_measured():
    rows = [_row("A", "builtin_on", None, None, status=table.ERROR, detail="boom"), _row("A", "pack_full", MiB, 1.0)]
    assert table.ratios(rows, "builtin_on")[("A", "pack_full")] == (None, None)
    text = table.format_table(rows, reference="builtin_on", reference_label="built-in on")
    assert "failed" in text and "boom" in text and "–" in text


def test_text_table_is_aligned_with_units_and_ratios():
    rows = [
        _row("SD", "builtin_on", 1536 * MiB, 2.5, note="168 layers"),
        _row("SD", "pack_full", 512 * MiB, 0.25, note="23/23 blocks"),
        _row("SD", "pack_off", None, None, status=table.OOM),
    ]
    text = table.format_table(rows, reference="builtin_on", reference_label="built-in on")
    lines = text.splitlines()
    assert lines[0].startswith("configuration") and "memory vs built-in on" in lines[0]
    assert set(lines[1]) <= {"-", " "}
    full = next(line for line in lines if line.startswith("pack full"))
    assert "512 MiB" in full and "×0.33" in full and "250 ms" in full and "×0.10" in full and "23/23 blocks" in full
    assert "1.5 GiB" in lines[2] and "2.50 s" in lines[2]
    assert "out of memory" in text
    # Right-aligned numbers: every row's peak cell ends at the same column as the header's.
    end = lines[0].index("peak above baseline") + len("peak above baseline")
    assert full[:end].endswith("512 MiB")


def test_markdown_table_and_model_column():
    rows = [_row("A", "builtin_on", MiB, 1.0), _row("B", "builtin_on", 2 * MiB, 2.0)]
    md = table.format_table(rows, reference="builtin_on", reference_label="built-in on", markdown=True)
    lines = md.splitlines()
    assert lines[0].startswith("| model | configuration |")
    assert lines[1].startswith("|---|---|---:|")
    assert len(lines) == 4 and all(line.startswith("|") and line.endswith("|") for line in lines)


def test_seconds_and_ratio_formatting():
    assert table.format_seconds(None) == "–"
    assert table.format_seconds(0.0042) == "4.2 ms"
    assert table.format_seconds(0.25) == "250 ms"
    assert table.format_seconds(12.345) == "12.35 s"
    assert table.format_ratio(0.4749) == "×0.47"
    assert table.format_ratio(None) == "–"


# --------------------------------------------------------------------------------------------
# Budget levels and targets


def test_budget_levels_lie_between_the_full_and_off_peaks():
    assert configs.budget_levels(100, 400) == [200, 300]
    assert configs.budget_levels(None, 400) == [None, None]
    assert configs.budget_levels(400, 100) == [None, None]
    assert configs.budget_levels(0, 100, [0.5]) == [50]


def test_target_lines_check_the_issue_targets():
    model = "M"
    rows = [
        _row(model, "builtin_on", 100, 2.0),
        _row(model, "pack_full", 50, 1.5),
        _row(model, "pack_every2", 150, 1.0),
        _row(model, "pack_off", 400, 0.8),
        _row(model, "pack_budget1", 140, 0.95),  # budget 150: fits; nearest every-N at or below: every 2 (150 <= 150)
        _row(model, "pack_budget2", 320, 0.9),  # budget 300: does not fit
    ]
    lines = configs.target_lines(rows, {(model, "pack_budget1"): 150, (model, "pack_budget2"): 300})
    builtin = next(line for line in lines if "vs built-in on" in line)
    assert "memory ×0.50 (target ≤ 0.80: met)" in builtin and "time ×0.75 (target ≤ 1.00: met)" in builtin
    engine = next(line for line in lines if "vs pack off" in line)
    assert "memory ×0.12 (target ≤ 0.40: met)" in engine and "time ×1.88 (target ≤ 1.50: MISSED)" in engine
    budget1, budget2 = (line for line in lines if "budget" in line)
    assert "(≤ budget: met)" in budget1 and "pack every 2" in budget1 and "MISSED" not in budget1
    assert "(≤ budget: MISSED)" in budget2 and "(≤: met)" in budget2


def test_comparator_is_the_every_n_plan_with_the_largest_peak_within_the_budget():
    rows = {r.config: r for r in [_row("M", "pack_full", 50, 2.0), _row("M", "pack_every2", 150, 1.0)]}
    assert configs.comparator(rows, 100).config == "pack_full"
    assert configs.comparator(rows, 150).config == "pack_every2"
    assert configs.comparator(rows, 10) is None


# --------------------------------------------------------------------------------------------
# The step probe


def test_schedule_phases_per_device():
    schedule = StepSchedule(warmup=2, timed=3)
    assert schedule.phases("cpu") == ("warmup", "warmup", "tracked", "timed", "timed", "timed", "trailing")
    assert schedule.phases("cuda") == ("warmup", "warmup", "timed", "timed", "timed", "timeline", "trailing")
    assert schedule.total_steps("cpu") == 7
    with pytest.raises(ValueError, match="timed"):
        StepSchedule(warmup=1, timed=0)


def test_probe_measures_a_known_allocation_and_known_step_times_on_cpu():
    schedule = StepSchedule(warmup=1, timed=3)
    probe = StepProbe("cpu", schedule)
    kept = torch.ones(1024)  # from before: not counted
    sleeps = {2: 0.02, 3: 0.05, 4: 0.03}
    for index, phase in enumerate(schedule.phases("cpu")):
        probe.boundary()
        block = torch.empty(MiB, dtype=torch.uint8)  # 1 MiB, freed at the end of the step
        if phase == "tracked":
            extra = torch.empty(2 * MiB, dtype=torch.uint8)
            del extra
        kept.add_(1)
        time.sleep(sleeps.get(index, 0.0))
        del block
    probe.close()
    figures = probe.figures()
    assert figures.complete and figures.method == "cpu-tensor-tracker"
    assert figures.peak_bytes == 3 * MiB  # both live at once; the in-place add allocates nothing
    assert figures.baseline_bytes == 0
    assert len(figures.step_seconds_all) == 3
    assert figures.step_seconds == pytest.approx(0.03, abs=0.015)
    assert figures.timeline and max(b for _, b in figures.timeline) == 3 * MiB
    # The timeline is stretched to the median step time.
    assert max(t for t, _ in figures.timeline) <= figures.step_seconds * 1.01
    assert _round_trip(figures) == figures


def _round_trip(figures: steps.StepFigures) -> steps.StepFigures:
    return steps.StepFigures.from_dict(json.loads(json.dumps(figures.as_dict())))


def test_probe_reports_nothing_for_an_incomplete_run_and_close_leaves_no_mode_behind():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    probe = StepProbe("cpu", StepSchedule(warmup=0, timed=2))
    probe.boundary()  # the tracked step: tracker and timeline entered
    assert _get_current_dispatch_mode() is not None
    probe.close()
    assert _get_current_dispatch_mode() is None
    figures = probe.figures()
    assert not figures.complete and figures.peak_bytes is None and figures.step_seconds is None


def test_decimate_keeps_the_peak():
    points = [(i / 1000, (i * 37) % 1000) for i in range(1000)] + [(0.5005, 5000)]
    points.sort()
    out = steps.decimate(points, 50)
    assert len(out) <= 50
    assert max(b for _, b in out) == 5000
    assert [t for t, _ in out] == sorted(t for t, _ in out)


def test_plots_draw_without_error():
    panel = plot.timeline_panel("t", [("a", [(0.0, 0), (0.5, 100), (1.0, 10)]), ("b", []), ("c", [(0.2, 50)])])
    assert panel.width >= 900 and panel.height >= 200
    head, body = table.table_cells([_row("M", "pack_full", MiB, 1.0)], reference="pack_full", reference_label="x", show_model=False)
    image = plot.table_image(head, body, numeric=table.numeric_columns(False), title="×²")
    assert image.width > 200
    assert plot.stack([panel, image]).height == panel.height + image.height + 8


# --------------------------------------------------------------------------------------------
# One real configuration, end to end through bench/run.py's core path, in fresh processes


def test_run_core_path_end_to_end(tmp_path):
    command = [
        sys.executable, str(ROOT / "bench" / "run.py"), "--backend", "core", "--device", "cpu", "--size", "small",
        "--configs", "pack_full,pack_off", "--rank", "4", "--timed", "2", "--threads", "1", "--out", str(tmp_path),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    # The table is printed last.
    tail = completed.stdout.strip().splitlines()
    assert tail[-4].startswith("configuration") and "memory vs pack off" in tail[-4]
    assert tail[-2].startswith("pack off") and "×1.00" in tail[-2] and tail[-1].startswith("pack full")
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["backend"] == "core"
    rows = {row["config"]: row for row in data["rows"]}
    for key in ("pack_full", "pack_off"):
        assert rows[key]["status"] == "ok"
        assert rows[key]["peak_bytes"] > 0 and rows[key]["step_seconds"] > 0
    # Checkpointing every block keeps less than checkpointing none.
    assert rows["pack_full"]["peak_bytes"] < rows["pack_off"]["peak_bytes"]
    markdown = (tmp_path / "results.md").read_text()
    assert "| configuration |" in markdown and "pack full" in markdown
    from PIL import Image

    with Image.open(tmp_path / "memory_timeline.png") as image:
        assert image.width >= 900
