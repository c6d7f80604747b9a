"""The values that pass between a tracked step's stages (see :mod:`avionics.step`).

The bottom of the package: it imports none of the stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

from avionics.persample import Request

if TYPE_CHECKING:
    from avionics.quantities.base import MicroBatch


@dataclass(frozen=True)
class Batch:
    """The step's batch over every process: the loss as reduced, N (None when unknown), N_r
    per process, and whether every process's loss is finite (None on one process until it is
    read, with the backward's scale); under data parallelism ``ranks``, per process (N_r, its
    loss L_r as reduced, the seconds its blocks took from the end of the block before to their
    first agreement), [W, 3] float64."""

    loss: Tensor
    size: int | None
    sizes: tuple
    finite: bool | None
    ranks: Tensor | None = None


@dataclass
class Entry:
    """A step as it entered its block, after every check: micro-batch ``index`` of ``k``,
    the quantities active at it and their merged request, and, where some are active, the
    loss (float32 or better), its reduction, N_i, the global batch (of one batch; None for
    micro-batches, known when the last ends) and whether the loss is finite. ``parts`` are
    the step's earlier micro-batches."""

    step: int
    info: dict
    index: int
    k: int
    active: list
    parts: list[Part] = field(default_factory=list)
    request: Request = field(default_factory=Request)
    reduction: str = "mean"
    n: int | None = None
    loss: Tensor | None = None
    batch: Batch | None = None
    finite: bool = True
    # under data parallelism, the cockpit's own error found on entering (raised with every
    # process's, when the block ends: :class:`~avionics.step.parallel.Agreement`)
    failure: Exception | None = None
    single: bool = field(init=False)  # the step is one batch (micro_batches == 1)
    last: bool = field(init=False)  # this is the step's last micro-batch

    def __post_init__(self):
        self.single, self.last = self.k == 1, self.index == self.k - 1


@dataclass
class Part:
    """One micro-batch of a step, as its block left it: its info, reduction, N_i and loss,
    its capture (None when nothing was captured), the gradient each parameter received in
    its backward (``gradients``, detached; ``graph`` with its graph, for the curvature
    quantities), the gradient that arrived at its ``info["loss"]``, and under data
    parallelism every process's row of its agreement (``ranks``,
    :class:`~avionics.step.parallel.Agreement`)."""

    info: dict
    reduction: str
    n: int | None
    loss: Tensor
    capture: Any
    gradients: list[Tensor | None] | None = None
    graph: list[Tensor | None] | None = None
    loss_gradient: Tensor | None = None
    ranks: Tensor | None = None
    # one batch on one process whose every tracked p.grad was None as its backward began:
    # p.grad is what the backward gave (no hook recorded ``gradients``; record_fresh_gradients)
    grads_fresh: bool = False

    def scale(self, read: float | None = None) -> float:
        """c: the backward was of c * info["loss"] (1 where no gradient reached the loss, as
        in a backward of another tensor); ``read``: its value as read with the step's other
        numbers (else it is read here)."""
        if self.loss_gradient is None:
            return 1.0
        c = float(self.loss_gradient.reshape(())) if read is None else read
        if not c > 0:
            raise ValueError(
                f"The backward was of {c:g} * info['loss']: backpropagate a positive multiple "
                "of info['loss'] (loss.backward(), (loss / k).backward(), "
                "scaler.scale(loss).backward())."
            )
        return c


@dataclass
class Accumulation:
    """The micro-batches of ``step`` seen so far: 0, ..., ``index`` of ``k``, and what the
    capture of the next one's forward is armed for."""

    step: int
    k: int
    index: int
    active: list
    parts: list[Part]
    request: Request


@dataclass
class Combined:
    """A step's micro-batches as one batch (:func:`avionics.step.batch.one_batch`,
    :func:`avionics.step.accumulation.accumulated`): the local loss, N, per-sample losses and
    gradients (of the loss itself: the backward scale divided out), the gradients with their
    graph, the captured calls and their output-gradient factor, the engine check's gradients
    (``check`` times ``factor`` is sum_n g_n) and its tolerance, the gradients as
    backpropagated (what DDP would average), and, where they were read with the scale (one
    batch on one process), whether the loss and the gradients are finite and, without a
    scale, the gradients' norms [||g^(k)||] (read for the finiteness; shared with the
    quantities)."""

    single: bool
    scale: float
    loss: Tensor
    n: int | None
    individual_losses: Tensor | None
    gradients: list[Tensor | None]
    graph: list[Tensor | None]
    calls: dict | None
    factor: float | None
    check: list[Tensor | None] | None
    check_rtol: float | None
    unsynced: list[Tensor | None]
    micro_batches: list[MicroBatch] | None = None
    scaled: bool | None = None
    loss_finite: bool | None = None
    gradients_finite: bool | None = None
    gradient_norms: Tensor | None = None

    def __post_init__(self):
        if self.scaled is None:
            self.scaled = self.scale != 1
