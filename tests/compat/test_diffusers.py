"""An SD1.5 LoRA file from this pack loads in diffusers, every key mapped, and computes what the adapters computed.

The reference is the host's own ``UNetModel`` (SD1.5 widths: model channels 320, context 768,
8 heads, conv ``proj_in``; two levels deep, a transformer everywhere), wrapped as the host
wraps an SD1.5 checkpoint (``supported_models.SD15`` in a ``BaseModel``), with this pack's
adapters attached by forward hooks. The file is written as the training node writes it: the
key function is the node's own ``kohya_key_function`` (diffusers-style Kohya names for SD1.x),
then ``kohya_state_dict`` and ``save_lora_file``.

The other side is diffusers' ``UNet2DConditionModel`` with the same block structure, given the
same base weights (ComfyUI names turned into diffusers names with the inverse of the host's
``comfy.utils.unet_to_diffusers``; every weight must land). The file goes through diffusers'
own path for a Kohya SD1.x LoRA, the two class methods that ``StableDiffusionPipeline.load_lora_weights``
calls for the UNet: ``lora_state_dict`` (Kohya -> diffusers key conversion and ``network_alphas``)
and ``load_lora_into_unet`` (-> ``UNet2DConditionModel.load_lora_adapter`` -> PEFT). A whole
pipeline is not built: its text encoder, tokenizer and VAE play no part in a UNet-only LoRA.

Checked: no warning from diffusers or PEFT (unexpected, missing or unconverted keys) and no
Python warning while loading; the PEFT LoRA layers sit on exactly the layers the pack trained,
hold the file's tensors and scale by ``alpha / rank``; and the output equals the host UNet's
with the adapters attached (and differs from the base output).

Needs diffusers and PEFT (requirements-dev.txt); without them the tests skip, or fail when
``LOWVRAM_LORA_REQUIRE_COMPAT=1`` (as ``.ci/run`` sets it).
"""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.host

ADAPTER = "lowvram_lora"

#: Forward inputs: latents 16x16 (8x8 after the one downsample), 8 context tokens.
BATCH, SIZE, CONTEXT_LEN = 2, 16, 8


def _compat_required() -> bool:
    return os.environ.get("LOWVRAM_LORA_REQUIRE_COMPAT", "") not in ("", "0")


@pytest.fixture(scope="module")
def diffusers_api(host_path):
    """diffusers' UNet and Kohya LoRA loader; skip (or fail under .ci/run) when not importable."""
    try:
        import peft  # noqa: F401
        from diffusers import UNet2DConditionModel
        from diffusers.loaders import StableDiffusionLoraLoaderMixin
        from peft.tuners.lora import LoraLayer
    except ImportError as exc:
        reason = (
            f"diffusers and peft are needed for the diffusers compatibility test ({exc}); "
            "install them with `pip install -r requirements-dev.txt`"
        )
        if _compat_required():
            pytest.fail(reason + " (LOWVRAM_LORA_REQUIRE_COMPAT is set)")
        pytest.skip(reason)
    return {
        "UNet2DConditionModel": UNet2DConditionModel,
        "loader": StableDiffusionLoraLoaderMixin,
        "LoraLayer": LoraLayer,
    }


@pytest.fixture(scope="module")
def host(host_path):
    import comfy.utils
    import host_models

    from lowvram_lora.nodes.host_training import kohya_key_function
    from lowvram_lora.training import lora

    return {"utils": comfy.utils, "models": host_models, "lora": lora, "kohya_key_function": kohya_key_function}


@pytest.fixture(scope="module")
def reference(host, diffusers_api):
    """The host's SD1.5-shaped model (SD15 model config in a BaseModel, as a checkpoint loads), inputs, base output.

    ``SD15_UNET_CONFIG`` keeps SD1.5's widths (320 channels, 8 heads of 40, context 768): the
    whole module runs in about 10 s on a CPU, and narrower widths would buy little.
    """
    models = host["models"]
    patcher = models.tiny_model_patcher("sd15", **models.SD15_UNET_CONFIG)
    unet_config = patcher.model.model_config.unet_config
    comfy_unet = patcher.model.diffusion_model
    assert type(patcher.model.model_config).__name__ == "SD15"
    assert (unet_config["model_channels"], unet_config["context_dim"], unet_config["num_heads"]) == (320, 768, 8)

    g = torch.Generator().manual_seed(3)
    inputs = {
        "x": torch.randn(BATCH, 4, SIZE, SIZE, generator=g),
        "timesteps": torch.tensor([999.0, 261.5]),
        "context": torch.randn(BATCH, CONTEXT_LEN, unet_config["context_dim"], generator=g),
    }
    with torch.no_grad():
        base = comfy_unet(**inputs, transformer_options={})
    return {"patcher": patcher, "unet": comfy_unet, "config": unet_config, "inputs": inputs, "base": base}


def _diffusers_unet(host, diffusers_api, reference):
    """diffusers' ``UNet2DConditionModel`` for ``reference["config"]``, with the host UNet's weights."""
    config = reference["config"]
    levels = len(config["channel_mult"])
    assert all(depth == 1 for depth in config["transformer_depth"]), "a transformer at every level"
    assert len(set(config["num_res_blocks"])) == 1
    assert config["num_head_channels"] == -1
    with torch.random.fork_rng(devices=[]):
        unet = diffusers_api["UNet2DConditionModel"](
            sample_size=config["image_size"],
            in_channels=config["in_channels"],
            out_channels=config["out_channels"],
            down_block_types=("CrossAttnDownBlock2D",) * levels,
            up_block_types=("CrossAttnUpBlock2D",) * levels,
            mid_block_type="UNetMidBlock2DCrossAttn",
            block_out_channels=tuple(config["model_channels"] * m for m in config["channel_mult"]),
            layers_per_block=config["num_res_blocks"][0],
            transformer_layers_per_block=1,
            cross_attention_dim=config["context_dim"],
            # SD1.5's diffusers config spells its 8 heads "attention_head_dim": 8 (a historical
            # misnomer that diffusers keeps); the head width is then channels / 8, as in ComfyUI.
            attention_head_dim=config["num_heads"],
            use_linear_projection=config["use_linear_in_transformer"],
            norm_num_groups=32,
            flip_sin_to_cos=True,
            freq_shift=0,
        )
    diffusers_to_comfy = host["utils"].unet_to_diffusers(config)
    comfy_sd = reference["unet"].state_dict()
    comfy_to_diffusers: dict[str, str] = {}
    for diffusers_name, comfy_name in diffusers_to_comfy.items():
        if comfy_name in comfy_sd:
            assert comfy_name not in comfy_to_diffusers, f"{comfy_name} has two diffusers names"
            comfy_to_diffusers[comfy_name] = diffusers_name
    unmapped = sorted(set(comfy_sd) - set(comfy_to_diffusers))
    assert unmapped == [], f"host weights without a diffusers name: {unmapped[:5]}"
    converted = {comfy_to_diffusers[k]: v for k, v in comfy_sd.items()}
    result = unet.load_state_dict(converted, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == [], (
        f"missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
    )
    return unet.eval()


def _diffusers_forward(unet, inputs) -> torch.Tensor:
    with torch.no_grad():
        return unet(inputs["x"], inputs["timesteps"], encoder_hidden_states=inputs["context"]).sample


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _load_in_diffusers(diffusers_api, unet, path):
    """What ``StableDiffusionPipeline.load_lora_weights(path)`` does for the UNet; returns the problems it reported.

    diffusers logs through its own ``diffusers`` logger, which does not propagate to the root
    logger (so pytest's caplog would not see it): a handler is put on it, and on ``peft``'s,
    and Python warnings are recorded.
    """
    loader = diffusers_api["loader"]
    handler = _Records()
    loggers = [logging.getLogger("diffusers"), logging.getLogger("peft")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state_dict, network_alphas, metadata = loader.lora_state_dict(
                str(path), local_files_only=True, return_lora_metadata=True
            )
            converted = dict(state_dict)
            loader.load_lora_into_unet(
                state_dict, network_alphas=network_alphas, unet=unet, adapter_name=ADAPTER, metadata=metadata
            )
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    problems = [f"{r.name} {r.levelname}: {r.getMessage()}" for r in handler.records if r.levelno >= logging.WARNING]
    problems += [f"{w.category.__name__}: {w.message}" for w in caught]
    return converted, network_alphas, problems


CASES = {
    # Default targets: every Linear of the transformers (attn1/attn2 q/k/v/out, ff). alpha != rank,
    # so a file read with the wrong scale cannot pass.
    "default-targets": dict(rank=4, alpha=2.0),
    # LoCon: also the ResBlocks' conv1/conv2/conv_shortcut and the transformers' conv proj_in/proj_out.
    "include-conv": dict(rank=4, alpha=8.0, include_conv=True),
    # Every layer the pack can take (explicit targets): also time_embed, emb_layers, conv_in,
    # conv_out and the down/upsampling convolutions, whose Kohya names diffusers special-cases.
    "every-layer": dict(rank=2, alpha=1.0, include_conv=True, targets=(r".",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sd15_lora_file_loads_in_diffusers_and_computes_the_same(host, diffusers_api, reference, tmp_path, case):
    lora = host["lora"]
    comfy_unet, inputs, base = reference["unet"], reference["inputs"], reference["base"]
    config = lora.LoRAConfig(**CASES[case])

    # The host UNet with the pack's adapters, random non-zero up weights.
    attached = lora.attach_lora(comfy_unet, config, generator=torch.Generator().manual_seed(0))
    try:
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for adapter in attached.adapters.values():
                adapter.up.weight.copy_(torch.randn(adapter.up.weight.shape, generator=g) * 0.2)
            expected = comfy_unet(**inputs, transformer_options={})
    finally:
        attached.detach()
    kinds = {adapter.kind for adapter in attached.adapters.values()}
    assert kinds == ({"linear", "conv2d"} if config.include_conv else {"linear"})

    # The file, keyed as the training node keys it for an SD1.x model.
    key_for = host["kohya_key_function"](reference["patcher"])
    comfy_to_diffusers = lora.diffusers_unet_key_map(host["utils"].unet_to_diffusers(reference["config"]))
    assert all(path in comfy_to_diffusers for path in attached.adapters), "every target has a diffusers name"
    tensors = lora.kohya_state_dict(attached, key_for)
    assert not any(k.startswith(("lora_unet_input_blocks", "lora_unet_middle_block", "lora_unet_output_blocks")) for k in tensors)
    names = {comfy_to_diffusers[p] for p in attached.adapters}
    if config.include_conv:
        assert {"up_blocks.0.resnets.0.conv_shortcut", "down_blocks.0.attentions.0.proj_in"} <= names
    if config.targets is not None:
        assert {"conv_in", "conv_out", "time_embedding.linear_1", "down_blocks.0.resnets.0.time_emb_proj",
                "down_blocks.0.downsamplers.0.conv", "up_blocks.0.upsamplers.0.conv"} <= names
    metadata = lora.lora_metadata(config, architecture="SD15", base_model_version="sd_v1", steps=1)
    path = lora.save_lora_file(tmp_path / f"{case}.safetensors", tensors, metadata)

    # diffusers: the same base UNet, then the file through diffusers' Kohya loader.
    unet = _diffusers_unet(host, diffusers_api, reference)
    torch.testing.assert_close(_diffusers_forward(unet, inputs), base, rtol=1e-4, atol=1e-5)
    converted, network_alphas, problems = _load_in_diffusers(diffusers_api, unet, path)
    assert problems == []
    assert len(converted) == 2 * len(attached.adapters)
    assert network_alphas is not None and len(network_alphas) == len(attached.adapters)
    assert set(network_alphas.values()) == {config.effective_alpha}

    # The PEFT layers: exactly the pack's layers (by their diffusers names), the file's tensors, alpha / rank.
    lora_layers = {
        name: module
        for name, module in unet.named_modules()
        if isinstance(module, diffusers_api["LoraLayer"]) and ADAPTER in module.lora_A
    }
    wanted = {comfy_to_diffusers[p]: p for p in attached.adapters}
    assert set(lora_layers) == set(wanted)
    for name, module in lora_layers.items():
        adapter = attached.adapters[wanted[name]]
        assert torch.equal(module.lora_A[ADAPTER].weight, adapter.down.weight)
        assert torch.equal(module.lora_B[ADAPTER].weight, adapter.up.weight)
        assert module.scaling[ADAPTER] == pytest.approx(config.scale)
        assert type(module.base_layer).__name__ == ("Linear" if adapter.kind == "linear" else "Conv2d")

    # The same function: diffusers with the LoRA equals the host UNet with the adapters.
    out = _diffusers_forward(unet, inputs)
    assert not torch.allclose(expected, base, rtol=1e-2, atol=1e-3), "the LoRA must change the output"
    assert (out - base).abs().max() > 100 * (out - expected).abs().max()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_diffusers_reports_a_key_it_cannot_place(host, diffusers_api, reference, tmp_path):
    """The negative control: a LoRA key naming no layer is reported, so ``problems == []`` above has teeth."""
    lora = host["lora"]
    config = lora.LoRAConfig(rank=2, targets=(r"input_blocks\.1\.1\.transformer_blocks\.0\.attn1\.to_q$",))
    attached = lora.attach_lora(reference["unet"], config, generator=torch.Generator().manual_seed(0))
    attached.detach()
    tensors = lora.kohya_state_dict(attached, host["kohya_key_function"](reference["patcher"]))
    good = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    bad = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_no_such_layer"
    assert f"{good}.lora_down.weight" in tensors
    for suffix in ("lora_down.weight", "lora_up.weight", "alpha"):
        tensors[f"{bad}.{suffix}"] = tensors[f"{good}.{suffix}"].clone()
    path = lora.save_lora_file(tmp_path / "bad.safetensors", tensors, {})
    unet = _diffusers_unet(host, diffusers_api, reference)
    _converted, _alphas, problems = _load_in_diffusers(diffusers_api, unet, path)
    assert any("no.such.layer" in p for p in problems), problems
