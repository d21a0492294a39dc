"""Training through model code that updates activations in place.

Inference code often writes residual updates as augmented assignments, ``x += f(norm(x))``: an
in-place add on a tensor that ``norm`` saved for backward. Under inference that is free memory;
under training, once ``x`` needs a gradient (any adapter upstream), autograd refuses it
("a variable needed for gradient computation has been modified by an inplace operation").
ComfyUI's Flux blocks (and others) do exactly this.

:func:`out_of_place_updates` turns such *augmented assignments* into their out-of-place form
while gradients are on. That includes tensors that need no gradient: a checkpointed block must
not change its inputs either, since recompute reads them again. Only augmented assignments, which
rebind their target (``x = x + y``), are changed: the Python instruction that called the
operator is checked, so an explicit ``out.add_(y)`` whose result is ignored keeps its in-place
meaning. Values are unchanged; only the aliasing of the old tensor is.

Checkpoint recompute runs in backward, outside the trainer's ``with``: the checkpointing engine
re-enters these updates for the recompute of a forward that ran under them (see :func:`active`).
"""

from __future__ import annotations

import contextlib
import dis
import sys
import threading
import weakref
from types import CodeType
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_IN_PLACE = {
    torch.Tensor.add_: torch.add,
    torch.Tensor.sub_: torch.sub,
    torch.Tensor.mul_: torch.mul,
    torch.Tensor.div_: torch.div,
}
_state = threading.local()
_augmented_offsets: "weakref.WeakKeyDictionary[CodeType, frozenset[int]]" = weakref.WeakKeyDictionary()
_offsets_lock = threading.Lock()


def _augmented(code: CodeType) -> frozenset[int]:
    """Byte offsets of the augmented-assignment instructions of ``code`` (cached)."""
    with _offsets_lock:
        found = _augmented_offsets.get(code)
        if found is None:
            found = frozenset(
                instruction.offset
                for instruction in dis.get_instructions(code)
                if instruction.opname.startswith("INPLACE_")  # Python 3.10
                or (instruction.opname == "BINARY_OP" and str(instruction.argrepr).endswith("="))
            )
            _augmented_offsets[code] = found
        return found


def _called_by_augmented_assignment(depth: int) -> bool:
    frame = sys._getframe(depth)
    return frame.f_lasti in _augmented(frame.f_code)


class _OutOfPlaceUpdates(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        replacement = _IN_PLACE.get(func)
        if (
            replacement is not None
            and torch.is_grad_enabled()
            and args
            and isinstance(args[0], torch.Tensor)
            and _called_by_augmented_assignment(2)
        ):
            return replacement(*args, **kwargs)
        return func(*args, **kwargs)


def active() -> bool:
    """Whether the calling thread is inside :func:`out_of_place_updates`."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def out_of_place_updates(enabled: bool = True) -> Iterator[None]:
    if not enabled:
        yield
        return
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with _OutOfPlaceUpdates():
            yield
    finally:
        _state.depth -= 1


def same_as_forward(was_active: bool) -> Any:
    """The context a recompute needs to run as its forward did."""
    return out_of_place_updates() if was_active else contextlib.nullcontext()
