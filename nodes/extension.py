"""The pack's entry for the host's V3 API: the list of nodes."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .benchmark import BenchmarkCheckpointing
from .checkpointing import EnableGradientCheckpointing
from .files import register_folders
from .loading import LoadModelForTraining
from .report import TrainingReportNode
from .routes import register_routes
from .saving import LoadTrainingState, SaveLoRA
from .training import TrainLoRAStep

NODES: list[type[io.ComfyNode]] = [
    LoadModelForTraining,
    EnableGradientCheckpointing,
    TrainLoRAStep,
    SaveLoRA,
    LoadTrainingState,
    TrainingReportNode,
    BenchmarkCheckpointing,
]


class LowVRAMLoRAExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        register_folders()
        register_routes()  # the web monitor's history route; a no-op without a running server
        return list(NODES)
