"""The nodes on the real host, in process: equivalences, the LoRA file in LoraLoader, a clean base
model, chaining, cancel and bad input."""

from __future__ import annotations

import logging

import pytest
import torch

from host_harness import CHECKPOINT_NAME
from host_models import tiny_model_patcher

pytestmark = pytest.mark.host

TRAIN_DEFAULTS = dict(
    steps=3, learning_rate=1e-3, rank=4, alpha=0.0, optimizer="adamw", seed=5, batch_size=1,
    grad_accumulation=1, precision="fp32", lr_schedule="constant", warmup_steps=0, loss="mse",
    min_snr_gamma=0.0, timestep_sampling="auto", targets="", include_conv=False, lora_dropout=0.0,
    max_grad_norm=1.0,
)


def train(comfy, model, latents, conditioning, **overrides):
    """Run TrainLoRAStep as the executor does (lists in, under inference mode)."""
    node = comfy.node_class("LowVRAMLoRA_TrainLoRAStep")
    values = {**TRAIN_DEFAULTS, **overrides}
    state = values.pop("training_state", None)
    kwargs = {name: [value] for name, value in values.items()}
    if state is not None:
        kwargs["training_state"] = [state]
    with torch.inference_mode():
        output = node.execute([model], latents, conditioning, **kwargs)
    return output.args if hasattr(output, "args") else output.result


def checkpointed(comfy, model, mode="every block", **overrides):
    node = comfy.node_class("LowVRAMLoRA_EnableGradientCheckpointing")
    values = {**dict(mode=mode, interval=2, budget_gb=6.0, offload_to_cpu=False, verify_recompute=True), **overrides}
    with torch.inference_mode():
        output = node.execute(model, **values)
    return (output.args if hasattr(output, "args") else output.result)[0]


@pytest.fixture(scope="module")
def sd15(comfy):
    """The generated SD1.5 checkpoint through LoadModelForTraining, with a tiny dataset."""
    node = comfy.node_class("LowVRAMLoRA_LoadModelForTraining")
    with torch.inference_mode():
        output = node.execute(f"checkpoints/{CHECKPOINT_NAME}", "default", "auto")
        model, clip, vae = output.args if hasattr(output, "args") else output.result
        conditioning = [clip.encode_from_tokens_scheduled(clip.tokenize(t)) for t in ("a red cube", "a blue ball")]
    generator = torch.Generator().manual_seed(0)
    latents = [{"samples": torch.randn(1, 4, 8, 8, generator=generator)} for _ in range(2)]
    return model, clip, vae, latents, conditioning


def assert_loras_equal(a, b, rtol=1e-5):
    assert a.tensors.keys() == b.tensors.keys()
    for key in a.tensors:
        scale = a.tensors[key].abs().max().item() + 1e-12
        assert (a.tensors[key] - b.tensors[key]).abs().max().item() <= rtol * scale, key


def test_every_block_and_off_train_the_same_lora(comfy, sd15):
    model, _clip, _vae, latents, conditioning = sd15
    plain = train(comfy, checkpointed(comfy, model, "off"), latents, conditioning)[0]
    full = train(comfy, checkpointed(comfy, model, "every block"), latents, conditioning)[0]
    every = train(comfy, checkpointed(comfy, model, "every N-th block", interval=3), latents, conditioning)[0]
    assert_loras_equal(plain, full)
    assert_loras_equal(plain, every)


def test_same_seed_same_lora_after_sampling_with_another_seed(comfy, sd15):
    model, _clip, _vae, latents, conditioning = sd15
    first = train(comfy, model, latents, conditioning)[0]
    comfy.run(sampling_prompt(seed=123))  # KSampler reseeds torch's global RNG
    torch.manual_seed(99999)
    second = train(comfy, model, latents, conditioning)[0]
    assert_loras_equal(first, second, rtol=0)
    other = train(comfy, model, latents, conditioning, seed=6)[0]
    assert any(not torch.equal(first.tensors[k], other.tensors[k]) for k in first.tensors)


def sampling_prompt(seed: int, lora_name: str | None = None) -> dict:
    model_source = ["1", 0]
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CHECKPOINT_NAME}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red cube", "clip": ["1", 1]}},
        "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "5": {"class_type": "VAEDecode", "inputs": {"samples": ["4", 0], "vae": ["1", 2]}},
        "6": {"class_type": "PreviewImage", "inputs": {"images": ["5", 0]}},
    }
    if lora_name is not None:
        prompt["7"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": lora_name, "strength_model": 1.0}}
        model_source = ["7", 0]
    prompt["4"] = {
        "class_type": "KSampler",
        "inputs": {
            "model": model_source, "positive": ["2", 0], "negative": ["2", 0], "latent_image": ["3", 0],
            "seed": seed, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0,
        },
    }
    return prompt


def sampled_image(comfy, seed: int, lora_name: str | None = None) -> torch.Tensor:
    from PIL import Image
    import numpy as np

    history = comfy.run(sampling_prompt(seed, lora_name))
    image = history["outputs"]["6"]["images"][0]
    path = comfy.base / image["type"] / image.get("subfolder", "") / image["filename"]
    if image["type"] == "temp":
        path = comfy.base / "temp" / image.get("subfolder", "") / image["filename"]
    return torch.from_numpy(np.asarray(Image.open(path)).copy())


def sample_with(model, conditioning) -> torch.Tensor:
    """KSampler's own code path on this very MODEL object (not a fresh load of the file)."""
    import nodes

    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    with torch.inference_mode():
        (out,) = nodes.common_ksampler(model, 3, 2, 1.0, "euler", "normal", conditioning, conditioning, latent)
    return out["samples"].clone()


def test_the_base_model_is_left_clean(comfy, sd15):
    model, _clip, _vae, latents, conditioning = sd15
    diffusion_model = model.model.diffusion_model
    before = sample_with(model, conditioning[0])
    state_before = {k: v.clone() for k, v in diffusion_model.state_dict().items()}
    grad_flags = [p.requires_grad for p in diffusion_model.parameters()]
    _lora, _state, _report, lora_model = train(comfy, checkpointed(comfy, model, "every block"), latents, conditioning)
    assert not any("forward" in m.__dict__ for m in diffusion_model.modules())
    assert not any(m._forward_hooks for m in diffusion_model.modules())
    assert [p.requires_grad for p in diffusion_model.parameters()] == grad_flags
    for key, value in diffusion_model.state_dict().items():
        assert torch.equal(value, state_before[key]), key
    assert torch.equal(sample_with(model, conditioning[0]), before)
    # (The host's own LoRA patching, below, is what sampling with the trained LoRA uses.)
    assert not torch.equal(sample_with(lora_model, conditioning[0]), before)
    assert torch.equal(sample_with(model, conditioning[0]), before)


def test_saved_file_loads_in_the_host_and_matches_the_trained_adapters(comfy, sd15, caplog):
    """LoraLoader's machinery maps every key, and the LoRA'd model computes what training did."""
    import comfy.model_management as model_management
    import comfy.sd as host_sd

    from lowvram_lora.nodes import conditioning as host_conditioning
    from lowvram_lora.nodes.files import save_lora
    from lowvram_lora.training.lora import attach_lora, load_lora_file

    model, clip, _vae, latents, conditioning = sd15
    lora, state = train(comfy, model, latents, conditioning, steps=4, learning_rate=5e-3)[:2]
    path = save_lora(lora, "tests/match")
    tensors, metadata = load_lora_file(path)
    assert metadata["ss_network_module"] == "networks.lora" and metadata["ss_network_dim"] == "4"
    assert any(k.startswith("lora_unet_down_blocks_0_attentions_0_") for k in tensors)  # Kohya/A1111 names

    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([2.0])
    with caplog.at_level(logging.WARNING):
        patched, _ = host_sd.load_lora_for_models(model, None, tensors, 1.0, 0)
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    with torch.inference_mode(False):
        model_management.load_models_gpu([patched], force_full_load=True)
        prepared = host_conditioning.prepare_conditioning(patched, [conditioning[0]], (1, 4, 8, 8), "cpu")
        with torch.no_grad():
            via_loader = host_conditioning.raw_model_output(patched, x, sigma, prepared.model_kwargs([0], x))
        model_management.load_models_gpu([model], force_full_load=True)
        from lowvram_lora.training.lora import LoRAConfig

        attached = attach_lora(model.model.diffusion_model, LoRAConfig(rank=4), generator=torch.Generator())
        try:
            attached.load_state(state.adapters)
            prepared = host_conditioning.prepare_conditioning(model, [conditioning[0]], (1, 4, 8, 8), "cpu")
            with torch.no_grad():
                via_adapters = host_conditioning.raw_model_output(model, x, sigma, prepared.model_kwargs([0], x))
                base = None
        finally:
            attached.detach()
        with torch.no_grad():
            base = host_conditioning.raw_model_output(model, x, sigma, prepared.model_kwargs([0], x))
    assert (via_adapters - base).abs().max() > 1e-3  # the LoRA changes the output
    torch.testing.assert_close(via_loader, via_adapters, rtol=1e-4, atol=1e-4)


def test_chained_training_states_equal_one_longer_run(comfy, sd15):
    model, _clip, _vae, latents, conditioning = sd15
    whole = train(comfy, model, latents, conditioning, steps=4, optimizer="sgd")[0]
    _lora, state = train(comfy, model, latents, conditioning, steps=2, optimizer="sgd")[:2]
    resumed = train(comfy, model, latents, conditioning, steps=2, optimizer="sgd", training_state=state)[0]
    assert resumed.steps == 4
    assert_loras_equal(whole, resumed, rtol=1e-6)


def test_resuming_with_another_rank_is_refused(comfy, sd15):
    model, _clip, _vae, latents, conditioning = sd15
    state = train(comfy, model, latents, conditioning, steps=1)[1]
    with pytest.raises(ValueError, match="rank"):
        train(comfy, model, latents, conditioning, steps=1, rank=8, training_state=state)


def test_cancel_stops_training_and_leaves_the_model_clean(comfy, sd15):
    import comfy.model_management as model_management
    import nodes

    model, _clip, _vae, latents, conditioning = sd15
    from lowvram_lora.nodes import progress

    calls = {"n": 0}
    original = progress.ProgressReporter.__call__

    def cancel_at_second_step(self, report):
        original(self, report)
        calls["n"] += 1
        if calls["n"] == 2:
            nodes.interrupt_processing(True)  # what the Cancel button does

    loras_before = set(comfy.loras.rglob("*"))
    progress.ProgressReporter.__call__ = cancel_at_second_step
    try:
        with pytest.raises(model_management.InterruptProcessingException):
            train(comfy, checkpointed(comfy, model, "every block"), latents, conditioning, steps=50)
    finally:
        progress.ProgressReporter.__call__ = original
        nodes.interrupt_processing(False)
    assert calls["n"] == 2
    diffusion_model = model.model.diffusion_model
    assert not any("forward" in m.__dict__ or m._forward_hooks for m in diffusion_model.modules())
    assert set(comfy.loras.rglob("*")) == loras_before


@pytest.mark.parametrize(
    "latents, conditioning_count, message",
    [
        ([], 1, "latents"),
        ([{"samples": torch.randn(1, 4, 8, 8)}] * 3, 2, "conditioning has 2 entries for 3 images"),
        ([{"not": "a latent"}], 1, r"latents\[0\]"),
    ],
)
def test_bad_dataset_is_refused_with_the_input_named(comfy, sd15, latents, conditioning_count, message):
    model, _clip, _vae, _latents, conditioning = sd15
    with pytest.raises(ValueError, match=message):
        train(comfy, model, latents, (conditioning * 3)[:conditioning_count])


def test_budget_below_the_minimum_names_the_budget(comfy, sd15):
    model, _clip, _vae, latents, conditioning = sd15
    budgeted = checkpointed(comfy, model, "memory budget", budget_gb=0.0001)
    with pytest.raises(ValueError, match=r"budget_gb 0.0001 .* below what this model needs .* Set budget_gb to at least"):
        train(comfy, budgeted, latents, conditioning, steps=1)
    assert not any("forward" in m.__dict__ for m in model.model.diffusion_model.modules())


def test_budget_plan_fits_and_is_reported(comfy, sd15):
    model, _clip, _vae, latents, conditioning = sd15
    generous = checkpointed(comfy, model, "memory budget", budget_gb=8.0)
    _lora, _state, report, _model = train(comfy, generous, latents, conditioning, steps=2)
    assert any("budget" in plan and "checkpointing 0 of" in plan for plan in report.plans)
    assert report.peak_bytes is not None and report.peak_bytes <= 8 * 1024**3


def test_a_model_the_pack_cannot_plan_for_gets_a_clear_error(comfy):
    patcher = tiny_model_patcher("sd15")
    patcher.model.diffusion_model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="model: cannot plan gradient checkpointing for model class 'Sequential'"):
        checkpointed(comfy, patcher)


def test_flux_model_trains_through_the_node(comfy):
    """A DiT through the same node path: the host's Flux (tiny), flow objective, every block."""
    patcher = tiny_model_patcher("flux")
    context = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(2))
    conditioning = [[[context, {"pooled_output": torch.randn(1, 32), "guidance": 3.5}]]]
    latents = [{"samples": torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))}]
    lora, _state, report, _model = train(comfy, checkpointed(comfy, patcher, "every block"), latents, conditioning, steps=2)
    assert any(key.startswith("lora_unet_double_blocks_0_img_attn_qkv") for key in lora.tensors)
    assert any("every block" in p or "all" in p for p in report.plans)


def test_mode_off_accepts_a_model_the_pack_cannot_plan_for(comfy):
    patcher = tiny_model_patcher("sd15")
    patcher.model.diffusion_model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert checkpointed(comfy, patcher, "off") is not patcher


def test_resuming_with_another_optimizer_is_refused(comfy, sd15):
    model, _clip, _vae, latents, conditioning = sd15
    state = train(comfy, model, latents, conditioning, steps=1, optimizer="adamw")[1]
    with pytest.raises(ValueError, match="optimizer"):
        train(comfy, model, latents, conditioning, steps=1, optimizer="sgd", training_state=state)


def entry(value: float):
    return [torch.full((1, 77, 8), value), {}]


@pytest.mark.parametrize(
    "batches, conditionings, images_to_entries",
    [
        ([1, 1, 1], [[entry(0)], [entry(1)], [entry(2)]], [0, 1, 2]),  # Make Training Dataset
        ([2, 1], [[entry(0), entry(1)], [entry(2)]], [0, 1, 2]),  # ResolutionBucket: a list per bucket
        ([3], [[entry(0)]], [0]),  # one for all
        ([3], [[entry(0)], [entry(1)], [entry(2)]], [0, 1, 2]),  # one batch, one each
    ],
)
def test_dataset_layouts_pair_each_image_with_its_caption(batches, conditionings, images_to_entries):
    from lowvram_lora.nodes.host_training import flatten_dataset

    latents = [{"samples": torch.zeros(b, 4, 8, 8)} for b in batches]
    dataset = flatten_dataset(latents, conditionings)
    assert len(dataset.latents) == sum(batches)
    assert [int(c[0][0][0, 0, 0]) for c in dataset.conditioning] == images_to_entries


def test_a_combined_conditioning_is_refused():
    from lowvram_lora.nodes.host_training import flatten_dataset

    combined = [entry(0), entry(1)]  # what Conditioning (Combine) makes for one image
    with pytest.raises(ValueError, match="Conditioning Combine"):
        flatten_dataset([{"samples": torch.zeros(1, 4, 8, 8)}], [combined])
    with pytest.raises(ValueError, match="Conditioning Combine"):
        flatten_dataset([{"samples": torch.zeros(1, 4, 8, 8)}] * 2, [combined, [entry(2)]])


def test_targets_field_splits_on_commas_and_lines_but_not_inside_quantifiers():
    from lowvram_lora.nodes.training import parse_targets

    assert parse_targets("") is None
    assert parse_targets("attn1\\.to_q, attn2\nff\\.net") == ("attn1\\.to_q", "attn2", "ff\\.net")
    assert parse_targets(r"blocks\.\d{1,2}\.qkv, proj") == (r"blocks\.\d{1,2}\.qkv", "proj")


@pytest.mark.parametrize("prefix", ["../../escaped", "/tmp/absolute_lora", "", "sub/../../x"])
def test_save_lora_never_writes_outside_the_loras_folder(comfy, sd15, prefix, tmp_path):
    model, _clip, _vae, latents, conditioning = sd15
    lora = train(comfy, model, latents, conditioning, steps=1)[0]
    node = comfy.node_class("LowVRAMLoRA_SaveLoRA")
    before = set(comfy.base.rglob("*.safetensors"))
    with pytest.raises(ValueError, match="filename_prefix"):
        node.execute(lora, prefix, False)
    assert set(comfy.base.rglob("*.safetensors")) == before
    assert not list((comfy.base.parent).glob("escaped*"))


def test_save_lora_never_overwrites_and_names_the_file_for_loraloader(comfy, sd15):
    import folder_paths

    model, _clip, _vae, latents, conditioning = sd15
    lora, state = train(comfy, model, latents, conditioning, steps=1)[:2]
    node = comfy.node_class("LowVRAMLoRA_SaveLoRA")
    names = []
    for _ in range(2):
        output = node.execute(lora, "tests/twice", True, state)
        names.append((output.args if hasattr(output, "args") else output.result)[0])
    assert names == ["tests/twice_00001_.safetensors", "tests/twice_00002_.safetensors"]
    assert all(name in folder_paths.get_filename_list("loras") for name in names)
    assert len(list((comfy.base / "models" / "training_states" / "tests").glob("twice_*.safetensors"))) == 2
    with pytest.raises(ValueError, match="save_training_state"):
        node.execute(lora, "tests/nostate", True, None)
