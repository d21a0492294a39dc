"""The example workflow, as an API prompt; run this file to rewrite examples/*.json from it.

    python tests/make_example_workflow.py      (needs the ComfyUI host)

It trains a LoRA from a folder of captioned images with gradient checkpointing on, saves it,
loads it with ComfyUI's LoraLoader and samples an image with it, and shows the training report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_lora_with_checkpointing.json"

# Names a user changes: their checkpoint and their dataset folder (inside ComfyUI/input).
CHECKPOINT = "checkpoints/v1-5-pruned-emaonly.safetensors"
DATASET = "my_lora_dataset"


def example_prompt(checkpoint: str = CHECKPOINT, dataset: str = DATASET, steps: int = 300, size: int = 512) -> dict:
    return {
        "1": {"class_type": "LoadImageTextDataSetFromFolder", "inputs": {"folder": dataset}},
        "2": {
            "class_type": "LowVRAMLoRA_LoadModelForTraining",
            "inputs": {"model_file": checkpoint, "weight_dtype": "default", "device": "auto"},
        },
        "3": {
            "class_type": "MakeTrainingDataset",
            "inputs": {"images": ["1", 0], "vae": ["2", 2], "clip": ["2", 1], "texts": ["1", 1]},
        },
        "4": {
            "class_type": "LowVRAMLoRA_EnableGradientCheckpointing",
            "inputs": {
                "model": ["2", 0],
                "mode": "every block",
                "interval": 2,
                "budget_gb": 6.0,
                "offload_to_cpu": False,
                "verify_recompute": True,
            },
        },
        "5": {
            "class_type": "LowVRAMLoRA_TrainLoRAStep",
            "inputs": {
                "model": ["4", 0],
                "latents": ["3", 0],
                "conditioning": ["3", 1],
                "steps": steps,
                "learning_rate": 1e-4,
                "rank": 16,
                "alpha": 16.0,
                "optimizer": "adamw",
                "seed": 42,
                "batch_size": 1,
                "grad_accumulation": 1,
                "precision": "bf16",
                "lr_schedule": "constant",
                "warmup_steps": 0,
                "loss": "mse",
                "min_snr_gamma": 0.0,
                "timestep_sampling": "auto",
                "targets": "",
                "include_conv": False,
                "lora_dropout": 0.0,
                "max_grad_norm": 1.0,
            },
        },
        "6": {
            "class_type": "LowVRAMLoRA_SaveLoRA",
            "inputs": {
                "lora": ["5", 0],
                "filename_prefix": "lowvram_lora/example",
                "save_training_state": True,
                "training_state": ["5", 1],
            },
        },
        "7": {"class_type": "LowVRAMLoRA_TrainingReport", "inputs": {"report": ["5", 2]}},
        "8": {
            "class_type": "LoraLoader",
            "inputs": {
                "model": ["2", 0],
                "clip": ["2", 1],
                "lora_name": ["6", 0],
                "strength_model": 1.0,
                "strength_clip": 0.0,
            },
        },
        "9": {"class_type": "CLIPTextEncode", "inputs": {"text": "a photo of thing 1", "clip": ["8", 1]}},
        "10": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["8", 1]}},
        "11": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "12": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["8", 0],
                "positive": ["9", 0],
                "negative": ["10", 0],
                "latent_image": ["11", 0],
                "seed": 7,
                "steps": 20,
                "cfg": 7.0,
                "sampler_name": "euler",
                "scheduler": "normal",
                "denoise": 1.0,
            },
        },
        "13": {"class_type": "VAEDecode", "inputs": {"samples": ["12", 0], "vae": ["2", 2]}},
        "14": {"class_type": "SaveImage", "inputs": {"images": ["13", 0], "filename_prefix": "lowvram_lora_example"}},
    }


POSITIONS = {
    "1": (40, 60), "2": (40, 260), "3": (420, 60), "4": (420, 300), "5": (800, 60), "6": (1200, 60),
    "7": (1200, 300), "8": (1600, 60), "9": (1600, 320), "10": (1600, 520), "11": (1600, 720),
    "12": (2000, 60), "13": (2400, 60), "14": (2400, 260),
}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import asyncio

    import hostenv

    hostenv.prepare_host_imports(hostenv.find_host())
    import nodes

    import conftest  # noqa: F401  (registers the pack as lowvram_lora)
    import lowvram_lora
    from workflow import api_to_ui, local_node_info

    asyncio.run(nodes.init_builtin_extra_nodes())
    for node in asyncio.run(asyncio.run(lowvram_lora.comfy_entrypoint()).get_node_list()):
        nodes.NODE_CLASS_MAPPINGS[node.GET_SCHEMA().node_id] = node
    prompt = example_prompt()
    infos = {node["class_type"]: local_node_info(node["class_type"]) for node in prompt.values()}
    workflow = api_to_ui(prompt, infos, POSITIONS)
    EXAMPLE.write_text(json.dumps(workflow, indent=1) + "\n")
    print(f"wrote {EXAMPLE}")


if __name__ == "__main__":
    main()
