"""Capture each module call of one forward pass and the gradient w.r.t. its outputs.

The cockpit's protocol runs the user's forward *before* ``with cockpit(step, ...)``, so the
capture is armed between steps, and only before a step that needs per-sample statistics. While
armed, one global forward hook (``torch.nn.modules.module.register_module_forward_hook``)
records calls of the watched modules: nothing is ever attached to the model or its
parameters, and on steps that need nothing no hook exists at all.

Output gradients are taken with pre-hooks on the autograd nodes that produced each output
(``grad_fn``, ``output_nr``), registered when the user's backward is about to run. A node
pre-hook sees the gradient w.r.t. the tensor as the module returned it, even when a later
in-place operation (``ReLU(inplace=True)``) has modified that tensor since, which a tensor hook
registered afterwards would not.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from avionics.persample.calls import ModuleCall, Shape, detached
from avionics.persample.precision import LOW_PRECISION
from avionics.persample.request import Request
from avionics.persample.rules.attention import inside
from avionics.persample.rules.broadcast import hook_shared_outputs
from avionics.persample.rules.randomness import draws_in_forward, state_before

# A forward that is never backpropagated (e.g. an evaluation pass run with gradients enabled)
# leaves calls that receive no gradient; keep at most this many root calls while armed.
MAX_ROOT_CALLS = 8


def batch_axes(model: nn.Module) -> dict[nn.Module, int]:
    """The batch axis of each module's tensors, inherited from the nearest ``batch_first``."""
    axes: dict[nn.Module, int] = {}

    def visit(module: nn.Module, inherited: int) -> None:
        flag = getattr(module, "batch_first", None)
        axis = inherited if not isinstance(flag, bool) else (0 if flag else 1)
        axes.setdefault(module, axis)
        for child in module.children():
            visit(child, axis)

    visit(model, 0)
    return axes


_WITH_KWARGS = getattr(torch.nn.modules.module, "_global_forward_hooks_with_kwargs", {})


class Capture:
    """Records the calls of ``modules`` during one forward, and their output gradients.

    Lifecycle per step: ``arm()`` before the forward; ``disarm()`` once it is done;
    ``record_gradients()`` before the backward; ``release()`` after using the calls.
    """

    def __init__(
        self,
        model: nn.Module,
        modules: list[nn.Module],
        axes: dict[nn.Module, int] | None = None,
        owners: list | None = None,
        members=None,
    ):
        self.root = model
        # the model's modules (a container; the engine's names): the output visitors see
        # these only, not the calls of another model running while this capture is armed
        self._members = set(model.modules()) if members is None else members
        self._axes = batch_axes(model) if axes is None else axes  # (:func:`batch_axes`)
        # (the model's parameter owners for the broadcast rule, where the engine keeps them)
        self._owners = owners
        self._watched = set(modules) | {model}
        # the watched modules whose calls the attention rule looks inside, or re-runs with
        # the random state of their forward (nn.MultiheadAttention): only their calls pay
        # for it, and without any the capture hooks no forward pre-hook at all
        self._attention = {m for m in self._watched if isinstance(m, nn.MultiheadAttention)}
        self.calls: list[ModuleCall] = []
        self._forward_handle: RemovableHandle | None = None
        self._pre_forward_handle: RemovableHandle | None = None
        self._rng_states: dict[nn.Module, tuple] = {}  # of the calls in progress
        self._gradient_handles: list[RemovableHandle] = []
        self._output_visitors: tuple = ()  # Request.module_outputs of the armed step
        self._summaries: list[tuple] = []  # of the forward in progress, until its root call

    @property
    def armed(self) -> bool:
        return self._forward_handle is not None

    def arm(self, request: Request | None = None) -> None:
        """Start recording; with ``request``, also summarise module outputs as its
        ``module_outputs`` visitors ask (at forward time: the outputs are not kept). Without
        one, a capture armed again (after a pause) keeps the visitors it had."""
        if request is not None:
            self._output_visitors = request.module_outputs
        if self._forward_handle is None:
            # The global hook holds the capture weakly: a capture that is dropped unarmed
            # (its cockpit deleted) removes its hook when it is collected.
            capture = weakref.ref(self)

            def hook(module, args, *kwargs_and_output):
                # (kwargs, output), or (output,) when torch calls it during its own removal:
                # a capture collected in the middle of a forward drops the with_kwargs flag
                # first (see disarm)
                alive = capture()
                if alive is not None and len(kwargs_and_output) == 2:
                    alive._on_forward(module, args, *kwargs_and_output)

            self._forward_handle = torch.nn.modules.module.register_module_forward_hook(
                hook, with_kwargs=True
            )

            def pre_hook(module, args):
                alive = capture()
                if alive is not None and module in alive._attention and draws_in_forward(module):
                    alive._rng_states[module] = state_before(args)

            if self._attention:
                self._pre_forward_handle = (
                    torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
                )

    def __del__(self):
        self.disarm()

    def disarm(self) -> None:
        if self._forward_handle is not None:
            self._forward_handle.remove()
            # torch's handle does not remove the hook's with_kwargs flag (a leak of one dict
            # entry per registration, torch 2.x): remove it here
            _WITH_KWARGS.pop(self._forward_handle.id, None)
            self._forward_handle = None
            if self._pre_forward_handle is not None:
                self._pre_forward_handle.remove()
                self._pre_forward_handle = None

    def _on_forward(self, module, args, kwargs, output) -> None:
        if not torch.is_grad_enabled():
            return
        if self._output_visitors and module in self._members:
            self._summarise(module, output)
        if module not in self._watched:
            return
        if module is self.root:
            roots = [i for i, c in enumerate(self.calls) if c.module is self.root]
            if len(roots) >= MAX_ROOT_CALLS:  # drop the oldest forward's calls
                self.calls = [c for c in self.calls[roots[0] + 1 :]]
        attention = module in self._attention
        self.calls.append(
            _call(
                module,
                args,
                kwargs,
                output,
                self._axes.get(module, 0),
                self._rng_states.pop(module, None) if attention else None,
                inside(module, args, kwargs, output) if attention else None,
            )
        )
        if module is self.root:
            self.calls[-1].summaries, self._summaries = self._summaries, []

    def _summarise(self, module, output) -> None:
        """Each output visitor's summary of this call's output, computed once, here."""
        axis = self._axes.get(module, 0)
        with torch.no_grad():
            for visit in self._output_visitors:
                summary = visit(module, output, axis)
                if summary is not None:
                    self._summaries.append((visit, module, summary))

    def record_gradients(self) -> None:
        """Hook every captured output so that the next backward stores its gradient."""
        for call in self.calls:
            for i, node in zip(call.node_outputs, call.nodes, strict=True):
                store = _storer(call, i)
                if isinstance(node, Tensor):  # a leaf returned as it is
                    self._gradient_handles.append(node.register_hook(store))
                else:
                    grad_fn, output_nr = node
                    self._gradient_handles.append(
                        grad_fn.register_prehook(_node_storer(store, output_nr))
                    )
            if call.inside is not None:
                self._gradient_handles += call.inside.hook()
        self._gradient_handles += hook_shared_outputs(self.root, self.calls, self._owners)

    def stop_recording(self) -> None:
        for handle in self._gradient_handles:
            handle.remove()
        self._gradient_handles = []

    def release(self) -> None:
        self.stop_recording()
        self.calls = []
        self._summaries = []

    def calls_by_module(self) -> dict[nn.Module, list[ModuleCall]]:
        """The calls that received a gradient, grouped by module in call order."""
        grouped: dict[nn.Module, list[ModuleCall]] = defaultdict(list)
        for call in self.calls:
            if call.received_gradient:
                grouped[call.module].append(call)
        return dict(grouped)


def at_least_float32(
    calls: dict[nn.Module, list[ModuleCall]], where: Callable[[nn.Module], str]
) -> torch.dtype | None:
    """Cast the captured 16-bit tensors of ``calls`` (inputs, output gradients and the
    per-sample gradients of broadcast additions) to float32, in place, so that every rule
    computes in float32 or better; the least precise dtype cast, or None where none was.

    The inputs are checked unchanged first (the cast copies are new tensors; ``where(module)``
    names a module in the error)."""
    cast: set[torch.dtype] = set()

    def up(t):
        if isinstance(t, Tensor) and t.dtype in LOW_PRECISION:
            cast.add(t.dtype)
            return t.float()
        return t

    for module_calls in calls.values():
        for call in module_calls:
            held = [*call.inputs, *call.grad_outputs, *call.broadcast_grad_outputs]
            held += call.shared_parameter_gradients.values()
            low = any(isinstance(t, Tensor) and t.dtype in LOW_PRECISION for t in held)
            if not low and not any(o.dtype in LOW_PRECISION for o in call.outputs):
                continue
            call.check_inputs_unchanged(where(call.module))
            call.args, call.kwargs = pytree.tree_map_only(Tensor, up, (call.args, call.kwargs))
            call.inputs = [up(t) for t in call.inputs]
            call.input_versions = [t._version for t in call.inputs]
            call.grad_outputs = [up(g) for g in call.grad_outputs]
            call.broadcast_grad_outputs = [up(g) for g in call.broadcast_grad_outputs]
            call.shared_parameter_gradients = {
                k: up(g) for k, g in call.shared_parameter_gradients.items()
            }
            for out in call.outputs:
                if out.dtype in LOW_PRECISION:
                    cast.add(out.dtype)
                    out.dtype = torch.float32
    return max(cast, key=lambda dtype: torch.finfo(dtype).eps) if cast else None


def output_edge(node) -> Tensor | GradientEdge:
    """Where a captured output lives in the graph (``ModuleCall.nodes``: a leaf tensor, or the
    producing node and its output index), as an input of ``torch.autograd.grad``; a later
    in-place operation on the output does not move it."""
    if isinstance(node, Tensor):
        return node
    grad_fn, output_nr = node
    return GradientEdge(grad_fn, output_nr)


def output_key(node) -> tuple:
    """A hashable name of a captured output (the same node gives the same key)."""
    return (id(node),) if isinstance(node, Tensor) else (id(node[0]), node[1])


# Values that are pytree leaves (or, None, a node without leaves) whatever the registry holds
_FLAT_LEAVES = (Tensor, type(None), bool, int, float, str)


def _tensors(tree) -> list[Tensor]:
    """The tensors in a pytree, in flattening order: without the pytree machinery for a
    tensor, and for a plain tuple, list or dict (flattened in order, a dict by insertion)
    whose items are no containers (a Hugging Face block's ``(hidden, None)``, its keyword
    arguments)."""
    if isinstance(tree, Tensor):
        return [tree]
    kind = type(tree)
    items = tree.values() if kind is dict else tree if kind is tuple or kind is list else None
    if items is not None and all(isinstance(t, _FLAT_LEAVES) for t in items):
        return [t for t in items if isinstance(t, Tensor)]
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, Tensor)]


def _call(module, args, kwargs, output, axis: int, rng_state, found_inside) -> ModuleCall:
    """The :class:`ModuleCall` of one call, with each tensor attribute read once: the node
    that produced each output that requires grad (taken now: a later in-place operation,
    ReLU with inplace=True, replaces the tensor's grad_fn), or the output itself where it is
    a leaf, and the inputs' versions (checked unchanged when a rule reads them)."""
    outputs = _tensors(output)
    shapes, nodes, node_outputs = [], [], []
    for i, t in enumerate(outputs):
        shapes.append(Shape(t))
        node = t.grad_fn
        if node is not None:  # (a tensor with a grad_fn requires grad)
            nodes.append((node, t.output_nr))
            node_outputs.append(i)
        elif t.requires_grad:
            nodes.append(t)
            node_outputs.append(i)
    inputs = _tensors(args)
    if kwargs:
        inputs += _tensors(kwargs)
    return ModuleCall(
        module=module,
        args=args,
        kwargs=kwargs,
        outputs=shapes,
        nodes=nodes,
        node_outputs=node_outputs,
        batch_axis=axis,
        inputs=inputs,
        input_versions=[t._version for t in inputs],
        rng_state=rng_state,
        inside=found_inside,
    )


def _storer(call: ModuleCall, index: int):
    def store(grad: Tensor | None) -> None:
        if grad is not None:
            call.grad_outputs[index] = detached(grad)

    return store


def _node_storer(store, output_nr: int):
    def prehook(grad_outputs):
        store(grad_outputs[output_nr])

    return prehook
