"""Gradient accumulation: k micro-batches of an optimiser step as one batch of their samples.

Micro-batch i of a step has its own forward and backward (of c_i times its loss). When the
last leaves its block, :func:`accumulated` combines them: N = sum_i N_i; for a mean-reduced
loss, weights w_i = N_i / N (the step's loss is the mean over all its samples, sum_i w_i L_i),
for a sum w_i = 1; the gradient is sum_i (w_i / c_i) grad_i; and the captured calls are merged
into those of one forward of the concatenated batch (:func:`merged_calls`), micro-batch i's
output gradients multiplied by f_i = (N_i for a mean, else 1) / c_i, so that the per-sample
gradients g_n are those of the one batch.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from avionics.persample.calls import ModuleCall
from avionics.persample.engine import find_batch_axes
from avionics.persample.rules.broadcast import UseAxes
from avionics.quantities.base import MicroBatch
from avionics.step.merged_axes import merged_output_axes
from avionics.step.precision import check_inputs_unchanged, check_rtol, detached_losses, in_float32
from avionics.step.values import Combined, Part


def accumulated(parts: list[Part], params: list, engine) -> Combined:
    """What the step's micro-batches add up to: their batch, loss and gradients as if they
    were one batch, each micro-batch's backward scale divided out (also the gradients with
    their graph, where their backwards kept one, for the curvature quantities)."""
    reduction = parts[0].reduction
    scales = [part.scale() for part in parts]
    n = sum(part.n for part in parts)
    weights = [part.n / n if reduction == "mean" else 1.0 for part in parts]
    # micro-batch i's g_n is its captured output gradient times f_i (as for one batch)
    factors = [(part.n if reduction == "mean" else 1) / c for part, c in zip(parts, scales)]
    loss = sum(w * part.loss.double() for w, part in zip(weights, parts)).to(parts[0].loss)
    per_unit = [w / c for w, c in zip(weights, scales)]
    gradients = weighted_sum([part.gradients for part in parts], per_unit)
    graphs = gradients
    if parts[0].graph is not None:
        graphs = weighted_sum([part.graph for part in parts], per_unit)
    calls, micro_batches, cast = None, None, None
    if all(part.capture is not None for part in parts):
        per_part = [part.capture.calls_by_module() for part in parts]
        for part_calls, part in zip(per_part, parts):
            check_inputs_unchanged(part_calls, engine)
            find_batch_axes(part_calls, part.n, engine.model)  # (each on its own samples)
        micro_batches = [
            MicroBatch(part_calls, part.info["individual_losses"], part.n / n)
            for part_calls, part in zip(per_part, parts)
        ]
        # (in float32 before the merge, so that each micro-batch's factor is applied in it)
        casts = [in_float32(part_calls, engine) for part_calls in per_part]
        cast = next((c for c in casts if c is not None), None)
        sizes = [part.n for part in parts]
        output_axes = merged_output_axes(per_part, sizes, engine.module_name)
        calls = merged_calls(per_part, sizes, factors, output_axes)
    return Combined(
        single=False,
        scale=1.0,
        scaled=any(c != 1 for c in scales),
        loss=loss,
        n=n,
        individual_losses=torch.cat([detached_losses(part.info) for part in parts]),
        gradients=gradients,
        graph=graphs,
        calls=calls,
        factor=1.0,
        check=weighted_sum([part.gradients for part in parts], factors),
        check_rtol=check_rtol(cast),
        unsynced=[p.grad.detach() if p.grad is not None else None for p in params],
        micro_batches=micro_batches,
    )


def merged_calls(
    per_part: list[dict], sizes: list[int], factors: list[float], output_axes: dict
) -> dict:
    """The calls of k micro-batches' forwards as those of one forward of their concatenated
    batch: call j of each module is the concatenation of the micro-batches' calls j, its
    inputs along the call's batch axis (tensors that do not carry a micro-batch's samples,
    such as a position table's indices, are taken from the first), each output and its
    gradient along the output's own batch axis (``output_axes``: :func:`~avionics.step.
    merged_axes.merged_output_axes`; a time-major model maps [T, N] to [N, C]), micro-batch
    i's output gradients multiplied by f_i, so that the merged calls' output-gradient factor
    is 1. The merged calls have no graph of their own: the curvature quantities read each
    micro-batch's."""
    modules = list(per_part[0])
    for i, part in enumerate(per_part[1:], start=1):
        if set(part) != set(modules) or any(len(part[m]) != len(per_part[0][m]) for m in modules):
            raise RuntimeError(
                f"Micro-batch {i} called the model's modules differently from micro-batch 0 "
                "(other modules, or a module another number of times): the step's micro-batches "
                "must run the same forward on their own samples."
            )
    return {
        m: [
            merged_call(calls, sizes, factors, output_axes[id(calls[0])])
            for calls in zip(*(part[m] for part in per_part))
        ]
        for m in modules
    }


def merged_call(
    calls: list[ModuleCall], sizes: list[int], factors: list[float], output_axes: list
) -> ModuleCall:
    """Call j of one module in each micro-batch, as one call on their concatenated batch
    (see :func:`merged_calls`; ``output_axes``: the batch axis of each output, None where
    every sample shares it)."""
    first = calls[0]
    axis = first.batch_axis
    # a call shared by all samples (its output broadcast into the batch: a position table)
    # has no tensor of the batch, whatever their sizes (the micro-batches' sizes may equal T)
    shared = any(c.shared or not c.carries_batch(n) for c, n in zip(calls, sizes))

    def batched(ts) -> bool:
        return not shared and all(
            t.dim() > axis
            and t.shape[axis] == n
            and t.shape[:axis] + t.shape[axis + 1 :]
            == ts[0].shape[:axis] + ts[0].shape[axis + 1 :]
            for t, n in zip(ts, sizes)
        )

    def merged(values, path):
        if isinstance(values[0], Tensor) and all(isinstance(v, Tensor) for v in values):
            if batched(values) and not _shared_mask(first.module, path, values[0]):
                return torch.cat(values, axis)
        return values[0]

    flat = [pytree.tree_flatten_with_path((c.args, c.kwargs)) for c in calls]
    spec = flat[0][1]
    leaves = [[leaf for _, leaf in pairs] for pairs, _ in flat]
    paths = [path for path, _ in flat[0][0]]
    args, kwargs = pytree.tree_unflatten(
        [merged(values, path) for values, path in zip(zip(*leaves), paths)], spec
    )
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    outputs, grad_outputs = [], []
    for j, (out, along) in enumerate(zip(first.outputs, output_axes, strict=True)):
        shapes = [c.outputs[j].shape for c in calls]
        shape = list(out.shape)
        if along is not None:
            shape[along] = sum(sizes)
        outputs.append(copy.copy(out))
        outputs[-1].shape = torch.Size(shape)
        grads = [c.grad_outputs[j] for c in calls]
        if all(g is None for g in grads):
            grad_outputs.append(None)
            continue
        if along is None:  # (an output every sample shares: its gradient is the sum)
            grad_outputs.append(sum(g * f for g, f in zip(grads, factors) if g is not None))
            continue
        grad_outputs.append(
            torch.cat(
                [
                    g * f if g is not None else torch.zeros(s, dtype=out.dtype, device=out.device)
                    for g, f, s in zip(grads, factors, shapes)
                ],
                along,
            )
        )
    call = ModuleCall(
        module=first.module,
        args=args,
        kwargs=kwargs,
        outputs=outputs,
        nodes=first.nodes,  # (only counted: the merged call's graph is not read)
        node_outputs=first.node_outputs,
        batch_axis=axis,
        inputs=inputs,
        input_versions=[t._version for t in inputs],
    )
    call.grad_outputs = grad_outputs
    call.shared = shared
    call.batch_axis_decided = True
    call.broadcast_grad_outputs = merged_broadcast(calls, factors, axis)
    merged_shared_parameters(call, calls, sizes, factors)
    call.summaries = added_summaries([c.summaries for c in calls])
    return call


def merged_shared_parameters(
    call: ModuleCall, calls: list[ModuleCall], sizes: list[int], factors: list[float]
) -> None:
    """The parameters used directly in the micro-batches' forwards, on the merged ``call``:
    each one's g_n (samples on axis 0), micro-batch i's times f_i, concatenated, and the
    :class:`~avionics.persample.rules.broadcast.UseAxes` of each of its uses with the sizes
    of the concatenated batch (:func:`merged_use_axes`), so that the engine's
    ``check_shared_parameters`` checks them against N as for one batch. A parameter the
    micro-batches used otherwise (other uses, reduced over other axes) gets None: the
    generic rule takes it, as one the check refuses."""
    keys = set(calls[0].shared_parameter_gradients)
    if any(set(c.shared_parameter_gradients) != keys for c in calls):
        return
    for k in keys:
        grads = [c.shared_parameter_gradients[k] for c in calls]
        uses = [c.shared_parameter_axes.get(k) for c in calls]
        merged = None if all(u is None for u in uses) else merged_use_axes(uses, sizes)
        if any(g is None for g in grads) or (merged is None and any(uses)):
            call.shared_parameter_gradients[k] = None
            continue
        call.shared_parameter_gradients[k] = torch.cat([g * f for g, f in zip(grads, factors)])
        if merged is not None:
            call.shared_parameter_axes[k] = merged


def merged_use_axes(uses: list[list | None], sizes: list[int]) -> list[UseAxes] | None:
    """One parameter's uses in each micro-batch (a list of ``UseAxes`` each) as those of one
    forward of the concatenated batch: the sizes of each use's broadcast output with N =
    sum_i N_i on every axis where each micro-batch has its N_i (where a micro-batch's size
    equals another size there, the check is as strict as for a batch of that size). None
    where the micro-batches' uses differ (another number of them, other candidate axes,
    another axis reduced over)."""
    if any(u is None or len(u) != len(uses[0]) for u in uses):
        return None
    merged = []
    for per_part in zip(*uses):
        first = per_part[0]
        same = [(u.candidates, u.axis, u.traced, len(u.sizes)) for u in per_part]
        if any(s != same[0] for s in same):
            return None
        shape = tuple(
            sum(sizes) if all(u.sizes[a] == n for u, n in zip(per_part, sizes)) else size
            for a, size in enumerate(first.sizes)
        )
        merged.append(UseAxes(shape, first.candidates, first.axis, first.traced))
    return merged


def _shared_mask(module, path, t: Tensor) -> bool:
    """Whether ``t`` (at ``path`` in a call's (args, kwargs)) is the 2-D ``attn_mask`` [L, S]
    of an ``nn.MultiheadAttention``, which every sample shares (a batched mask is 3-D), also
    where a micro-batch's size equals L."""
    named = any(getattr(key, "key", None) == "attn_mask" for key in path)
    return isinstance(module, torch.nn.MultiheadAttention) and named and t.dim() == 2


def merged_broadcast(calls: list[ModuleCall], factors: list[float], axis: int) -> list:
    """The per-sample output gradients of a shared call's outputs broadcast into the batch
    (``broadcast_grad_outputs``, batch on ``axis``): micro-batch i's times f_i, concatenated
    (empty where a micro-batch has none)."""
    per_call = [c.broadcast_grad_outputs for c in calls]
    if not per_call[0] or any(len(b) != len(per_call[0]) for b in per_call):
        return []
    merged = []
    for grads in zip(*per_call):
        if any(g is None for g in grads):
            merged.append(None)
        else:
            merged.append(torch.cat([g * f for g, f in zip(grads, factors)], axis))
    return merged


def added_summaries(per_call: list[list[tuple]]) -> list[tuple]:
    """The output visitors' summaries of one root call in each micro-batch as those of one
    forward of their concatenated batch: each summary's tensors added over the micro-batches
    (a summary holds counts and sums over its call's samples, added over the processes too).
    The micro-batches' forwards call the same modules in the same order (the merged calls
    require it), so their summaries pair up in order."""
    first = per_call[0]
    for summaries in per_call[1:]:
        if [(v, m) for v, m, _ in summaries] != [(v, m) for v, m, _ in first]:
            raise RuntimeError(
                "The micro-batches' forwards ran different activation modules, so their "
                "output summaries (ActivationHealth) cannot be added: give every micro-batch "
                "of a step the same forward, or leave out the quantities that read module "
                "outputs."
            )
    added = []
    for j, (visit, module, summary) in enumerate(first):
        others = [summaries[j][2] for summaries in per_call[1:]]
        total = pytree.tree_map(lambda *ts: sum(ts[1:], ts[0]), summary, *others)
        added.append((visit, module, total))
    return added


def weighted_sum(lists: list[list[Tensor | None] | None], weights: list[float]) -> list:
    """sum_i w_i t_i per parameter (None where no t_i is)."""
    out = []
    for k in range(len(next(l for l in lists if l is not None))):
        terms = [(w, l[k]) for l, w in zip(lists, weights) if l is not None and l[k] is not None]
        out.append(sum(w * t for w, t in terms) if terms else None)
    return out
