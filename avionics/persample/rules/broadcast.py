"""Per-sample output gradients of a call whose output every sample shares.

A position table looked up by ``arange(T)`` (GPT-2's ``wpe``) returns y of shape [1, T, D] or
[T, D], without a batch axis, and its consumer broadcasts it into the batch: h = e + y with e
of shape [N, T, D]. Autograd sums dh over the broadcast axis before it reaches y, so y's
captured output gradient is sum_n dh_n. Sample n's output gradient is dh_n itself, since
dh/dy is the identity on every sample's slice (alpha for ``e + alpha * y``). So where every
consumer of y is such an addition, the gradient the additions receive, read by a pre-hook on
their autograd node, is y's per-sample output gradient (summed over the consumers), and the
call's rule treats y as broadcast to the batch (:attr:`ModuleCall.broadcast_grad_outputs`).
Any other consumer (a product, a matmul) leaves the call to its batched ancestor's rule.

Parameters used directly in a forward (a ViT's class token and position table, a scale or
shift of the root module) have closed forms where every path from the parameter p reaches
the batch through views (``pos[:T]``, ``cls.unsqueeze(0)``) and then one of

* an addition h = e + alpha v (v the viewed p): dh_n/dv = alpha dh_n, reduced to v's shape;
* an expand along the batch axis v -> [N, ...] (``cls.expand(N, -1, -1)``, then concatenated
  with the patches): sample n's gradient is the expand output's gradient at n, reduced to v;
* a product h = e * v (a scale): sample n's gradient is (dh_n * e_n) reduced to v's shape;

and is mapped back through the views' backward per sample. A parameter of the root (or of a
module the forward does not call) that the forward does not use at all has per-sample
gradients zero. Only parameters without such a form take the generic rule (the whole model
re-run under vmap).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.func import vmap
from torch.utils.hooks import RemovableHandle

from avionics.persample.rules.base import Rule

# Autograd nodes whose incoming gradient is that of each operand before broadcasting
# (times alpha for the second operand of an addition).
_ADDITIONS = {"AddBackward0": (1, "_saved_alpha"), "SubBackward0": (1, "_saved_alpha")}


def hook_shared_outputs(root, calls, owners=None) -> list[RemovableHandle]:
    """Pre-hooks on the additions that broadcast shared tensors of the last forward of
    ``root`` in ``calls`` into the batch (N, from the root call's input):

    * outputs of calls whose input does not carry the batch, each of whose consumers is an
      addition: their per-sample output gradients go to ``call.broadcast_grad_outputs``;
    * parameters used directly in a forward (see :func:`_direct_users`), reaching
      additions through views (``pos[:T]``, ``cls.unsqueeze(0)``): their per-sample gradients
      [N, *shape], each addition's per-sample gradient taken back through the views by
      vmap over the view nodes' own backward, go to the root call's
      ``shared_parameter_gradients`` (by ``id`` of the parameter).

    The consumers are found by one walk of the autograd graph from the root call's outputs,
    made only when such a tensor exists. ``owners``: :func:`parameter_owners` of ``root``
    where the caller keeps it from step to step (found here otherwise).
    """
    roots = [k for k, call in enumerate(calls) if call.module is root]
    if not roots or not calls[roots[-1]].inputs:
        return []
    last = calls[roots[-1]]
    forward = calls[roots[-2] + 1 if len(roots) > 1 else 0 : roots[-1]]
    x, axis = last.inputs[0], last.batch_axis
    if x.dim() <= axis:
        return []
    n = x.shape[axis]
    shared = {
        node: (call, i)
        for call in forward
        if not call.carries_batch(n)
        for i, node in zip(call.node_outputs, call.nodes, strict=True)
        if not isinstance(node, Tensor)
    }
    # lookups by indices of fewer axes than the model's input, with N entries on the batch
    # axis: shared by all samples where the walk finds them broadcast with axes put in front
    # (positions arange(T) with T == N)
    suspects = [c for c in forward if c.carries_batch(n) and _fewer_index_axes(c, x)]
    owners = parameter_owners(root) if owners is None else owners
    direct = {id(p): p for m in _direct_users(root, forward, owners) for p in m.parameters(False)}
    if not shared and not direct and not suspects:
        return []
    consumers, leaves = _consumers(last.nodes, direct)
    for call in suspects:
        edges = {node: (call, i) for i, node in zip(call.node_outputs, call.nodes, strict=True)}
        edges = {node: used for node, used in edges.items() if not isinstance(node, Tensor)}
        if any(_prepends_axes(consumers.get(e, ()), call, i, axis) for e, (_, i) in edges.items()):
            call.shared = True
            shared.update(edges)
    handles = []
    for edge, (call, i) in shared.items():
        uses = [
            (node, _addition_scale(node, position)) for node, position in consumers.get(edge, ())
        ]
        if uses and all(scale is not None for _, scale in uses):
            call.broadcast_grad_outputs = [None] * len(call.outputs)
            for node, scale in uses:
                handles.append(node.register_prehook(_accumulator(call, i, scale)))
    declared = functools.cache(lambda: _declared_axes(forward))  # (walked where asked)
    for leaf in leaves:
        uses = _parameter_uses(leaf, consumers, axis, declared) or ()
        if uses:
            last.shared_parameter_axes[id(leaf.variable)] = [axes for _, _, axes in uses]
        for node, per_sample, _ in uses:
            handles.append(node.register_prehook(_parameter_accumulator(last, leaf, per_sample)))
    # parameters the forward does not reach: g_n = 0 (a zero of stride 0, materialised by the
    # rule a chunk of samples at a time)
    reached = {id(leaf.variable) for leaf in leaves}
    for key, p in direct.items():
        if key not in reached and p.requires_grad:
            last.shared_parameter_gradients[key] = p.detach().new_zeros(()).expand(n, *p.shape)
    return handles


def _prepends_axes(uses, call, output: int, axis: int) -> bool:
    """Whether one of ``uses`` (consumers of output ``output`` of ``call``) is an elementwise
    operation that broadcasts it with axes put in front, so that its batch axis lands on
    another axis than ``axis``, the batch's (h = e + y, e [N, T, D], y [T, D] with T == N):
    then y is not batched but shared by the samples."""
    rank = len(call.outputs[output].shape)
    for node, _ in uses:
        if node.name() in ELEMENTWISE:
            result = len(node._input_metadata[0].shape)
            if result > rank and call.batch_axis + result - rank != axis:
                return True
    return False


ELEMENTWISE = {"AddBackward0", "SubBackward0", "MulBackward0", "DivBackward0"}


def _fewer_index_axes(call, x: Tensor) -> bool:
    """Whether the first input of ``call`` holds indices and has fewer axes than ``x``."""
    first = call.inputs[0]
    return not first.is_floating_point() and not first.is_complex() and first.dim() < x.dim()


def shared_parameter_uses(root_call, params: list[Tensor]) -> dict[int, list[tuple]] | None:
    """(node, per-sample map) for every use of each of ``params`` (parameters whose per-sample
    gradients the captured backward found by :func:`hook_shared_outputs`, in
    ``root_call.shared_parameter_gradients``) in the graph of ``root_call``'s forward, by
    ``id`` of the parameter: the per-sample gradients of p for any gradient backpropagated
    from the root's outputs are sum over its uses of ``per_sample(dh)``, dh the gradient
    w.r.t. the use node's output (an empty list: p is not reached, g_n = 0). None where a
    parameter's uses have no closed form (then the generic rule is needed).

    One walk of the graph: for gradients other than the captured one (the GGN diagonal's
    columns), which ask autograd for dh at the use nodes instead of hooking them."""
    wanted = {id(p): p for p in params}
    consumers, leaves = _consumers(root_call.nodes, wanted)
    found = {id(p): [] for p in params}
    for leaf in leaves:
        uses = _parameter_uses(leaf, consumers, root_call.batch_axis)
        if uses is None:
            return None
        found[id(leaf.variable)] += [(node, per_sample) for node, per_sample, _ in uses]
    return found


def _consumers(roots, direct: dict) -> tuple[dict, list]:
    """One walk of the graph from the captured outputs ``roots`` (each node's edges read
    once): edge -> [(consuming node, input position)], and the AccumulateGrad nodes of the
    parameters in ``direct`` (by id)."""
    consumers: dict[tuple, list[tuple]] = {}
    leaves = []
    stack = [r[0] for r in roots if not isinstance(r, Tensor)]
    seen = {id(node) for node in stack}
    while stack:
        node = stack.pop()
        edges = node.next_functions
        if not edges:  # (a leaf: AccumulateGrad, or a graph's end)
            if direct and id(getattr(node, "variable", None)) in direct:
                leaves.append(node)
            continue
        for position, edge in enumerate(edges):
            if edge in consumers:
                consumers[edge].append((node, position))
                continue
            consumers[edge] = [(node, position)]
            child = edge[0]
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return consumers, leaves


def _declared_axes(forward) -> dict:
    """:func:`~avionics.persample.graph_axes.traced_axes` from the first input of every call
    of ``forward`` whose module has a ``batch_first`` attribute (its axis is declared)."""
    from avionics.persample.graph_axes import traced_axes

    found: dict = {}
    for call in forward:
        first = call.inputs[0] if call.inputs else None
        declared = isinstance(getattr(call.module, "batch_first", None), bool)
        if declared and first is not None and first.grad_fn is not None:
            for key, a in traced_axes((first.grad_fn, first.output_nr), call.batch_axis).items():
                found[key] = a if found.get(key, a) == a else None
    return found


def _parameter_uses(leaf, consumers, preferred: int, declared=None) -> list[tuple] | None:
    """(broadcasting node, dh -> the parameter's per-sample gradients, :class:`UseAxes`) for
    each use of the parameter of ``leaf`` (:func:`_uses`, :func:`_per_sample`), the batch on
    the axis of dh that :func:`_use_batch_axes` finds; None where one has no closed form, no
    such axis, or a product couples it with a statistic of the batch (the generic rule says so)."""
    uses = _uses((leaf, 0), consumers, leaf.variable.shape)
    if uses is None:
        return None
    found = []
    for node, scale, views, shape in uses:
        axes = _use_batch_axes(node, shape, preferred, declared)
        if axes is None:
            return None
        axis, n = axes.axis, axes.sizes[axes.axis]
        if _reduces_over_batch(scale, axis, n):
            return None
        found.append((node, _per_sample(scale, views, shape, axes), axes))
    return found


class UseAxes:
    """Where the batch of a broadcasting node's output dh (shape ``sizes``) may be for one
    use of a shared parameter: ``candidates``, the axes the operand is broadcast along (a
    parameter every sample shares has the batch on one of them), and ``axis``, the one its
    per-sample map reduces over (checked against the batch size by :func:`check_use_axes`)."""

    def __init__(self, sizes: tuple, candidates: list[int], axis: int, traced: bool = False):
        self.sizes, self.candidates, self.axis = sizes, candidates, axis
        self.traced = traced  # whether ``axis`` was read off the graph (:func:`_declared_axes`)


def _use_batch_axes(node, shape, preferred: int, declared=None) -> UseAxes | None:
    """:class:`UseAxes` of the operand of ``shape`` at ``node``: the axes of the node's output
    where the operand, aligned to the right as broadcasting does, is missing or of size 1
    (pos[:T] of [T, 1, W] added to time-major [T, N, W]: axis 1 alone, whatever N and T).
    The batch axis is the one candidate, else the one a walk back through the graph from a
    module with a ``batch_first`` attribute finds on the node's output (``declared()``: the
    scale of time-major [T, N, W] read by a batch_first=False LSTM), else ``preferred`` (the
    root's) where it is one; None where none (no closed form: the generic rule)."""
    sizes = tuple(node._input_metadata[0].shape)
    offset = len(sizes) - len(shape)
    candidates = [a for a in range(len(sizes)) if a < offset or shape[a - offset] == 1]
    if len(candidates) == 1:
        return UseAxes(sizes, candidates, candidates[0])
    traced = None if declared is None else declared().get((id(node), 0))
    if traced in candidates:
        return UseAxes(sizes, candidates, traced, traced=True)
    if preferred in candidates:
        return UseAxes(sizes, candidates, preferred)
    return None


def check_shared_parameters(root: nn.Module, calls: dict, n: int) -> None:
    """Drop the per-sample gradients of the root's shared parameters (``calls``' one root
    call's ``shared_parameter_gradients``) that did not reduce over the batch axis of ``n``
    samples (:func:`check_use_axes`): the generic rule takes those parameters. The batch
    axis is known where the root has a ``batch_first`` attribute, or where every call that
    carries the batch has it on one axis (as the engine corrected them)."""
    roots = calls.get(root, [])
    if len(roots) != 1 or not roots[0].shared_parameter_axes:
        return
    flag = getattr(root, "batch_first", None)
    axes = {c.batch_axis for cs in calls.values() for c in cs if c.carries_batch(n)}
    known = (
        (0 if flag else 1) if isinstance(flag, bool) else (min(axes) if len(axes) == 1 else None)
    )
    gradients = roots[0].shared_parameter_gradients
    names = {id(p): name for name, p in root.named_parameters()}
    for key, uses in roots[0].shared_parameter_axes.items():
        if gradients.get(key) is not None and not check_use_axes(uses, n, known, names[key]):
            gradients[key] = None


def check_use_axes(uses: list[UseAxes], n: int, known: int | None, name: str) -> bool:
    """Whether each use of the shared parameter ``name`` (its :class:`UseAxes`) reduced over
    the batch axis of ``n`` samples: the axis used is the only candidate with ``n`` entries,
    or the model's ``known`` batch axis. False where no candidate has ``n`` entries (the
    parameter is not broadcast along the batch: the generic rule is taken); a ValueError where
    the axis used is another one, or one of several with ``n`` entries while the batch axis
    is not known (the backward reduced before the batch size was known)."""
    for use in uses:
        sized = [a for a in use.candidates if use.sizes[a] == n]
        if not sized:
            return False
        if use.axis != known and (use.axis not in sized or (len(sized) > 1 and not use.traced)):
            raise ValueError(
                f"The per-sample gradients of the parameter {name!r} need the batch axis of "
                f"the tensor of shape {tuple(use.sizes)} it is broadcast into along axes "
                f"{use.candidates}: axes {sized} have the batch size {n}, and the model's "
                f"modules do not agree on one batch axis (it was taken as axis {use.axis}). "
                "Give the model a `batch_first` attribute (True: the batch on axis 0 of its "
                "inputs, False: on axis 1)."
            )
    return True


def _direct_users(root: nn.Module, forward, owners) -> list[nn.Module]:
    """Modules whose parameters may be used directly in a forward: those not called in it
    (their parent uses them), and those the generic rule would handle (their own forward).
    ``owners``: :func:`parameter_owners` of ``root``."""
    called = {call.module for call in forward} | {root}
    return [
        m
        for m, generic in owners
        if m not in called or (_generic(m) if generic is None else generic)
    ]


def parameter_owners(root: nn.Module) -> list[tuple[nn.Module, bool | None]]:
    """(module, whether the generic rule handles it) for each module of ``root`` with
    parameters of its own; None for a recurrent module, whose rule depends on its train
    mode (:func:`~avionics.persample.rules.recurrent.reproducible`)."""
    from avionics.persample.rules.recurrent import RECURRENT

    return [
        (m, None if type(m) in RECURRENT else _generic(m))
        for m in root.modules()
        if next(m.parameters(recurse=False), None) is not None
    ]


def _generic(module: nn.Module) -> bool:
    """Whether the generic rule handles the parameters of ``module`` (its own forward)."""
    from avionics.persample.rules import GenericRule, rule_for  # (imports this module)

    names = [name for name, _ in module.named_parameters(recurse=False)]
    return rule_for(module, names) is GenericRule


# Nodes of one input whose backward maps the gradient of a view back to its base; a chain of
# them between a parameter and an addition is replayed per sample.
_VIEWS = {
    "SliceBackward0", "SelectBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
    "SqueezeBackward1", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
    "TBackward0", "TransposeBackward0", "PermuteBackward0", "ToCopyBackward0",
}  # fmt: skip


def _uses(edge, consumers, shape, views=()) -> list[tuple] | None:
    """(broadcasting node, scale, views from it back to ``edge``, the operand's shape) for
    every path from ``edge`` (a tensor of ``shape``) through views to an addition, an expand
    or a product (:func:`_broadcast_scale`); None where any consumer is none of them."""
    found = []
    for node, position in consumers.get(edge, ()):
        scale = _broadcast_scale(node, position)
        if scale is not None:
            found.append((node, scale, views, shape))
        elif node.name() in _VIEWS and len(node.next_functions) == 1:
            inner = _uses((node, 0), consumers, node._input_metadata[0].shape, (node, *views))
            if inner is None:
                return None
            found += inner
        else:
            return None
    return found


def _per_sample(scale: float, views: tuple, shape, axes: UseAxes):
    """dh (the node's gradient, batch on ``axes.axis``, n = its size there) -> the
    parameter's per-sample gradients [n, *parameter shape]: each sample's dh reduced to the
    operand's ``shape`` as broadcasting does, then through the views' backward."""
    shape, axis, n = tuple(shape), axes.axis, axes.sizes[axes.axis]
    # the operand's shape without the batch axis where it has one (of size 1 there)
    inside = axis - (len(axes.sizes) - len(shape))
    rest = shape[:inside] + shape[inside + 1 :] if inside >= 0 else shape

    def one(g: Tensor) -> Tensor:  # one sample's dh, without the batch axis
        g = g.sum_to_size(rest).reshape(shape)
        for view in views:
            g = view(g)
        return g

    def every_sample(g: Tensor) -> Tensor:  # ``one`` of all samples, where there are no views
        g = g.movedim(axis, 0)  # [n, *one sample's dh]
        padded = (1,) * (g.dim() - 1 - len(rest)) + rest
        return g.sum_to_size(n, *padded).reshape(n, *shape)

    reduce = every_sample if not views else vmap(one, in_dims=axis)

    def gradients(dh: Tensor) -> Tensor | None:
        if dh.dim() <= axis or dh.shape[axis] != n:
            return None
        if isinstance(scale, Tensor):  # a product's other operand, broadcast to dh
            if scale.dim() > dh.dim():
                return None
            return reduce(dh.detach() * scale.detach().expand_as(dh))
        return reduce(dh.detach() * scale)

    return gradients


def _addition_scale(node, position: int) -> float | None:
    """d(output)/d(operand ``position``) of an addition node (1, alpha or -alpha), else None."""
    kind = _ADDITIONS.get(node.name())
    if kind is None:
        return None
    second, alpha = kind
    if position != second:
        return 1.0
    value = float(getattr(node, alpha, 1))
    return -value if node.name() == "SubBackward0" else value


def _broadcast_scale(node, position: int) -> float | Tensor | None:
    """d(output)/d(operand ``position``) of a node that broadcasts a parameter's view into the
    batch: an addition's (:func:`_addition_scale`), 1 for an expand, the other operand for a
    product (a tensor); else None."""
    scale = _addition_scale(node, position)
    if scale is not None:
        return scale
    name = node.name()
    if name == "ExpandBackward0":
        return 1.0
    if name == "MulBackward0" and position in (0, 1):
        other = node._saved_other if position == 0 else node._saved_self
        return other if isinstance(other, Tensor) else None
    return None


# Backward nodes of reductions; those with a dim argument reduce over the batch when it holds
# the batch axis (saved as unsigned 64-bit integers where negative).
_REDUCTIONS = {"MeanBackward0", "SumBackward0", "MeanBackward1", "SumBackward1"}
_REDUCTIONS |= {"VarBackward0", "StdBackward0", "VarMeanBackward0", "StdMeanBackward0"}


def _reduces_over_batch(t, axis: int, n: int, budget: int = 256) -> bool:
    """Whether the graph that made ``t`` (a product's other operand) holds a reduction over
    the batch axis of a tensor with ``n`` samples there (``h - h.mean(0)``), among its first
    ``budget`` nodes: such a product couples the samples, and its closed form would hide it
    (the generic rule re-runs the forward per sample, which shows the coupling)."""
    if not isinstance(t, Tensor) or t.grad_fn is None:
        return False
    seen, frontier = set(), [t.grad_fn]
    while frontier and len(seen) < budget:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() in _REDUCTIONS:
            sizes = getattr(node, "_saved_self_sym_sizes", None)
            if sizes is None and isinstance(getattr(node, "_saved_self", None), Tensor):
                sizes = node._saved_self.shape
            dims = getattr(node, "_saved_dim", None)
            if sizes is not None and len(sizes) > axis and sizes[axis] == n:
                if dims is None or axis in {
                    (d - 2**64 if d >= 2**63 else d) % len(sizes) for d in dims
                }:
                    return True
        frontier += [next_node for next_node, _ in node.next_functions]
    return False


def _accumulator(call, index: int, scale: float):
    def prehook(grad_outputs):
        g = grad_outputs[0]
        if g is not None:
            g = g.detach() * scale if scale != 1 else g.detach()
            current = call.broadcast_grad_outputs[index]
            call.broadcast_grad_outputs[index] = g if current is None else current + g

    return prehook


def _parameter_accumulator(root_call, leaf, per_sample):
    key = id(leaf.variable)

    def prehook(grad_outputs):
        if grad_outputs[0] is None:
            return
        g = per_sample(grad_outputs[0])
        if g is None:  # the addition's gradient does not carry the batch: not shared
            root_call.shared_parameter_gradients[key] = None
            return
        gradients = root_call.shared_parameter_gradients
        if key not in gradients:
            gradients[key] = g
        elif gradients[key] is not None:
            gradients[key] = gradients[key] + g

    return prehook


class SharedParameterRule(Rule):
    """Parameters used directly in ``module``'s forward, each broadcast into the batch by
    additions, expands or products (or not used at all): their per-sample gradients
    ``gradients`` (from the captured backward, see :func:`hook_shared_outputs`, output-gradient
    factor 1 there), kept whole and scaled a chunk of samples at a time."""

    def __init__(
        self,
        module: nn.Module,
        calls,
        names: list[str],
        n: int,
        output_gradient_factor: float,
        gradients: list[Tensor],
    ):
        super().__init__(module, calls, names, n, output_gradient_factor)
        self.gradients = gradients

    def materialize(self, start: int, stop: int) -> list[Tensor]:
        return [g[start:stop] * self.output_gradient_factor for g in self.gradients]


# columns whose gradients at the use nodes are kept before they are mapped together
SHARED_PARAMETER_GROUP = 16


class SharedParameterColumnSums:
    """sum over backpropagated columns j of sum_n g_{n,j}^2 (with ``traces``, its sum_d) for
    parameters used directly in the forward (:func:`shared_parameter_uses`): g_{n,j} = sum over
    the parameter's uses of ``per_sample(dh_j)``, dh_j column j's gradient w.r.t. the use
    node's output, asked of autograd at :attr:`edges` in the column's backward (the closed
    forms of :class:`SharedParameterRule`, where the generic rule would re-run the whole model
    under vmap for every column). The columns' dh_j are kept and a group of
    :data:`SHARED_PARAMETER_GROUP` goes through each map at once (vmap over the columns:
    [K, *dh] -> [K, N, *p]), squared and summed over j and n, instead of one map per column."""

    def __init__(self, names: list[str], uses: list[list[tuple]], traces: bool):
        self.names, self.traces = names, traces
        at: dict[int, int] = {}  # id(node) -> its position in edges
        self.edges: list[GradientEdge] = []
        self.uses: list[list[tuple]] = []  # per name: [(edge position, per_sample)]
        for parameter_uses in uses:
            self.uses.append([])
            for node, per_sample in parameter_uses:
                if id(node) not in at:
                    at[id(node)] = len(self.edges)
                    self.edges.append(GradientEdge(node, 0))
                self.uses[-1].append((at[id(node)], per_sample))
        self.pending: list[list[Tensor | None]] = []
        self.totals: list[Tensor | None] = [None] * len(names)

    def add(self, grads: list[Tensor | None]) -> None:
        """One column: ``grads[i]`` is its gradient at ``edges[i]`` (None: none arrived)."""
        self.pending.append(list(grads))
        if len(self.pending) == SHARED_PARAMETER_GROUP:
            self._reduce()

    def _reduce(self) -> None:
        """The pending columns' squared per-sample gradients, added to the totals. A column
        without a gradient at an edge adds nothing there (a zero in the stack)."""
        columns, self.pending = self.pending, []
        stacked = [_stack([column[i] for column in columns]) for i in range(len(self.edges))]
        for k, parameter_uses in enumerate(self.uses):
            found = [
                vmap(per_sample)(stacked[i])
                for i, per_sample in parameter_uses
                if stacked[i] is not None
            ]
            if not found:
                continue
            g = sum(found[1:], found[0])  # [K, N, *p]
            s = g.square_().sum() if self.traces else g.square_().sum((0, 1))
            self.totals[k] = s if self.totals[k] is None else self.totals[k].add_(s)

    def result(self, scale: float) -> list[Tensor | None]:
        """``scale`` times the sums, one per name (None where no column reached the name)."""
        if self.pending:
            self._reduce()
        return [t.mul_(scale) if t is not None else None for t in self.totals]


def _stack(grads: list[Tensor | None]) -> Tensor | None:
    """[K, *dh] from the columns' gradients at one edge, zeros where one had none (None where
    no column had one)."""
    known = next((g for g in grads if g is not None), None)
    if known is None:
        return None
    zero = torch.zeros_like(known)
    return torch.stack([zero if g is None else g for g in grads])
