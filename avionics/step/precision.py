"""Precision: every statistic in float32 or better, whatever the forward and the backward ran in.

* A forward under autocast gives 16-bit losses, layer inputs and output gradients: the loss
  and the captured tensors are cast to float32 (:func:`at_least_float32`, :func:`in_float32`)
  and the values are computed outside any autocast region (:func:`without_autocast`).
* A backward of c * info["loss"] (``scaler.scale(loss).backward()``, ``(loss / k).backward()``)
  is measured by the gradient that arrives at ``info["loss"]`` (:func:`scale_recorder`) and
  divided out (:func:`unscaled`); a step whose gradients are not finite after a scaled backward
  is one ``torch.amp.GradScaler`` skips (:func:`all_finite`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from avionics.step.values import Part

LOW_PRECISION = (torch.float16, torch.bfloat16)


def at_least_float32(t: Tensor) -> Tensor:
    """``t`` in float32 where it is a 16-bit float (autocast), else itself."""
    return t.float() if t.dtype in LOW_PRECISION else t


def detached_losses(info: dict) -> Tensor | None:
    """``info["individual_losses"]``, detached, in float32 or better (None where absent)."""
    losses = info.get("individual_losses")
    return None if losses is None else at_least_float32(losses.detach())


def without_autocast(device_type: str):
    """No autocast region (the user's forward may have run in one, with the block inside):
    a region that disables it where it is enabled, else nothing."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.autocast(device_type, enabled=False)
    except RuntimeError:  # a device type without autocast
        pass
    return contextlib.nullcontext()


def scale_recorder(loss: Tensor, part: Part):
    """A hook on ``info["loss"]`` that keeps the gradient arriving there (c of a backward of
    c * loss), or None for a loss without graph."""
    if not loss.requires_grad:
        return None

    def record(grad):
        part.loss_gradient = grad.detach()

    return loss.register_hook(record)


def unscaled(t: Tensor | None, c: float) -> Tensor | None:
    """t / c (t itself for c = 1, and None for None)."""
    return t if t is None or c == 1 else t / c


def all_finite(gradients: list[Tensor | None]) -> bool:
    """Whether every gradient is finite (one host transfer)."""
    present = [g for g in gradients if g is not None]
    return bool(torch.stack(torch._foreach_norm(present)).isfinite().all()) if present else True


def check_inputs_unchanged(calls: dict, engine) -> None:
    """The captured layer inputs are as the forward left them (an in-place change after the
    forward would make every statistic wrong)."""
    for module, module_calls in calls.items():
        for call in module_calls:
            call.check_inputs_unchanged(engine.module_name(module))


def in_float32(calls: dict, engine) -> torch.dtype | None:
    """Cast the captured inputs and output gradients of 16-bit floats (a forward under
    autocast) to float32, in place, so that every statistic is computed in float32 or better;
    the lowest precision cast, or None."""
    cast = [
        t.dtype
        for module_calls in calls.values()
        for call in module_calls
        for t in [*call.inputs, *call.grad_outputs]
        if t is not None and t.dtype in LOW_PRECISION
    ]
    if not cast:
        return None
    check_inputs_unchanged(calls, engine)  # (the cast tensors are new)
    for module_calls in calls.values():
        for call in module_calls:
            call.args, call.kwargs = pytree.tree_map_only(
                Tensor, at_least_float32, (call.args, call.kwargs)
            )
            call.inputs = [at_least_float32(t) for t in call.inputs]
            call.input_versions = [t._version for t in call.inputs]
            call.grad_outputs = [
                g if g is None else at_least_float32(g) for g in call.grad_outputs
            ]
            for out in call.outputs:
                if out.dtype in LOW_PRECISION:
                    out.dtype = torch.float32
    return max(cast, key=lambda dtype: torch.finfo(dtype).eps)


def check_rtol(cast: torch.dtype | None) -> float | None:
    """The engine check's tolerance for statistics of tensors captured in ``cast``: the
    backward rounded each product to it."""
    return None if cast is None else 4 * torch.finfo(cast).eps
