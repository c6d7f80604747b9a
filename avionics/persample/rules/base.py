"""The protocol of a per-layer rule.

A rule turns the captured calls of one module (inputs x and output gradients delta, summed
over the calls of one forward) into per-sample gradients g_n of a subset of the parameters,
where g_n = output_gradient_factor * (the sample-n part of the backpropagated gradient): the
output-gradient factor is N for a mean-reduced loss (whose backward carries dl_n/dout / N) and
1 for a sum. Every rule can *materialise* g_n for a run of samples;
rules with closed forms override :meth:`Rule.statistics` to avoid materialising.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from avionics.persample.precision import computing_dtype
from avionics.persample.request import Accumulator, Request

if TYPE_CHECKING:
    from avionics.persample.calls import ModuleCall

# Bytes one materialised chunk of per-sample gradients may take.
CHUNK_BYTES = 8 * 2**20


def chunk_size(n: int, numel: int, element_size: int) -> int:
    """How many samples' gradients of ``numel`` elements fit in :data:`CHUNK_BYTES`."""
    return max(1, min(n, CHUNK_BYTES // max(1, numel * element_size)))


class Rule:
    """Per-sample gradients of ``names`` (parameters reached from ``module``) from ``calls``."""

    def __init__(
        self,
        module: nn.Module,
        calls: list[ModuleCall],
        names: list[str],
        n: int,
        output_gradient_factor: float,
    ):
        self.module, self.calls, self.names, self.n, self.output_gradient_factor = (
            module,
            calls,
            names,
            n,
            output_gradient_factor,
        )
        self.params = [module.get_parameter(name) for name in names]

    def materialize(self, start: int, stop: int) -> list[Tensor]:
        """[g_start, ..., g_{stop-1}] for each parameter: a list of [stop-start, *p.shape]."""
        raise NotImplementedError

    def chunks(self):
        """Yield (start, per-parameter chunks) over all samples, within the memory budget."""
        numel = sum(p.numel() for p in self.params)
        step = chunk_size(self.n, numel, self.params[0].element_size())
        for start in range(0, self.n, step):
            yield start, self.materialize(start, min(self.n, start + step))

    def statistics(
        self, requests: list[Request], directions: list[dict[str, Tensor]]
    ) -> list[dict]:
        """Each parameter's requested statistics (see :class:`Accumulator` for the keys).

        ``requests[k]`` and ``directions[k]`` belong to parameter k; ``index`` of visitors is k.
        """
        accumulators = [
            Accumulator(r, d, index=k) for k, (r, d) in enumerate(zip(requests, directions))
        ]
        if not any(requests):
            return [acc.result() for acc in accumulators]
        for _, chunk in self.chunks():
            for acc, c in zip(accumulators, chunk, strict=True):
                acc.add(c)
        return [acc.result() for acc in accumulators]

    @classmethod
    def column_sums(
        cls, module: nn.Module, calls: list[ModuleCall], names: list[str], n: int, traces: bool
    ) -> ColumnSums:
        """An accumulator of sum_j sum_n g_{n,j}^2 over backpropagated columns j (the curvature
        diagonals of :mod:`avionics.curvature.step.ggn_diagonal`): g_{n,j} is the per-sample
        gradient (output-gradient factor 1) when column j's gradients w.r.t. the outputs of
        ``calls`` replace their captured ones; with ``traces``, only sum_d of each sum.

        This default builds the rule on each column and asks it for ``sum_sq`` (``sq_norms``
        with ``traces``): its closed forms, or materialised chunks. Rules with a cheaper form
        over many columns at once override it."""
        return ColumnSums(cls, module, calls, names, n, traces)

    def total(self) -> list[Tensor]:
        """sum_n g_n per parameter (checked against autograd's gradient)."""
        totals = [torch.zeros_like(p, dtype=computing_dtype(p.dtype)) for p in self.params]
        for _, chunk in self.chunks():
            for t, c in zip(totals, chunk, strict=True):
                t += c.sum(0)
        return totals


class ColumnSums:
    """sum over columns j of sum_n g_{n,j}^2 (or its sum_d) for the parameters ``names`` of
    ``module``, one column at a time through ``rule`` (see :meth:`Rule.column_sums`).

    ``edges``: where else in the graph a subclass reads each column's gradient (e.g. inside
    the module); the column sums then call ``add(grad_outputs, edge_grads)``."""

    edges: tuple = ()

    def __init__(self, rule: type[Rule], module, calls, names, n: int, traces: bool):
        self.rule, self.module, self.calls, self.names = rule, module, calls, names
        self.n, self.traces = n, traces
        self.totals: list[Tensor | None] = [None] * len(names)

    def add(self, grad_outputs: list[list[Tensor | None]]) -> None:
        """One column: ``grad_outputs[c]`` replaces ``calls[c].grad_outputs``."""
        column_calls = [
            call.with_grad_outputs(outs)
            for call, outs in zip(self.calls, grad_outputs, strict=True)
        ]
        rule = self.rule(self.module, column_calls, self.names, self.n, 1.0)
        request = Request(sq_norms=True) if self.traces else Request(sum_sq=True)
        results = rule.statistics([request] * len(self.names), [{}] * len(self.names))
        for i, r in enumerate(results):
            s = r["sq_norms"].sum() if self.traces else r["sum_sq"]
            self.totals[i] = s if self.totals[i] is None else self.totals[i].add_(s)

    def result(self, scale: float) -> list[Tensor | None]:
        """``scale`` times the sums, one per name (None where no column arrived)."""
        return [t.mul_(scale) if t is not None else None for t in self.totals]


# columns a grouped column sums holds before it forms their per-sample gradients together
COLUMN_GROUP = 16


class GroupedColumnSums(ColumnSums):
    """Column sums that hold each column's data (:meth:`hold`) and, :data:`COLUMN_GROUP` at a
    time, form the held columns' per-sample gradients together (a subclass's ``_reduce``,
    which empties :attr:`pending` and adds each parameter's squares by :meth:`_add`)."""

    def __init__(self, calls, names: list[str], n: int, traces: bool):
        self.calls, self.names, self.n, self.traces = calls, names, n, traces
        self.pending: list = []
        self.totals: dict[str, Tensor] = {}

    def hold(self, column) -> None:
        """Keep one column's data; a full group is formed at once."""
        self.pending.append(column)
        if len(self.pending) == COLUMN_GROUP:
            self._reduce()

    def _add(self, name: str, s: Tensor) -> None:
        s = s.sum() if self.traces else s
        self.totals[name] = s if name not in self.totals else self.totals[name].add_(s)

    def result(self, scale: float) -> list[Tensor | None]:
        """``scale`` times the sums, one per name (None where no column arrived)."""
        if self.pending:
            self._reduce()
        return [self.totals[name].mul_(scale) if name in self.totals else None
                for name in self.names]  # fmt: skip


def batch_first(t: Tensor, axis: int, n: int, where: str) -> Tensor:
    """Move the batch axis of ``t`` to the front, checking it has ``n`` entries."""
    if t.dim() <= axis or t.shape[axis] != n:
        raise RuntimeError(
            f"{where}: expected the batch ({n} samples) on axis {axis} of a tensor of shape "
            f"{tuple(t.shape)}. Per-sample statistics need every sample on one axis of each "
            "layer's input and output; set `batch_first` on the module if it has that option."
        )
    return t if axis == 0 else t.movedim(axis, 0)


def concatenate(tensors: list[Tensor], axis: int) -> Tensor:
    """``torch.cat`` that does not copy the tensor of a module called once per forward."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, axis)


def output_gradient(call: ModuleCall, index: int = 0) -> Tensor:
    """The gradient w.r.t. output ``index`` of a call (zeros where none arrived)."""
    g = call.grad_outputs[index]
    if g is None:
        meta = call.outputs[index]
        g = torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
    return g
