"""Ranks: the per-rank view of a data-parallel step, each process's own loss, gradient norm,
batch size and time, to find a straggler or a shard unlike the others."""

from __future__ import annotations

import torch

from avionics.quantities.base import Quantity, StepData
from avionics.quantities.outputs import TENSORS

FIELDS = ("loss", "grad_norm", "batch_size", "step_time")


class Ranks(Quantity):
    """Per process r, in rank order, of its own shard of the step (N_r samples):

    * ``loss``: L_r, its loss as the user reduced it (``info["loss"]`` on that process; for
      accumulated micro-batches of a mean-reduced loss, sum_i N_ri L_ri / N_r);
    * ``grad_norm``: ||g_r||, g_r = (1/N_r) sum_{n in shard r} g_n the gradient of its shard's
      mean loss (before any all-reduce: the gradient that process alone would have);
    * ``batch_size``: N_r;
    * ``step_time``: the seconds from the end of its previous ``with cockpit(...)`` block to
      its first agreement of this step (when its backward starts): its optimizer
      step, data loading and forward, the part of a step that no collective waits in (the
      backward's all-reduces make every process wait for the slowest). Host time: on a GPU,
      the time to launch that work unless the loop synchronises.

    Stored as ``{"loss": [...], "grad_norm": [...], "batch_size": [...], "step_time":
    [...]}``, lists of one number per process. The losses, sizes and times travel in the
    collectives every tracked step of several processes makes anyway (the agreement of
    :class:`~avionics.step.parallel.Agreement`); the gradient norms add one number per process
    to the step's packed all-reduce. With one process: lists of one, ``step_time`` None.
    """

    output = TENSORS

    def sums(self, data: StepData):
        """Every process's ||g_r||^2 in its own slot (the slots summed over the processes
        hold all of them)."""
        own = data.parallel.local_grads if data.parallel.local_grads is not None else data.grads
        # (the norm accumulates in float64 without a float64 copy of the gradient)
        norm = torch.linalg.vector_norm
        square = sum(norm(g.detach(), dtype=torch.float64).square() for g in own)
        if data.reduction == "sum" and data.parallel.batch_sizes[data.parallel.world.rank]:
            square = square / data.parallel.batch_sizes[data.parallel.world.rank] ** 2
        return {"squared_norms": data.parallel.world.slots(square.reshape(()))}

    def compute(self, data: StepData):
        norms = data.totals[self.name]["squared_norms"].sqrt().tolist()
        if data.parallel.ranks is None:  # one process
            value = dict(zip(FIELDS, ([float(data.loss)], norms, [data.batch_size], [None])))
            return {data.step: value}
        sizes, losses, seconds = data.parallel.ranks.unbind(1)
        value = {
            "loss": losses.tolist(),
            "grad_norm": norms,
            "batch_size": [int(s) for s in sizes.tolist()],
            "step_time": seconds.tolist(),
        }
        return {data.step: value}
