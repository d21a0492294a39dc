"""nodes/conditioning.py turns host CONDITIONING into the model call the sampler would make.

The models are the host's own (tests/host_models.py: a tiny UNet inside an SD15 BaseModel,
a tiny Flux inside a Flux BaseModel) wrapped in a host ModelPatcher and loaded the way the
sampler loads them. CONDITIONING is made under ``torch.inference_mode()``, as ComfyUI's
nodes make it; training runs under ``torch.inference_mode(False)``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.host


@pytest.fixture(scope="module")
def host(host_path):
    import comfy.model_base
    import comfy.model_management
    import comfy.sampler_helpers
    import comfy.samplers
    import host_models

    from lowvram_lora.nodes import conditioning

    return {
        "C": conditioning,
        "models": host_models,
        "model_base": comfy.model_base,
        "mm": comfy.model_management,
        "sampler_helpers": comfy.sampler_helpers,
        "samplers": comfy.samplers,
    }


def _loaded(host, kind="sd15", model_type=None):
    """A fresh tiny MODEL, loaded as the sampler loads it (for tests that patch it)."""
    patcher = host["models"].tiny_model_patcher(kind, model_type=model_type)
    host["mm"].load_models_gpu([patcher])
    return patcher


@pytest.fixture(scope="module")
def shared(host):
    """Tiny MODELs shared by the tests that leave them as they found them."""
    cache = {}

    def get(kind="sd15", model_type=None):
        if (kind, model_type) not in cache:
            cache[kind, model_type] = _loaded(host, kind, model_type)
        return cache[kind, model_type]

    return get


def _text_conditioning(n, context_dim=32, lengths=None, pooled=32, seed=0, **options):
    """``n`` CONDITIONINGs as CLIPTextEncode makes them: inference tensors, one entry each."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or [8] * n
    with torch.inference_mode():
        out = []
        for length in lengths:
            context = torch.randn(1, length, context_dim, generator=g)
            out.append([[context, {"pooled_output": torch.randn(1, pooled, generator=g), **options}]])
        return out


def _host_sampler_denoised(host, patcher, conditioning, x, sigma):
    """The denoised prediction the host's sampler computes for one image (batch of 1)."""
    samplers, helpers = host["samplers"], host["sampler_helpers"]
    model_options = patcher.model_options.copy()
    model_options["transformer_options"] = patcher.model_options["transformer_options"].copy()
    conds = {"positive": helpers.convert_cond(conditioning)}
    helpers.prepare_model_patcher(patcher, conds, model_options)
    conds = samplers.process_conds(patcher.model, torch.zeros_like(x), conds, x.device, seed=0, latent_shapes=[x.shape])
    patcher.pre_run()
    try:
        (denoised,) = samplers.calc_cond_batch(patcher.model, [conds["positive"]], x, sigma, model_options)
    finally:
        patcher.cleanup()
    return denoised


def _invert(kind, x, sigma, denoised, sigma_data):
    s = sigma.view(-1, 1, 1, 1)
    if kind in ("eps", "flow"):
        return (x - denoised) / s
    sd2 = sigma_data**2
    return (x * sd2 / (s**2 + sd2) - denoised) * (s**2 + sd2) ** 0.5 / (s * sigma_data)


@pytest.mark.parametrize(
    "kind, model_type, expected",
    [("sd15", None, "eps"), ("sd15", "V_PREDICTION", "v"), ("flux", None, "flow")],
)
def test_raw_output_is_what_the_sampler_computes(host, shared, kind, model_type, expected):
    C = host["C"]
    model_type = getattr(host["model_base"].ModelType, model_type) if model_type else None
    patcher = shared(kind, model_type)
    assert C.prediction_type(patcher) == expected
    context_dim = 32
    options = {"guidance": 3.5} if kind == "flux" else {}
    # The UNet's CONDCrossAttn joins contexts of different lengths; Flux's CONDRegular does not.
    lengths = [8, 8, 8] if kind == "flux" else [8, 16, 8]
    conditioning = _text_conditioning(3, context_dim, lengths=lengths, **options)
    channels = 16 if kind == "flux" else 4
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, channels, 8, 8, generator=g)
    sigma = torch.tensor([0.3, 0.7, 0.5]) if expected == "flow" else torch.tensor([0.5, 3.0, 9.0])

    with torch.inference_mode(False):
        prepared = C.prepare_conditioning(patcher, conditioning, x.shape, "cpu")
        raw = C.raw_model_output(patcher, x, sigma, prepared.model_kwargs([0, 1, 2], x))
        denoised = patcher.model.apply_model(x, sigma, **prepared.model_kwargs([0, 1, 2], x))
    assert raw.dtype == torch.float32 and raw.shape == x.shape
    inverted = _invert(expected, x, sigma, denoised, C.sigma_data(patcher))
    torch.testing.assert_close(raw, inverted, rtol=1e-4, atol=1e-4)

    for i in range(3):
        xi, si = x[i : i + 1], sigma[i : i + 1]
        with torch.inference_mode(False):
            alone = patcher.model.apply_model(xi, si, **prepared.model_kwargs([i], xi))
        reference = _host_sampler_denoised(host, patcher, conditioning[i], xi, si)
        # One image: the very call the host sampler makes. In a batch: the same up to float
        # reordering (batched kernels; for the UNet, 8-token contexts repeated to 16 tokens).
        torch.testing.assert_close(alone, reference, rtol=0, atol=1e-6)
        torch.testing.assert_close(denoised[i : i + 1], reference, rtol=1e-4, atol=1e-4)


def test_gradients_flow_to_a_trainable_weight_that_saves_the_context(host):
    C = host["C"]
    patcher = _loaded(host)
    conditioning = _text_conditioning(2)
    x = torch.randn(2, 4, 8, 8)
    sigma = torch.tensor([1.0, 4.0])
    unet = patcher.model.diffusion_model
    weight = unet.input_blocks[1][1].transformer_blocks[0].attn2.to_k.weight
    with torch.inference_mode():  # a node's execute
        with torch.inference_mode(False):  # the training code
            unet.requires_grad_(False)
            weight.requires_grad_(True)
            try:
                prepared = C.prepare_conditioning(patcher, conditioning, x.shape, "cpu")
                raw = C.raw_model_output(patcher, x.clone(), sigma.clone(), prepared.model_kwargs([1, 0], x))
                assert raw.requires_grad
                raw.square().mean().backward()
            finally:
                weight.requires_grad_(False)
    assert weight.grad is not None and weight.grad.abs().sum() > 0
    assert len(unet._forward_hooks) == 0, "the capture hook is removed"


def test_mismatched_conditioning_count_names_conditioning(host, shared):
    C = host["C"]
    patcher = shared()
    with pytest.raises(ValueError, match=r"conditioning: got 2 conditionings for 3 images"):
        C.prepare_conditioning(patcher, _text_conditioning(2), (3, 4, 8, 8), "cpu")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda c: [], r"conditioning: expected a non-empty list"),
        (lambda c: c[0][0][0], r"conditioning: expected a non-empty list"),
        (lambda c: [c[0][0][0]], r"conditioning\[0\]: expected a CONDITIONING"),
        (lambda c: [c[0] + c[0]], r"conditioning\[0\]: holds 2 entries"),
        (lambda c: [[[c[0][0][0], {"area": (8, 8, 0, 0)}]]], r"conditioning\[0\] carries an area"),
        (lambda c: [[[c[0][0][0], {"start_percent": 0.0, "end_percent": 0.5}]]], r"conditioning\[0\] is limited"),
        (lambda c: [[("text", {})]], r"conditioning\[0\]: an entry must be"),
    ],
)
def test_conditioning_that_the_sampler_alone_can_apply_is_refused(host, shared, make, message):
    C = host["C"]
    patcher = shared()
    with pytest.raises(ValueError, match=message):
        C.prepare_conditioning(patcher, make(_text_conditioning(1)), (1, 4, 8, 8), "cpu")


def test_a_single_conditioning_is_broadcast_to_every_image(host, shared):
    C = host["C"]
    patcher = shared()
    conditioning = _text_conditioning(1)
    x = torch.randn(3, 4, 8, 8)
    sigma = torch.tensor([1.0, 2.0, 3.0])
    with torch.inference_mode(False):
        prepared = C.prepare_conditioning(patcher, conditioning, x.shape, "cpu")
        assert prepared.broadcast
        kwargs = prepared.model_kwargs([2, 0, 1], x)
        assert kwargs["c_crossattn"].shape == (3, 8, 32)
        for row in kwargs["c_crossattn"]:
            assert torch.equal(row, conditioning[0][0][0][0])
        assert not kwargs["c_crossattn"].is_inference()
        batched = C.raw_model_output(patcher, x, sigma, kwargs)
        single = C.raw_model_output(patcher, x[1:2], sigma[1:2], prepared.model_kwargs([0], x[1:2]))
    torch.testing.assert_close(batched[1:2], single, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="indices"):
        prepared.model_kwargs([3], x[:1])
    assert torch.equal(prepared.model_kwargs(torch.tensor([2, 1]), x[:2])["c_crossattn"], kwargs["c_crossattn"][:2])
    with pytest.raises(ValueError, match=r"x: rows of shape \(4, 16, 16\)"):
        prepared.model_kwargs([0], torch.randn(1, 4, 16, 16))
    with pytest.raises(ValueError, match="x: batch of 3 rows for 2 indices"):
        prepared.model_kwargs([0, 1], x)


def test_flux_conditioning_becomes_guidance_pooled_vector_and_context(host, shared):
    C = host["C"]
    patcher = shared("flux")
    conditioning = _text_conditioning(2, guidance=2.0)
    x = torch.randn(2, 16, 8, 8)
    with torch.inference_mode(False):
        kwargs = C.prepare_conditioning(patcher, conditioning, x.shape, "cpu").model_kwargs([1, 0], x)
    assert torch.equal(kwargs["guidance"], torch.tensor([2.0, 2.0]))
    assert torch.equal(kwargs["y"][0], conditioning[1][0][1]["pooled_output"][0])
    assert torch.equal(kwargs["c_crossattn"][1], conditioning[0][0][0][0])


@pytest.mark.parametrize("kind", ["sd15", "flux"])
def test_conds_that_cannot_share_a_call_raise(host, shared, kind):
    C = host["C"]
    patcher = shared(kind)
    if kind == "sd15":  # different context widths
        mixed = _text_conditioning(1, context_dim=32) + _text_conditioning(1, context_dim=48)
    else:  # Flux: different token counts (its context is a CONDRegular, joined only when equal)
        mixed = _text_conditioning(2, lengths=[8, 16])
    x = torch.randn(2, 16 if kind == "flux" else 4, 8, 8)
    with torch.inference_mode(False):
        prepared = C.prepare_conditioning(patcher, mixed, x.shape, "cpu")
        with pytest.raises(ValueError, match="'c_crossattn' of image 1 .* cannot be batched together"):
            prepared.model_kwargs([0, 1], x)
        assert prepared.model_kwargs([1], x[:1])["c_crossattn"].shape[0] == 1


def test_patcher_wrappers_patches_and_function_wrapper_apply(host):
    import comfy.patcher_extension as ext

    C = host["C"]
    patcher = _loaded(host).clone()
    seen = {"apply_model": 0, "diffusion_model": 0, "attn2": 0, "function_wrapper": 0}

    def apply_model_wrapper(executor, *args, **kwargs):
        seen["apply_model"] += 1
        return executor(*args, **kwargs)

    def diffusion_model_wrapper(executor, *args, **kwargs):
        seen["diffusion_model"] += 1
        return executor(*args, **kwargs) * 2.0  # visible in the raw output

    def attn2_patch(q, k, v, extra_options):
        seen["attn2"] += 1
        assert extra_options["sigmas"].shape == (2,)
        return q, k, v

    def function_wrapper(apply_model, args):
        seen["function_wrapper"] += 1
        return apply_model(args["input"], args["timestep"], **args["c"])

    patcher.add_wrapper(ext.WrappersMP.APPLY_MODEL, apply_model_wrapper)
    patcher.set_model_attn2_patch(attn2_patch)
    patcher.set_model_unet_function_wrapper(function_wrapper)
    ext.add_wrapper(
        ext.WrappersMP.DIFFUSION_MODEL, diffusion_model_wrapper, patcher.model_options, is_model_options=True
    )
    host["mm"].load_models_gpu([patcher])

    x = torch.randn(2, 4, 8, 8)
    sigma = torch.tensor([1.0, 2.0])
    with torch.inference_mode(False):
        prepared = C.prepare_conditioning(patcher, _text_conditioning(2), x.shape, "cpu")
        raw = C.raw_model_output(patcher, x, sigma, prepared.model_kwargs([0, 1], x))
        plain = host["models"].tiny_model_patcher("sd15")
        host["mm"].load_models_gpu([plain])
        plain_kwargs = C.prepare_conditioning(plain, _text_conditioning(2), x.shape, "cpu").model_kwargs([0, 1], x)
        reference = C.raw_model_output(plain, x, sigma, plain_kwargs)
    assert seen["apply_model"] == 1 and seen["diffusion_model"] == 1 and seen["function_wrapper"] == 1
    assert seen["attn2"] > 0
    torch.testing.assert_close(raw, reference * 2.0, rtol=1e-5, atol=1e-5)


def test_prediction_type_follows_model_sampling_patches(host):
    import comfy_extras.nodes_model_advanced as advanced

    C = host["C"]
    patcher = host["models"].tiny_model_patcher("sd15")
    assert (C.prediction_type(patcher), C.sigma_data(patcher)) == ("eps", 1.0)
    (v,) = advanced.ModelSamplingDiscrete().patch(patcher, "v_prediction", False)
    assert C.prediction_type(v) == "v"
    (lcm,) = advanced.ModelSamplingDiscrete().patch(patcher, "lcm", False)
    with pytest.raises(ValueError, match=r"model: BaseModel \(model type EPS\) predicts with LCM"):
        C.prediction_type(lcm)
    (x0,) = advanced.ModelSamplingDiscrete().patch(patcher, "x0", False)
    with pytest.raises(ValueError, match="X0"):
        C.prediction_type(x0)
    flux = host["models"].tiny_model_patcher("flux")
    assert (C.prediction_type(flux), C.sigma_data(flux)) == ("flow", 1.0)


def test_a_model_that_is_not_loaded_is_refused(host):
    import comfy_extras.nodes_model_advanced as advanced

    C = host["C"]
    x = torch.randn(1, 4, 8, 8)
    fresh = host["models"].tiny_model_patcher("sd15")
    with torch.inference_mode(False):
        kwargs = C.prepare_conditioning(fresh, _text_conditioning(1), x.shape, "cpu").model_kwargs([0], x)
        with pytest.raises(RuntimeError, match="load_models_gpu"):
            C.raw_model_output(fresh, x, torch.tensor([1.0]), kwargs)

    patcher = _loaded(host)
    (v,) = advanced.ModelSamplingDiscrete().patch(patcher, "v_prediction", False)
    with torch.inference_mode(False):
        kwargs = C.prepare_conditioning(v, _text_conditioning(1), x.shape, "cpu").model_kwargs([0], x)
        with pytest.raises(RuntimeError, match="load_models_gpu"):
            C.raw_model_output(v, x, torch.tensor([1.0]), kwargs)
        host["mm"].load_models_gpu([v])
        raw = C.raw_model_output(v, x, torch.tensor([1.0]), kwargs)
    assert torch.isfinite(raw).all()
