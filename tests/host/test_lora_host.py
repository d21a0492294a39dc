"""LoRA files from training/lora.py load through ComfyUI's own LoRA machinery, unchanged.

The models are the host's own classes (UNetModel inside an SD15 BaseModel, Flux inside a Flux
BaseModel), tiny and seeded (tests/host_models.py). A file is saved with random ``up`` weights,
read back with the loader's reader (``comfy.utils.load_torch_file(safe_load=True)``), mapped
with ``comfy.lora.model_lora_keys_unet`` and ``comfy.lora.load_lora`` through
``comfy.sd.load_lora_for_models`` (what LoraLoader calls), applied with
``ModelPatcher.patch_model``, and the patched model must compute what the attached adapters
computed.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.host

UNLOADED_MARKERS = ("lora key not loaded", "NOT LOADED")


@pytest.fixture(scope="module")
def host(host_path):
    import comfy.lora
    import comfy.ops
    import comfy.sd
    import comfy.utils
    import host_models

    from lowvram_lora.training import lora

    return {
        "lora": lora,
        "models": host_models,
        "comfy_lora": comfy.lora,
        "ops": comfy.ops,
        "sd": comfy.sd,
        "utils": comfy.utils,
    }


def _randomize_up(attached, seed: int = 11, std: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in attached.adapters.values():
            adapter.up.weight.copy_(torch.randn(adapter.up.weight.shape, generator=g) * std)


def _load_through_host(host, patcher, path, caplog):
    """What LoraLoader does with a file: read it, map its keys, patch a clone of the model."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        sd = host["utils"].load_torch_file(str(path), safe_load=True)
        key_map = host["comfy_lora"].model_lora_keys_unet(patcher.model, {})
        patches = host["comfy_lora"].load_lora(sd, key_map)
        patched, _clip = host["sd"].load_lora_for_models(patcher, None, sd, 1.0, 0.0)
    problems = [r.getMessage() for r in caplog.records if any(m in r.getMessage() for m in UNLOADED_MARKERS)]
    return sd, patches, patched, problems


# ---------------------------------------------------------------------------------------------
# Default targets on the host's own modules
# ---------------------------------------------------------------------------------------------


def test_default_targets_on_host_unet(host):
    lora = host["lora"]
    unet = host["models"].tiny_unet()
    found = lora.find_target_layers(unet, lora.LoRAConfig())
    names = [name for name, _ in found]
    block = "input_blocks.1.1.transformer_blocks.0."
    for suffix in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "ff.net.0.proj", "ff.net.2"):
        assert block + suffix in names
    assert "middle_block.1.transformer_blocks.0.attn1.to_q" in names
    assert any(n.startswith("output_blocks.") for n in names)
    assert all(isinstance(m, host["ops"].disable_weight_init.Linear) for _, m in found)
    assert not any(".emb_layers." in n or n.startswith("time_embed") for n in names)

    with_conv = [name for name, _ in lora.find_target_layers(unet, lora.LoRAConfig(include_conv=True))]
    for name in ("input_blocks.1.0.in_layers.2", "input_blocks.1.0.out_layers.3", "input_blocks.1.1.proj_in", "input_blocks.1.1.proj_out"):
        assert name in with_conv
    assert any(n.endswith(".skip_connection") for n in with_conv)
    assert "input_blocks.0.0" not in with_conv and "out.2" not in with_conv  # conv_in / conv_out
    assert not any(n.endswith(".op") for n in with_conv)  # Downsample


def test_default_targets_on_host_flux(host):
    lora = host["lora"]
    flux = host["models"].tiny_flux()
    names = [name for name, _ in lora.find_target_layers(flux, lora.LoRAConfig())]
    for name in (
        "double_blocks.0.img_attn.qkv",
        "double_blocks.0.img_attn.proj",
        "double_blocks.0.txt_attn.qkv",
        "double_blocks.0.img_mlp.0",
        "double_blocks.1.txt_mlp.2",
        "single_blocks.0.linear1",
        "single_blocks.1.linear2",
    ):
        assert name in names
    assert not any(n.startswith(("img_in", "txt_in", "time_in", "vector_in", "final_layer")) for n in names)


# ---------------------------------------------------------------------------------------------
# Files through the host's loader
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key_form", ["comfy_path", "diffusers"])
def test_unet_lora_file_loads_in_comfyui_and_matches_the_adapters(host, tmp_path, caplog, key_form):
    lora, models = host["lora"], host["models"]
    patcher = models.tiny_model_patcher("sd15")
    unet = patcher.model.diffusion_model
    state_keys = sorted(unet.state_dict())
    base = unet(**models.unet_inputs(model=unet))

    attached = lora.attach_lora(unet, lora.LoRAConfig(rank=4, alpha=2.0, include_conv=True), generator=torch.Generator().manual_seed(0))
    assert sorted(unet.state_dict()) == state_keys, "attaching must not rename the host's weights"
    _randomize_up(attached)
    with torch.no_grad():
        expected = unet(**models.unet_inputs(model=unet))
    attached.detach()
    assert not torch.allclose(expected, base, atol=1e-3)

    if key_form == "diffusers":
        comfy_to_diffusers = lora.diffusers_unet_key_map(host["utils"].unet_to_diffusers(patcher.model.model_config.unet_config))
        key_for = lora.key_function_from_map(comfy_to_diffusers)
        assert all(path in comfy_to_diffusers for path in attached.adapters), "every target has a diffusers name"
    else:
        key_for = lora.default_kohya_key
    tensors = lora.kohya_state_dict(attached, key_for)
    if key_form == "diffusers":
        assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in tensors
        assert "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight" in tensors
        assert not any(k.startswith("lora_unet_input_blocks") for k in tensors)
    else:
        assert "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in tensors
    meta = lora.lora_metadata(attached.config, architecture="UNetModel", base_model_version="sd_v1", steps=1)
    path = lora.save_lora_file(tmp_path / f"unet_{key_form}.safetensors", tensors, meta)

    sd, patches, patched, problems = _load_through_host(host, patcher, path, caplog)
    assert problems == []
    assert set(sd) == set(tensors)
    assert len(patches) == len(attached.adapters)
    assert {f"diffusion_model.{p}.weight" for p in attached.adapters} == set(patches)

    patched.patch_model()
    try:
        with torch.no_grad():
            out = patched.model.diffusion_model(**models.unet_inputs(model=unet))
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)
    finally:
        patched.unpatch_model()
    with torch.no_grad():
        restored = unet(**models.unet_inputs(model=unet))
    assert torch.equal(restored, base)


def test_flux_lora_file_loads_in_comfyui_and_matches_the_adapters(host, tmp_path, caplog):
    lora, models = host["lora"], host["models"]
    patcher = models.tiny_model_patcher("flux")
    flux = patcher.model.diffusion_model
    with torch.no_grad():
        base = flux(**models.flux_inputs(model=flux))

    attached = lora.attach_lora(flux, lora.LoRAConfig(rank=4), generator=torch.Generator().manual_seed(0))
    _randomize_up(attached)
    with torch.no_grad():
        expected = flux(**models.flux_inputs(model=flux))
    attached.detach()
    assert not torch.allclose(expected, base, atol=1e-3)

    tensors = lora.kohya_state_dict(attached)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight" in tensors
    assert "lora_unet_single_blocks_0_linear1.lora_down.weight" in tensors
    path = lora.save_lora_file(tmp_path / "flux.safetensors", tensors, lora.lora_metadata(attached.config, architecture="Flux", base_model_version="flux1"))

    sd, patches, patched, problems = _load_through_host(host, patcher, path, caplog)
    assert problems == []
    assert {f"diffusion_model.{p}.weight" for p in attached.adapters} == set(patches)

    patched.patch_model()
    try:
        with torch.no_grad():
            out = patched.model.diffusion_model(**models.flux_inputs(model=flux))
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)
    finally:
        patched.unpatch_model()


def test_unknown_keys_are_what_the_host_reports(host, tmp_path, caplog):
    """The negative control: a key the host cannot map is logged, so the checks above can fail."""
    lora, models = host["lora"], host["models"]
    patcher = models.tiny_model_patcher("sd15")
    unet = patcher.model.diffusion_model
    attached = lora.attach_lora(unet, lora.LoRAConfig(rank=2, targets=(r"input_blocks\.1\.1\.transformer_blocks\.0\.attn1\.to_q$",)), generator=torch.Generator().manual_seed(0))
    attached.detach()
    tensors = lora.kohya_state_dict(attached, lambda path: "lora_unet_no_such_layer")
    path = lora.save_lora_file(tmp_path / "bad.safetensors", tensors, {})
    _sd, patches, _patched, problems = _load_through_host(host, patcher, path, caplog)
    assert patches == {}
    assert any("lora_unet_no_such_layer" in p for p in problems)
