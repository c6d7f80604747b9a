"""The batch axis of each output of the micro-batches' calls, along which the merged call of
:mod:`avionics.step.accumulation` concatenates their outputs and output gradients.

An output's batch axis is its own, not its call's input's: a time-major model maps token ids
[T, N] to logits [N, C]. Output j of a call has the batch on axis a where, in every
micro-batch i, it has N_i entries on a and micro-batch 0's sizes on every other axis. Where
several axes qualify (micro-batches of one size N_i that equals T or C), the axis is, in this
order: the input's batch axis for a layer of a closed-form rule (Linear, convolutions,
Embedding, the normalisations, Hugging Face's Conv1D: each keeps its input's batch axis, and
its rule reads the output gradient there); the one a walk back from the calls whose input's
batch axis the engine decided finds on the output in micro-batch 0's autograd graph, through
operations that only move axes (:func:`~avionics.persample.graph_axes.traced_axes`: an
embedding's output read by a batch_first=False LSTM); that of an inner call whose output it
is (a model's logits are its head's); else the one a re-run of the module on its first
sample alone finds (:func:`~avionics.persample.rules.generic.output_batch_axes`, as the
generic rule does).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from avionics.persample.calls import ModuleCall
from avionics.persample.engine import producer_edge
from avionics.persample.graph_axes import traced_axes
from avionics.persample.rules import GenericRule, rule_for
from avionics.persample.rules.generic import output_batch_axes
from avionics.persample.rules.recurrent import RecurrentRule


def merged_output_axes(
    per_part: list[dict], sizes: list[int], name: Callable
) -> dict[int, list[int | None]]:
    """id(micro-batch 0's call) -> the batch axis of each of its outputs (None where the output
    does not carry the batch: a call every sample shares). ``per_part``: each micro-batch's
    calls by module, their input batch axes decided (the engine's ``find_batch_axes``);
    ``name(module)``: the module's name in the model (inner calls are decided first)."""
    axes: dict[int, list[int | None]] = {}
    pending = []  # (call, output index, candidate axes)
    for module in per_part[0]:
        for calls in zip(*(part[module] for part in per_part)):
            if any(c.shared or not c.carries_batch(n) for c, n in zip(calls, sizes)):
                axes[id(calls[0])] = [None] * len(calls[0].outputs)
                continue
            found = [_sized_axes(calls, j, sizes) for j in range(len(calls[0].outputs))]
            axes[id(calls[0])] = [a[0] if len(a) == 1 else None for a in found]
            pending += [(calls[0], j, a) for j, a in enumerate(found) if len(a) > 1]
    if pending:
        depth = {c.module: name(c.module).count(".") + bool(name(c.module)) for c, _, _ in pending}
        pending.sort(key=lambda p: -depth[p[0].module])  # (inner calls first)
        _decide(per_part[0], pending, axes, sizes[0])
    return axes


def _sized_axes(calls: list[ModuleCall], j: int, sizes: list[int]) -> list[int]:
    """The axes on which output ``j`` of each micro-batch's call has that micro-batch's
    number of samples, and the sizes of micro-batch 0's output on every other axis."""
    shapes = [tuple(c.outputs[j].shape) for c in calls]
    first = shapes[0]
    return [
        a
        for a in range(len(first))
        if all(
            len(s) == len(first) and s[a] == n and s[:a] + s[a + 1 :] == first[:a] + first[a + 1 :]
            for s, n in zip(shapes, sizes)
        )
    ]


def _decide(calls: dict, pending: list, axes: dict, n: int) -> None:
    """Fill in ``axes`` for the ``pending`` outputs (several candidate axes) of micro-batch 0
    (``n`` samples): see the module docstring."""
    traced = _traced(calls, n)
    known = {  # (id(node), output index) -> batch axis of the outputs decided so far
        key: axes[id(c)][j] for c, j, key in _output_keys(calls) if axes[id(c)][j] is not None
    }
    keys = {(id(c), j): key for c, j, key in _output_keys(calls)}
    for call, j, candidates in pending:
        key = keys.get((id(call), j))
        axis = call.batch_axis if _keeps_input_axis(call.module) else None
        if axis not in candidates:
            axis = traced.get(key)
        if axis not in candidates:
            axis = known.get(key)
        if axis not in candidates:
            axis = output_batch_axes(call, n)[j]
        axes[id(call)][j] = axis
        if key is not None:
            known[key] = axis


def _keeps_input_axis(module) -> bool:
    """Whether ``module``'s weight and bias take a closed-form per-layer rule, whose layer
    keeps its input's batch axis (not the generic rule, nor a recurrent one, whose final
    states hold the batch on axis 1 whatever ``batch_first`` says)."""
    return rule_for(module, ["weight", "bias"]) not in (GenericRule, RecurrentRule)


def _output_keys(calls: dict):
    """(call, output index, (id(node), output index of the node)) of each output in the graph."""
    for module_calls in calls.values():
        for call in module_calls:
            for produced, j in zip(call.nodes, call.node_outputs, strict=True):
                if not isinstance(produced, Tensor):
                    yield call, j, (id(produced[0]), produced[1])


def _traced(calls: dict, n: int) -> dict:
    """(id(node), output index) -> the batch axis the walks back from each call's first input
    (its batch axis decided) find on that tensor; None where two walks disagree."""
    stops = frozenset(key for _, _, key in _output_keys(calls))
    found: dict = {}
    for module_calls in calls.values():
        for reader in module_calls:
            if not reader.inputs or not reader.carries_batch(n):
                continue
            edge, axis = producer_edge(reader)
            if edge is None:
                continue
            for key, a in traced_axes(edge, axis, stops).items():
                found[key] = a if found.get(key, a) == a else None
    return found
