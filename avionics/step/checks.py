"""The checks of a tracked step: everything that can be checked is, before anything changes.

At construction: the quantities, the parameters and the steps given. On entering a step
(before the backward): the step number, the micro-batch numbering, ``info`` (each active
quantity's keys and checks, the loss and how it reduces the per-sample losses), that the
per-sample losses lead to the captured forward, and each quantity's check of that forward.
After the backward: that it kept the graph the curvature quantities need.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

from avionics.persample.capture import output_edge
from avionics.quantities.base import Quantity
from avionics.records.sink import Sink
from avionics.step.values import Accumulation


def check_step(step, last: int | None, restored: bool, quantities: list) -> None:
    """``step`` is a new step number: after the last tracked one (a first step past 1 of a
    cockpit with no restored state warns of what starts afresh)."""
    if not is_step(step):
        raise TypeError(f"cockpit(step, ...) needs the step as a non-negative int, got {step!r}.")
    if last is None:
        if step > 1 and not restored:  # a loop counting from 1 starts afresh
            _warn_fresh_start(step, quantities)
    elif step == last:
        raise ValueError(
            f"Step {step} was already tracked. A second `with cockpit({step}, ...)` block "
            "would overwrite the first one's values: track each optimizer step once, around "
            "one backward, or, for gradient accumulation over k micro-batches, give each "
            "micro-batch's block micro_batch=i, micro_batches=k."
        )
    elif step < last:
        raise ValueError(
            f"Step {step} comes after step {last}: step numbers must increase (the values "
            "of a step are stored under its number). A resumed run continues from the "
            "checkpoint's next step."
        )


def _warn_fresh_start(step: int, quantities: list) -> None:
    """A run starting at step > 0 without a restored state: say what starts afresh."""
    stateful = [q.name for q in quantities if type(q).state_dict is not Quantity.state_dict]
    if stateful:
        warnings.warn(
            f"The first tracked step is {step}, but no state was restored: "
            f"{', '.join(stateful)} start afresh here"
            + (
                f" (Distance measures from step {step}'s parameters)"
                if "Distance" in stateful
                else ""
            )
            + ". To continue a resumed run, save Cockpit.state_dict() with the checkpoint "
            "and call load_state_dict on the new cockpit.",
            stacklevel=6,
        )


def check_micro_batch(acc: Accumulation | None, step, i, k) -> Accumulation | None:
    """The accumulation ``acc`` that micro-batch ``i`` of ``k`` continues (None for the first);
    raises, before anything changes, where i and k do not follow the protocol."""
    for name, value in (("micro_batch", i), ("micro_batches", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"cockpit(step, info, {name}=...) takes an int, got {value!r} "
                f"({type(value).__name__})."
            )
    if k < 1:
        raise ValueError(
            f"micro_batches={k}: an optimizer step has at least one micro-batch (the "
            "default, 1, is one batch)."
        )
    if not 0 <= i < k:
        raise ValueError(
            f"micro_batch={i} with micro_batches={k}: number the micro-batches of a step "
            f"0, ..., {k - 1}."
        )
    if i == 0:
        if acc is not None:
            raise ValueError(
                f"Step {step}, micro-batch 0: step {acc.step} has had micro-batches "
                f"0, ..., {acc.index} of {acc.k} so far; enter its micro-batch "
                f"{acc.index + 1} next (an exception inside a block abandons its step)."
            )
        return None
    if acc is None:
        raise ValueError(
            f"Step {step}, micro-batch {i}: no micro-batch 0 of this step came before; "
            "start each optimizer step at micro_batch=0."
        )
    if (step, k, i) != (acc.step, acc.k, acc.index + 1):
        raise ValueError(
            f"Step {step}, micro-batch {i} of {k}: expected step {acc.step}, micro-batch "
            f"{acc.index + 1} of {acc.k} (the micro-batches of a step come in order, with "
            "the step and micro_batches of its micro-batch 0)."
        )
    return acc


def check_info(step: int, info, active: list) -> tuple[str, int | None]:
    """``info`` holds what the active quantities read, as they read it (each quantity's own
    check too); returns how the loss reduces the per-sample losses, and N (None if unknown)."""
    if not isinstance(info, dict):
        raise TypeError(f"cockpit(step, info=...) needs a dict, got {type(info).__name__}.")
    if "loss" not in info:
        raise KeyError(f"Step {step}: info['loss'] is required on every tracked step.")
    for q in active:
        for key in q.required_info(step):
            if key not in info:
                raise KeyError(
                    f"Step {step}: {q.name} reads info['{key}'], which is missing. Pass it "
                    f"in cockpit(step, info={{..., '{key}': ...}}) or remove {q.name}."
                )
    loss = info["loss"]
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(f"info['loss'] must be a scalar tensor, got {loss!r}.")
    optimizer = info.get("optimizer")
    if optimizer is not None and not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            "info['optimizer'] must be the optimizer that takes the step (a "
            f"torch.optim.Optimizer, or an object with a step() method), got "
            f"{type(optimizer).__name__}."
        )
    n = info.get("batch_size")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise TypeError(
            f"info['batch_size'] must be the number of samples in the batch, a positive "
            f"int; got {n!r} ({type(n).__name__})."
        )
    losses = info.get("individual_losses")
    if losses is None:
        reduction = "mean"
    else:
        if not isinstance(losses, Tensor) or losses.dim() != 1:
            raise ValueError(
                "info['individual_losses'] must be the per-sample losses, a tensor of shape "
                f"[N]; got {getattr(losses, 'shape', type(losses).__name__)}."
            )
        if losses.dtype != loss.dtype:
            raise TypeError(
                f"info['individual_losses'] is {losses.dtype} but info['loss'] is "
                f"{loss.dtype}: pass the per-sample losses the loss is computed from, as "
                "they are (losses = criterion(out, y, reduction='none'); loss = "
                "losses.mean())."
            )
        if n is not None and n != len(losses):
            raise ValueError(
                f"info['batch_size'] is {n} but info['individual_losses'] has "
                f"{len(losses)} entries; they must agree."
            )
        reduction, n = reduction_of(loss, losses), len(losses)
    for q in active:
        q.validate(step, info)
    return reduction, n


# the autograd nodes of a loss that is the mean or the sum of all the per-sample losses
_REDUCTION_NODES = {
    "MeanBackward0": "mean",
    "MeanBackward1": "mean",
    "SumBackward0": "sum",
    "SumBackward1": "sum",
}


def reduction_of(loss: Tensor, losses: Tensor) -> str:
    """'mean' or 'sum', from how ``loss`` relates to the per-sample ``losses``: from the
    graph where ``loss`` is ``losses.mean()`` or ``losses.sum()`` itself (of a 1-d tensor,
    over every entry), else from their values (one host transfer)."""
    node = loss.grad_fn
    if node is not None and losses.grad_fn is not None and len(node.next_functions) == 1:
        reduction = _REDUCTION_NODES.get(type(node).__name__)
        if reduction is not None and node.next_functions[0][0] is losses.grad_fn:
            return reduction
    loss, losses = loss.detach(), losses.detach()
    value, total = torch.stack([loss.reshape(()), losses.sum()]).double().tolist()
    mean = total / len(losses)
    # (16-bit losses of a forward under autocast: to their precision)
    rtol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(loss.dtype, 1e-2)
    if not math.isfinite(value) or abs(value - mean) <= 2 * rtol * abs(mean):
        return "mean"
    if abs(value - total) <= 2 * rtol * abs(total):
        return "sum"
    raise ValueError(
        f"info['loss'] = {value:.6g} is neither the mean ({mean:.6g}) nor the sum "
        f"({total:.6g}) of info['individual_losses']. Pass the loss you backpropagate "
        "and the per-sample losses it is the mean or sum of."
    )


def check_micro_batch_info(step, i, info, reduction, n, parts) -> None:
    """Every micro-batch of a step gives its number of samples and reduces alike."""
    if n is None:
        raise ValueError(
            f"Step {step}, micro-batch {i}: with micro_batches > 1 each micro-batch weighs by "
            "its samples; pass info['batch_size'] or info['individual_losses']."
        )
    if parts and reduction != parts[0].reduction:
        raise ValueError(
            f"Step {step}, micro-batch {i}: info['loss'] is the {reduction} of the per-sample "
            f"losses, micro-batch 0's was their {parts[0].reduction}: reduce every micro-batch "
            "alike (the step's loss is the mean over all its samples, or their sum)."
        )


def _reached(tensor: Tensor, edges: list) -> set[int]:
    """The indices of ``edges`` (captured outputs of the model) that ``tensor``'s graph leads
    to: a walk of its graph until all are found, running no backward (a backward would fire
    the hooks on the model's outputs, FSDP's pre-backward all-gathers among them); where
    an output is a tensor itself (no node of its own), a backward to the outputs."""
    if any(isinstance(edge, Tensor) for edge in edges):
        grads = torch.autograd.grad(tensor.sum(), edges, retain_graph=True, allow_unused=True)
        return {k for k, g in enumerate(grads) if g is not None}
    index = {(id(edge.node), edge.output_nr): k for k, edge in enumerate(edges)}
    # (``seen`` holds the nodes themselves: a node's Python object lives only while it is
    # referenced, and a freed one's id is reused by the next, which would end the walk early)
    found, seen = set(), {}
    stack = [(tensor.grad_fn, tensor.output_nr)]
    while stack:
        node, output_nr = stack.pop()
        if node is None:
            continue
        k = index.get((id(node), output_nr))
        if k is not None:  # (and on: an output may lead to another, as autograd.grad finds)
            found.add(k)
            if len(found) == len(edges):
                break
        if id(node) not in seen:
            seen[id(node)] = node
            stack.extend(node.next_functions)
    return found


def check_loss_graphs(step: int, info: dict, active: list, capture, model: nn.Module) -> None:
    """Before the backward: the per-sample losses of a step whose quantities differentiate
    through them have a graph, and it leads to the captured forward of the model."""
    readers = [
        q.name for q in active if q.create_graph and "individual_losses" in q.required_info(step)
    ]
    if not readers:
        return
    losses = info["individual_losses"]
    if losses.grad_fn is None:
        raise ValueError(
            f"Step {step}: {', '.join(readers)} backpropagate through info['individual_losses'], "
            "which has no graph (detached, or computed under no_grad): pass the per-sample "
            "losses the loss is computed from, as they are."
        )
    roots = [c for c in capture.calls if c.module is model and c.nodes] if capture else []
    if not roots:
        return
    edges = [output_edge(node) for call in roots for node in call.nodes]
    if not _reached(losses, edges) & _reached(info["loss"], edges):
        raise ValueError(
            f"Step {step}: info['loss'] and info['individual_losses'] do not come from one "
            f"forward pass of the model, which {', '.join(readers)} backpropagate through: "
            "compute both from one forward (out = model(x); losses = criterion(out, y, "
            "reduction='none'); loss = losses.mean())."
        )


def reads_forward(step: int, active: list) -> bool:
    """Whether a check before the backward reads the step's forward for ``active``
    (:func:`check_loss_graphs`, a quantity's ``validate_forward``): those run on a finite loss
    only, so that its finiteness is read on entering (else with the backward's scale)."""
    return any(
        type(q).validate_forward is not Quantity.validate_forward
        or (q.create_graph and "individual_losses" in q.required_info(step))
        for q in active
    )


def validate_forwards(step: int, info: dict, active: list, capture, model, params) -> None:
    """Before the backward: each quantity's check of the step's captured forward (e.g. the
    cost of a curvature diagonal, from the model's output), on the latest forward of the
    model (the one the loss comes from, as a rule)."""
    roots = [c for c in capture.calls if c.module is model][-1:] if capture is not None else []
    losses = info.get("individual_losses")
    n = len(losses) if isinstance(losses, Tensor) and losses.dim() == 1 else None
    for q in active:
        q.validate_forward(step, model, params, roots, n)


def check_backward(step: int, active: list, graph: list[Tensor | None]) -> None:
    """After the backward: it kept the graph that the step's curvature quantities need (on
    some of the gradients ``graph``, as the curvature quantities read them)."""
    readers = [q.name for q in active if q.create_graph]
    if readers and not any(g is not None and g.requires_grad for g in graph):
        raise RuntimeError(
            f"Step {step}: {', '.join(readers)} differentiate the gradient again, but the "
            "backward kept no graph: call loss.backward(create_graph=cockpit.create_graph(step)) "
            "inside the `with cockpit(...)` block. Nothing of this step was stored."
        )


def check_quantities(quantities: list) -> None:
    """Each is a quantity, and no class comes twice (values are stored under its name)."""
    names = set()
    for q in quantities:
        if not isinstance(q, Quantity):
            raise TypeError(
                f"{q!r} is not a quantity. Pass instances such as "
                "avionics.quantities.NormTest(), or configuration('economy')."
            )
        if q.name in names:
            raise ValueError(
                f"Two {q.name} quantities: each quantity is stored under its class name, so "
                "a cockpit takes one of each."
            )
        names.add(q.name)


def check_sinks(sinks: list, log, exist: str, fsync: bool) -> None:
    """Each sink is one, and the log's options are known."""
    for sink in sinks:
        if not isinstance(sink, Sink):
            raise TypeError(
                f"{sink!r} is not a sink: a sink has write(step, values), "
                "update_metadata(metadata) and close() (see avionics.records.sink)."
            )
    if log is not None and (exist, fsync) != ("append", False):
        from avionics.records.writer import EXIST_MODES

        if exist not in EXIST_MODES:
            raise ValueError(f"exist must be one of {EXIST_MODES}, got {exist!r}.")


def as_list(quantities) -> list:
    """``Cockpit(quantities=...)`` as a list (a single quantity is refused, with the fix)."""
    if isinstance(quantities, Quantity):
        raise TypeError(
            f"Cockpit(quantities=...) takes a list of quantities, got a single {quantities.name}: "
            f"pass [{quantities.name}()]."
        )
    try:
        return list(quantities)
    except TypeError:
        raise TypeError(
            "Cockpit(quantities=...) takes a list of quantities such as "
            f"[avionics.quantities.NormTest()] or configuration('economy'), got {quantities!r}."
        ) from None


def tracked_parameters(model: nn.Module, params) -> tuple[list[nn.Parameter], list[str]]:
    """The parameters to track and their names: ``params`` (each once, of the model,
    requiring grad), or every parameter of the model that requires grad."""
    named = {id(p): name for name, p in model.named_parameters()}
    if params is None:
        chosen = [p for p in model.parameters() if p.requires_grad]
        if not chosen:
            raise ValueError("The model has no parameter that requires grad; nothing to track.")
    else:
        chosen = list(params)
        seen: dict[int, int] = {}
        for k, p in enumerate(chosen):
            if id(p) in seen:
                raise ValueError(
                    f"params[{k}] is params[{seen[id(p)]}] again ('{named.get(id(p), '?')}'): "
                    "list each parameter once."
                )
            seen[id(p)] = k
            if id(p) not in named:
                raise ValueError(f"params[{k}] is not a parameter of the model.")
            if not p.requires_grad:
                raise ValueError(
                    f"Parameter '{named[id(p)]}' does not require grad, so it has no gradient "
                    "to track. Set requires_grad=True or leave it out of params."
                )
    for p in chosen:
        if p.is_complex():
            raise ValueError(
                f"Parameter '{named[id(p)]}' is complex ({p.dtype}): the cockpit's "
                "quantities are defined for real parameters. Leave it out of params=, or "
                "track a real view of it (torch.view_as_real) as the model's parameter."
            )
    return chosen, [named[id(p)] for p in chosen]


def check_model_unchanged(
    step: int, model: nn.Module, params: list, names: list[str], every: bool, sharded: bool
) -> None:
    """The tracked parameters are still the model's, under their names, requiring grad (and,
    with ``every``, i.e. params=None, the only parameters that require grad): raises on
    entering a step, before anything changes, naming what changed. Under FSDP (``sharded``)
    only whether they require grad: between its forward and backward the root module holds
    unsharded tensors in place of its parameters."""
    remedy = (
        "build a new Cockpit on the model as it is now (its quantities start afresh), or "
        "change the model only before building the cockpit"
    )
    now = dict(zip(names, params)) if sharded else dict(model.named_parameters())
    every = every and not sharded
    changed = []
    for name, p in zip(names, params):
        current = now.get(name)
        if current is None:
            changed.append(f"'{name}' is no longer a parameter of the model")
        elif current is not p:
            changed.append(f"'{name}' is another tensor (its module was replaced)")
        elif not p.requires_grad:
            changed.append(f"'{name}' no longer requires grad (frozen)")
    if every:
        tracked = {id(p) for p in params}
        changed += [
            f"'{name}' is a new parameter that requires grad"
            for name, p in now.items()
            if p.requires_grad and id(p) not in tracked and name not in names
        ]
    if changed:
        raise ValueError(
            f"Step {step}: the model changed after the cockpit was built: "
            f"{'; '.join(changed)}. The cockpit tracks the parameters it was built with: "
            f"{remedy}."
        )


def is_step(step) -> bool:
    """Whether ``step`` is a step number: a non-negative int."""
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0
