"""nn.MultiheadAttention's sums over backpropagated columns (the GGN diagonal), many columns
at once.

Column j's per-sample gradients have the bilinear forms of :mod:`attention` with the
column's output gradient delta^j in place of the loss's: for sample n

    G^j_n(W)   = sum_t [dq^j_t (x^q_t)^T; dk^j_t (x^k_t)^T; dv^j_t (x^v_t)^T],
    G^j_n(b)   = sum_t [dq^j_t; dk^j_t; dv^j_t],
    G^j_n(W_o) = sum_t delta^j_t o_t^T,        G^j_n(b_o) = sum_t delta^j_t,

with (dq^j, dk^j, dv^j) the vector-Jacobian product of the attention o(q, k, v) with
do^j = delta^j W_o. The attention is re-run once per step on the captured inputs (as the
rule's re-run: identity projections, the call's dropout masks drawn again) and its graph
kept; the columns' output gradients are kept and, up to :data:`COLUMN_GROUP` at a time, go
back through it in one batched vector-Jacobian product (``is_grads_batched``), and each
form is one product over the positions for all columns and samples of a chunk,
[N, K F, T] @ [N, T, I], squared and summed over n and j. The calls of one module add their
gradients before the square (a module called twice has one per-sample gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from avionics.curvature.step._autograd import batched_grad
from avionics.persample.precision import computing
from avionics.persample.rules.attention import _rerun, _time_major, _time_major_gradient

# columns pending before they go back through the re-run attention together
COLUMN_GROUP = 16
# bytes of one chunk of per-sample, per-column gradients [c, K, F, I]
CHUNK_BYTES = 2**24


class AttentionColumnSums:
    """sum over columns j of sum_n G^j_n^2 (or its sum, with ``traces``) for the parameters
    ``names`` of an nn.MultiheadAttention whose calls the rule re-runs (see the module
    docstring; :meth:`Rule.column_sums <avionics.persample.rules.base.Rule.column_sums>`)."""

    def __init__(self, module: nn.MultiheadAttention, calls, names: list[str], n: int, traces):
        self.module, self.calls, self.names, self.n, self.traces = module, calls, names, n, traces
        self.in_proj = bool({"in_proj_weight", "in_proj_bias"} & set(names))
        self.runs = []
        for call in calls:
            a, xs = _time_major(module, call)
            xs = [computing(x) for x in xs]
            with torch.enable_grad():
                qkv, o = _rerun(module, a, xs, call.rng_state)
            self.runs.append((xs, qkv, o))
        self.out_weight = computing(module.out_proj.weight.detach())
        self.pending: list[list[Tensor]] = []
        self.totals: dict[str, Tensor] = {}

    def add(self, grad_outputs: list[list[Tensor | None]]) -> None:
        """One column: ``grad_outputs[c]`` replaces ``calls[c].grad_outputs``."""
        self.pending.append([
            computing(_time_major_gradient(self.module, call.with_grad_outputs(outs)))
            for call, outs in zip(self.calls, grad_outputs, strict=True)
        ])  # fmt: skip
        if len(self.pending) == COLUMN_GROUP:
            self._reduce()

    def _reduce(self) -> None:
        """The pending columns' squared per-sample gradients, added to the totals."""
        deltas = [torch.stack(ds) for ds in zip(*self.pending, strict=True)]  # [K, T, N, E]
        self.pending = []
        factors = []  # per call: (x, delta) per form, time-major, delta with the column axis
        for (xs, qkv, o), delta in zip(self.runs, deltas, strict=True):
            forms = {}
            if self.in_proj:
                dq, dk, dv = batched_grad([o], list(qkv), [delta @ self.out_weight])
                forms["in_proj"] = list(zip(xs, (dq, dk, dv), strict=True))
            forms["out_proj"] = [(o.detach(), delta)]
            factors.append(forms)
        k, e = len(deltas[0]), self.module.embed_dim
        step = max(1, CHUNK_BYTES // (k * 4 * e * e * deltas[0].element_size()))
        for start in range(0, self.n, step):
            stop = min(self.n, start + step)
            for form in factors[0]:
                weight, bias = _chunk_gradients([f[form] for f in factors], start, stop)
                self._add(form, weight, bias)

    def _add(self, form: str, weight: Tensor, bias: Tensor) -> None:
        names = {"in_proj": ("in_proj_weight", "in_proj_bias"),
                 "out_proj": ("out_proj.weight", "out_proj.bias")}[form]  # fmt: skip
        for name, g in zip(names, (weight, bias), strict=True):
            if name in self.names:
                s = g.square().sum((0, 1))
                s = s.sum() if self.traces else s
                self.totals[name] = s if name not in self.totals else self.totals[name].add_(s)

    def result(self, scale: float) -> list[Tensor | None]:
        """``scale`` times the sums, one per name (None where no column arrived)."""
        if self.pending:
            self._reduce()
        return [self.totals[name].mul_(scale) if name in self.totals else None
                for name in self.names]  # fmt: skip


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
