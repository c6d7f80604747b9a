"""The per-sample engine: the capture of a step, its captured step, and their check.

For every tracked parameter the engine's :class:`~avionics.persample.routing.Routing` finds
the module calls its gradient flows through (the modules that register it, or the nearest
called ancestor that adopts it); the statistics themselves come from one
:class:`~avionics.persample.step.CapturedStep` a step. On the first step, and whenever the
pattern of calls changes, the sum over samples of the result is checked against autograd's
gradient. A parameter whose check fails (it is also used outside the modules that own it) is
handled from then on by the root module's generic rule, which covers every use in the
forward.

A parameter with one contribution gets its statistics from that rule's closed forms; one with
several (tied weights, adopted parameters) is materialised in chunks, summed over its
contributions, and reduced, because ||a + b||^2 is not ||a||^2 + ||b||^2. Projections alone
are linear, (a + b) . v = a . v + b . v: a request of directions only sums each contribution's
closed form instead.

A direction may be given, per parameter, as a :class:`~avionics.persample.rules.factored.
FactoredDirection` (the factors of a mean of outer products, which Alpha keeps for plain SGD);
the bilinear rules project onto it directly, every other path receives it as a tensor.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from avionics.persample.calls import ModuleCall
from avionics.persample.capture import Capture, at_least_float32, batch_axes
from avionics.persample.graph_axes import traced_axes
from avionics.persample.precision import computing, computing_dtype
from avionics.persample.routing import Routing
from avionics.persample.rules.broadcast import check_shared_parameters, parameter_owners
from avionics.persample.step import CapturedStep

# Elements of one slice of the gradient check's differences (1 MiB in float32).
CHECK_CHUNK = 2**18
# Relative tolerance of the check of summed per-sample gradients against autograd's.
CHECK_RTOL = {torch.float64: 1e-8, torch.float32: 1e-3}


class PerSampleEngine(Routing):
    """Per-sample statistics of ``params`` (parameters of ``model``), one step at a time: the
    :class:`~avionics.persample.routing.Routing` of their gradients, the capture of a step
    (:meth:`capture`) and its :class:`~avionics.persample.step.CapturedStep` (:meth:`step`),
    checked against autograd's gradient."""

    def __init__(self, model: nn.Module, params: list[Tensor]):
        super().__init__(model, params)
        self._checked_pattern: tuple | None = None
        self._batchnorms = [
            m for m in self._names if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]
        self._warned: set[nn.Module] = set()  # modules already warned about
        self._watched: list[nn.Module] | None = None  # what capture() watches, found once
        self._axes: dict[nn.Module, int] = {}  # each module's batch axis (capture.batch_axes)
        self._owners: list = []  # the broadcast rule's parameter_owners of the model
        # (the key of the last step's calls, the batch axes found for them): see _batch_axes
        self._found_axes: tuple[tuple, list[int]] | None = None

    def capture(self) -> Capture:
        """A capture watching every module that owns a tracked parameter, and its ancestors."""
        if self._watched is None:  # (the model's structure is that of the engine's creation)
            watched = set()
            for owners in self.owners:
                for m, _ in owners:
                    while m is not None and m not in watched:
                        watched.add(m)
                        m = self._parent.get(m)
            self._watched = sorted(watched, key=lambda m: self._names[m])
            self._axes = batch_axes(self.model)
            self._owners = parameter_owners(self.model)
        return Capture(self.model, self._watched, self._axes, self._owners, self._names)

    # ----------------------------------------------------------------------------------------
    def step(
        self,
        calls: dict[nn.Module, list[ModuleCall]],
        n: int,
        output_gradient_factor: float,
        gradients: list[Tensor | None] | None = None,
        rtol: float | None = None,
    ) -> CapturedStep:
        """The captured step of ``calls`` (see :class:`~avionics.persample.step.CapturedStep`).

        With ``gradients`` (``gradients[k]``: what parameter k received in the captured
        backward), the routing is first checked against them when the pattern of calls is new
        (:meth:`check`); a parameter that fails is routed through the root's generic rule.
        ``rtol``: the check's relative tolerance, where the captured tensors are less precise
        than the gradients (a forward under autocast; default by the gradients' dtype, or by
        that of the 16-bit captured tensors).

        Captured 16-bit tensors (a half-precision model, autocast) are cast to float32 first:
        every statistic is computed in float32 or better.
        """
        self._warn_batch_statistics()
        cast = at_least_float32(calls, self.module_name)
        if cast is not None and rtol is None:
            rtol = 4 * torch.finfo(cast).eps  # (the backward rounded each product to it)
        self._batch_axes(calls, n)
        check_shared_parameters(self.model, calls, n)
        step = CapturedStep(self, calls, n, output_gradient_factor)
        if gradients is not None and self.needs_check(calls) and self.check(step, gradients, rtol):
            step = CapturedStep(self, calls, n, output_gradient_factor)  # rerouted
            self._warn_coupled(step, gradients)
        return step

    def _batch_axes(self, calls: dict[nn.Module, list[ModuleCall]], n: int) -> None:
        """Set each call's batch axis by :func:`find_batch_axes`, or, where the calls have
        the key (:func:`_axes_key`) of the last step's, to the axes found for it: the search
        reads sizes and the autograd graph (a walk of it where N equals another size, 0.4-2
        ms a step on the transformers), the same each step while the shapes repeat."""
        key = _axes_key(calls, n)
        every = [call for module_calls in calls.values() for call in module_calls]
        if self._found_axes is not None and self._found_axes[0] == key:
            for call, axis in zip(every, self._found_axes[1], strict=True):
                call.batch_axis = axis
            return
        self._found_axes = None  # (kept only once found: the search may refuse the calls)
        find_batch_axes(calls, n, self.model)
        self._found_axes = key, [call.batch_axis for call in every]

    def _warn_batch_statistics(self) -> None:
        """Warn once per module of each BatchNorm that normalises with batch statistics."""
        for module in self._batchnorms:
            uses_batch = module.training or module.running_mean is None
            if uses_batch and module not in self._warned:
                self._warned.add(module)
                warnings.warn(
                    f"Module '{self.module_name(module)}' ({type(module).__name__}) normalises "
                    "with the statistics of the whole batch (train mode), so per-sample "
                    "gradients are not defined. avionics computes each sample's share of the "
                    "batch gradient (sample n's term in backpropagation), which sums to the true "
                    "gradient. A curvature quantity's GGN columns are shared out the same way, "
                    "so its diagonal also depends on which factor of the loss Hessian is "
                    "backpropagated (avionics/curvature/step/loss_root.py). Put BatchNorm "
                    "layers in eval mode for exact per-sample statistics and curvature.",
                    stacklevel=6,
                )

    def _warn_coupled(self, step: CapturedStep, gradients: list[Tensor | None]) -> None:
        """After rerouting: parameters whose per-sample gradients through the root's generic
        rule (the model applied to one sample at a time) still do not sum to the batch
        gradient. The forward couples the samples (a statistic over the batch)."""
        coupled = [self._param_name(k) for k in self._mismatched(step, gradients)]
        if coupled:
            warnings.warn(
                "The per-sample gradients of "
                f"{', '.join(coupled[:8])}{' ...' if len(coupled) > 8 else ''} do not sum to "
                "the batch gradient: the model's forward couples the samples of a batch (e.g. "
                "h - h.mean(0), or another statistic over the batch axis), so a sample's "
                "gradient is not defined. What is computed for them is the gradient of the "
                "model applied to each sample alone.",
                stacklevel=6,
            )

    # ----------------------------------------------------------------------------------------
    def needs_check(self, calls: dict[nn.Module, list[ModuleCall]]) -> bool:
        return self._pattern(calls) != self._checked_pattern

    def _pattern(self, calls) -> tuple:
        return tuple(sorted((self._names[m], len(c)) for m, c in calls.items()))

    def check(self, step: CapturedStep, gradients: list[Tensor | None], rtol=None) -> bool:
        """Compare sum_n g_n of ``step`` with autograd's gradient (times the output-gradient
        factor); route mismatches through the root's generic rule. Whether any was rerouted.

        ``gradients[k]`` is the gradient parameter k received in the captured backward.
        """
        rerouted = False
        for k in self._mismatched(step, gradients, skip=self._from_root, rtol=rtol):
            if self.model not in step.calls:
                raise RuntimeError(
                    f"Parameter '{self._param_name(k)}' receives gradient from uses "
                    "outside the modules that own it, and the model's own forward was "
                    "not captured. Call the model (not its submodules) in the forward."
                )
            self._from_root.add(k)
            rerouted = True
        self._checked_pattern = self._pattern(step.calls)
        return rerouted

    def _mismatched(
        self, step: CapturedStep, gradients: list[Tensor | None], skip=frozenset(), rtol=None
    ) -> list[int]:
        """The parameters (not in ``skip``) whose sum_n g_n differs from their gradient.

        The sums come rule by rule (:meth:`CapturedStep.totals`) and each is compared as soon
        as its parameter's last contribution has arrived, a slice at a time: one rule's sums
        (and the running sums of tied weights still waiting for a contribution) are alive at
        a time, not a model-sized set of sums and differences."""
        mismatched = []
        factor = step.output_gradient_factor
        checked = [k for k, g in enumerate(gradients) if g is not None and k not in skip]
        with torch.no_grad():
            # absolute slack relative to the whole gradient: a parameter whose gradient is
            # zero up to rounding (a bias before BatchNorm) must not fail the check
            total_norm = sum(_norm(gradients[k]).square() for k in checked) ** 0.5 * factor
            left = {k: len(step.contributions[k]) for k in checked}
            summed: dict[int, Tensor] = {}  # k -> sum of its contributions so far (tied)

            def compare(k: int, total: Tensor | None) -> None:
                actual = gradients[k]
                tol = max(CHECK_RTOL.get(actual.dtype, 1e-2), rtol or 0)
                atol = 100 * torch.finfo(actual.dtype).eps * total_norm
                if _difference_norm(total, actual, factor) > tol * factor * _norm(actual) + atol:
                    mismatched.append(k)

            for k in [k for k in checked if left[k] == 0]:  # no contribution: g_n = 0
                compare(k, None)
            for k, total in step.totals():
                if k not in left:
                    continue
                left[k] -= 1
                if k in summed or left[k] > 0:
                    total = summed[k].add_(total) if k in summed else total.clone()
                    summed[k] = total
                if left[k] == 0:
                    summed.pop(k, None)
                    compare(k, total)
        return sorted(mismatched)


def _norm(t: Tensor) -> Tensor:
    """||t||, of a 16-bit tensor accumulated and returned in float32 (no overflow of float16's
    largest value 65504 by the sum of squares)."""
    return torch.linalg.vector_norm(t, dtype=computing_dtype(t.dtype))


def _difference_norm(total: Tensor | None, actual: Tensor, factor: float) -> Tensor:
    """||total - factor * actual|| (total None: zero), a slice at a time: the temporaries
    are of :data:`CHECK_CHUNK` elements, not of the parameter's size."""
    total_flat = None if total is None else total.reshape(-1)
    actual_flat = actual.reshape(-1)
    square = actual_flat.new_zeros((), dtype=torch.float64)
    for start in range(0, actual_flat.numel(), CHECK_CHUNK):
        part = computing(actual_flat[start : start + CHECK_CHUNK]) * -factor
        if total_flat is not None:
            part += total_flat[start : start + CHECK_CHUNK]
        square += torch.linalg.vector_norm(part).double().square()
    return square.sqrt()


def _axes_key(calls: dict[nn.Module, list[ModuleCall]], n: int) -> tuple:
    """What :func:`find_batch_axes` reads of a step's calls, but for their autograd graph:
    N and, per call in order, its module, its ``batch_first``, the axis it inherited, whether
    it is shared by all samples, the shapes of its inputs and outputs, the sequences of a
    packed first input, its outputs' places in the graph's nodes, and which call's first
    input (by position in this key) its own first input is. Two steps with the same key find
    the same axes where the forward builds the same graph for the same shapes and modules (as
    the engine's routing assumes: it is checked when the pattern of calls changes)."""
    firsts: dict[int, int] = {}  # id(first input) -> the position of the first call with it
    key: list = [n]
    for module, module_calls in calls.items():
        for call in module_calls:
            first = call.args[0] if call.args else None
            packed = int(first.batch_sizes[0]) if isinstance(first, PackedSequence) else None
            shared_input = firsts.setdefault(id(call.inputs[0]), len(key)) if call.inputs else None
            key.append((
                module, getattr(module, "batch_first", None), call.batch_axis, call.shared,
                tuple(t.shape for t in call.inputs), tuple(o.shape for o in call.outputs),
                packed, tuple(call.node_outputs), shared_input,
            ))  # fmt: skip
    return tuple(key)


def find_batch_axes(calls: dict[nn.Module, list[ModuleCall]], n: int, root: nn.Module) -> None:
    """Correct the batch axis of each call whose first input does not have the ``n`` samples
    on the axis inherited from its ancestors' ``batch_first`` but on exactly one other axis
    (time-major token ids [T, N] given to an nn.Embedding before a batch_first=False RNN; a
    head's [N, D] input below a root with ``batch_first=False``), and of each call whose
    first input has N entries on several axes (time-major [T, N] with T == N) by the call
    that reads its output or shares its input (:func:`_propagated_axes`).

    Never for a call found shared by all samples (:attr:`ModuleCall.shared`), nor for a
    first input of size 1 on the inherited axis where the model's input has the batch there:
    that axis is broadcast, and a size equal to N on another axis is a coincidence (BERT's
    position ids [1, T] with T == N are shared, not a batch on axis 1)."""
    root_calls = calls.get(root, [])
    batch_where_inherited = bool(root_calls) and all(c.carries_batch(n) for c in root_calls)
    ambiguous = []
    for module_calls in calls.values():
        for call in module_calls:
            if not call.inputs or call.shared or call.batch_axis_decided:
                continue
            shape = call.inputs[0].shape
            axes = [a for a, size in enumerate(shape) if size == n]
            if len(axes) > 1 and not isinstance(getattr(call.module, "batch_first", None), bool):
                ambiguous.append((call, axes))
                continue
            if call.carries_batch(n):
                continue
            broadcast = len(shape) > call.batch_axis and shape[call.batch_axis] == 1
            if broadcast and batch_where_inherited:
                continue
            if len(axes) == 1:
                call.batch_axis = axes[0]
    if ambiguous:
        _refuse_contradicted(calls, _propagated_axes(calls, ambiguous, root), n, root)


def _propagated_axes(
    calls: dict, ambiguous: list[tuple[ModuleCall, list[int]]], root: nn.Module
) -> list[tuple[ModuleCall, list[int]]]:
    """The batch axis of calls whose first input has N entries on several ``axes``, from the
    calls whose axis is known, until nothing changes: a call whose output the first input of
    a known call is computed from (directly, through operations that only move axes, such as
    x.transpose(0, 1), :func:`~avionics.persample.graph_axes.traced_axes`, or packed by
    ``pack_padded_sequence``, whose ``batch_first`` autograd keeps) and whose output keeps its
    input's leading axes takes the axis that walk finds (an nn.Embedding of token ids [N, N]
    transposed into a batch_first=False RNN); a call whose
    first input is a known call's first input takes its axis (the root and that embedding).
    A call left undecided takes the axis of the nearest enclosing module of ``root`` whose
    calls are all decided (:func:`_enclosing_axes`: the Linear layers of an
    nn.TransformerEncoderLayer, which has no ``batch_first`` attribute of its own, below the
    layer found time-major), else keeps its inherited axis. The calls left undecided, with
    their candidate axes."""
    pending = {id(call): (call, axes) for call, axes in ambiguous}
    known = [c for cs in calls.values() for c in cs if id(c) not in pending and c.inputs]
    outputs = frozenset(
        (id(produced[0]), produced[1])
        for cs in calls.values()
        for c in cs
        for produced in c.nodes
        if not isinstance(produced, Tensor)
    )
    while pending and known:
        found = []
        for reader in known:
            into, axis = producer_edge(reader)
            traced = {} if into is None else traced_axes(into, axis, outputs)
            for key, (call, axes) in list(pending.items()):
                same_input = call.inputs[0] is reader.inputs[0]
                if same_input and reader.batch_axis in axes:
                    call.batch_axis = reader.batch_axis
                elif (axis := _traced_axis(call, traced)) is not None and axis in axes:
                    call.batch_axis = axis
                else:
                    continue
                found.append(pending.pop(key)[0])
        known = found
    return _enclosing_axes(calls, pending, root)


def _enclosing_axes(
    calls: dict, pending: dict, root: nn.Module
) -> list[tuple[ModuleCall, list[int]]]:
    """The batch axis of each call in ``pending`` (id -> (call, its candidate axes)): that of
    the nearest enclosing module of ``root`` with calls, all decided, on one axis among the
    call's candidates; the call keeps its axis where the nearest such module has none. The
    calls that keep it, with their candidate axes."""
    if not pending:
        return []
    undecided = []
    parents = {child: parent for parent in root.modules() for child in parent.children()}
    for call, axes in pending.values():
        module = parents.get(call.module)
        while module is not None and not calls.get(module):
            module = parents.get(module)
        around = calls.get(module, [])
        found = {c.batch_axis for c in around}
        if any(id(c) in pending for c in around) or len(found) != 1 or not found <= set(axes):
            undecided.append((call, axes))
            continue
        call.batch_axis = found.pop()
    return undecided


def _refuse_contradicted(calls: dict, undecided: list, n: int, root: nn.Module) -> None:
    """A ValueError for the calls left ``undecided`` (the first input has N entries on several
    axes, nothing in the step tells which is the batch's: time-major token ids [T, N] with
    T == N, the embedding's output reaching the RNN through a function, not a module) that
    keep their inherited axis while another call of the step has the batch on another of
    those axes (the RNN's axis 1), where their modules have parameters of their own: the
    per-sample gradients of those would be taken over the wrong axis (the time steps')."""
    left = {id(call) for call, _ in undecided}
    decided = {
        c.batch_axis
        for cs in calls.values()
        for c in cs
        if id(c) not in left and c.carries_batch(n)
    }
    params = {id(p): name for name, p in root.named_parameters()}
    named, contradicted = [], None
    for call, axes in undecided:
        others = decided.intersection(axes) - {call.batch_axis}
        own = [params[id(p)] for p in call.module.parameters(recurse=False) if id(p) in params]
        if others and own:
            named += [name for name in own if name not in named]
            contradicted = contradicted or (call, axes, min(others))
    if contradicted is not None:
        call, axes, other = contradicted
        where = next(name for name, m in root.named_modules() if m is call.module)
        raise ValueError(
            f"The per-sample gradients of {', '.join(map(repr, named))} need the batch axis of "
            f"the input of shape {tuple(call.inputs[0].shape)} of "
            f"{repr(where) if where else 'the model'}: axes {axes} have the "
            f"batch size {n}, and the model's modules do not agree on one (some have it on "
            f"axis {other}, it was taken as axis {call.batch_axis}). Give the model a "
            "`batch_first` attribute (True: the batch on axis 0 of its inputs, False: on axis 1)."
        )


def producer_edge(call: ModuleCall) -> tuple[object | None, int]:
    """(the autograd edge (node, output index) of the call's first input, or None, and the
    batch axis of that tensor): through ``pack_padded_sequence`` (and its sorting
    ``index_select``) for a PackedSequence."""
    first = call.args[0] if call.args else None
    if isinstance(first, PackedSequence):
        node = first.data.grad_fn
        if node is None or type(node).__name__ != "PackPaddedSequenceBackward0":
            return None, 0
        axis = 0 if node._saved_batch_first else 1
        edge = node.next_functions[0]
        if edge[0] is not None and type(edge[0]).__name__ == "IndexSelectBackward0":
            edge = edge[0].next_functions[0]
        return (edge if edge[0] is not None else None), axis
    first = call.inputs[0]
    return (
        (first.grad_fn, first.output_nr) if first.grad_fn is not None else None
    ), call.batch_axis


def _traced_axis(call: ModuleCall, traced: dict) -> int | None:
    """The batch axis ``traced`` (:func:`~avionics.persample.graph_axes.traced_axes`) finds
    on an output of ``call`` that has the call's first input's sizes on its axes 0..axis (an
    embedding, a Linear or an elementwise module: the input has the batch there too), or
    None."""
    shape = call.inputs[0].shape
    for produced, i in zip(call.nodes, call.node_outputs, strict=True):
        if isinstance(produced, Tensor):
            continue
        axis = traced.get((id(produced[0]), produced[1]))
        out = call.outputs[i].shape
        if axis is not None and len(out) > axis and out[: axis + 1] == shape[: axis + 1]:
            return axis
    return None
