"""The pack in a real ComfyUI server, driven over HTTP (and the websocket) only, as the frontend
drives it: it loads, its nodes describe themselves, the example workflow runs, training is
reproducible across prompts, a cancel leaves nothing behind, and bad input ends one node with a
readable error while the server keeps serving.

One server for the whole file (the ``server`` fixture); trainings are 1-3 steps on 64x64 images.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
import uuid
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from host_harness import CHECKPOINT_NAME, DATASET_FOLDER, write_dataset
from hostenv import PACK_NODE_IDS, PACK_ROOT
from make_example_workflow import EXAMPLE, example_prompt
from server_harness import PACK_FOLDER, ComfyServer, dumps, object_info
from workflow import ui_to_api

pytestmark = pytest.mark.server

PROGRESS_EVENT = "lowvram_lora.progress"
_unique_seeds = itertools.count(1000)


# ---------------------------------------------------------------- helpers


def loras(server: ComfyServer) -> Path:
    return server.base / "models" / "loras"


def files_under(folder: Path) -> set[Path]:
    """Every file (hidden and temporary ones included)."""
    return {path for path in folder.rglob("*") if path.is_file()}


def log_size(server: ComfyServer) -> int:
    return len(server.log())


def log_since(server: ComfyServer, offset: int) -> str:
    return server.log()[offset:]


def status_messages(entry: dict, event: str) -> list[dict]:
    return [data for name, data in entry["status"]["messages"] if name == event]


def assert_success(entry: dict) -> None:
    assert entry["status"]["status_str"] == "success", f"the prompt failed:\n{dumps(status_messages(entry, 'execution_error'))}"


def the_error(entry: dict) -> dict:
    """The single execution_error of a failed prompt."""
    assert entry["status"]["status_str"] == "error", f"the prompt did not fail: {dumps(entry['status'])}"
    errors = status_messages(entry, "execution_error")
    assert len(errors) == 1, dumps(entry["status"])
    return errors[0]


def assert_serving(server: ComfyServer) -> None:
    server.assert_alive()
    response = server.get("/system_stats")
    assert response.status_code == 200, response.text
    assert "system" in response.json()


def saved_by(entry: dict, before: set[Path], folder: Path) -> Path:
    """The one LoRA file a successful prompt wrote."""
    assert_success(entry)
    new = files_under(folder) - before
    assert len(new) == 1, f"expected exactly one new file in {folder}, got {sorted(map(str, new))}"
    path = new.pop()
    assert path.suffix == ".safetensors", path
    return path


def training_prompt(
    *,
    seed: int,
    prefix: str,
    mode: str = "every block",
    steps: int = 3,
    budget_gb: float = 6.0,
) -> dict:
    """The example's training half (load -> dataset -> checkpointing -> train -> save) at test size."""
    prompt = {
        node_id: {"class_type": node["class_type"], "inputs": dict(node["inputs"])}
        for node_id, node in example_prompt(f"checkpoints/{CHECKPOINT_NAME}", DATASET_FOLDER).items()
        if node_id in ("1", "2", "3", "4", "5", "6")
    }
    prompt["4"]["inputs"].update(mode=mode, budget_gb=budget_gb)
    prompt["5"]["inputs"].update(
        steps=steps, learning_rate=1e-3, rank=4, alpha=4.0, seed=seed, precision="fp32"
    )
    prompt["6"]["inputs"] = {"lora": ["5", 0], "filename_prefix": prefix, "save_training_state": False}
    return prompt


def sampling_prompt(seed: int) -> dict:
    """A plain KSampler run on the same checkpoint: it seeds torch's global RNG with ``seed``."""
    return {
        "2": {
            "class_type": "LowVRAMLoRA_LoadModelForTraining",
            "inputs": {"model_file": f"checkpoints/{CHECKPOINT_NAME}", "weight_dtype": "default", "device": "auto"},
        },
        "20": {"class_type": "CLIPTextEncode", "inputs": {"text": "a photo of thing 2", "clip": ["2", 1]}},
        "21": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["2", 1]}},
        "22": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "23": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["2", 0],
                "positive": ["20", 0],
                "negative": ["21", 0],
                "latent_image": ["22", 0],
                "seed": seed,
                "steps": 2,
                "cfg": 7.0,
                "sampler_name": "euler",
                "scheduler": "normal",
                "denoise": 1.0,
            },
        },
        "24": {"class_type": "VAEDecode", "inputs": {"samples": ["23", 0], "vae": ["2", 2]}},
        "25": {"class_type": "PreviewImage", "inputs": {"images": ["24", 0]}},
    }


def free_caches(server: ComfyServer) -> None:
    """Drop the executor's cached node results (and unload models): the next prompt really runs.

    /free only sets flags that the prompt worker reads when it wakes; give it a moment, or a
    prompt queued at once could still run against the old cache (the callers check that a
    new file was written).
    """
    response = server.post("/free", {"free_memory": True, "unload_models": True})
    assert response.status_code == 200, response.text
    time.sleep(1.0)


def assert_quick_training_completes(server: ComfyServer) -> None:
    """A one-step training on a fresh seed (so it is not served from the cache) saves a LoRA."""
    before = files_under(loras(server))
    entry = server.run(training_prompt(seed=next(_unique_seeds), prefix="server_tests/quick", steps=1), timeout=120)
    saved_by(entry, before, loras(server))


def load_lora(path: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(str(path))
    assert tensors, f"{path} holds no tensors"
    return tensors


def max_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert first.keys() == second.keys(), sorted(set(first) ^ set(second))[:10]
    return max(float((first[key].float() - second[key].float()).abs().max()) for key in first)


# ---------------------------------------------------------------- 1. loading and node descriptions


def test_pack_imports_without_error(server):
    log = server.log()
    pack_markers = (PACK_FOLDER, str(PACK_ROOT))
    failures = [
        line for line in log.splitlines()
        if ("Cannot import" in line or "IMPORT FAILED" in line) and any(m in line for m in pack_markers)
    ]
    assert not failures, "\n".join(failures)
    # A traceback is "Traceback ..." followed by indented frames and ends at its first unindented line.
    tracebacks, current = [], None
    for line in log.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            current = [line]
            tracebacks.append(current)
        elif current is not None:
            current.append(line)
            if line and not line[0].isspace():
                current = None
    ours = ["\n".join(block) for block in tracebacks if any(m in "\n".join(block) for m in pack_markers)]
    assert not ours, "\n\n".join(ours)
    timing = [line for line in log.splitlines() if "seconds" in line and line.rstrip().endswith("/" + PACK_FOLDER)]
    assert timing, f"the host did not report loading {PACK_FOLDER}; log:\n{server.log_tail()}"
    assert not any("IMPORT FAILED" in line for line in timing), timing


def test_all_nodes_are_listed_with_names_descriptions_and_tooltips(server):
    infos = object_info(server)
    missing = [node for node in PACK_NODE_IDS if node not in infos]
    assert not missing, f"not in /object_info: {missing}"
    problems = []
    for node in PACK_NODE_IDS:
        info = infos[node]
        if not info.get("display_name") or info["display_name"] == node:
            problems.append(f"{node}: no display name")
        if not (info.get("description") or "").strip():
            problems.append(f"{node}: no description")
        for category in ("required", "optional"):
            for name, spec in info["input"].get(category, {}).items():
                options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                if not (options.get("tooltip") or "").strip():
                    problems.append(f"{node}: {category} input {name!r} ({spec[0]}) has no tooltip")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- 2. the example workflow


def example_api_prompt(server: ComfyServer) -> dict:
    """examples/*.json (UI format) converted with the server's own node infos, test-sized."""
    workflow = json.loads(Path(EXAMPLE).read_text())
    prompt = ui_to_api(workflow, object_info(server))
    by_type = {node["class_type"]: node["inputs"] for node in prompt.values()}
    by_type["LowVRAMLoRA_LoadModelForTraining"]["model_file"] = f"checkpoints/{CHECKPOINT_NAME}"
    by_type["LoadImageTextDataSetFromFolder"]["folder"] = DATASET_FOLDER
    by_type["LowVRAMLoRA_TrainLoRAStep"].update(steps=3, precision="fp32")
    by_type["KSampler"]["steps"] = 2
    by_type["EmptyLatentImage"].update(width=64, height=64)
    return prompt


def test_example_workflow_runs_over_http(server):
    before = files_under(loras(server))
    images_before = set((server.base / "output").glob("*.png"))
    offset = log_size(server)
    entry = server.run(example_api_prompt(server), timeout=180)
    lora_file = saved_by(entry, before, loras(server))
    assert lora_file.parent.name == "lowvram_lora" and lora_file.name.startswith("example_"), lora_file
    assert load_lora(lora_file)
    log = log_since(server, offset)
    assert "lora key not loaded" not in log, log
    assert set((server.base / "output").glob("*.png")) - images_before, "the sampler's image was not saved"


# ---------------------------------------------------------------- 3. reproducibility


def test_checkpointing_does_not_change_the_trained_lora(server):
    folder = loras(server)
    files = {}
    for mode in ("every block", "off"):
        before = files_under(folder)
        entry = server.run(training_prompt(seed=7, prefix=f"server_tests/mode_{mode.replace(' ', '_')}", mode=mode))
        files[mode] = saved_by(entry, before, folder)
    difference = max_difference(load_lora(files["every block"]), load_lora(files["off"]))
    assert difference <= 1e-5, f"checkpointing changed the LoRA: max |difference| {difference:g}"


def test_same_seed_gives_the_same_lora_after_sampling_with_another_seed(server):
    folder = loras(server)
    prompt = training_prompt(seed=123, prefix="server_tests/repeat")
    before = files_under(folder)
    first = saved_by(server.run(prompt), before, folder)

    assert_success(server.run(sampling_prompt(seed=987654321)))  # reseeds torch's global RNG
    free_caches(server)  # else the identical prompt below is served from the cache and runs nothing

    before = files_under(folder)
    second = saved_by(server.run(prompt), before, folder)
    assert second != first and second.name.endswith("_00002_.safetensors"), (first, second)
    difference = max_difference(load_lora(first), load_lora(second))
    assert difference <= 1e-7, f"the same seed gave another LoRA: max |difference| {difference:g}"


# ---------------------------------------------------------------- 4. cancel


async def _train_and_interrupt(server: ComfyServer, prompt: dict, timeout: float = 90) -> tuple[str, list[dict]]:
    """Queue ``prompt`` with a websocket open, POST /interrupt once a training step was reported,
    and return the prompt id and every message seen until ``execution_interrupted``."""
    client_id = str(uuid.uuid4())
    ws_url = server.url.replace("http://", "ws://") + f"/ws?clientId={client_id}"
    seen: list[dict] = []
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url) as ws:

        async def next_message() -> dict:
            while True:
                message = await ws.receive(timeout=timeout)
                if message.type == aiohttp.WSMsgType.TEXT:
                    data = json.loads(message.data)
                    seen.append(data)
                    return data
                if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                    raise AssertionError(f"the websocket closed: {message}")
                # binary frames (previews) are not ours

        async with session.post(server.url + "/prompt", json={"prompt": prompt, "client_id": client_id}) as response:
            assert response.status == 200, await response.text()
            prompt_id = (await response.json())["prompt_id"]

        def ours(data: dict) -> bool:
            return data.get("data", {}).get("prompt_id") == prompt_id

        while True:
            data = await next_message()
            if data["type"] == PROGRESS_EVENT and data["data"].get("step"):
                break
            if data["type"] in ("execution_error", "execution_success", "execution_interrupted") and ours(data):
                raise AssertionError(f"the prompt ended before training started: {dumps(data)}")
        async with session.post(server.url + "/interrupt", json={"prompt_id": prompt_id}) as response:
            assert response.status == 200
        while True:
            data = await next_message()
            if data["type"] == "execution_interrupted" and ours(data):
                return prompt_id, seen
            if data["type"] in ("execution_error", "execution_success") and ours(data):
                raise AssertionError(f"the prompt was not interrupted: {dumps(data)}")


def test_cancel_during_training_leaves_no_file_and_the_server_serving(server):
    folder = loras(server)
    before = files_under(folder)
    prompt = training_prompt(seed=next(_unique_seeds), prefix="server_tests/cancelled", steps=2000)
    try:
        prompt_id, seen = asyncio.run(_train_and_interrupt(server, prompt))
    except BaseException:
        server.post("/interrupt", {})  # leave the shared server idle for the next tests
        raise
    progress = [m["data"] for m in seen if m["type"] == PROGRESS_EVENT]
    assert progress and progress[0]["status"] == "started" and progress[0]["total_steps"] == 2000, progress[:2]
    assert max(p.get("step", 0) for p in progress) < 2000

    entry = server.wait(prompt_id, timeout=60)
    assert entry["status"]["status_str"] == "error"
    interrupted = status_messages(entry, "execution_interrupted")
    assert interrupted and interrupted[0]["node_type"] == "LowVRAMLoRA_TrainLoRAStep", dumps(entry["status"])
    assert not status_messages(entry, "execution_error"), dumps(entry["status"])

    left = files_under(folder) - before
    assert not left, f"a cancelled training left files in models/loras: {sorted(map(str, left))}"
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp")]
    recovered = server.base / "output" / "lowvram_lora_recovered"
    assert not (recovered.exists() and files_under(recovered)), "a cancel is not a failure to recover from"

    assert_serving(server)
    assert_quick_training_completes(server)  # the MODEL was left usable by the interrupted run


# ---------------------------------------------------------------- 5. bad input


def test_empty_image_folder_stops_at_the_hosts_loader(server):
    # The folder combo lists input/ sub-folders each time a prompt is validated.
    (server.base / "input" / "lowvram_empty_folder").mkdir(exist_ok=True)
    prompt = training_prompt(seed=next(_unique_seeds), prefix="server_tests/never")
    prompt["1"]["inputs"]["folder"] = "lowvram_empty_folder"
    error = the_error(server.run(prompt))
    # The host's own loader refuses an empty folder before any of the pack's nodes runs.
    assert error["node_type"] == "LoadImageTextDataSetFromFolder", dumps(error)
    assert "No valid images" in error["exception_message"], error["exception_message"]
    assert_serving(server)


def test_empty_dataset_names_the_latents_input(server):
    # An empty saved dataset (SaveTrainingDataset's layout) is the graph way to feed an empty
    # list of latents to the training node.
    folder_name = "lowvram_empty_saved_dataset"
    dataset = server.base / "output" / folder_name
    dataset.mkdir(parents=True, exist_ok=True)
    torch.save({"latents": [], "conditioning": []}, dataset / "shard_0000.pkl")
    prompt = training_prompt(seed=next(_unique_seeds), prefix="server_tests/never")
    for node in ("1", "3"):
        del prompt[node]
    prompt["30"] = {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": folder_name}}
    prompt["5"]["inputs"].update(latents=["30", 0], conditioning=["30", 1])
    before = files_under(loras(server))
    error = the_error(server.run(prompt))
    assert error["node_type"] == "LowVRAMLoRA_TrainLoRAStep", dumps(error)
    assert "latents" in error["exception_message"] and "empty" in error["exception_message"], error["exception_message"]
    assert files_under(loras(server)) == before
    assert_serving(server)
    assert_quick_training_completes(server)


def test_mismatched_conditioning_names_the_conditioning_input(server):
    # Latents of the 3-image dataset, conditionings of a 2-image one.
    write_dataset(server.base / "input" / "lowvram_two_images", count=2)
    prompt = training_prompt(seed=next(_unique_seeds), prefix="server_tests/never")
    prompt["31"] = {"class_type": "LoadImageTextDataSetFromFolder", "inputs": {"folder": "lowvram_two_images"}}
    prompt["32"] = {
        "class_type": "MakeTrainingDataset",
        "inputs": {"images": ["31", 0], "vae": ["2", 2], "clip": ["2", 1], "texts": ["31", 1]},
    }
    prompt["5"]["inputs"]["conditioning"] = ["32", 1]
    error = the_error(server.run(prompt))
    assert error["node_type"] == "LowVRAMLoRA_TrainLoRAStep", dumps(error)
    message = error["exception_message"]
    assert "conditioning" in message and re.search(r"\b2\b", message) and re.search(r"\b3\b", message), message
    assert_serving(server)


def test_memory_budget_below_the_minimum_names_the_budget_and_the_minimum(server):
    # 192x192 latents: even with every block checkpointed a step needs far more than 0.01 GB.
    prompt = training_prompt(seed=next(_unique_seeds), prefix="server_tests/never", mode="memory budget", budget_gb=0.01)
    for node in ("1", "3"):
        del prompt[node]
    prompt["33"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 192, "height": 192, "batch_size": 1}}
    prompt["34"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "a photo of thing 0", "clip": ["2", 1]}}
    prompt["5"]["inputs"].update(latents=["33", 0], conditioning=["34", 0])
    before = files_under(loras(server))
    error = the_error(server.run(prompt, timeout=120))
    assert error["node_type"] == "LowVRAMLoRA_TrainLoRAStep", dumps(error)
    message = error["exception_message"]
    # The input by name and the user's value, the measured minimum, and the value to set instead.
    assert "budget_gb 0.01 " in message, message
    assert re.search(r"\d+(?:\.\d+)? MiB measured", message), message
    assert re.search(r"Set budget_gb to at least \d", message), message
    assert files_under(loras(server)) == before
    assert_serving(server)
