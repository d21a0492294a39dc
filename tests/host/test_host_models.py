"""The builders in tests/host_models.py make real host models and files the host accepts.

Tiny modules run forward on the CPU with real (seeded, finite) weights; the SD1.5 checkpoint
loads through ``comfy.sd.load_checkpoint_guess_config`` (CheckpointLoaderSimple) and is
detected as SD15, its text encoder encodes a prompt and its VAE encodes and decodes a
64x64 image; the Flux file loads through ``comfy.sd.load_diffusion_model`` (UNETLoader).
Model files are cached under pytest's cache folder (``.pytest_cache/d/host-models``), so
only the first run pays for writing them.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.host


@pytest.fixture(scope="module")
def hm(host_path):
    import host_models

    return host_models


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    return cache.mkdir("host-models") if cache is not None else tmp_path_factory.mktemp("host-models")


def _assert_real_weights(module: torch.nn.Module) -> None:
    for name, tensor in module.state_dict().items():
        if tensor.is_floating_point():
            assert torch.isfinite(tensor).all(), name
            assert tensor.abs().max() < 100, name


@pytest.mark.parametrize("kind", ["unet", "flux", "sd3"])
def test_tiny_models_run_forward_with_seeded_real_weights(hm, kind):
    build, inputs = {
        "unet": (hm.tiny_unet, lambda m: hm.unet_inputs(2, 8, model=m)),
        "flux": (hm.tiny_flux, lambda m: hm.flux_inputs(2, 8, 8, model=m)),
        "sd3": (hm.tiny_sd3, lambda m: hm.sd3_inputs(2, 8, 8, model=m)),
    }[kind]
    rng_before = torch.random.get_rng_state()
    model = build()
    assert torch.equal(torch.random.get_rng_state(), rng_before), "building must not touch the global RNG"
    _assert_real_weights(model)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 2_000_000

    with torch.no_grad():
        out = model(**inputs(model))
        again = build()(**inputs(model))
    assert out.shape == inputs(model)["x"].shape
    assert torch.isfinite(out).all() and out.std() > 1e-3
    assert torch.equal(out, again), "same seed, same weights, same output"
    other = build(seed=1)
    assert not torch.equal(next(iter(other.state_dict().values())), next(iter(model.state_dict().values())))


def test_host_modules_are_the_hosts_own_classes(hm):
    from comfy.ldm.flux.model import Flux
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    assert type(hm.tiny_unet()) is UNetModel
    flux = hm.tiny_flux()
    assert type(flux) is Flux and len(flux.double_blocks) == 2 and len(flux.single_blocks) == 2
    sd3 = hm.tiny_sd3()
    assert type(sd3) is OpenAISignatureMMDITWrapper and len(sd3.joint_blocks) == 2


def test_dropout_variant_draws_random_numbers_everywhere(hm):
    from comfy.ldm.modules.attention import SpatialTransformer

    model = hm.tiny_unet_with_dropout(0.2)
    assert model.training
    transformers = [t for t in model.modules() if isinstance(t, SpatialTransformer)]
    transformer_dropouts = [m for t in transformers for m in t.modules() if isinstance(m, torch.nn.Dropout)]
    assert transformer_dropouts and all(m.p == 0.2 for m in transformer_dropouts)
    with torch.no_grad():
        torch.manual_seed(3)
        a = model(**hm.unet_inputs(model=model))
        torch.manual_seed(3)
        b = model(**hm.unet_inputs(model=model))
        c = model(**hm.unet_inputs(model=model))
    assert torch.equal(a, b), "same global seed, same dropout masks"
    assert not torch.equal(b, c), "dropout is active"


def test_tiny_model_patchers_wrap_host_base_models(hm):
    import comfy.model_base
    import comfy.model_patcher

    sd15 = hm.tiny_model_patcher("sd15")
    assert isinstance(sd15, comfy.model_patcher.ModelPatcher)
    assert type(sd15.model) is comfy.model_base.BaseModel
    assert type(sd15.model.model_config).__name__ == "SD15"
    assert sd15.model.model_type == comfy.model_base.ModelType.EPS
    _assert_real_weights(sd15.model.diffusion_model)

    flux = hm.tiny_model_patcher("flux")
    assert type(flux.model) is comfy.model_base.Flux
    assert flux.model.model_type == comfy.model_base.ModelType.FLUX

    v = hm.tiny_model_patcher("sd15", model_type=comfy.model_base.ModelType.V_PREDICTION)
    assert v.model.model_type == comfy.model_base.ModelType.V_PREDICTION
    with pytest.raises(ValueError, match="kind"):
        hm.tiny_model_patcher("sdxl")


@pytest.mark.parametrize("config_name", ["SD15_UNET_CONFIG", "SD15_UNET_MINIMAL_CONFIG"])
def test_sd15_unet_shapes_are_detected_as_sd15(hm, config_name):
    import comfy.model_detection

    sd = hm.sd15_unet_state_dict(getattr(hm, config_name), prefix="model.diffusion_model.")
    config = comfy.model_detection.model_config_from_unet(sd, "model.diffusion_model.")
    assert type(config).__name__ == "SD15"


def test_without_an_input_transformer_the_unet_is_not_sd15(hm):
    """Detection takes context_dim from the first input-block transformer: one is required."""
    import comfy.model_detection

    config = {**hm.SD15_UNET_MINIMAL_CONFIG, "transformer_depth": [0], "context_dim": None}
    sd = hm.sd15_unet_state_dict(config, prefix="model.diffusion_model.")
    detected = comfy.model_detection.model_config_from_unet(sd, "model.diffusion_model.")
    assert detected is None or type(detected).__name__ != "SD15"


def test_model_files_are_cached_by_spec_and_content(hm, tmp_path):
    calls = []

    def build():
        calls.append(1)
        return {"w": torch.arange(6, dtype=torch.float16).reshape(2, 3)}

    path = tmp_path / "m.safetensors"
    assert hm._write_cached(path, {"v": 1}, build) == path
    mtime = path.stat().st_mtime_ns
    hm._write_cached(path, {"v": 1}, build)
    assert len(calls) == 1 and path.stat().st_mtime_ns == mtime, "same spec and content: reused"
    hm._write_cached(path, {"v": 2}, build)
    assert len(calls) == 2, "another spec: rebuilt"
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x7f")
    hm._write_cached(path, {"v": 2}, build)
    assert len(calls) == 3, "changed content: rebuilt"
    assert not list(tmp_path.glob("*.tmp")), "no temporary files left behind"


def test_sd15_checkpoint_loads_as_sd15_with_clip_and_vae(hm, model_dir):
    import comfy.model_base
    import comfy.sd

    started = time.perf_counter()
    path = hm.write_sd15_checkpoint(model_dir / "sd15-tiny.safetensors")
    built = time.perf_counter() - started
    assert path.stat().st_size < 400e6

    with torch.inference_mode():  # as ComfyUI runs nodes
        model, clip, vae, _clipvision = comfy.sd.load_checkpoint_guess_config(str(path))
        assert type(model.model.model_config).__name__ == "SD15"
        assert type(model.model) is comfy.model_base.BaseModel
        assert model.model.model_type == comfy.model_base.ModelType.EPS
        assert model.model.diffusion_model.model_channels == 320

        conditioning = clip.encode_from_tokens_scheduled(clip.tokenize("a photo"))
        cond, options = conditioning[0]
        assert cond.shape == (1, 77, 768) and torch.isfinite(cond).all()
        assert options["pooled_output"].shape == (1, 768)

        image = torch.rand(1, 64, 64, 3)
        latent = vae.encode(image)
        assert latent.shape == (1, 4, 8, 8) and torch.isfinite(latent).all()
        decoded = vae.decode(latent)
        assert decoded.shape == (1, 64, 64, 3) and torch.isfinite(decoded).all()

        x = torch.randn(1, 4, 8, 8)
        denoised = model.model.apply_model(x, torch.tensor([1.0]), c_crossattn=cond)
        assert denoised.shape == x.shape and torch.isfinite(denoised).all()
    print(f"sd15 checkpoint: {path.stat().st_size / 1e6:.0f} MB, ready in {built:.1f} s")


@pytest.mark.slow
def test_flux_file_loads_through_the_diffusion_model_loader(hm, model_dir):
    import comfy.model_base
    import comfy.sd

    path = hm.write_flux_diffusion_model(model_dir / "flux-d1-s1.safetensors")
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model(str(path))
        base = model.model
        assert type(base.model_config).__name__ == "Flux"
        assert type(base) is comfy.model_base.Flux
        flux = base.diffusion_model
        assert flux.hidden_size == 3072
        assert (len(flux.double_blocks), len(flux.single_blocks)) == (1, 1)
        out = flux(**hm.flux_inputs(1, 4, 4, model=flux))
        assert out.shape == (1, 16, 4, 4) and torch.isfinite(out).all()
