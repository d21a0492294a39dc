"""A real ComfyUI server on loopback with this pack installed, for the server and browser tests.

The server runs ``main.py --cpu --listen 127.0.0.1 --port N --base-directory D`` with every write
in D (models, input, output, user data, the database). The pack is installed the way a user
installs it: a folder in D/custom_nodes (a symbolic link to this checkout), loaded by the host's
own custom-node loader.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from hostenv import PACK_ROOT
from host_harness import CHECKPOINT_NAME, DATASET_FOLDER, write_dataset

PACK_FOLDER = "comfyui-lowvram-lora"
START_TIMEOUT_SECONDS = 240


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ComfyServer:
    process: subprocess.Popen
    base: Path
    url: str
    log_path: Path

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(self.url + path, timeout=30, **kwargs)

    def post(self, path: str, payload: dict) -> requests.Response:
        return requests.post(self.url + path, json=payload, timeout=30)

    def queue(self, prompt: dict, client_id: str | None = None) -> str:
        response = self.post("/prompt", {"prompt": prompt, "client_id": client_id or str(uuid.uuid4())})
        if response.status_code != 200:
            raise AssertionError(f"POST /prompt refused: {response.status_code} {response.text}")
        return response.json()["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 300) -> dict:
        """The /history entry of a finished prompt (successful or not)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.get(f"/history/{prompt_id}").json()
            if prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
                entry = history[prompt_id]
                if entry["status"].get("status_str") in ("success", "error"):
                    return entry
            self.assert_alive()
            time.sleep(0.2)
        raise AssertionError(f"prompt {prompt_id} did not finish in {timeout} s; log:\n{self.log_tail()}")

    def run(self, prompt: dict, timeout: float = 300) -> dict:
        return self.wait(self.queue(prompt), timeout)

    def assert_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"the server exited with {self.process.returncode}; log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_server(host: Path, base: Path, model_cache: Path) -> ComfyServer:
    """Lay out ``base`` and start the server on a free loopback port; waits until it answers."""
    import host_models

    for sub in ("custom_nodes", "models/checkpoints", "models/loras", "input", "output", "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_FOLDER
    if not link.exists():
        link.symlink_to(PACK_ROOT, target_is_directory=True)
    cached = host_models.write_sd15_checkpoint(model_cache / CHECKPOINT_NAME)
    checkpoint = base / "models" / "checkpoints" / CHECKPOINT_NAME
    if not checkpoint.exists():
        try:
            os.link(cached, checkpoint)
        except OSError:
            shutil.copyfile(cached, checkpoint)
    write_dataset(base / "input" / DATASET_FOLDER)
    port = free_port()
    log_path = base / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [
        sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
        "--base-directory", str(base), "--database-url", f"sqlite:///{base}/db.sqlite",
        "--disable-auto-launch",
    ]
    # The child keeps its own copy of the descriptor; ours is closed at once.
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, cwd=host, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    server = ComfyServer(process, base, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        server.assert_alive()
        try:
            if server.get("/system_stats").status_code == 200:
                return server
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    server.stop()
    raise AssertionError(f"the server did not answer in {START_TIMEOUT_SECONDS} s; log:\n{server.log_tail()}")


def object_info(server: ComfyServer) -> dict[str, Any]:
    return server.get("/object_info").json()


def dumps(value: Any) -> str:
    return json.dumps(value, indent=1, default=str)
