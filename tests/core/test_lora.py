"""LoRA adapters on plain torch models: attach/detach, targets, Kohya files, merging, safe writes."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lowvram_lora.training import lora, safefile
from lowvram_lora.training.lora import LoRAConfig, attach_lora

# ---------------------------------------------------------------------------------------------
# Small models whose class names follow ComfyUI's UNet and a generic DiT
# ---------------------------------------------------------------------------------------------


class CrossAttention(nn.Module):
    def __init__(self, dim: int, context_dim: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(context_dim, dim, bias=False)
        self.to_v = nn.Linear(context_dim, dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(0.0))

    def forward(self, x, context=None):
        context = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.to_out(weights @ v)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim: int, context_dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn1 = CrossAttention(dim, dim)
        self.attn2 = CrossAttention(dim, context_dim)
        self.ff = nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))

    def forward(self, x, context):
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class SpatialTransformer(nn.Module):
    def __init__(self, channels: int, context_dim: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, channels)
        self.proj_in = nn.Conv2d(channels, channels, 1)
        self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(channels, context_dim)])
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x, context):
        b, c, h, w = x.shape
        y = self.proj_in(self.norm(x)).flatten(2).transpose(1, 2)
        for block in self.transformer_blocks:
            y = block(y, context)
        return x + self.proj_out(y.transpose(1, 2).reshape(b, c, h, w))


class ResBlock(nn.Module):
    def __init__(self, channels: int, out_channels: int) -> None:
        super().__init__()
        self.in_layers = nn.Sequential(nn.GroupNorm(4, channels), nn.SiLU(), nn.Conv2d(channels, out_channels, 3, padding=1))
        self.out_layers = nn.Sequential(
            nn.GroupNorm(4, out_channels), nn.SiLU(), nn.Dropout(0.0), nn.Conv2d(out_channels, out_channels, 3, padding=1)
        )
        self.skip_connection = nn.Conv2d(channels, out_channels, 1)

    def forward(self, x):
        return self.skip_connection(x) + self.out_layers(self.in_layers(x))


class TinyUNet(nn.Module):
    def __init__(self, channels: int = 8, context_dim: int = 12) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(4, channels, 3, padding=1)
        self.res = ResBlock(channels, channels * 2)
        self.attn = SpatialTransformer(channels * 2, context_dim)
        self.down = nn.Conv2d(channels * 2, channels * 2, 3, stride=2, padding=1)
        self.out = nn.Conv2d(channels * 2, 4, 3, padding=1)

    def forward(self, x, context):
        return self.out(self.down(self.attn(self.res(self.conv_in(x)), context)))


class DiTBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v)
        return x + self.mlp(x)


class TinyDiT(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(6, dim)
        self.blocks = nn.ModuleList([DiTBlock(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 6)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def seeded(model_cls, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return model_cls(**kwargs).eval()


def unet_inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 5, 12, generator=g)


def randomize_up(attached, seed: int = 7, std: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in attached.adapters.values():
            adapter.up.weight.copy_(torch.randn(adapter.up.weight.shape, generator=g) * std)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def module_state(model: nn.Module):
    return {
        path: (sorted(vars(m)), len(m._forward_hooks), len(m._forward_hooks_with_kwargs), len(m._forward_pre_hooks))
        for path, m in model.named_modules()
    }


# ---------------------------------------------------------------------------------------------
# Attach / detach
# ---------------------------------------------------------------------------------------------


def test_attach_then_detach_leaves_model_bit_identical():
    model = seeded(TinyUNet)
    x, ctx = unet_inputs()
    before_out = model(x, ctx)
    before_state = module_state(model)
    before_params = {k: v.clone() for k, v in model.state_dict().items()}

    attached = attach_lora(model, LoRAConfig(rank=4, include_conv=True), generator=gen())
    randomize_up(attached)
    assert not torch.equal(model(x, ctx), before_out)
    attached.detach()
    attached.detach()  # idempotent

    assert torch.equal(model(x, ctx), before_out)
    assert module_state(model) == before_state
    assert all(torch.equal(before_params[k], v) for k, v in model.state_dict().items())
    assert sorted(model.state_dict()) == sorted(before_params)


def test_initial_output_equals_base_output():
    model = seeded(TinyUNet)
    x, ctx = unet_inputs()
    base = model(x, ctx)
    with attach_lora(model, LoRAConfig(rank=4, alpha=8, include_conv=True), generator=gen()) as attached:
        assert attached.attached
        assert torch.equal(model(x, ctx), base)
        assert all(torch.count_nonzero(a.up.weight) == 0 for a in attached.adapters.values())
        assert all(torch.count_nonzero(a.down.weight) > 0 for a in attached.adapters.values())
    assert not attached.attached


def test_gradients_reach_only_adapters_and_requires_grad_is_left_alone():
    model = seeded(TinyUNet)
    model.requires_grad_(True)
    attached = attach_lora(model, LoRAConfig(rank=4), generator=gen())
    assert all(p.requires_grad for p in model.parameters()), "attach_lora must not freeze the base"
    model.requires_grad_(False)  # the caller freezes the base
    randomize_up(attached)
    x, ctx = unet_inputs()
    model(x, ctx).square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    for path, adapter in attached.adapters.items():
        assert adapter.down.weight.grad is not None and adapter.down.weight.grad.abs().sum() > 0, path
        assert adapter.up.weight.grad is not None and adapter.up.weight.grad.abs().sum() > 0, path
    assert attached.num_parameters() == sum(p.numel() for p in attached.parameters()) > 0
    attached.detach()


def test_init_is_reproducible_from_the_generator():
    a = attach_lora(seeded(TinyDiT), LoRAConfig(rank=4), generator=gen(3))
    b = attach_lora(seeded(TinyDiT), LoRAConfig(rank=4), generator=gen(3))
    c = attach_lora(seeded(TinyDiT), LoRAConfig(rank=4), generator=gen(4))
    sa, sb, sc = a.state(), b.state(), c.state()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_attaching_twice_to_a_layer_raises_and_detach_allows_again():
    model = seeded(TinyDiT)
    first = attach_lora(model, LoRAConfig(rank=2), generator=gen())
    with pytest.raises(ValueError, match="already has a LoRA attached"):
        attach_lora(model, LoRAConfig(rank=2, targets=(r"blocks\.0\.qkv$",)), generator=gen())
    first.detach()
    second = attach_lora(model, LoRAConfig(rank=2), generator=gen())
    second.detach()


def test_state_and_load_state_restore_exact_tensors():
    model = seeded(TinyDiT)
    attached = attach_lora(model, LoRAConfig(rank=3), generator=gen())
    randomize_up(attached)
    saved = attached.state()
    x = torch.randn(2, 5, 6, generator=gen(9))
    expected = model(x)
    attached.detach()

    again = attach_lora(model, LoRAConfig(rank=3), generator=gen(123))
    assert not torch.equal(model(x), expected)
    again.load_state(saved)
    assert torch.equal(model(x), expected)
    with pytest.raises(ValueError, match="missing"):
        again.load_state({k: v for k, v in list(saved.items())[1:]})
    wrong = dict(saved)
    key = next(iter(wrong))
    wrong[key] = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="shape"):
        again.load_state(wrong)
    again.detach()


def test_low_precision_base_keeps_its_dtype_with_fp32_adapters():
    model = seeded(TinyDiT).to(torch.bfloat16)
    attached = attach_lora(model, LoRAConfig(rank=4), generator=gen())
    randomize_up(attached)
    x = torch.randn(2, 5, 6, generator=gen(2)).to(torch.bfloat16)
    out = model(x)
    assert out.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in attached.parameters())
    attached.detach()
    half = attach_lora(model, LoRAConfig(rank=4), generator=gen(), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    half.detach()


def test_hook_accepts_the_input_as_keyword():
    layer = nn.Linear(4, 3)
    holder = nn.Sequential(layer)
    attached = attach_lora(holder, LoRAConfig(rank=2, targets=("0",)), generator=gen())
    randomize_up(attached)
    x = torch.randn(2, 4, generator=gen(1))
    assert torch.allclose(layer(input=x), layer(x))
    assert not torch.allclose(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    attached.detach()


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------


def test_default_unet_targets_are_the_transformer_linears():
    model = seeded(TinyUNet)
    names = [path for path, _ in lora.find_target_layers(model, LoRAConfig())]
    prefix = "attn.transformer_blocks.0."
    for name in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "ff.0", "ff.2"):
        assert prefix + name in names
    assert all(isinstance(m, nn.Linear) for _, m in lora.find_target_layers(model, LoRAConfig()))
    assert not any(n.startswith("res.") for n in names)

    with_conv = [path for path, _ in lora.find_target_layers(model, LoRAConfig(include_conv=True))]
    for name in ("res.in_layers.2", "res.out_layers.3", "res.skip_connection", "attn.proj_in", "attn.proj_out"):
        assert name in with_conv
    for name in ("conv_in", "down", "out"):
        assert name not in with_conv


def test_default_dit_targets_are_the_linears_inside_blocks():
    model = seeded(TinyDiT)
    names = [path for path, _ in lora.find_target_layers(model, LoRAConfig())]
    assert names == [f"blocks.{i}.{n}" for i in range(3) for n in ("qkv", "proj", "mlp.0", "mlp.2")]


def test_explicit_targets_and_unmatched_patterns():
    model = seeded(TinyUNet)
    names = [p for p, _ in lora.find_target_layers(model, LoRAConfig(targets=(r"attn[12]\.to_[qv]$",)))]
    assert names == [f"attn.transformer_blocks.0.attn{i}.to_{c}" for i in (1, 2) for c in ("q", "v")]
    with pytest.raises(ValueError) as err:
        lora.find_target_layers(model, LoRAConfig(targets=(r"to_q$", r"nothing_like_this")))
    message = str(err.value)
    assert "targets" in message and "nothing_like_this" in message and "to_q" in message
    # Convolutions are only candidates with include_conv.
    with pytest.raises(ValueError, match="targets"):
        lora.find_target_layers(model, LoRAConfig(targets=(r"^conv_in$",)))
    assert lora.find_target_layers(model, LoRAConfig(targets=(r"^conv_in$",), include_conv=True))[0][0] == "conv_in"


def test_model_without_blocks_needs_explicit_targets():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Conv2d(3, 3, 1))
    with pytest.raises(ValueError, match="targets"):
        lora.find_target_layers(model, LoRAConfig())


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (LoRAConfig(rank=0), "rank"),
        (LoRAConfig(rank=2.5), "rank"),  # type: ignore[arg-type]
        (LoRAConfig(alpha=0), "alpha"),
        (LoRAConfig(alpha=-1.0), "alpha"),
        (LoRAConfig(dropout=1.0), "dropout"),
        (LoRAConfig(dropout=-0.1), "dropout"),
        (LoRAConfig(targets="to_q"), "targets"),  # type: ignore[arg-type]
        (LoRAConfig(targets=("(",)), "targets"),
        (LoRAConfig(targets=()), "targets"),
    ],
)
def test_bad_config_names_the_field(config, field):
    with pytest.raises(ValueError) as err:
        config.validate()
    assert str(err.value).startswith(field)


# ---------------------------------------------------------------------------------------------
# Convolutions
# ---------------------------------------------------------------------------------------------


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.strided = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.dilated = nn.Conv2d(8, 8, 3, padding=2, dilation=2, padding_mode="reflect")
        self.rect = nn.Conv2d(8, 6, (1, 3), padding=(0, 1))
        self.grouped = nn.Conv2d(6, 6, 3, padding=1, groups=2)
        self.c1 = nn.Conv1d(6, 4, 3, padding="same")
        self.c3 = nn.Conv3d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.grouped(self.rect(self.dilated(self.strided(x))))
        b, c, h, w = y.shape
        z = self.c1(y.reshape(b, c, h * w))
        return self.c3(z.reshape(b, 4, 1, h, w))


def test_conv_adapters_follow_stride_padding_and_the_locon_layout(tmp_path):
    model = seeded(ConvNet)
    attached = attach_lora(model, LoRAConfig(rank=2, targets=(".",), include_conv=True), generator=gen())
    assert sorted(attached.adapters) == ["c1", "c3", "dilated", "rect", "strided"]  # grouped is skipped
    randomize_up(attached)
    x = torch.randn(2, 3, 9, 9, generator=gen(5))
    expected = model(x)

    tensors = lora.kohya_state_dict(attached)
    assert tensors["lora_unet_strided.lora_down.weight"].shape == (2, 3, 3, 3)
    assert tensors["lora_unet_strided.lora_up.weight"].shape == (8, 2, 1, 1)
    assert tensors["lora_unet_rect.lora_down.weight"].shape == (2, 8, 1, 3)
    assert tensors["lora_unet_c1.lora_up.weight"].shape == (4, 2, 1)
    assert tensors["lora_unet_c3.lora_down.weight"].shape == (2, 4, 3, 3, 3)
    attached.detach()

    merged = copy.deepcopy(model)
    lora.merge_lora(merged, tensors)
    torch.testing.assert_close(merged(x), expected, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Kohya files
# ---------------------------------------------------------------------------------------------


def test_file_round_trip_merges_to_the_attached_output(tmp_path):
    model = seeded(TinyUNet)
    x, ctx = unet_inputs()
    attached = attach_lora(model, LoRAConfig(rank=4, alpha=2.0, include_conv=True), generator=gen())
    randomize_up(attached)
    expected = model(x, ctx)
    tensors = lora.kohya_state_dict(attached)
    attached.detach()

    key = "lora_unet_attn_transformer_blocks_0_attn1_to_q"
    assert tensors[f"{key}.lora_down.weight"].shape == (4, 16)
    assert tensors[f"{key}.lora_up.weight"].shape == (16, 4)
    assert tensors[f"{key}.alpha"].ndim == 0 and tensors[f"{key}.alpha"].item() == 2.0
    assert len(tensors) == 3 * len(attached.adapters)

    meta = lora.lora_metadata(
        attached.config,
        architecture="TinyUNet",
        base_model_version="sd_v1",
        steps=10,
        checkpointing={"mode": "every_n", "interval": 2},
        training={"lr": 1e-4, "seed": 0},
    )
    path = lora.save_lora_file(tmp_path / "my_lora.safetensors", tensors, meta)
    loaded, loaded_meta = lora.load_lora_file(path)
    assert loaded_meta == meta
    assert loaded_meta["ss_network_module"] == "networks.lora"
    assert loaded_meta["ss_network_dim"] == "4" and loaded_meta["ss_network_alpha"] == "2"
    assert json.loads(loaded_meta["lowvram_lora.checkpointing"]) == {"mode": "every_n", "interval": 2}
    assert json.loads(loaded_meta["ss_network_args"]) == {"conv_alpha": "2", "conv_dim": "4"}
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)

    merged = copy.deepcopy(model)
    base = merged(x, ctx)
    assert lora.merge_lora(merged, loaded) is None
    torch.testing.assert_close(merged(x, ctx), expected, rtol=0, atol=1e-5)
    assert not torch.allclose(base, expected, atol=1e-3)

    with pytest.raises(FileExistsError, match="my_lora"):
        lora.save_lora_file(path, tensors, meta)


def test_kohya_state_dict_dtype_and_key_functions():
    model = seeded(TinyDiT)
    attached = attach_lora(model, LoRAConfig(rank=2), generator=gen())
    half = lora.kohya_state_dict(attached, dtype=torch.float16)
    assert half["lora_unet_blocks_0_qkv.lora_down.weight"].dtype == torch.float16
    assert half["lora_unet_blocks_0_qkv.alpha"].dtype == torch.float32

    key_for = lora.key_function_from_map({"blocks.0.qkv": "transformer_blocks.0.attn.to_qkv"})
    assert key_for("blocks.0.qkv") == "lora_unet_transformer_blocks_0_attn_to_qkv"
    assert key_for("blocks.1.qkv") == "lora_unet_blocks_1_qkv"
    renamed = lora.kohya_state_dict(attached, key_for)
    assert "lora_unet_transformer_blocks_0_attn_to_qkv.lora_up.weight" in renamed
    with pytest.raises(ValueError, match="both"):
        lora.kohya_state_dict(attached, lambda path: "same")
    attached.detach()

    merged = copy.deepcopy(model)
    with pytest.raises(ValueError, match="match no layer"):
        lora.merge_lora(merged, renamed)  # default keys cannot find the renamed layer
    lora.merge_lora(merged, renamed, key_for)


def test_diffusers_unet_key_map_inverts_weights_deterministically():
    forward = {
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight": "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight",
        "down_blocks.0.attentions.0.proj_in.bias": "input_blocks.1.1.proj_in.bias",
        "class_embedding.linear_1.weight": "label_emb.0.0.weight",
        "add_embedding.linear_1.weight": "label_emb.0.0.weight",
    }
    inverse = lora.diffusers_unet_key_map(forward)
    assert inverse == {
        "input_blocks.1.1.transformer_blocks.0.attn1.to_q": "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
        "label_emb.0.0": "add_embedding.linear_1",
    }
    key_for = lora.key_function_from_map(inverse)
    assert (
        key_for("input_blocks.1.1.transformer_blocks.0.attn1.to_q")
        == "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    )


def test_metadata_values_are_strings():
    meta = lora.lora_metadata(LoRAConfig(rank=8, alpha=4.5, dropout=0.1), architecture="Flux", steps=3)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    assert meta["ss_network_alpha"] == "4.5" and meta["ss_base_model_version"] == "Flux" and meta["ss_steps"] == "3"
    assert json.loads(meta["lowvram_lora.lora_config"])["rank"] == 8
    with pytest.raises(TypeError, match="string"):
        safefile.atomic_write_safetensors("unused.safetensors", {}, {"ss_steps": 3})  # type: ignore[dict-item]


# ---------------------------------------------------------------------------------------------
# Dropout and checkpointing
# ---------------------------------------------------------------------------------------------


def test_dropout_is_reproducible_under_a_global_seed_and_off_in_eval():
    model = seeded(TinyDiT)
    attached = attach_lora(model, LoRAConfig(rank=4, dropout=0.5), generator=gen())
    randomize_up(attached)
    x = torch.randn(2, 5, 6, generator=gen(1))
    torch.manual_seed(42)
    first = model(x)
    torch.manual_seed(42)
    second = model(x)
    third = model(x)
    assert torch.equal(first, second)
    assert not torch.equal(second, third)
    attached.eval()
    assert torch.equal(model(x), model(x))
    attached.detach()


def test_dropout_gradients_match_under_non_reentrant_checkpointing():
    x = torch.randn(2, 5, 6, generator=gen(1))

    def grads(use_checkpoint: bool):
        model = seeded(TinyDiT)
        model.requires_grad_(False)
        attached = attach_lora(model, LoRAConfig(rank=4, dropout=0.3), generator=gen())
        randomize_up(attached)
        torch.manual_seed(5)
        h = model.embed(x)
        for block in model.blocks:
            h = checkpoint(block, h, use_reentrant=False) if use_checkpoint else block(h)
        model.head(h).square().sum().backward()
        result = {k: p.grad.clone() for k, p in attached.named_parameters()}
        attached.detach()
        return result

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys()
    for key in plain:
        torch.testing.assert_close(checkpointed[key], plain[key], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Safe files
# ---------------------------------------------------------------------------------------------


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_atomic_write_never_overwrites(tmp_path):
    target = tmp_path / "a.safetensors"
    safefile.atomic_write_safetensors(target, {"x": torch.ones(2)}, {"k": "v"})
    original = target.read_bytes()
    with pytest.raises(FileExistsError) as err:
        safefile.atomic_write_safetensors(target, {"x": torch.zeros(2)}, {})
    assert str(target) in str(err.value)
    assert target.read_bytes() == original
    assert _leftovers(tmp_path) == []
    safefile.atomic_write_safetensors(target, {"x": torch.zeros(2)}, {}, overwrite=True)
    assert target.read_bytes() != original
    assert _leftovers(tmp_path) == []


def test_atomic_write_creates_parents(tmp_path):
    target = tmp_path / "sub" / "deeper" / "b.safetensors"
    safefile.atomic_write_safetensors(target, {"x": torch.ones(1)})
    tensors, meta = lora.load_lora_file(target)
    assert torch.equal(tensors["x"], torch.ones(1)) and meta == {}


@pytest.mark.parametrize("failing", ["save_file", "fsync", "link_and_replace"])
def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch, failing):
    target = tmp_path / "c.safetensors"

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    if failing == "save_file":

        def partial_then_fail(tensors, filename, metadata=None):
            Path(filename).write_bytes(b"partial")
            raise OSError("disk full (simulated)")

        monkeypatch.setattr(safefile, "save_file", partial_then_fail)
    elif failing == "fsync":
        monkeypatch.setattr(safefile.os, "fsync", boom)
    else:
        monkeypatch.setattr(safefile.os, "link", boom)
        monkeypatch.setattr(safefile.os, "replace", boom)
    with pytest.raises(OSError, match="simulated"):
        safefile.atomic_write_safetensors(target, {"x": torch.ones(2)}, {})
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_without_hard_links_still_refuses_to_overwrite(tmp_path, monkeypatch):
    def no_links(*args, **kwargs):
        raise PermissionError("hard links not supported (simulated)")

    monkeypatch.setattr(safefile.os, "link", no_links)
    target = tmp_path / "d.safetensors"
    safefile.atomic_write_safetensors(target, {"x": torch.ones(2)})
    assert lora.load_lora_file(target)[0]["x"].shape == (2,)
    with pytest.raises(FileExistsError):
        safefile.atomic_write_safetensors(target, {"x": torch.ones(2)})
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("name", ["../../x", "/abs", "C:\\x", "c:x", "", "   ", "a/../../b", "..", "sub\\..\\..\\x", "./", "a\x00b"])
def test_safe_child_path_rejects_escapes(tmp_path, name):
    with pytest.raises(ValueError) as err:
        safefile.safe_child_path(tmp_path, name)
    assert str(err.value).startswith("filename")


def test_safe_child_path_accepts_plain_and_nested_names(tmp_path):
    assert safefile.safe_child_path(tmp_path, "my_lora.safetensors") == tmp_path.resolve() / "my_lora.safetensors"
    assert safefile.safe_child_path(tmp_path, "sub/my_lora") == tmp_path.resolve() / "sub" / "my_lora"
    assert safefile.safe_child_path(tmp_path, "sub\\my_lora") == tmp_path.resolve() / "sub" / "my_lora"


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
def test_safe_child_path_rejects_a_symlink_out(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    inside = tmp_path / "loras"
    inside.mkdir()
    (inside / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match="outside"):
        safefile.safe_child_path(inside, "link/x.safetensors")


def test_unique_path_counts_up(tmp_path):
    first = safefile.unique_path(tmp_path, "lora")
    assert first.name == "lora_00001_.safetensors"
    first.write_bytes(b"")
    assert safefile.unique_path(tmp_path, "lora").name == "lora_00002_.safetensors"
    assert safefile.unique_path(tmp_path, "sub/lora", "safetensors") == tmp_path.resolve() / "sub" / "lora_00001_.safetensors"
    with pytest.raises(ValueError, match="filename"):
        safefile.unique_path(tmp_path, "../escape")
