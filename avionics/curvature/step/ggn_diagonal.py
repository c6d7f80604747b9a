"""The diagonal of the generalized Gauss-Newton matrix of one captured, graph-keeping step.

For the mini-batch mean loss L = mean_n l_n, G = (1/N) sum_n J_n^T H_n J_n, with J_n the
Jacobian of the model output for sample n and H_n the Hessian of l_n w.r.t. that output.
Write H_n = S_n S_n^T (:mod:`avionics.curvature.step.loss_root`); then

    G_dd = (1/N) sum_n sum_j (J_n^T S_n e_j)_d^2:

the per-sample "gradients" obtained by backpropagating the columns S_n e_j instead of
dl_n/dout, squared and summed (``"diag_ggn_exact"``). ``"diag_ggn_mc"`` uses S_n z_n,
z_n ~ N(0, I) from a seeded generator (E[S z z^T S^T] = H_n), averaged over ``mc_samples``
draws: an unbiased estimate, one backward per draw whatever the output size.

Each column goes back from the model output to every captured module output (none when that
output is the model output itself), up to ``COLUMN_GROUP`` columns in one batched backward
(one plain backward per column where a convolution's input gradient is needed, which vmap
batches worse than a loop);
the squared per-sample gradients are summed over the columns by each parameter's per-layer
rule (:meth:`Rule.column_sums <avionics.persample.rules.base.Rule.column_sums>`: a closed
form for Linear layers without shared axes, all columns of a group in one product per
sample for convolutions, Linear layers with shared axes and attention (whose projections'
gradients are read inside the columns' backward), the rule's own statistics for everything
else), routed as the per-sample engine routes the parameter.

Cost, with K columns (V - 1 = 9 for 10 classes; for a token-level loss, V - 1 per position that
some sample's loss reaches, so none for padding or the position a causal shift drops): K
backwards from the output to the layer outputs (no weight gradients), each roughly the input-
gradient half of a backward; for each convolution, K times the multiply-adds of its forward
(the per-sample, per-column weight gradients have no cheaper exact form); for Linear layers,
one product the size of the layer's forward in all. So on 10 classes the exact diagonal costs
several plain steps on any network whose backward is not negligible; the MC diagonal costs one
column. The exact diagonal needs M <= ``MAX_OUTPUT_SIZE`` output entries per sample.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from avionics.curvature.step._autograd import batched_grad
from avionics.curvature.step.loss_root import (
    check_exact_columns,
    loss_gradient,
    loss_hessian_root,
)
from avionics.persample.capture import output_edge, output_key
from avionics.persample.request import Request

# sets AttentionRule.column_sums_class: all of a group's columns through one re-run
from avionics.persample.rules import (
    attention_columns,  # noqa: F401
    rule_for,
)
from avionics.persample.rules.base import ColumnSums
from avionics.persample.rules.broadcast import SharedParameterColumnSums, shared_parameter_uses
from avionics.persample.rules.generic import GenericRule
from avionics.persample.step import summed_statistics

# columns backpropagated together (their gradients at every captured output are held at once)
COLUMN_GROUP = 16

# the 16-bit floats of a forward under autocast
_HALF = (torch.float16, torch.bfloat16)


def ggn_diagonal(
    model: nn.Module,
    engine,
    calls: dict,
    individual_losses: Tensor,
    params: list[Tensor],
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    traces: bool = False,
    rows: tuple[int, int] | None = None,
) -> list[Tensor]:
    """Exact (``mc_samples=None``) or Monte-Carlo diagonal of the GGN of the mean loss, or with
    ``traces`` only its sum per parameter, sum_d G_dd (0-dim tensors).

    With a square root S_n of the loss Hessian H_n w.r.t. sample n's output (S_n S_n^T = H_n,
    see :func:`~avionics.curvature.step.loss_root.loss_hessian_root`), G_dd = (1/N) sum_n sum_j
    (J_n^T S_n e_j)_d^2 (exact: every column of the factor) or (1/(N K)) sum_n sum_k
    (J_n^T S_n z_{n,k})_d^2 (Monte Carlo: z ~ N(0, I) from ``generator``, K = ``mc_samples``).
    Each column S e_j (or S z) is backpropagated from the model output to every captured
    module output (and to the use nodes of the root's broadcast parameters), up to
    :data:`COLUMN_GROUP` columns in one batched backward; the squared per-sample gradients are
    summed over columns by :class:`_ColumnSums`. The traces need only the per-sample squared norms
    ||J_n^T S_n e_j||^2, which Linear layers without shared axes have in closed form.

    ``rows`` = (start, N): the samples are rows [start, start + n) of a global batch of N
    (data parallelism); the Monte-Carlo draws z are then the global batch's, these rows of
    them, so that the processes' diagonals, N_r / N-weighted, add to one process's.
    """
    root = _root_call(model, calls, individual_losses)
    n = len(individual_losses)
    out_edge = output_edge(root.nodes[0])
    out_shape = root.outputs[root.node_outputs[0]].shape
    m = out_shape.numel() // n
    if mc_samples is None:
        check_exact_columns(out_shape, m)
    u = loss_gradient(individual_losses, root)
    root_of = loss_hessian_root(individual_losses, root, u)
    if mc_samples is None:
        columns = root_of.columns()
    else:
        start, total = rows or (0, n)
        z = torch.randn(mc_samples, total, m, generator=generator, dtype=u.dtype, device="cpu")
        z = z[:, start : start + n]
        columns = (root_of(zk) for zk in z.to(u.device))
    sums = _ColumnSums(engine, calls, params, n, traces, root)
    moved_shape = (n, *(s for a, s in enumerate(out_shape) if a != root.batch_axis))
    # the model output is often a captured output too (a final Linear): its column is given
    inner = [i for i, k in enumerate(sums.keys) if k != output_key(root.nodes[0])]
    # and the sums that read the columns elsewhere (the root parameters' use nodes, the
    # attention's projections) need their gradients there
    edges = [sums.edges[i] for i in inner] + sums.sum_edges
    batched = _batches_well(calls)
    for group in _groups(columns):
        group = torch.stack([c.reshape(moved_shape).movedim(0, root.batch_axis) for c in group])
        for column, found in zip(group, _backward(out_edge, edges, group, batched)):
            grads = [column] * len(sums.edges)
            for i, g in zip(inner, found[: len(inner)], strict=True):
                grads[i] = g
            sums.add(_float(grads), _float(found[len(inner) :]))
    return sums.result(1.0 / (n if mc_samples is None else n * mc_samples))


def _backward(out_edge, edges: list, group: Tensor, batched: bool):
    """Per column of ``group`` [k, *output] (the model output's), its gradients at ``edges``
    (None where none arrived): one batched backward where ``batched`` (and k > 1), else one
    plain backward per column, each made when the caller asks for it (one column's gradients
    held at a time)."""
    if not edges:
        yield from ([] for _ in group)
    elif batched and len(group) > 1:
        found = batched_grad([out_edge], edges, [group])
        yield from ([None if g is None else g[j] for g in found] for j in range(len(group)))
    else:
        for column in group:
            yield torch.autograd.grad(
                [out_edge], edges, [column], retain_graph=True, allow_unused=True
            )


def _batches_well(calls: dict) -> bool:
    """Whether the columns go back in one batched backward (vmap over the group) rather than
    one backward per column: not where a convolution's input gradient is needed, since vmap's
    rule for ``convolution_backward`` runs the convolution once per column and copies the
    expanded operands around it (9 columns through the ResNet's graph, one process: the GGN
    diagonal 144 ms batched, 134 ms by 9 backwards; BENCHMARKS.md, "Business on the seven
    models")."""
    for module, module_calls in calls.items():
        if isinstance(module, nn.modules.conv._ConvNd):
            for call in module_calls:
                x = call.args[0] if call.args else None
                if isinstance(x, Tensor) and x.requires_grad:
                    return False
    return True


def _groups(columns):
    """The columns in groups of at most :data:`COLUMN_GROUP`, each backpropagated in one
    batched backward (``is_grads_batched``: vmap over the group, one kernel per operation
    instead of one per column)."""
    group = []
    for column in columns:
        group.append(column)
        if len(group) == COLUMN_GROUP:
            yield group
            group = []
    if group:
        yield group


def _float(grads) -> list[Tensor | None]:
    """(a forward under autocast backpropagates 16-bit columns: summed in float32)"""
    return [g.float() if g is not None and g.dtype in _HALF else g for g in grads]


def _edges(sums) -> tuple:
    """Where column sums read the columns' gradients besides the captured outputs
    (:attr:`ColumnSums.edges <avionics.persample.rules.base.ColumnSums.edges>`)."""
    return tuple(getattr(sums, "edges", ()))


def _root_call(model: nn.Module, calls: dict, individual_losses: Tensor):
    """The model's call, its ``batch_axis`` that of its output (:func:`_output_batch_axis`)."""
    roots = calls.get(model, [])
    if len(roots) != 1 or len(roots[0].nodes) != 1:
        raise RuntimeError(
            "The GGN diagonal needs exactly one forward of the model with one tensor output per "
            f"step; this step has {len(roots)} calls of the model. Use curvature='diag_h'."
        )
    root = copy.copy(roots[0])
    root.batch_axis = _output_batch_axis(root, individual_losses)
    return root


def _output_batch_axis(root, individual_losses: Tensor) -> int:
    """The batch axis of the model output: its one axis of N entries, or where several have
    N, the one along which sample 0's loss reads its own entries only (one product through
    the loss: d l_0 / d output is zero off index 0 there). Not the root call's own
    ``batch_axis``, which is its input's: time-major token ids [T, N] give axis 1 to a model
    whose output is [N, C] (its GGN diagonal was refused, or with C == N summed over the
    classes as samples)."""
    n, shape = len(individual_losses), root.outputs[root.node_outputs[0]].shape
    axes = [a for a, size in enumerate(shape) if size == n]
    if len(axes) == 1:
        return axes[0]
    if not axes:
        raise ValueError(
            f"The GGN diagonal needs the batch ({n} samples) on an axis of the model output; "
            f"it has shape {tuple(shape)}."
        )
    (first,) = torch.autograd.grad(
        individual_losses[0], [output_edge(root.nodes[0])], retain_graph=True
    )
    own = [a for a in axes if not first.narrow(a, 1, n - 1).any()]
    return own[0] if len(own) == 1 else (root.batch_axis if root.batch_axis in axes else axes[0])


class _ColumnSums:
    """sum over columns of sum_n g_{n,d}^2, g_n the per-sample gradient of one backpropagated
    column, from the columns' gradients w.r.t. the captured module outputs (with ``traces``,
    only sum_d of each parameter's sums).

    Each parameter is routed as the engine routes it (:meth:`PerSampleEngine.contributions
    <avionics.persample.engine.PerSampleEngine.contributions>`, the gradient check's moves to
    the root's generic rule included). One contribution: its module's rule accumulates the
    columns (:meth:`Rule.column_sums <avionics.persample.rules.base.Rule.column_sums>`).
    Several (tied weights): g_n is the sum of the contributions' materialised gradients,
    summed in chunks before squaring, as the engine does for them (||a + b||^2 is not
    ||a||^2 + ||b||^2). Parameters used directly in the forward whose per-sample gradients
    the captured backward had in closed form (the main step's
    :class:`~avionics.persample.rules.broadcast.SharedParameterRule`) get them here by the
    same forms, from the columns' gradients at their use nodes (:attr:`sum_edges`), not
    by the generic rule's re-run of the whole model.
    """

    def __init__(self, engine, calls: dict, params: list[Tensor], n: int, traces: bool, root):
        self.engine, self.calls, self.params = engine, calls, params
        self.n, self.traces = n, traces
        keyed: dict = {}
        for module_calls in calls.values():
            for call in module_calls:
                for node in call.nodes:
                    keyed.setdefault(output_key(node), output_edge(node))
        self.keys = list(keyed)
        self.edges = [keyed[k] for k in self.keys]
        self.contributions = engine.contributions(calls, n)
        single: dict[nn.Module, list[str]] = {}
        self.summed: dict[nn.Module, list[str]] = {}  # modules of several-contribution params
        for pairs in self.contributions:
            into = single if len(pairs) == 1 else self.summed
            for module, name in pairs:
                names = into.setdefault(module, [])
                if name not in names:
                    names.append(name)
        for module in {**single, **self.summed}:
            for call in calls[module]:
                call.check_inputs_unchanged(engine.module_name(module))
        self.sums = {}
        shared = self._shared_parameter_sums(single, root)
        for module, names in single.items():
            if module in shared:
                self.sums[module] = shared[module]
                continue
            with engine.naming(module):
                self.sums[module] = rule_for(module, names).column_sums(
                    module, calls[module], names, n, traces
                )
        # where the sums read the columns' gradients besides the captured outputs, in order
        self.sum_edges = [e for sums in self.sums.values() for e in _edges(sums)]
        self.totals: list[Tensor | None] = [None] * len(params)

    def _shared_parameter_sums(self, single: dict, root) -> dict:
        """:class:`SharedParameterColumnSums` for each module the generic rule would handle
        whose parameters all had closed-form per-sample gradients in the captured backward
        (``root.shared_parameter_gradients``), as the main step decides."""
        known = root.shared_parameter_gradients
        modules = {}
        for module, names in single.items():
            if rule_for(module, names) is GenericRule:
                ps = [module.get_parameter(name) for name in names]
                if all(known.get(id(p)) is not None for p in ps):
                    modules[module] = (names, ps)
        if not modules:
            return {}
        uses = shared_parameter_uses(root, [p for _, ps in modules.values() for p in ps])
        if uses is None:
            return {}
        return {
            module: SharedParameterColumnSums(names, [uses[id(p)] for p in ps], self.traces)
            for module, (names, ps) in modules.items()
        }

    def _grad_outputs(self, module, by_key) -> list[list[Tensor | None]]:
        outs = []
        for call in self.calls[module]:
            call_outs: list[Tensor | None] = [None] * len(call.outputs)
            for i, node in zip(call.node_outputs, call.nodes, strict=True):
                call_outs[i] = by_key[output_key(node)]
            outs.append(call_outs)
        return outs

    def add(self, grads, edge_grads) -> None:
        """One column: its gradients w.r.t. the captured outputs (in :attr:`keys` order) and at
        :attr:`sum_edges`."""
        by_key = dict(zip(self.keys, grads, strict=True))
        edge_grads = list(edge_grads)
        with torch.no_grad():
            for module, sums in self.sums.items():
                k = len(_edges(sums))
                own, edge_grads = edge_grads[:k], edge_grads[k:]
                if isinstance(sums, SharedParameterColumnSums):
                    sums.add(own)
                elif type(sums) is ColumnSums:  # the rule's own statistics: name its errors
                    with self.engine.naming(module):
                        sums.add(self._grad_outputs(module, by_key))
                elif k:  # a closed form that reads gradients inside the module
                    sums.add(self._grad_outputs(module, by_key), own)
                else:  # a closed form over the columns (Linear, convolution)
                    sums.add(self._grad_outputs(module, by_key))
            if self.summed:
                self._add_summed(by_key)

    def _add_summed(self, by_key) -> None:
        rules = {}
        for module, names in self.summed.items():
            calls = [
                call.with_grad_outputs(outs)
                for call, outs in zip(self.calls[module], self._grad_outputs(module, by_key))
            ]
            with self.engine.naming(module):
                rules[module] = rule_for(module, names)(module, calls, names, self.n, 1.0)
        request = Request(sq_norms=True) if self.traces else Request(sum_sq=True)
        for k, pairs in enumerate(self.contributions):
            if len(pairs) < 2:
                continue
            stats = summed_statistics(
                self.engine, rules, pairs, self.params[k], k, request, {}, self.n
            )
            s = stats["sq_norms"].sum() if self.traces else stats["sum_sq"]
            self.totals[k] = s if self.totals[k] is None else self.totals[k].add_(s)

    def result(self, scale: float = 1.0) -> list[Tensor]:
        """``scale`` times the sums (or their traces), one tensor per parameter (owned by the
        caller)."""
        with torch.no_grad():
            results = {module: sums.result(scale) for module, sums in self.sums.items()}
            for k, pairs in enumerate(self.contributions):
                if len(pairs) == 1:
                    module, name = pairs[0]
                    self.totals[k] = results[module][self.sums[module].names.index(name)]
                elif self.totals[k] is not None:
                    self.totals[k].mul_(scale)
        return [
            t if t is not None else (p.new_zeros(()) if self.traces else torch.zeros_like(p))
            for t, p in zip(self.totals, self.params, strict=True)
        ]
