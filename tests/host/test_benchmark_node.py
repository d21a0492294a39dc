"""The Benchmark Gradient Checkpointing node on a tiny host model, and the benchmark's host path.

The node runs every plan for a few real training steps on the user's MODEL, LATENT and
CONDITIONING: its table must list every plan with measured numbers, its image must be an
IMAGE tensor, and the MODEL must come back exactly as it went in (same outputs bit for bit, no
instance ``forward`` left on any module, no hook, ``requires_grad`` and wrappers unchanged).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parents[2]
NUMBER_WITH_UNIT = r"\d+(\.\d+)? (B|KiB|MiB|GiB)"
SECONDS = r"\d+(\.\d+)? (ms|s)\b"


@pytest.fixture(scope="module")
def node(host_path):
    from lowvram_lora.nodes.benchmark import BenchmarkCheckpointing

    return BenchmarkCheckpointing


def _state(patcher):
    model = patcher.model.diffusion_model
    return {
        "grad": {name: p.requires_grad for name, p in model.named_parameters()},
        "forward_in_dict": [name for name, m in model.named_modules() if "forward" in m.__dict__],
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
        "wrappers": repr(patcher.wrappers),
        "attachments": sorted(patcher.attachments),
        "params": {name: id(p) for name, p in model.named_parameters()},
    }


def _output(patcher) -> torch.Tensor:
    base = patcher.model
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 4, 8, 8, generator=g)
    context = torch.randn(1, 8, 32, generator=g)
    with torch.no_grad():
        return base.apply_model(x, torch.tensor([3.0]), c_crossattn=context).clone()


def _run(node, patcher, **overrides):
    g = torch.Generator().manual_seed(1)
    latent = {"samples": torch.randn(1, 4, 8, 8, generator=g)}
    conditioning = [[torch.randn(1, 8, 32, generator=g), {}]]
    values = dict(
        steps=2,
        warmup_steps=1,
        rank=4,
        precision="fp32",
        batch_size=1,
        interval=2,
        budget_levels=2,
        offload=True,
        targets="",
        include_conv=False,
    )
    values.update(overrides)
    with torch.inference_mode():  # as the host's executor runs nodes
        return node.execute(patcher, latent, conditioning, **values)


def test_node_measures_every_plan_and_leaves_the_model_clean(node):
    import host_models

    patcher = host_models.tiny_model_patcher("sd15")
    before_state = _state(patcher)
    before_output = _output(patcher)

    out = _run(node, patcher)
    text, image = out.args

    # Every plan is a row with a measured peak and step time.
    rows = {line.split("  ")[0].strip(): line for line in text.splitlines()}
    labels = ["off", "every block", "every 2nd block", "every block + offload"]
    budget_rows = [line for label, line in rows.items() if label.startswith("memory budget")]
    assert len(budget_rows) == 2, text
    for line in [rows[label] for label in labels] + budget_rows:
        assert re.search(NUMBER_WITH_UNIT, line), line
        assert re.search(SECONDS, line), line
        assert "×" in line, line
    assert "out of memory" not in text and "failed" not in text

    # An IMAGE: (1, H, W, 3) float in [0, 1].
    assert isinstance(image, torch.Tensor) and image.ndim == 4 and image.shape[0] == 1 and image.shape[3] == 3
    assert image.dtype == torch.float32 and image.shape[1] > 100 and image.shape[2] > 100
    assert float(image.min()) >= 0.0 and float(image.max()) <= 1.0
    assert out.ui is not None

    # The MODEL is as it was.
    after_state = _state(patcher)
    assert after_state["forward_in_dict"] == []
    assert after_state == before_state
    assert torch.equal(_output(patcher), before_output)


def test_node_leaves_trainable_flags_as_they_were(node):
    import host_models

    patcher = host_models.tiny_model_patcher("sd15")
    model = patcher.model.diffusion_model
    # A user's model may have some parameters marked trainable: they must stay so.
    chosen = {name for index, (name, _) in enumerate(model.named_parameters()) if index % 3 == 0}
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in chosen)
    before = _state(patcher)
    _run(node, patcher, steps=1, budget_levels=0, offload=False)
    assert _state(patcher) == before


def test_node_schema_has_a_tooltip_on_every_input(node):
    from lowvram_lora.nodes.extension import NODES

    assert node in NODES
    schema = node.GET_SCHEMA()
    assert schema.node_id == "LowVRAMLoRA_BenchmarkCheckpointing"
    for item in schema.inputs:
        assert getattr(item, "tooltip", None), f"input {item.id} has no tooltip"
    for item in schema.outputs:
        assert getattr(item, "tooltip", None), f"output {item.display_name} has no tooltip"


def test_bench_worker_runs_the_builtin_trainer_in_a_fresh_process(tmp_path, host_path):
    """One real configuration of bench/run.py's host path: ComfyUI's own TrainLoraNode."""
    out = tmp_path / "row.json"
    command = [
        sys.executable, str(ROOT / "bench" / "worker.py"), "--backend", "host", "--model", "sd15", "--size", "small",
        "--config", "builtin_on", "--device", "cpu", "--rank", "4", "--timed", "2", "--threads", "1", "--out", str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=240, env={**_env(host_path)})
    assert out.exists(), completed.stdout[-2000:] + completed.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["status"] == "ok", result.get("traceback") or result.get("error")
    figures = result["figures"]
    assert figures["complete"] and figures["peak_bytes"] > 0 and figures["step_seconds"] > 0
    assert len(figures["step_seconds_all"]) == 2
    assert figures["method"] == "cpu-tensor-tracker"
    assert result["adapted_layers"] > 0 and result["lora_parameters"] > 0
    assert len(result["losses"]) == 5  # 1 warm-up + 1 tracked + 2 timed + 1 trailing


def _env(host_path) -> dict:
    import os

    return {**os.environ, "COMFYUI_PATH": str(host_path), "TQDM_DISABLE": "1"}
