"""One batch (micro_batches == 1), and the step on one process: the plain step's straight path.

The backward's gradients are recorded by hooks on the tracked parameters where ``p.grad`` will
not hold them as the backward made them (:func:`record_gradients`); the step's one batch is
its :class:`~avionics.step.values.Combined` (:func:`one_batch`); on one process the global
batch is the local one (:class:`OneProcess`; :class:`~avionics.step.parallel.DataParallel`
under data parallelism).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from avionics.distributed import World
from avionics.persample.calls import detached
from avionics.step.precision import (
    all_finite,
    detached_losses,
    unscaled,
)
from avionics.step.transfer import finiteness
from avionics.step.values import Batch, Combined, Part


def local(tensor: Tensor) -> Tensor:
    """This process's part of a (sharded) parameter or gradient."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def zeros_where_none(tensors, params) -> list[Tensor]:
    """``tensors``, with zeros of the (local) parameter's shape where one is None."""
    return [
        t if t is not None else torch.zeros_like(local(p))
        for t, p in zip(tensors, params, strict=True)
    ]


def record_gradients(part: Part, params: list, copy: bool, graph: bool) -> list:
    """Hooks that keep in ``part.gradients`` (and, with ``graph``, ``part.graph``) the
    gradient each parameter receives in the backward: copied with ``copy`` (DDP may overwrite
    the tensor its hook saw with the average, and a later micro-batch's backward adds into
    it). Returns the hooks' handles."""
    part.gradients = [None] * len(params)
    part.graph = [None] * len(params) if graph else None
    return [p.register_hook(_store(part, k, copy)) for k, p in enumerate(params)]


def record_fresh_gradients(part: Part, params: list) -> list:
    """:func:`record_gradients` for one batch on one process (no copies, no graph), where
    ``p.grad`` may hold an earlier backward's gradient. Where every tracked ``p.grad`` is
    None as the backward begins (``optimizer.zero_grad()``'s default), ``p.grad`` after it is
    the backward's gradient itself: nothing is hooked (``part.grads_fresh``), and the step
    reads ``p.grad`` (:func:`one_batch`). Returns the hooks' handles."""
    if all(p.grad is None for p in params):
        part.grads_fresh = True
        return []
    return record_gradients(part, params, False, False)


def _store(part: Part, k: int, copy: bool):
    def store(grad):
        part.gradients[k] = grad.detach().clone() if copy else grad.detach()
        if part.graph is not None:  # (a backward with create_graph adds out of place)
            part.graph[k] = grad

    return store


def one_batch(part: Part, params: list, graph: bool, several: bool) -> Combined:
    """The step's one batch: its loss, gradients (the backward scale c divided out; with
    ``graph`` also with their graph, for the curvature quantities) and captured calls.
    ``several``: under data parallelism, where ``p.grad`` may hold DDP's average. c and, on
    one process, whether the loss and the gradients are finite are read in one host
    transfer (:func:`read_after_backward`)."""
    # p.grad with one process; under data parallelism what this process's backward gave
    # each parameter (DDP's average is in p.grad)
    raw = part.gradients
    if raw is None or not several:
        raw = [detached(local(p.grad)) if p.grad is not None else None for p in params]
    c, loss_finite, gradients_finite, norms = read_after_backward(part, raw, several)
    gradients = [unscaled(g, c) for g in raw]
    # (the engine casts captured 16-bit tensors to float32 itself, with the check's rtol)
    calls = part.capture.calls_by_module() if part.capture is not None else None
    return Combined(
        single=True,
        scale=c,
        loss=part.loss,
        n=part.n,
        individual_losses=detached_losses(part.info),
        gradients=gradients,
        # (the gradients with their graph: p.grad, or where the hooks kept them (FSDP's
        # unsharded parameters, whose p.grad is the reduce-scattered shard) theirs
        graph=[unscaled(g, c) for g in _with_graph(part, params)] if graph else gradients,
        calls=calls,
        # a mean-reduced loss backpropagates c dl_n/dout / N: the factor N / c undoes it
        factor=None if part.n is None else (part.n if part.reduction == "mean" else 1) / c,
        check=raw if part.grads_fresh else part.gradients,
        check_rtol=None,
        unsynced=raw,
        loss_finite=loss_finite,
        gradients_finite=gradients_finite,
        # the check's norms are the gradients' own where the backward had no scale
        gradient_norms=norms if c == 1 else None,
    )


def _with_graph(part: Part, params: list) -> list:
    """The gradients with their graph, as the hooks kept them, else ``p.grad``."""
    return part.graph if part.graph is not None else [p.grad for p in params]


def read_after_backward(part: Part, raw: list, several: bool):
    """(c, whether the loss is finite, whether the gradients ``raw`` as backpropagated are
    finite, their norms [||raw_k||] where every parameter has one), in one host transfer;
    the finiteness and norms on one process only (None under data parallelism, where the
    processes decide it together)."""
    scalars = [] if part.loss_gradient is None else [part.loss_gradient.reshape(())]
    present = [g for g in raw if g is not None]
    norms = None
    if not several:
        # the loss itself and a number finite where every norm is (read as float64: finite
        # where they are)
        scalars.append(detached(part.loss).reshape(()))
        if present:
            norms = torch.stack(torch._foreach_norm(present))
            scalars.append(finiteness(norms))
    if not scalars:
        return 1.0, None, None, None
    device = scalars[0].device
    read = torch.stack([s.to(device, torch.float64) for s in scalars]).tolist()
    c = part.scale(read.pop(0)) if part.loss_gradient is not None else 1.0
    if several:
        return c, None, None, None
    whole = norms if len(present) == len(raw) else None
    return c, math.isfinite(read[0]), math.isfinite(read[1]) if present else True, whole


def settled(batch: Batch, combined: Combined) -> Batch:
    """``batch`` with whether its loss is finite: as read after the backward (one batch on
    one process), or read now."""
    if batch.finite is not None:
        return batch
    finite = combined.loss_finite
    if finite is None:
        finite = bool(torch.isfinite(batch.loss))
    return dataclasses.replace(batch, finite=finite)


def with_finiteness(batch: Batch) -> Batch:
    """``batch`` with whether its loss is finite, read now (where a check before the backward
    depends on it)."""
    if batch.finite is not None:
        return batch
    return dataclasses.replace(batch, finite=bool(torch.isfinite(batch.loss)))


class OneProcess:
    """The step on one process: the global batch is this process's. The same methods as
    :class:`~avionics.step.parallel.DataParallel`, each the identity."""

    sharded = False

    def __init__(self, params: list, world: World):
        self.params, self.world = params, world

    def parameters(self) -> list[Tensor]:
        """The tracked parameters' values, detached."""
        return [p.detach() for p in self.params]

    def batch(self, loss: Tensor, reduction: str, n: int | None) -> Batch:
        """The step's loss and batch size; whether the loss is finite is read after the
        backward, with its scale (:func:`settled`), or where a check before the backward needs
        it (:func:`with_finiteness`)."""
        return Batch(loss, n, (n,), None)

    def gradients(self, combined: Combined, reduction: str, batch: Batch) -> list[Tensor]:
        """The gradient of the loss, per tracked parameter (zeros where none arrived)."""
        return zeros_where_none(combined.gradients, self.params)

    def local_gradients(self, combined: Combined) -> None:
        """No gradient of the process's own loss apart from the global one."""
        return None

    def finite(self, gradients: list[Tensor | None]) -> bool:
        """Whether the gradients are finite (one host transfer; one batch reads it with the
        scale: :attr:`Combined.gradients_finite`)."""
        return all_finite(gradients)

    def add(self, sums: dict) -> dict:
        """The quantities' sums (nothing to add)."""
        return sums

    def agreed(self, data) -> None:
        """Nothing learnt from other processes."""

    def average_unsynced(self, gradients) -> None:
        """Nothing to average."""

    def no_sync(self, needed: bool) -> None:
        """No DDP to keep from synchronising."""
