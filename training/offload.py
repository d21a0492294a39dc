"""CPU offload of the tensors a checkpointed unit keeps.

A checkpointed unit keeps only its inputs for backward. Non-reentrant ``torch.utils.checkpoint``
stores positional tensor inputs as saved tensors, so they pass through the saved-tensor hooks
that are active around the ``checkpoint`` call. :class:`CpuOffload` installs such hooks: pack
copies an accelerator tensor to (pinned) host memory, unpack brings it back when backward
recomputes the unit. Tensors already on the CPU, and small ones, stay where they are.

One activation is often an input of many units (the timestep embedding, the text context, the
rotary table): within one forward it is copied once and shared.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

DEFAULT_MIN_BYTES = 64 * 1024


@dataclass
class OffloadStats:
    tensors: int = 0  # tensors copied to the host
    bytes: int = 0  # bytes copied to the host
    shared: int = 0  # packs that reused a copy made earlier in the same forward
    restored: int = 0  # unpacks that copied a tensor back


class _HostCopy:
    __slots__ = ("device", "host")

    def __init__(self, device: torch.device, host: torch.Tensor) -> None:
        self.device = device
        self.host = host


def _is_accelerator_tensor(tensor: torch.Tensor) -> bool:
    return tensor.device.type not in ("cpu", "meta")


class CpuOffload:
    """Saved-tensor hooks that keep checkpoint inputs in host memory until backward needs them.

    ``should_offload`` decides per tensor (default: tensors on an accelerator); tests on a CPU
    machine pass ``lambda t: True`` to exercise the copy path.
    """

    def __init__(
        self,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        pin_memory: bool | None = None,
        should_offload: Callable[[torch.Tensor], bool] = _is_accelerator_tensor,
    ) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        self.min_bytes = min_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.should_offload = should_offload
        self.stats = OffloadStats()
        self._lock = threading.Lock()
        # id(tensor) -> (weakref, version, copy): lives for one forward (see new_forward).
        self._shared: dict[int, tuple[weakref.ref, int, _HostCopy]] = {}

    def new_forward(self) -> None:
        """Forget the copies shared within the previous forward."""
        with self._lock:
            self._shared.clear()

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> object:
        if not self.should_offload(tensor) or tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        key = id(tensor)
        with self._lock:
            entry = self._shared.get(key)
            if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
                self.stats.shared += 1
                return entry[2]
        pin = self.pin_memory and tensor.device.type == "cuda"
        # empty_like keeps the layout (channels-last too) of a dense tensor.
        host = torch.empty_like(tensor, device="cpu", pin_memory=pin)
        # non_blocking from device into pinned memory is ordered on the stream before any reuse
        # of the source block by the caching allocator, so the source may be freed right away.
        host.copy_(tensor.detach(), non_blocking=pin)
        copy = _HostCopy(tensor.device, host)
        with self._lock:
            self._shared[key] = (weakref.ref(tensor), tensor._version, copy)
            self.stats.tensors += 1
            self.stats.bytes += host.numel() * host.element_size()
        return copy

    def _unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        assert isinstance(packed, _HostCopy)
        with self._lock:
            self.stats.restored += 1
        if packed.device.type == "cpu":
            return packed.host.clone()
        return packed.host.to(packed.device, non_blocking=packed.host.is_pinned())

