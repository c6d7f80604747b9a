"""The quantities' values of a finished step, from one :class:`~avionics.quantities.StepData`.

In order (docs/cockpit.md, section 1): the step's data (the global gradient, the mean
gradient g), the captured step of the per-sample engine where some quantity asked for
per-sample statistics, each quantity's ``prepare`` (the directions it projects onto), the
merged request's statistics in one call, each quantity's ``sums`` added over the processes
in one packed all-reduce, and each quantity's ``compute``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from avionics.persample.request import MEAN_GRADIENT
from avionics.persample.step import factorable
from avionics.quantities.base import Parallel, StepData
from avionics.step.values import Batch, Combined, Entry


def compute(
    entry: Entry,
    active: list,
    request,
    combined: Combined,
    batch: Batch,
    *,
    model,
    params: list,
    names: list[str],
    engine,
    processes,
) -> dict[int, dict[str, Any]]:
    """The values of the step's ``active`` quantities, {step they belong to: {name: value}},
    of the tracked ``params`` of ``model`` (named ``names``), with the per-sample ``engine``,
    over the step's ``processes`` (:class:`~avionics.step.batch.OneProcess` or
    :class:`~avionics.step.parallel.DataParallel`)."""
    world = processes.world
    n, reduction = batch.size, entry.reduction
    grads = processes.gradients(combined, reduction, batch)
    mean_grad = grads if reduction == "mean" or n is None else [g / n for g in grads]
    data = StepData(
        step=entry.step,
        params=processes.parameters(),
        names=names,
        loss=batch.loss,
        info=entry.info,
        reduction=reduction,
        batch_size=n,
        individual_losses=combined.individual_losses,
        grads=grads,
        mean_grad=mean_grad,
        graph_grads=combined.graph,
        tracked=params,
        graph_leaves=processes.leaves() if processes.sharded else None,
        model=model,
        active=tuple(active),
        micro_batches=combined.micro_batches,
        parallel=Parallel(
            world=world,
            batch_sizes=batch.sizes,
            local_grads=processes.local_gradients(combined),
            sharded=processes.sharded,
            ranks=batch.ranks,
            layout=processes.layout if processes.sharded else None,
        ),
    )
    if combined.gradient_norms is not None and mean_grad is grads and world.size == 1:
        data.cache.g_norms = combined.gradient_norms  # (computed for the finiteness check)
    if request:
        data.captured = engine.step(
            combined.calls,
            batch.sizes[world.rank],
            combined.factor,
            gradients=combined.check,
            rtol=combined.check_rtol,
        )
    directions = {MEAN_GRADIENT: mean_grad}
    for q in active:
        directions.update(q.prepare(data))
    values: dict[int, dict[str, Any]] = defaultdict(dict)
    try:
        if request.asks_statistics:
            # the mean gradient is the mean of this process's g_n on one process only
            data.statistics = data.captured.statistics(
                request, directions, sample_mean=MEAN_GRADIENT if world.size == 1 else None
            )
            # keep only the rules that mean_gradient_factors reuses: the others hold
            # scaled copies of the step's output gradients
            data.captured.release_rules(keep=factorable)
        data.totals = processes.add({q.name: q.sums(data) for q in active})
        processes.agreed(data)  # the global loss, where it travelled with the sums
        for q in active:
            for s, value in q.compute(data).items():
                values[s][q.name] = value
    finally:
        if data.captured is not None:
            data.captured.release_rules()  # what quantities keep of it is theirs
    return values
