"""The example workflow runs end to end in the real executor on a tiny generated SD1.5 checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from host_harness import CHECKPOINT_NAME, DATASET_FOLDER
from make_example_workflow import EXAMPLE
from workflow import local_node_info, ui_to_api

pytestmark = pytest.mark.host


def example_api_prompt(steps: int = 3) -> dict:
    """The committed example (UI format) as the executor runs it, with test-sized settings."""
    workflow = json.loads(Path(EXAMPLE).read_text())
    infos = {node["type"]: local_node_info(node["type"]) for node in workflow["nodes"]}
    prompt = ui_to_api(workflow, infos)
    by_type = {node["class_type"]: node["inputs"] for node in prompt.values()}
    by_type["LowVRAMLoRA_LoadModelForTraining"]["model_file"] = f"checkpoints/{CHECKPOINT_NAME}"
    by_type["LoadImageTextDataSetFromFolder"]["folder"] = DATASET_FOLDER
    by_type["LowVRAMLoRA_TrainLoRAStep"].update(steps=steps, precision="fp32")
    by_type["KSampler"]["steps"] = 2
    by_type["EmptyLatentImage"].update(width=64, height=64)
    return prompt


def test_example_converts_to_the_graph_it_was_written_from(comfy):
    from make_example_workflow import example_prompt

    workflow = json.loads(Path(EXAMPLE).read_text())
    infos = {node["type"]: local_node_info(node["type"]) for node in workflow["nodes"]}
    assert ui_to_api(workflow, infos) == {
        node_id: {"class_type": node["class_type"], "inputs": node["inputs"]} for node_id, node in example_prompt().items()
    }


def test_example_trains_saves_loads_with_loraloader_and_samples(comfy, caplog):
    before = set(comfy.loras.rglob("*.safetensors"))
    with caplog.at_level(logging.WARNING):
        history = comfy.run(example_api_prompt())
    saved = set(comfy.loras.rglob("*.safetensors")) - before
    assert len(saved) == 1
    lora_file = saved.pop()
    assert lora_file.parent.name == "lowvram_lora" and lora_file.name.startswith("example_")
    # LoraLoader loaded it (it fed the sampler) without unmapped keys
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    states = list((comfy.base / "models" / "training_states").rglob("*.safetensors"))
    assert states, "the training state was asked for and not written"
    images = list(comfy.output.glob("lowvram_lora_example*.png"))
    assert images, f"no sampled image in {comfy.output}"
    texts = [o for o in history["outputs"].values() if "text" in o]
    assert any("LoRA:" in t["text"][0] for t in texts)
    assert any("images" in o for o in history["outputs"].values())
