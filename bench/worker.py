"""One benchmark configuration, in this (fresh) process: build the model, train, measure, write JSON.

``bench/run.py`` starts one of these per configuration, so that every peak is measured in a
process that has run nothing else. Run by hand for one row:

    python bench/worker.py --model sd15 --size small --config pack_full --out /tmp/row.json

``--backend host`` (default) trains the host's own UNetModel/Flux inside a host BaseModel and
ModelPatcher: the built-in rows through ComfyUI's ``TrainLoraNode.execute``, the pack's rows
through ``nodes/host_training.train_lora`` with the plan set by ``nodes/model_patch.with_checkpointing``.
``--backend core`` trains a plain-torch DiT through the core ``LoRATrainer`` and ``Checkpointer``
(no host needed; pack rows only). ``--check-host`` only reports whether the host imports.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.register_pack()

import torch  # noqa: E402

from lowvram_lora.bench import configs as bench_configs  # noqa: E402
from lowvram_lora.bench import models as bench_models  # noqa: E402
from lowvram_lora.bench.steps import StepProbe, StepSchedule  # noqa: E402

LEARNING_RATE = 1e-4
MATCHED_TARGETS = (r".",)  # every Linear and (with include_conv) every convolution: what the built-in adapts


def _dtype_for(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _precision_name(device: torch.device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


def _checkpoint_config(config: bench_configs.Configuration, budget_bytes: int | None):
    from lowvram_lora.training.checkpointing import CheckpointConfig

    return CheckpointConfig(
        mode=config.mode,
        interval=config.interval,
        budget_bytes=budget_bytes if config.mode == "budget" else None,
        offload=config.offload,
    )


def _lora_config(config: bench_configs.Configuration, rank: int):
    from lowvram_lora.training.lora import LoRAConfig

    if config.targets == "matched":
        return LoRAConfig(rank=rank, targets=MATCHED_TARGETS, include_conv=True)
    return LoRAConfig(rank=rank)


def _train_config(steps: int, device: torch.device):
    from lowvram_lora.training.loop import TrainConfig
    from lowvram_lora.training.optim import OptimizerConfig

    # No clipping (the built-in trainer has none); the trainer's own CPU tracker only on its first
    # (warm-up) step, so that it never runs inside a step this benchmark times.
    return TrainConfig(
        steps=steps,
        precision=_precision_name(device),
        max_grad_norm=None,
        seed=0,
        measure_memory_every=10**9,
        optimizer=OptimizerConfig(name="adamw", learning_rate=LEARNING_RATE),
    )


def _plan_summary(plans: list[dict]) -> dict:
    if not plans:
        return {}
    plan = plans[0]
    return {
        "mode": plan.get("mode"),
        "units": plan.get("units"),
        "checkpointed": len(plan.get("checkpointed") or ()),
        "offload": plan.get("offload"),
        "budget_bytes": plan.get("budget_bytes"),
        "expected_peak_bytes": plan.get("expected_peak_bytes"),
        "description": plan.get("description"),
    }


# --------------------------------------------------------------------------------------------
# The three ways of training


def run_builtin(patcher, latent, conditioning, args, probe: StepProbe, checkpointing: bool, device: torch.device) -> dict:
    """ComfyUI's TrainLoraNode, called as the executor calls it (lists, under inference mode).

    Step boundaries: its sampler's per-step method (``TrainSampler._train_step_standard_mode``),
    wrapped for this process only; a step's span runs to the next call, so it holds the data,
    forward, backward and the optimizer step that follows.
    """
    import comfy_extras.nodes_train as nodes_train

    # ComfyUI 0.8.0 computes Flux's rotary embedding with comfy-kitchen custom ops that have no
    # backward, so the built-in trainer cannot train Flux where comfy-kitchen is installed. The
    # pack registers the missing formula before it trains (nodes/host_compat.py); do the same here
    # so that both trainers run the same kernels. A no-op where the ops have a backward already.
    from lowvram_lora.nodes.host_compat import enable_training_kernels

    enable_training_kernels()
    original = nodes_train.TrainSampler._train_step_standard_mode

    def step(self, *a, **k):
        probe.boundary()
        return original(self, *a, **k)

    nodes_train.TrainSampler._train_step_standard_mode = step
    dtype = _precision_name(device)
    steps = probe.schedule.total_steps(device)
    try:
        with torch.inference_mode():
            output = nodes_train.TrainLoraNode.execute(
                model=[patcher],
                latents=[{"samples": latent}],
                positive=[conditioning],
                batch_size=[1],
                steps=[steps],
                grad_accumulation_steps=[1],
                learning_rate=[LEARNING_RATE],
                rank=[args.rank],
                optimizer=["AdamW"],
                loss_function=["MSE"],
                seed=[0],
                training_dtype=[dtype],
                lora_dtype=[dtype],
                algorithm=["LoRA"],
                gradient_checkpointing=[checkpointing],
                existing_lora=["[None]"],
                bucket_mode=[False],
            )
    finally:
        nodes_train.TrainSampler._train_step_standard_mode = original
    _model, lora_sd, loss_map, _steps = output.args
    lora_keys = [k for k in lora_sd if k.endswith(".lora_up.weight")]
    return {
        "lora_parameters": int(sum(t.numel() for t in lora_sd.values())),
        "adapted_layers": len(lora_keys),
        "other_trained_tensors": len(lora_sd) - 2 * len(lora_keys),
        "losses": [float(v) for v in loss_map["loss"]],
        "plan": {"description": "TrainLoraNode gradient_checkpointing=" + str(checkpointing)},
    }


def run_pack_host(patcher, latent, conditioning, args, probe: StepProbe, config, device: torch.device) -> dict:
    """The pack's node path: a MODEL clone with the plan, then ``train_lora``, as TrainLoRAStep runs it."""
    from lowvram_lora.nodes.host_training import TrainRequest, flatten_dataset, train_lora
    from lowvram_lora.nodes.model_patch import with_checkpointing

    clone, _checkpointer = with_checkpointing(patcher, _checkpoint_config(config, args.budget_bytes))
    dataset = flatten_dataset([{"samples": latent}], [conditioning])
    request = TrainRequest(_lora_config(config, args.rank), _train_config(probe.schedule.total_steps(device), device))
    with torch.inference_mode():
        outcome = train_lora(clone, dataset, request, should_stop=probe.should_stop)
    if outcome.error is not None:
        raise outcome.error
    tensors = outcome.lora.tensors
    info = {
        "lora_parameters": int(sum(t.numel() for k, t in tensors.items() if not k.endswith(".alpha"))),
        "adapted_layers": sum(1 for k in tensors if k.endswith(".lora_down.weight")),
        "losses": [float(v) for v in outcome.report.losses],
        "plan": _plan_summary(outcome.state.settings.get("plan") or []),
    }
    if args.save_lora:
        info["lora_file"] = _save_and_check_host(Path(args.save_lora), outcome.lora, patcher)
    return info


def _save_and_check_host(path: Path, lora, patcher) -> dict:
    """Save the trained LoRA, and map it with the host's own LoRA loader (what LoraLoader does)."""
    import comfy.lora
    import comfy.utils

    from lowvram_lora.training.lora import save_lora_file

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    save_lora_file(path, lora.tensors, lora.metadata)
    state_dict = comfy.utils.load_torch_file(str(path), safe_load=True)
    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    patches = comfy.lora.load_lora(state_dict, key_map)
    layers = sum(1 for k in state_dict if k.endswith(".lora_down.weight"))
    return {"path": str(path), "layers": layers, "mapped_by_host": len(patches)}


def run_pack_core(model_spec, args, probe: StepProbe, config, device: torch.device) -> dict:
    """The core alone: a plain-torch DiT, ``attach_lora``, ``Checkpointer`` and ``LoRATrainer``."""
    from lowvram_lora.training.checkpointing import Checkpointer
    from lowvram_lora.training.data import TrainingData
    from lowvram_lora.training.lora import attach_lora, kohya_state_dict, lora_metadata, save_lora_file
    from lowvram_lora.training.loop import LoRATrainer
    from lowvram_lora.training.objectives import NoiseSchedule

    model = bench_models.build_core_model(model_spec, device, _dtype_for(device))
    model.requires_grad_(False)
    latent, conditioning = bench_models.training_data(model_spec)
    context = conditioning[0][0].to(device)
    attached = attach_lora(model, _lora_config(config, args.rank), generator=torch.Generator().manual_seed(0))
    try:
        checkpointer = Checkpointer(model, _checkpoint_config(config, args.budget_bytes))

        def denoiser(x_t, sigma, conditions):
            return model(x_t, sigma, context.expand(len(conditions), -1, -1))

        trainer = LoRATrainer(
            parameters=list(attached.parameters()),
            denoiser=denoiser,
            schedule=NoiseSchedule("flow", lambda u: u.float()),
            data=TrainingData((latent[0],), conditioning_count=1),
            config=_train_config(probe.schedule.total_steps(device), device),
            device=device,
            checkpointer=checkpointer,
        )
        result = trainer.run(should_stop=probe.should_stop)
        info = {
            "lora_parameters": attached.num_parameters(),
            "adapted_layers": len(attached.adapters),
            "losses": result.losses,
            "plan": _plan_summary([plan.as_dict() for plan in result.plans.values()]),
            "model_parameters": bench_models.parameter_count(model),
        }
        if args.save_lora:
            path = Path(args.save_lora)
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                path.unlink()
            metadata = lora_metadata(attached.config, architecture="CoreDiT", steps=result.end_step)
            save_lora_file(path, kohya_state_dict(attached), metadata)
            info["lora_file"] = {"path": str(path), "layers": len(attached.adapters)}
        return info
    finally:
        attached.detach()


# --------------------------------------------------------------------------------------------


def check_host() -> dict:
    """Whether the host and the pack's host modules import here (what the host rows need)."""
    from lowvram_lora.bench import host

    folder = host.find_host()
    if folder is None:
        return {"ok": False, "reason": "no ComfyUI host found ($COMFYUI_PATH, bench/.host/ComfyUI, ~/comfy/ComfyUI)"}
    try:
        host.prepare(folder)
        import comfy.model_base  # noqa: F401
        import comfy_extras.nodes_train  # noqa: F401

        import lowvram_lora.nodes.host_training  # noqa: F401
        import lowvram_lora.nodes.model_patch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (any import failure means: use the core path)
        return {"ok": False, "path": str(folder), "reason": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "path": str(folder), "version": host.host_version(folder)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-host", action="store_true", help="only report whether the host imports")
    parser.add_argument("--backend", choices=("host", "core"), default="host")
    parser.add_argument("--model", default="sd15", help="sd15, sdxl, flux (host) or core_dit (core)")
    parser.add_argument("--size", choices=bench_models.SIZES, default="small")
    parser.add_argument("--config", choices=[c.key for c in bench_configs.CONFIGURATIONS], default="pack_full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget-bytes", type=int, default=None, help="for the budget configurations")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timed", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--save-lora", default="", help="save the trained LoRA here (pack rows)")
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    args = parser.parse_args(argv)
    out = Path(args.out)

    if args.check_host:
        out.write_text(json.dumps(check_host()))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    config = bench_configs.BY_KEY[args.config]
    device = torch.device(args.device)
    result: dict = {
        "config": config.key,
        "label": config.label,
        "trainer": config.trainer,
        "backend": args.backend,
        "size": args.size,
        "model": args.model,
        "device": str(device),
        "dtype": str(_dtype_for(device)).replace("torch.", ""),
        "rank": args.rank,
        "budget_bytes": args.budget_bytes,
        "status": "error",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if config.mode == "budget" and args.budget_bytes is None:
        result.update(status="skipped", error="no budget: the full and off peaks it lies between were not measured")
        out.write_text(json.dumps(result))
        return 0
    probe = None
    started = time.perf_counter()
    try:
        if args.backend == "core":
            if config.trainer != bench_configs.PACK:
                raise ValueError("the core backend has no built-in trainer: pack configurations only")
            model_spec = bench_models.core_spec(args.size)
            result["model_title"] = model_spec.title
            probe = StepProbe(device, StepSchedule(args.warmup, args.timed))
            info = run_pack_core(model_spec, args, probe, config, device)
        else:
            from lowvram_lora.bench import host

            folder = host.find_host()
            if folder is None:
                raise RuntimeError("no ComfyUI host found; use --backend core")
            host.prepare(folder)
            result["host"] = {"path": str(folder), "version": host.host_version(folder)}
            model_spec = bench_models.spec(args.model, args.size)
            result["model_title"] = model_spec.title
            built = time.perf_counter()
            patcher = bench_models.build_host_patcher(model_spec, device, _dtype_for(device))
            result["build_seconds"] = time.perf_counter() - built
            result["model_parameters"] = bench_models.parameter_count(patcher.model.diffusion_model)
            latent, conditioning = bench_models.training_data(model_spec)
            probe = StepProbe(device, StepSchedule(args.warmup, args.timed))
            if config.trainer == bench_configs.BUILTIN:
                info = run_builtin(patcher, latent, conditioning, args, probe, config.checkpointing, device)
            else:
                info = run_pack_host(patcher, latent, conditioning, args, probe, config, device)
        probe.close()
        result.update(info)
        figures = probe.figures()
        result["figures"] = figures.as_dict()
        result["status"] = "ok" if figures.complete else "error"
        if not figures.complete:
            result["error"] = f"the trainer ran {probe.steps_started} of {len(probe.phases)} steps"
    except torch.OutOfMemoryError as exc:
        result.update(status="oom", error=str(exc).splitlines()[0][:300])
        if device.type == "cuda":
            result["max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    except Exception as exc:  # noqa: BLE001 (reported in the table, with the traceback in the JSON)
        result.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500], traceback=traceback.format_exc()[-4000:])
    finally:
        if probe is not None:
            probe.close()
    result["run_seconds"] = time.perf_counter() - started
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
