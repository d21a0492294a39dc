"""Making the host's inference-only kernels differentiable, so every architecture can train.

ComfyUI 0.8.0 computes rotary embeddings (Flux, Chroma, HunyuanVideo, Qwen-Image, Lumina, ...)
with comfy-kitchen's ``comfy_kitchen::apply_rope`` / ``apply_rope1`` custom ops, which have no
autograd formula: backward through them raises "no autograd formula was registered". RoPE is a
fixed 2x2 linear map per channel pair (``out = F @ x`` with ``F = freqs_cis[..., :, :]``), so its
backward is the same op with ``F`` transposed. We register that formula for an op only when a
test call shows it has none: the forward is untouched, and a comfy-kitchen that ships its own
formula keeps it.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)
_lock = threading.Lock()
_checked = False


def _transposed(freqs_cis: torch.Tensor) -> torch.Tensor:
    return freqs_cis.transpose(-1, -2).contiguous()


def _freqs_grad(grad: torch.Tensor, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    # out[..., i] = sum_j F[..., i, j] * x[..., j] over channel pairs: dF[i, j] = g_i * x_j.
    pairs = grad.float().reshape(*grad.shape[:-1], -1, 2)
    values = x.float().reshape(*x.shape[:-1], -1, 2)
    outer = pairs.unsqueeze(-1) * values.unsqueeze(-2)
    return outer.sum_to_size(freqs_cis.shape).to(freqs_cis.dtype)


def _register_rope(ops) -> None:
    def setup_two(ctx, inputs, output):
        xq, xk, freqs_cis = inputs
        ctx.save_for_backward(xq, xk, freqs_cis)

    def backward_two(ctx, grad_q, grad_k):
        xq, xk, freqs_cis = ctx.saved_tensors
        back = _transposed(freqs_cis)
        gq, gk = ops.apply_rope(grad_q.contiguous(), grad_k.contiguous(), back)
        gf = None
        if ctx.needs_input_grad[2]:
            gf = _freqs_grad(grad_q, xq, freqs_cis) + _freqs_grad(grad_k, xk, freqs_cis)
        return gq.to(xq.dtype), gk.to(xk.dtype), gf

    def setup_one(ctx, inputs, output):
        x, freqs_cis = inputs
        ctx.save_for_backward(x, freqs_cis)

    def backward_one(ctx, grad):
        x, freqs_cis = ctx.saved_tensors
        gx = ops.apply_rope1(grad.contiguous(), _transposed(freqs_cis))
        gf = _freqs_grad(grad, x, freqs_cis) if ctx.needs_input_grad[1] else None
        return gx.to(x.dtype), gf

    torch.library.register_autograd("comfy_kitchen::apply_rope", backward_two, setup_context=setup_two)
    torch.library.register_autograd("comfy_kitchen::apply_rope1", backward_one, setup_context=setup_one)


def _rope_has_autograd(ops) -> bool:
    try:
        # Nodes run under inference mode: the probe tensors must be made outside it.
        with torch.inference_mode(False), torch.enable_grad():
            q = torch.randn(1, 1, 2, 4, requires_grad=True)
            freqs = torch.randn(1, 1, 2, 2, 2, 2)
            out_q, out_k = ops.apply_rope(q, q, freqs)
            (out_q.sum() + out_k.sum()).backward()
    except RuntimeError as error:
        if "autograd" in str(error):
            return False
        raise
    return True


def enable_training_kernels() -> None:
    """Idempotent; call before training on a host model."""
    global _checked
    with _lock:
        if _checked:
            return
        try:
            import comfy.quant_ops  # noqa: F401  (imports comfy-kitchen, which defines the ops)
        except ImportError:
            pass
        _checked = True
        ops = getattr(torch.ops, "comfy_kitchen", None)
        if ops is None or not hasattr(ops, "apply_rope") or not hasattr(ops, "apply_rope1"):
            return
        try:
            if _rope_has_autograd(ops):
                return
        except Exception as error:  # an op that cannot even run here is not ours to fix
            log.warning("could not check comfy_kitchen::apply_rope for autograd: %s", error)
            return
        _register_rope(ops)
        log.info("registered the backward of comfy_kitchen::apply_rope/apply_rope1 (rotary embeddings) for training")
