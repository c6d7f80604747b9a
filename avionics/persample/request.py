"""What quantities ask of the per-sample gradients, and what the engine hands back.

Notation (docs/definitions.md, section 1): g_n is the gradient of the loss l_n of sample n,
for one parameter at a time; the engine never holds all g_n of the network at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

# The direction named "grad" is the step's mean gradient g (of the global batch), which the
# cockpit supplies to every quantity that names it.
MEAN_GRADIENT = "grad"


@dataclass(frozen=True)
class OuterProducts:
    """Per-sample gradients g_n = delta_n x_n^T of a run of samples, not multiplied out:
    ``delta`` [n, O], ``x`` [n, I] (a Linear weight [O, I] without shared axes)."""

    delta: Tensor
    x: Tensor

    @property
    def device(self) -> torch.device:
        return self.delta.device

    def materialize(self) -> Tensor:
        """g as a tensor [n, O, I]."""
        return self.delta[:, :, None] * self.x[:, None, :]

    def abs_max(self) -> Tensor:
        """max_{n,o,i} |delta_{n,o} x_{n,i}| = max_n max_o |delta_{n,o}| max_i |x_{n,i}|
        (rounding is monotone, so this is the largest product exactly)."""
        d = self.delta.abs().amax(1)
        return (d * self.x.abs().amax(1)).amax() if len(d) else d.new_zeros(())


# visitor(parameter_index, chunk): chunk[i] = g_{start + i} for a run of consecutive samples,
# a tensor [n, *parameter shape] or, where a rule can give it, the factors of the outer
# products (only the histograms visit, and they accept both).
Visitor = Callable[[int, "Tensor | OuterProducts"], None]

# output_visitor(module, output, batch_axis) -> summary or None: called at forward time, under
# torch.no_grad, with every module call of the captured forward, its output (a tensor or a
# tree of them) and the axis of the batch in it. The summary (small tensors) is kept with the
# forward's root call (ModuleCall.summaries); the output itself is not.
OutputVisitor = Callable[[nn.Module, Any, int], Any]


@dataclass(frozen=True)
class Request:
    """The per-sample statistics one step needs; requests merge with ``|``.

    * ``sq_norms``: ||g_n||^2 per parameter, shape [N].
    * ``sum_sq``: sum_n g_{n,d}^2 per parameter, shaped like the parameter.
    * ``directions``: names of directions v (one tensor per parameter, supplied at compute
      time); for each, the projections g_n . v per parameter, shape [N].
    * ``visitors``: called with chunks of materialised per-sample gradients (histograms).
    * ``module_outputs``: output visitors, called with every module call's output in the
      captured forward (activation statistics: no per-sample gradient is needed for them);
      a summary holds counts and sums over the call's samples (tensors), which a step's
      micro-batches add (:func:`avionics.step.accumulation.added_summaries`).
    * ``calls``: only the captured layer calls (for quantities that backpropagate through them
      themselves, as the GGN diagonal does); implied by every statistic.
    * ``sample_mean``: the direction among ``directions`` that is the mean (1/n) sum_n g_n of
      the very g_n the statistics are of, or None: the rules may then compute g_n . v from the
      inner products g_n . g_m instead of from v. Set by the captured step
      (:meth:`~avionics.persample.step.CapturedStep.statistics`), not by quantities.
    """

    sq_norms: bool = False
    sum_sq: bool = False
    directions: frozenset[str] = frozenset()
    visitors: tuple[Visitor, ...] = ()
    calls: bool = False
    module_outputs: tuple[OutputVisitor, ...] = ()
    sample_mean: str | None = None

    def __or__(self, other: Request) -> Request:
        return Request(
            sq_norms=self.sq_norms or other.sq_norms,
            sum_sq=self.sum_sq or other.sum_sq,
            directions=self.directions | other.directions,
            visitors=_merged(self.visitors, other.visitors),
            calls=self.calls or other.calls,
            module_outputs=_merged(self.module_outputs, other.module_outputs),
            sample_mean=self.sample_mean or other.sample_mean,
        )

    @property
    def asks_statistics(self) -> bool:
        """Whether any per-sample statistic is asked for."""
        return self.sq_norms or self.sum_sq or bool(self.directions) or bool(self.visitors)

    def __bool__(self) -> bool:
        """Whether the step's layer calls must be captured."""
        return self.asks_statistics or self.calls or bool(self.module_outputs)


def _merged(ours: tuple, theirs: tuple) -> tuple:
    """``ours`` and those of ``theirs`` not among them, in order."""
    return ours + tuple(v for v in theirs if v not in ours)


@dataclass
class Statistics:
    """Per-parameter results of a :class:`Request` (lists follow the parameter order)."""

    sq_norms: list[Tensor] | None = None
    sum_sq: list[Tensor] | None = None
    projections: dict[str, list[Tensor]] = field(default_factory=dict)


class Accumulator:
    """Statistics of one parameter from chunks of its materialised per-sample gradients."""

    def __init__(self, request: Request, directions: dict[str, Tensor], index: int):
        self.request, self.directions, self.index = request, directions, index
        self.sq_norms: list[Tensor] = []
        self.projections: dict[str, list[Tensor]] = {name: [] for name in directions}
        self.sum_sq: Tensor | None = None

    def add(self, chunk: Tensor) -> None:
        flat = chunk if chunk.dim() == 2 else chunk.reshape(chunk.shape[0], -1)
        if self.request.sq_norms:
            self.sq_norms.append(torch.linalg.vector_norm(flat, dim=1).square())
        for name, v in self.directions.items():
            self.projections[name].append(flat @ v.flatten())
        if self.request.sum_sq:
            s = chunk.pow(2).sum(0)
            self.sum_sq = s if self.sum_sq is None else self.sum_sq + s
        for visit in self.request.visitors:
            visit(self.index, chunk)

    def result(self) -> dict:
        out: dict = {}
        if self.request.sq_norms:
            out["sq_norms"] = _cat(self.sq_norms)
        if self.directions:
            out["projections"] = {k: _cat(v) for k, v in self.projections.items()}
        if self.request.sum_sq:
            out["sum_sq"] = self.sum_sq
        return out


def _cat(chunks: list[Tensor]) -> Tensor:
    return torch.cat(chunks) if len(chunks) > 1 else chunks[0]
