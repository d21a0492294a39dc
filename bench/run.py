"""The benchmark: every checkpointing configuration, each in a fresh process, in one table.

    python bench/run.py                 # CPU: SD1.5-shaped UNet and Flux-shaped DiT (a few minutes)
    python bench/run.py --quick         # small models, a few minutes: trains, saves a LoRA, prints the table
    python bench/run.py --device cuda --size full --time-limit 420    # what bench/gpu.sh runs

Rows: ComfyUI's built-in TrainLoraNode with its gradient_checkpointing off and on, and this
pack with checkpointing off, every block, every 2nd block, two memory budgets between the
`full` and `off` peaks, every block with CPU offload, and every block with the pack's default
(smaller) set of layers. Same model, latent, conditioning, LoRA rank, optimizer and step count
in all. Ratios are to "built-in, checkpointing on". When no host imports, the core path runs
(a plain-torch DiT, pack rows only, ratios to "pack full").

Writes bench/out/results.md, results.json and memory_timeline.png (see bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.register_pack()

from lowvram_lora.bench import configs as bench_configs  # noqa: E402
from lowvram_lora.bench import models as bench_models  # noqa: E402
from lowvram_lora.bench import table  # noqa: E402
from lowvram_lora.bench.steps import StepFigures  # noqa: E402
from lowvram_lora.training.memory import format_bytes  # noqa: E402

BENCH = Path(__file__).resolve().parent
WORKER = BENCH / "worker.py"
DEFAULT_OUT = BENCH / "out"
# Share of the time limit each model may use (cumulative deadlines: time one leaves goes to the next).
TIME_SHARES = {"sd15": 0.2, "sdxl": 0.3, "flux": 0.5, "core_dit": 1.0}
MIN_CONFIG_SECONDS = 20.0  # a configuration is not started with less time than this left


def log(message: str) -> None:
    print(message, flush=True)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def run_worker(arguments: list[str], timeout: float, scratch: Path, name: str) -> dict:
    """One configuration in a fresh Python process; its JSON result (or why there is none)."""
    out = scratch / f"{name}.json"
    log_path = scratch / f"{name}.log"
    command = [sys.executable, str(WORKER), *arguments, "--out", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    try:
        with open(log_path, "w") as handle:
            completed = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": table.SKIPPED, "error": f"stopped at the time limit ({timeout:.0f} s)"}
    if out.exists():
        return json.loads(out.read_text())
    tail = log_path.read_text(errors="replace")[-800:] if log_path.exists() else ""
    return {"status": table.ERROR, "error": f"worker exited with {completed.returncode} and no result: {tail.strip()[-300:]}"}


def check_host(scratch: Path) -> dict:
    return run_worker(["--check-host"], timeout=180, scratch=scratch, name="check_host")


def _note(result: dict) -> str:
    """The plan column: which blocks are checkpointed, and a budget's target and expectation."""
    plan = result.get("plan") or {}
    parts = []
    if plan.get("units"):
        parts.append(f"{plan.get('checkpointed', 0)}/{plan['units']} blocks")
    elif result.get("trainer") == bench_configs.BUILTIN:
        parts.append("every outermost module" if "True" in str(plan.get("description")) else "none")
    if plan.get("offload"):
        parts.append("offload")
    if result.get("budget_bytes"):
        parts.append(f"budget {format_bytes(int(result['budget_bytes']))}")
        if plan.get("expected_peak_bytes"):
            parts.append(f"expects {format_bytes(int(plan['expected_peak_bytes']))}")
    return ", ".join(parts)


def _short_error(text: str, limit: int = 90) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    for prefix in ("RuntimeError: ", "torch.OutOfMemoryError: "):
        if line.startswith(prefix):
            line = line[len(prefix):]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def to_row(model_title: str, config: bench_configs.Configuration, result: dict) -> table.Row:
    figures = StepFigures.from_dict(result["figures"]) if result.get("figures") else None
    status = result.get("status", table.ERROR)
    if status == table.OK and (figures is None or figures.peak_bytes is None):
        status = table.ERROR
    detail = _short_error(result.get("error", ""))
    if status == "oom" and result.get("max_allocated_bytes"):
        detail = f"out of memory (over {format_bytes(result['max_allocated_bytes'])} allocated)"
    return table.Row(
        model=model_title,
        config=config.key,
        label=config.label,
        status=status,
        peak_bytes=figures.peak_bytes if figures else None,
        baseline_bytes=figures.baseline_bytes if figures else 0,
        step_seconds=figures.step_seconds if figures else None,
        note=_note(result),
        detail=detail,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--size", choices=bench_models.SIZES, default=None, help="small, cpu or full (default: full on cuda, cpu on cpu)")
    parser.add_argument("--small", action="store_true", help="same as --size small (a dry run of the GPU script on a CPU)")
    parser.add_argument("--quick", action="store_true", help="small models; also saves the pack's LoRA and checks the host loads it")
    parser.add_argument("--backend", choices=("auto", "host", "core"), default="auto", help="auto: the host when it imports, else the core")
    parser.add_argument("--models", default="", help="comma-separated subset, e.g. sd15,flux")
    parser.add_argument("--configs", default="", help="comma-separated subset of configuration keys")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1)")
    parser.add_argument("--timed", type=int, default=3, help="timed steps per configuration (the median is reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads in each worker (0: torch's default)")
    parser.add_argument("--time-limit", type=float, default=0.0, help="seconds for all configurations together (0: none)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="folder for results.md, results.json, memory_timeline.png")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if _cuda_available() else "cpu"
    if args.small or args.quick:
        args.size = "small"
    if args.size is None:
        args.size = "full" if args.device.startswith("cuda") else "cpu"
    if args.size == "small" and args.threads == 0 and not args.device.startswith("cuda"):
        # Tiny models are per-operator overhead: more threads only wait on each other.
        args.threads = 1
    if args.warmup is None:
        args.warmup = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="lowvram-bench-"))

    backend, host_info = args.backend, {}
    if backend in ("auto", "host"):
        host_info = check_host(scratch)
        if host_info.get("ok"):
            backend = "host"
            log(f"host: ComfyUI {host_info.get('version')} at {host_info.get('path')}")
        elif backend == "host":
            log(f"the host does not import: {host_info.get('reason') or host_info.get('error')}")
            return 2
        else:
            backend = "core"
            log(f"no usable host ({host_info.get('reason') or host_info.get('error')}): core-only path on a plain-torch DiT")
    model_keys = [m for m in args.models.split(",") if m] or (
        list(bench_models.MODELS_FOR_SIZE[args.size]) if backend == "host" else ["core_dit"]
    )
    wanted = [c for c in args.configs.split(",") if c] or list(bench_configs.RUN_ORDER)
    unknown = [c for c in wanted if c not in bench_configs.BY_KEY]
    if unknown:
        log(f"unknown configurations {unknown}; known: {list(bench_configs.BY_KEY)}")
        return 2
    run_order = [c for c in bench_configs.RUN_ORDER if c in wanted]
    if backend == "core":
        run_order = [c for c in run_order if bench_configs.BY_KEY[c].trainer == bench_configs.PACK]
    reference, reference_label = (
        (bench_configs.REFERENCE, bench_configs.REFERENCE_LABEL)
        if backend == "host"
        else (bench_configs.CORE_REFERENCE, bench_configs.CORE_REFERENCE_LABEL)
    )
    log(
        f"device {args.device} ({_device_name(args.device)}), size {args.size}, models {model_keys}, "
        f"{len(run_order)} configurations each, {args.warmup} warm-up + {args.timed} timed steps, rank {args.rank}"
    )

    results: dict[tuple[str, str], dict] = {}
    rows: list[table.Row] = []
    budgets: dict[tuple[str, str], int] = {}
    panels = []
    titles: dict[str, str] = {}
    share_total = sum(TIME_SHARES.get(m, 1.0) for m in model_keys)
    share_done = 0.0
    for model_key in model_keys:
        share_done += TIME_SHARES.get(model_key, 1.0)
        deadline = started + args.time_limit * share_done / share_total if args.time_limit else None
        model_spec = bench_models.core_spec(args.size) if backend == "core" else bench_models.spec(model_key, args.size)
        title = model_spec.short
        titles[title] = model_spec.title
        log(f"\n{title}: {model_spec.title}")
        model_results: dict[str, dict] = {}
        for key in run_order:
            config = bench_configs.BY_KEY[key]
            budget = None
            if config.mode == "budget":
                full = _peak(model_results.get("pack_full"))
                off = _peak(model_results.get("pack_off"))
                budget = bench_configs.budget_levels(full, off)[config.budget_index or 0]
            worker_args = [
                "--backend", backend, "--model", model_key, "--size", args.size, "--config", key,
                "--device", args.device, "--rank", str(args.rank), "--warmup", str(args.warmup),
                "--timed", str(args.timed), "--threads", str(args.threads),
            ]
            if budget is not None:
                worker_args += ["--budget-bytes", str(budget)]
                budgets[(title, key)] = budget
            if args.quick and key == "pack_full":
                worker_args += ["--save-lora", str(out_dir / f"quick_{model_key}_lora.safetensors")]
            remaining = (deadline - time.monotonic()) if deadline is not None else 24 * 3600.0
            if remaining < MIN_CONFIG_SECONDS:
                result = {"status": table.SKIPPED, "error": "not started: the time limit was reached"}
            elif config.mode == "budget" and budget is None:
                result = {"status": table.SKIPPED, "error": "no budget: pack full and off were not both measured"}
            else:
                t0 = time.monotonic()
                result = run_worker(worker_args, timeout=remaining, scratch=scratch, name=f"{model_key}_{key}")
                result["wall_seconds"] = time.monotonic() - t0
            model_results[key] = result
            results[(title, key)] = result
            row = to_row(title, config, result)
            log("  " + _progress_line(row, result))
        model_rows = [to_row(title, c, model_results[c.key]) for c in bench_configs.CONFIGURATIONS if c.key in model_results]
        rows.extend(model_rows)
        panels.append((f"{title}: {titles[title]}", [(c.label, _timeline(model_results.get(c.key))) for c in bench_configs.CONFIGURATIONS if c.key in model_results]))

    text_table = table.format_table(rows, reference=reference, reference_label=reference_label)
    md_table = table.format_table(rows, reference=reference, reference_label=reference_label, markdown=True)
    # The pack's plans against its own 'off': what checkpointing alone saves and costs.
    pack_rows = [row for row in rows if bench_configs.BY_KEY[row.config].trainer == bench_configs.PACK]
    if reference != "pack_off" and any(row.config == "pack_off" for row in pack_rows):
        text_table += "\n\n" + table.format_table(pack_rows, reference="pack_off", reference_label="pack off")
        md_table += "\n\n" + table.format_table(pack_rows, reference="pack_off", reference_label="pack off", markdown=True)
    targets = bench_configs.target_lines(rows, budgets) if backend == "host" and args.size != "small" else []
    if backend == "host" and args.size == "small":
        targets_note = (
            "targets not checked at the small sizes: a tiny model's peak comes late in the step, from the LoRA's "
            "gradients and the optimizer's update, not from activations; run without --quick/--small for the claim"
        )
    else:
        targets_note = ""
    plot_note = _save_plot(panels, out_dir / "memory_timeline.png")
    meta = {
        "command": "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": args.device,
        "device_name": _device_name(args.device),
        "size": args.size,
        "backend": backend,
        "host": host_info,
        "rank": args.rank,
        "warmup": args.warmup,
        "timed": args.timed,
        "seconds": time.monotonic() - started,
        "python": platform.python_version(),
        "torch": _torch_version(),
        "models": titles,
    }
    (out_dir / "results.json").write_text(
        json.dumps({"meta": meta, "rows": [r.as_dict() for r in rows], "results": [
            {"model": m, "config": c, **{k: v for k, v in r.items() if k != "traceback"}} for (m, c), r in results.items()
        ]}, indent=1)
    )
    (out_dir / "results.md").write_text(_markdown(meta, md_table, targets, results, reference_label, targets_note))
    quick_files = [r.get("lora_file") for r in results.values() if r.get("lora_file")]

    log("")
    for lora_file in quick_files:
        mapped = lora_file.get("mapped_by_host")
        check = f", {mapped} of them mapped by the host's LoRA loader" if mapped is not None else ""
        log(f"trained LoRA saved: {lora_file['path']} ({lora_file['layers']} layers{check})")
    for line in targets:
        log("target: " + line)
    if targets_note:
        log(targets_note)
    log(f"wrote {out_dir / 'results.md'}, {out_dir / 'results.json'}, {plot_note} ({time.monotonic() - started:.0f} s)")
    log("")
    for short, long in titles.items():
        log(f"{short}: {long}")
    log(text_table)
    return 0


def _save_plot(panels: list, path: Path) -> str:
    """Draw the memory timelines (PIL: ComfyUI ships it; a bare core-only machine may not have it)."""
    try:
        from lowvram_lora.bench import plot
    except ImportError as exc:
        return f"no plot ({exc}: pip install pillow)"
    plot.timeline_figure(panels).save(path)
    return str(path)


def _peak(result: dict | None) -> int | None:
    if not result or result.get("status") != table.OK or not result.get("figures"):
        return None
    return result["figures"].get("peak_bytes")


def _timeline(result: dict | None) -> list[tuple[float, int]]:
    if not result or result.get("status") != table.OK or not result.get("figures"):
        return []
    return [(float(t), int(b)) for t, b in result["figures"].get("timeline") or []]


def _progress_line(row: table.Row, result: dict) -> str:
    if row.measured:
        return (f"{row.label}: peak {format_bytes(row.peak_bytes)}, {table.format_seconds(row.step_seconds)}/step "
                f"({result.get('wall_seconds', 0):.0f} s)")
    return f"{row.label}: {row.status}: {row.detail}"


def _torch_version() -> str:
    import torch

    return torch.__version__


def _markdown(meta: dict, md_table: str, targets: list[str], results: dict, reference_label: str, targets_note: str = "") -> str:
    host = meta.get("host") or {}
    lines = [
        "# Gradient checkpointing benchmark",
        "",
        f"Command: `{meta['command'].strip()}`  ",
        f"Device: {meta['device_name']} ({meta['device']}), torch {meta['torch']}, Python {meta['python']}  ",
        f"Path: {'ComfyUI ' + str(host.get('version')) + ' host' if meta['backend'] == 'host' else 'core only (no host)'}; "
        f"LoRA rank {meta['rank']}, batch 1, {meta['warmup']} warm-up + {meta['timed']} timed steps per configuration, "
        f"each configuration in a fresh process; {meta['seconds']:.0f} s in all.",
        "",
        f"Peak: live memory above the step's start (CUDA: allocator counters; CPU: the pack's tensor tracker, one "
        f"step). Step: median wall time of the timed steps (CPU: untracked). Ratios to {reference_label}. "
        "See bench/README.md for the method.",
        "",
        *[f"- {short}: {long}" for short, long in (meta.get("models") or {}).items()],
        "",
        md_table,
        "",
    ]
    if targets:
        lines += ["## Targets", ""] + [f"- {line}" for line in targets] + [""]
    elif targets_note:
        lines += ["## Targets", "", targets_note[0].upper() + targets_note[1:] + ".", ""]
    lines += ["## Details", ""]
    for (model, config), result in results.items():
        figures = result.get("figures") or {}
        times = ", ".join(f"{t:.3g}" for t in figures.get("step_seconds_all") or [])
        losses = result.get("losses") or []
        extra = []
        if result.get("baseline_bytes") or figures.get("baseline_bytes"):
            extra.append(f"baseline {format_bytes(int(figures.get('baseline_bytes') or 0))}")
        if times:
            extra.append(f"step times [{times}] s")
        if result.get("adapted_layers") is not None:
            extra.append(f"LoRA on {result['adapted_layers']} layers, {result.get('lora_parameters', 0) / 1e6:.2f} M parameters")
        if losses:
            extra.append(f"last loss {losses[-1]:.4g}")
        plan = (result.get("plan") or {}).get("description")
        if plan:
            extra.append(plan)
        if result.get("error"):
            extra.append(f"{result.get('status')}: {result['error']}")
        lines.append(f"- {model} / {config}: " + "; ".join(extra))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
