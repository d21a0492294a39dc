"""Small plain-torch models for the core tests: the call patterns of real diffusion models.

``ToyDiT`` iterates a list of transformer blocks with keyword arguments, a shared context and a
``transformer_options`` dict it mutates between blocks (as ComfyUI's Flux does). ``ToyUNet``
iterates the layers of its sequentials itself (as ComfyUI's UNet does), so wrapping a
sequential has no effect. Each block carries a small trainable adapter; the base is frozen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Adapter(nn.Module):
    """A trainable low-rank residual, standing in for a LoRA (base weights frozen)."""

    def __init__(self, width: int, rank: int = 4) -> None:
        super().__init__()
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)
        nn.init.normal_(self.up.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class ToyBlock(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.ff1 = nn.Linear(width, 4 * width)
        self.ff2 = nn.Linear(4 * width, width)
        self.cross = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)
        self.adapter = Adapter(width)

    def forward(self, x, *, context, scale=(1.0, 1.0), transformer_options=None):
        options = transformer_options if transformer_options is not None else {}
        # Depends on the index the caller set before this block: recompute must see the same one.
        index_gain = 1.0 + 0.01 * options.get("block_index", 0)
        options["seen"] = options.get("seen", 0) + 1
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        x = x + self.proj(attn) * scale[0] * index_gain + self.adapter(x)
        x = x + self.cross(context.mean(dim=1, keepdim=True))
        h = self.dropout(F.gelu(self.ff1(self.norm2(x))))
        return x + self.ff2(h) * scale[1]


class ToyDiT(nn.Module):
    def __init__(self, width: int = 32, depth: int = 6, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList([ToyBlock(width, heads, dropout) for _ in range(depth)])
        self.head = nn.Linear(width, width)

    def forward(self, x, context, transformer_options=None):
        options = transformer_options if transformer_options is not None else {}
        h = self.embed(x)
        for index, block in enumerate(self.blocks):
            options["block_index"] = index
            h = block(h, context=context, scale=(1.0, 0.5), transformer_options=options)
        return self.head(h)


class ToyResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.adapter = nn.Conv2d(channels, channels, 1, bias=False)
        nn.init.normal_(self.adapter.weight, std=0.02)

    def forward(self, x, emb):
        h = self.conv1(F.silu(self.norm(x))) + emb[:, :, None, None]
        return x + self.conv2(F.silu(h)) + self.adapter(x)


class ToyUNet(nn.Module):
    """Iterates the layers of each sequential itself, like ComfyUI's forward_timestep_embed."""

    def __init__(self, channels: int = 8, levels: int = 3) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(4, channels, 3, padding=1)
        self.time = nn.Linear(1, channels)
        self.input_blocks = nn.ModuleList(
            [nn.Sequential(ToyResBlock(channels), ToyResBlock(channels)) for _ in range(levels)]
        )
        self.conv_out = nn.Conv2d(channels, 4, 3, padding=1)

    def forward(self, x, t):
        emb = self.time(t[:, None])
        h = self.conv_in(x)
        for sequential in self.input_blocks:
            for layer in sequential:  # the sequential's own forward is never called
                h = layer(h, emb)
        return self.conv_out(h)


def freeze_base(model: nn.Module) -> list[nn.Parameter]:
    """Freeze everything but the adapters; return the adapter parameters."""
    trainable = []
    for name, parameter in model.named_parameters():
        is_adapter = ".adapter." in f".{name}"
        parameter.requires_grad_(is_adapter)
        if is_adapter:
            trainable.append(parameter)
    return trainable


def make_toy_dit(seed: int = 0, **kwargs) -> ToyDiT:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = ToyDiT(**kwargs)
    freeze_base(model)
    return model


def toy_dit_batch(seed: int = 1, batch: int = 2, tokens: int = 64, width: int = 32, context_tokens: int = 8):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, width, generator=generator)
    context = torch.randn(batch, context_tokens, width, generator=generator)
    return x, context


class ToyLatentDenoiser(nn.Module):
    """A tiny DiT over latent pixels: (B, C, H, W) + sigma + per-image context -> (B, C, H, W)."""

    def __init__(self, channels: int = 4, width: int = 32, depth: int = 4, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.inp = nn.Linear(channels, width)
        self.sigma_embed = nn.Linear(1, width)
        self.blocks = nn.ModuleList([ToyBlock(width, heads, dropout) for _ in range(depth)])
        self.out = nn.Linear(width, channels)

    def forward(self, x, sigma, context, transformer_options=None):
        b, c, h, w = x.shape
        tokens = self.inp(x.flatten(2).transpose(1, 2)) + self.sigma_embed(sigma.reshape(b, 1, 1).log())
        options = transformer_options if transformer_options is not None else {}
        for index, block in enumerate(self.blocks):
            options["block_index"] = index
            tokens = block(tokens, context=context, transformer_options=options)
        return self.out(tokens).transpose(1, 2).reshape(b, c, h, w)


def make_toy_denoiser(seed: int = 0, **kwargs) -> ToyLatentDenoiser:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = ToyLatentDenoiser(**kwargs)
    model.requires_grad_(False)
    return model
