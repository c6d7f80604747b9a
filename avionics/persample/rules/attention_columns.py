"""nn.MultiheadAttention's sums over backpropagated columns (the GGN diagonal), many columns
at once.

Column j's per-sample gradients have the bilinear forms of :mod:`attention` with the
column's output gradient delta^j in place of the loss's: for sample n

    G^j_n(W)   = sum_t [dq^j_t (x^q_t)^T; dk^j_t (x^k_t)^T; dv^j_t (x^v_t)^T],
    G^j_n(b)   = sum_t [dq^j_t; dk^j_t; dv^j_t],
    G^j_n(W_o) = sum_t delta^j_t o_t^T,        G^j_n(b_o) = sum_t delta^j_t,

with (dq^j, dk^j, dv^j) the gradients w.r.t. the projections' outputs. Where the capture found
the projections in the call's graph (:class:`~avionics.persample.rules.attention.Inside`),
they are read in the columns' own batched backward (at :attr:`AttentionColumnSums.edges`):
no re-run. Else the attention is re-run once per step on the captured inputs (as the rule's
re-run: identity projections, the call's dropout masks drawn again), its graph kept, and
(dq^j, dk^j, dv^j) is its vector-Jacobian product with do^j = delta^j W_o, up to
:data:`~avionics.persample.rules.base.COLUMN_GROUP` columns in one batched product
(``is_grads_batched``). Each form is then one product over the positions for all columns
and samples of a chunk, [N, K F, T] @ [N, T, I], squared and summed over n and j. The calls
of one module add their gradients before the square (a module called twice has one
per-sample gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from avionics.curvature.step._autograd import batched_grad
from avionics.persample.precision import computing
from avionics.persample.rules.attention import (
    _WIDTHS,
    AttentionRule,
    _rerun,
    _taken_inside,
    _time_major,
    _time_major_gradient,
)
from avionics.persample.rules.base import GroupedColumnSums

# bytes of one chunk of per-sample, per-column gradients [c, K, F, I]
CHUNK_BYTES = 2**24


class AttentionColumnSums(GroupedColumnSums):
    """sum over columns j of sum_n G^j_n^2 (or its sum, with ``traces``) for the parameters
    ``names`` of an nn.MultiheadAttention (see the module docstring;
    :meth:`Rule.column_sums <avionics.persample.rules.base.Rule.column_sums>`): each call's
    projections' gradients read inside the columns' backward (:class:`_Inside`) or from its
    re-run (:class:`_ReRun`)."""

    def __init__(self, module: nn.MultiheadAttention, calls, names: list[str], n: int, traces):
        super().__init__(calls, names, n, traces)
        self.module = module
        self.in_proj = bool({"in_proj_weight", "in_proj_bias"} & set(names))
        self.sources = [
            _Inside(module, call) if _taken_inside(module, call, n) else _ReRun(module, call)
            for call in calls
        ]
        self.edges = [edge for source in self.sources for edge in source.edges]

    def add(self, grad_outputs: list[list[Tensor | None]], edge_grads=()) -> None:
        """One column: ``grad_outputs[c]`` replaces ``calls[c].grad_outputs``; ``edge_grads``:
        its gradients at :attr:`edges` (None: none arrived)."""
        edge_grads, column = list(edge_grads), []
        for call, outs, source in zip(self.calls, grad_outputs, self.sources, strict=True):
            delta = computing(_time_major_gradient(self.module, call.with_grad_outputs(outs)))
            own, edge_grads = edge_grads[: len(source.edges)], edge_grads[len(source.edges) :]
            column.append((delta, own))
        self.hold(column)

    def _reduce(self) -> None:
        """The pending columns' squared per-sample gradients, added to the totals."""
        per_call = list(zip(*self.pending, strict=True))
        self.pending = []
        factors = []  # per call: (x, delta) per form, time-major, delta with the column axis
        for source, columns in zip(self.sources, per_call, strict=True):
            delta = torch.stack([d for d, _ in columns])  # [K, T, N, E]
            forms = {}
            if self.in_proj:
                grads = source.projections(delta, [g for _, g in columns])
                forms["in_proj"] = list(zip(source.xs, grads, strict=True))
            if source.o is not None:
                forms["out_proj"] = [(source.o, delta)]
            factors.append(forms)
        k, e = len(per_call[0]), self.module.embed_dim
        size = per_call[0][0][0].element_size()
        step = max(1, CHUNK_BYTES // (k * 4 * e * e * size))
        for start in range(0, self.n, step):
            stop = min(self.n, start + step)
            for form in factors[0]:
                weight, bias = _chunk_gradients([f[form] for f in factors], start, stop)
                self._add_form(form, weight, bias)

    def _add_form(self, form: str, weight: Tensor, bias: Tensor) -> None:
        names = {"in_proj": ("in_proj_weight", "in_proj_bias"),
                 "out_proj": ("out_proj.weight", "out_proj.bias")}[form]  # fmt: skip
        for name, g in zip(names, (weight, bias), strict=True):
            if name in self.names:
                self._add(name, g.square_().sum((0, 1)))  # (g: this chunk's own)


class _ReRun:
    """A call's attention re-run (identity projections, the call's dropout masks drawn
    again), its graph kept: (dq, dk, dv) of K columns by one batched vector-Jacobian product
    with do = delta W_o."""

    edges = ()

    def __init__(self, module: nn.MultiheadAttention, call):
        a, xs = _time_major(module, call)
        self.xs = [computing(x) for x in xs]
        with torch.enable_grad():
            self.qkv, o = _rerun(module, a, self.xs, call.rng_state)
        self.o = o.detach()
        self._o, self.out_weight = o, computing(module.out_proj.weight.detach())

    def projections(self, delta: Tensor, _) -> list[Tensor]:
        """[K, T, N, E] each of q, k and v."""
        return list(batched_grad([self._o], self.qkv, [delta @ self.out_weight]))


class _Inside:
    """A call whose projections the capture found in its graph
    (:class:`~avionics.persample.rules.attention.Inside`): the columns' gradients w.r.t. the
    products' outputs are read in the columns' own backward, at :attr:`edges` (no re-run)."""

    def __init__(self, module: nn.MultiheadAttention, call):
        found = call.inside
        xs = [computing(x.detach()) for x in found.inputs]
        self.xs = [x.transpose(0, 1) for x in xs] if module.batch_first else xs
        t, n, e = self.xs[0].shape
        self.o = None if found.o is None else computing(found.o).reshape(t, n, e)
        self.edges = [GradientEdge(node, 0) for node in found.nodes]
        widths = _WIDTHS[len(found.pieces)]  # (in units of E)
        self.shapes = [(self.xs[p].shape[0], n, widths[p] * e) for p in found.pieces]
        self.e = e

    def projections(self, delta: Tensor, grads: list[list[Tensor | None]]) -> list[Tensor]:
        """[K, T, N, E] each of q, k and v, from the columns' gradients at :attr:`edges`
        (``grads[j][i]``: column j's at edge i, [T N, width] in (t, n) order)."""
        blocks = []
        for i, shape in enumerate(self.shapes):
            g = [
                torch.zeros(shape, dtype=delta.dtype, device=delta.device)
                if column[i] is None
                else computing(column[i]).reshape(shape)
                for column in grads
            ]
            blocks += torch.stack(g).split(self.e, -1)
        return blocks


def _chunk_gradients(per_call: list[list[tuple[Tensor, Tensor]]], start: int, stop: int):
    """The weight's and the bias's per-sample, per-column gradients of samples start..stop-1,
    [c, K, F, I] and [c, K, F], summed over the calls: each call's pieces (x [T, N, I],
    delta [K, T, N, F]) stacked along F."""
    weight = bias = None
    for pieces in per_call:
        w = torch.cat([_outer(x[:, start:stop], d[:, :, start:stop]) for x, d in pieces], 2)
        b = torch.cat([d[:, :, start:stop].sum(1).movedim(1, 0) for _, d in pieces], 2)
        weight = w if weight is None else weight.add_(w)
        bias = b if bias is None else bias.add_(b)
    return weight, bias


def _outer(x: Tensor, delta: Tensor) -> Tensor:
    """sum_t delta_{j,t,n} x_{t,n}^T for each sample n and column j: one product
    [c, K F, T] @ [c, T, I] -> [c, K, F, I]."""
    k, t, c, f = delta.shape
    d = delta.permute(2, 0, 3, 1).reshape(c, k * f, t)
    return torch.bmm(d, x.movedim(1, 0)).reshape(c, k, f, x.shape[-1])


AttentionRule.column_sums_class = AttentionColumnSums
