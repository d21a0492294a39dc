"""Training data and a batch order that is a pure function of (seed, micro-batch number).

Images are grouped into buckets by latent shape (a batch needs one shape). Each epoch shuffles
every bucket, cuts it into micro-batches and shuffles the order of those micro-batches; epoch
``e`` is drawn from a generator seeded by ``(seed, e)``. Noise and noise levels of each sample are
drawn from a generator seeded by ``(seed, epoch, image)``. So:

* a run resumed at step N continues exactly as an uninterrupted run would (nothing to save but
  the step), and the same seed gives the same batches whatever ran before in the process;
* ``k`` accumulated micro-batches of ``b`` images see the same samples, noise and levels as one
  batch of ``k * b`` when the epoch holds ``k * b`` images.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import torch


def derive_seed(seed: int, *parts: int | str) -> int:
    """A 63-bit seed from the user's seed and labels, stable across runs and platforms."""
    text = ":".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def generator_for(seed: int, *parts: int | str) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, *parts))


@dataclass(frozen=True)
class MicroBatch:
    epoch: int
    bucket: tuple[int, ...]  # the latent shape of the images in it
    indices: tuple[int, ...]  # image indices into the dataset


@dataclass(frozen=True)
class TrainingData:
    """Latents, one per image (``(C, H, W)``, or ``(C, T, H, W)`` for video), and how many
    conditionings were given for them (one per image, or one for all)."""

    latents: tuple[torch.Tensor, ...]
    conditioning_count: int
    buckets: dict[tuple[int, ...], tuple[int, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.latents) == 0:
            raise ValueError("latents is empty: give at least one image latent to train on")
        for index, latent in enumerate(self.latents):
            if not isinstance(latent, torch.Tensor) or latent.ndim < 3:
                raise ValueError(
                    f"latents[{index}] must be a tensor of shape (C, H, W) or (C, T, H, W), got "
                    f"{getattr(latent, 'shape', type(latent).__name__)}"
                )
            if not latent.is_floating_point() or not torch.isfinite(latent).all():
                raise ValueError(f"latents[{index}] must hold finite floating-point values")
        if self.conditioning_count not in (1, len(self.latents)):
            raise ValueError(
                f"conditioning has {self.conditioning_count} entries but there are {len(self.latents)} "
                "latents: give one conditioning per image (in the same order), or a single one for all"
            )
        buckets: dict[tuple[int, ...], list[int]] = {}
        for index, latent in enumerate(self.latents):
            buckets.setdefault(tuple(latent.shape), []).append(index)
        object.__setattr__(self, "buckets", {shape: tuple(ids) for shape, ids in buckets.items()})

    @classmethod
    def from_batches(cls, batches: Sequence[torch.Tensor], conditioning_count: int) -> "TrainingData":
        """From latent batches ``(B, C, H, W)`` as the host's LATENT holds them."""
        latents = tuple(sample for batch in batches for sample in batch)
        return cls(latents, conditioning_count)

    def condition_index(self, image: int) -> int:
        return 0 if self.conditioning_count == 1 else image

    def micro_batches_per_epoch(self, batch_size: int) -> int:
        return sum(-(-len(ids) // batch_size) for ids in self.buckets.values())

    def epoch_order(self, seed: int, epoch: int, batch_size: int) -> list[MicroBatch]:
        generator = generator_for(seed, "epoch", epoch)
        batches: list[MicroBatch] = []
        for shape in sorted(self.buckets):
            ids = self.buckets[shape]
            order = torch.randperm(len(ids), generator=generator).tolist()
            shuffled = [ids[i] for i in order]
            for start in range(0, len(shuffled), batch_size):
                batches.append(MicroBatch(epoch, shape, tuple(shuffled[start : start + batch_size])))
        order = torch.randperm(len(batches), generator=generator).tolist()
        return [batches[i] for i in order]

    def micro_batch(self, seed: int, number: int, batch_size: int) -> MicroBatch:
        """The ``number``-th micro-batch (0-based) of the whole run."""
        per_epoch = self.micro_batches_per_epoch(batch_size)
        epoch, position = divmod(number, per_epoch)
        return self.epoch_order(seed, epoch, batch_size)[position]

    def stacked(self, batch: MicroBatch, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return torch.stack([self.latents[i] for i in batch.indices]).to(device=device, dtype=dtype)
