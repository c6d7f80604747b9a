"""One captured call of a module: what the capture keeps of it and the rules read.

The bottom of the per-sample engine's data: the capture (:mod:`avionics.persample.capture`)
makes these, the rules (:mod:`avionics.persample.rules`) and the routing
(:mod:`avionics.persample.routing`) read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence


class ForwardFacts:
    """What the generic rule's re-runs found of a call's forward, found once a step: the batch
    axis of each output (:attr:`output_batch_axes`, None until found) and the statistics of
    the BatchNorms inside that normalise with the batch's
    (:class:`~avionics.persample.rules.forward_state.BatchStatistics`, None until recorded).
    One object is shared by the call and its copies for other backpropagated columns
    (:meth:`ModuleCall.with_grad_outputs`), so that the columns find nothing again."""

    __slots__ = ("output_batch_axes", "batch_statistics")

    def __init__(self):
        self.output_batch_axes: list[int] | None = None
        self.batch_statistics = None


def detached(t: Tensor) -> Tensor:
    """``t`` outside autograd: itself where no graph is recorded for it (a gradient of a
    backward without ``create_graph``, a value already detached), else ``t.detach()``; one
    dispatched operation less per tensor a step where nothing is to be detached."""
    return t.detach() if t.requires_grad else t


class Shape:
    """What is kept of an output once its gradient is hooked: shape, dtype, device."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, t: Tensor):
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device


@dataclass
class ModuleCall:
    """One call of a watched module: its inputs, and (after backward) its output gradients.

    ``batch_axis`` is the axis of the batch in the module's tensors (1 below a module with
    ``batch_first=False``, else 0). ``grad_outputs`` has one entry per tensor in the flattened
    output, None where no gradient arrived. ``summaries`` (root calls only): what the
    request's output visitors returned for the module calls of this forward, as ``(visitor,
    module, summary)`` in call order.
    """

    module: nn.Module
    args: tuple
    kwargs: dict
    outputs: list[Shape]
    nodes: list
    node_outputs: list[int]
    batch_axis: int
    inputs: list[Tensor]
    input_versions: list[int]
    grad_outputs: list[Tensor | None] = field(default_factory=list)
    summaries: list[tuple] = field(default_factory=list)
    # per output: its per-sample gradient where the output is shared by all samples and
    # broadcast into the batch by additions (see avionics.persample.rules.broadcast)
    broadcast_grad_outputs: list[Tensor | None] = field(default_factory=list)
    # (device, random generator state) as the call began, for a module whose own forward
    # draws random numbers that a rule re-runs (avionics.persample.rules.randomness)
    rng_state: tuple | None = None
    # (root calls only) id(parameter) -> per-sample gradients [N, *shape] of a parameter used
    # directly in a forward and broadcast into the batch by additions (None: not broadcast)
    shared_parameter_gradients: dict = field(default_factory=dict)
    # (root calls only) id(parameter) -> the UseAxes of each of those uses, checked against
    # the batch size (avionics.persample.rules.broadcast.check_use_axes)
    shared_parameter_axes: dict = field(default_factory=dict)
    # what a rule found inside the call's graph at forward time and has the backward fill in
    # (an attention call's projections: avionics.persample.rules.attention.Inside), or None
    inside: object | None = None
    # whether the capture's graph walk found the call's output shared by all samples although
    # its first input has N entries on the batch axis (a position table looked up by
    # arange(T) with T == N, broadcast into the batch with axes put in front of it: see
    # avionics.persample.rules.broadcast.hook_shared_outputs)
    shared: bool = False
    # whether ``batch_axis`` is already decided (a merged call of gradient accumulation, its
    # axis decided on each micro-batch's own graph: avionics.step.accumulation), so that the
    # engine's find_batch_axes keeps it
    batch_axis_decided: bool = False
    # what the generic rule's re-runs found of the forward (avionics.persample.rules.generic),
    # shared by the call's copies for other columns
    found: ForwardFacts = field(default_factory=ForwardFacts)

    def __post_init__(self):
        self.grad_outputs = [None] * len(self.outputs)

    def carries_batch(self, n: int) -> bool:
        """Whether the first input tensor has the ``n`` samples on the batch axis (a
        PackedSequence: as many sequences as ``n``), and the call is not :attr:`shared`."""
        if self.shared:
            return False
        if self.args and isinstance(self.args[0], PackedSequence):
            return int(self.args[0].batch_sizes[0]) == n
        if not self.inputs:
            return False
        first = self.inputs[0]
        return first.dim() > self.batch_axis and first.shape[self.batch_axis] == n

    def with_grad_outputs(self, grad_outputs: list[Tensor | None]) -> ModuleCall:
        """This call with other output gradients (e.g. one backpropagated column of a loss
        Hessian root instead of the loss gradient)."""
        # (__post_init__ resets grad_outputs; what the backward filled in inside is not the
        # column's)
        call = replace(self, broadcast_grad_outputs=[], inside=None)
        call.grad_outputs = grad_outputs
        return call

    @property
    def received_gradient(self) -> bool:
        return any(g is not None for g in self.grad_outputs)

    def check_inputs_unchanged(self, name: str) -> None:
        for t, version in zip(self.inputs, self.input_versions, strict=True):
            if t._version != version:
                raise RuntimeError(
                    f"The input of module '{name}' was modified in place after the module "
                    "used it; its per-sample gradients cannot be computed. Replace the in-place "
                    "operation on that tensor (e.g. `x += y` -> `x = x + y`)."
                )
