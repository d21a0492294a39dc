"""In-process ComfyUI for the host tests: folders in a temporary base directory, the host's own
nodes plus this pack's, and its real executor (``execution.PromptExecutor``). The fixtures
that build it are in tests/host/conftest.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DATASET_FOLDER = "lowvram_dataset"
CHECKPOINT_NAME = "tiny_sd15.safetensors"


@dataclass
class FakeServer:
    """What the executor and the progress hooks need of a PromptServer."""

    client_id: str | None = None
    last_node_id: str | None = None
    messages: list[tuple[str, Any]] = field(default_factory=list)

    def send_sync(self, event, data, sid=None):
        self.messages.append((event, data))

    def send_progress_text(self, text, node_id, sid=None):
        self.messages.append(("progress_text", {"node": node_id, "text": text}))

    def queue_updated(self):
        pass


@dataclass
class Comfy:
    """The host, set up once per session: run prompts, reach folders and node classes."""

    base: Path
    checkpoint: Path
    server: FakeServer
    executor: Any

    @property
    def loras(self) -> Path:
        return self.base / "models" / "loras"

    @property
    def output(self) -> Path:
        return self.base / "output"

    def node_class(self, class_type: str):
        import nodes

        return nodes.NODE_CLASS_MAPPINGS[class_type]

    def run(self, prompt: dict, *, expect_success: bool = True) -> dict:
        """Validate and execute an API-format prompt; return the history result."""
        import execution

        prompt_id = str(uuid.uuid4())
        valid = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
        if not valid[0]:
            raise AssertionError(f"prompt did not validate: {valid[1]} {valid[3]}")
        self.server.messages.clear()
        self.executor.execute(prompt, prompt_id, {}, valid[2])
        if expect_success and not self.executor.success:
            errors = [data for event, data in self.executor.status_messages if event == "execution_error"]
            raise AssertionError(f"prompt failed: {errors}")
        return self.executor.history_result

    def errors(self) -> list[dict]:
        return [data for event, data in self.executor.status_messages if event == "execution_error"]

    def reset_cache(self) -> None:
        self.executor.reset()


def write_dataset(folder: Path, count: int = 3, size: int = 64) -> None:
    """Captioned images as LoadImageTextDataSetFromFolder reads them: img.png + img.txt."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(3)
    for index in range(count):
        pixels = (torch.rand(size, size, 3, generator=generator) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / f"image_{index}.png")
        (folder / f"image_{index}.txt").write_text(f"a photo of thing {index}")


def build_comfy(base: Path, model_cache: Path) -> Comfy:
    """Lay out the folders, the checkpoint and the dataset under ``base``; register the nodes."""
    import folder_paths
    import nodes

    import host_models
    import lowvram_lora

    for sub in ("models/checkpoints", "models/loras", "models/diffusion_models", "models/vae", "input", "output", "temp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    cached = host_models.write_sd15_checkpoint(model_cache / CHECKPOINT_NAME)
    checkpoint = base / "models" / "checkpoints" / CHECKPOINT_NAME
    try:
        os.link(cached, checkpoint)
    except OSError:
        shutil.copyfile(cached, checkpoint)
    write_dataset(base / "input" / DATASET_FOLDER)

    folder_paths.set_output_directory(str(base / "output"))
    folder_paths.set_temp_directory(str(base / "temp"))
    folder_paths.set_input_directory(str(base / "input"))
    folder_paths.models_dir = str(base / "models")
    for name in ("checkpoints", "loras", "diffusion_models", "vae"):
        _paths, extensions = folder_paths.folder_names_and_paths[name]
        folder_paths.folder_names_and_paths[name] = ([str(base / "models" / name)], extensions)
    folder_paths.folder_names_and_paths.pop("training_states", None)

    asyncio.run(nodes.init_builtin_extra_nodes())
    extension = asyncio.run(lowvram_lora.comfy_entrypoint())
    for node in asyncio.run(extension.get_node_list()):
        schema = node.GET_SCHEMA()
        nodes.NODE_CLASS_MAPPINGS[schema.node_id] = node
        nodes.NODE_DISPLAY_NAME_MAPPINGS[schema.node_id] = schema.display_name

    import execution

    server = FakeServer()
    executor = execution.PromptExecutor(server, cache_type=False, cache_args={"lru": 0, "ram": 0})
    return Comfy(base, checkpoint, server, executor)
