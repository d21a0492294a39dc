"""Low-VRAM LoRA trainer for ComfyUI: gradient checkpointing you control, measured.

ComfyUI loads this folder as a custom node pack and awaits ``comfy_entrypoint``. Nothing
from the host is imported at module import time, so the host-independent core in
``training/`` can be imported and tested without ComfyUI.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes.extension import LowVRAMLoRAExtension

    return LowVRAMLoRAExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
