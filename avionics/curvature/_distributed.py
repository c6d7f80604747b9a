"""Curvature operators over a data set sharded across torch.distributed processes.

With ``distributed`` on, process r holds the shard D_r of the data set D = D_0 + ... + D_{R-1}
(its batches, in rank order), and the operator is that of D. Every operator of (1) in
:mod:`avionics.curvature._data` is a sum over batches, so it splits over the shards,

    A = sum_b w_b A_b = sum_r ( sum_{b in D_r} w_b A_b ),   w_b = B_b / N  or  1,

with N the size of D: each process sums its own batches, and one ``all_reduce`` adds the
processes' sums (:func:`avionics.distributed.sum_over_processes`, one packed buffer). Every
process gets the same bytes back, so an algorithm run on every process with the same seed makes
the same decisions on every process.

A process whose share raises (a pass with other samples than counted, its determinism check)
must not leave the others waiting in an ``all_reduce`` it never joins: every collective here
carries a failure flag per process, and all processes raise together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from avionics.distributed import SINGLE, World, current_world, sum_over_processes


def data_world(distributed, owner: str) -> World:
    """The processes whose shards make up the data set: :data:`SINGLE` (the data is all there
    is) for ``distributed=False``, or for ``None`` when torch.distributed is not initialised or
    has one process; else the default process group's world.

    Raises a ValueError for a ``distributed`` that is not None or a bool, and for True when
    torch.distributed is not initialised.
    """
    if distributed is not None and not isinstance(distributed, bool):
        raise ValueError(
            f"{owner}: distributed must be None, True or False, got {distributed!r} (a "
            f"{type(distributed).__name__}); pass None (a shard of the data set when "
            "torch.distributed is initialised with several processes), True (a shard: "
            "torch.distributed must be initialised) or False (this process's data alone)."
        )
    if distributed is False:
        return SINGLE
    if distributed and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{owner}: distributed=True makes data this process's shard of the data set, but "
            "torch.distributed is not initialised; call torch.distributed.init_process_group() "
            "first (torchrun sets up its environment), or pass distributed=False for this "
            "process's data alone."
        )
    return current_world()


def refuse_distributed(distributed, owner: str, why: str) -> None:
    """Refuse ``distributed`` other than None or False for an operator whose space is this
    process's samples (``why`` says so and what to use instead)."""
    if distributed is not None and distributed is not False:
        raise ValueError(
            f"{owner}: distributed must be None or False (both keep the operator on this "
            f"process's data), got {distributed!r}: {why}"
        )


def sum_on_every_process(
    compute: Callable[[], list[Tensor]],
    shapes: Sequence[Sequence[int]],
    world: World,
    device: torch.device,
    owner: str,
    what: str,
) -> list[Tensor]:
    """``compute()`` summed over the processes by one ``all_reduce``, or, when it raises on
    any process, an error on every process.

    ``shapes`` are those of the tensors ``compute`` returns: a process whose ``compute`` raises
    takes part with zeros of them and a failure flag in its own slot, then raises its own
    error; the others raise a RuntimeError that names it. The collective runs on ``device``
    (the operator's: a GPU for NCCL). With one process: ``compute()``.
    """
    if world.size == 1:
        return compute()
    try:
        local, error = compute(), None
    except Exception as caught:  # re-raised below, after the collective every process joins
        local = [torch.zeros(shape, dtype=torch.float64, device=device) for shape in shapes]
        error = caught
    failed = world.slots(torch.tensor(float(error is not None), device=device))
    *summed, failures = sum_over_processes([*local, failed], world)
    if error is not None:
        raise error
    failed_ranks = failures.nonzero().flatten().tolist()
    if failed_ranks:
        raise RuntimeError(
            f"{owner}: process(es) {failed_ranks} raised during the {what} (their own error "
            "says why), so this process stops with them; nothing was changed. Fix the data or "
            "model on those processes."
        )
    return summed
