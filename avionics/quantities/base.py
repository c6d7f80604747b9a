"""The protocol every cockpit instrument follows (public: write your own).

A :class:`Quantity` has a schedule and, for each step it is active at, four hooks that the
cockpit calls in this order:

1. ``request(step) -> Request``, before the forward of the step is captured: the per-sample
   statistics it needs (sums of squared per-sample gradient norms, per-coordinate second
   moments, projections g_n . v onto named directions, visitors of chunks of g_n). A
   non-empty request makes the cockpit capture the step, which needs
   ``info["individual_losses"]``: that key is then required automatically.
2. ``prepare(data) -> {name: direction}``, after the backward and before the per-sample
   statistics are computed: start-of-step work, and the tensors (one per parameter) of the
   directions it named in its request.
3. ``sums(data) -> {name: tensor}``: the sums over the process's samples that ``compute``
   needs (sum_n ||g_n||^2, histogram counts, ...). Under data parallelism the cockpit adds
   every quantity's sums over the processes in one packed ``all_reduce``; ``compute`` reads the
   totals in ``data.totals[name]`` (with one process, the sums themselves). A quantity whose
   value needs only the step's loss, gradient and parameters (global already) has no sums;
   one that asks for per-sample statistics and has none is refused by name under data
   parallelism (:func:`check_data_parallel`: its value would be one process's).
4. ``compute(data) -> {step: value}``: values keyed by the step they belong to (usually
   ``{data.step: value}``; a two-step quantity stores under its start step, see
   :class:`TwoStepQuantity`).

Under data parallelism (:mod:`avionics.distributed`) every value is that of the global batch,
the concatenation of the processes' batches: ``loss``, ``grads``, ``mean_grad`` and
``batch_size`` in :class:`StepData` are global; ``individual_losses``, ``statistics``,
``graph_grads`` and ``captured`` are this process's; ``parallel`` (:class:`Parallel`) says
how the batch is split.

Each class declares its ``output`` (:mod:`avionics.quantities.outputs`): how the run log's
readers, the exports and the dashboard read its value.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from avionics.distributed import SINGLE, World, sum_over_processes
from avionics.persample import CapturedStep, Request, Statistics
from avionics.persample.calls import detached
from avionics.records.outputs import SCALAR, Output
from avionics.schedules import Schedule, describe, linear

# The package's directory: frames of files under it are avionics' own (see user_stacklevel).
_PACKAGE = str(Path(__file__).parents[1] / "_")[:-1]

# The info key every non-empty request implies: the per-sample losses give N and whether the
# loss is their mean or their sum.
PER_SAMPLE_LOSSES = "individual_losses"


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step accumulated over several (:attr:`StepData.micro_batches`):
    its captured calls (module -> calls, with their graph), its per-sample losses (with
    theirs) and its share N_i / N of the step's samples: a curvature diagonal of the step's
    mean loss is sum_i share_i times micro-batch i's of its own mean loss."""

    calls: dict
    individual_losses: Tensor
    share: float


@dataclass(frozen=True)
class Parallel:
    """The processes a step's batch is split over (data parallelism), as its quantities see
    them: one process (:data:`~avionics.distributed.SINGLE`) without data parallelism.

    Attributes:
        world: the processes (rank and size).
        batch_sizes: N_r of every process, in rank order (``(N,)`` with one process).
        local_grads: under data parallelism, this process's gradient of its own loss (before
            any all-reduce), per tracked parameter; None with one process.
        sharded: whether each process holds only a shard of each parameter (FSDP): the step's
            ``params`` and ``grads`` are then this process's shards.
        ranks: under data parallelism, per process (N_r, its own loss L_r as reduced, the
            seconds of its step outside the collectives), [W, 3] float64, from the step's
            agreement (:class:`~avionics.step.parallel.Agreement`); None with one process.
        layout: where the parameters are sharded, how (a
            :class:`~avionics.step.sharded.ShardLayout`, for :meth:`whole`); else None.
    """

    world: World = SINGLE
    batch_sizes: tuple[int, ...] = ()
    local_grads: list[Tensor] | None = None
    sharded: bool = False
    ranks: Tensor | None = None
    layout: Any = None

    def sum(self, tensors: list[Tensor]) -> list[Tensor]:
        """``tensors`` added over the processes (one collective; the tensors themselves with
        one process). Every process must call it, in the same order."""
        return sum_over_processes(tensors, self.world)

    def whole(self, tensors: list[Tensor]) -> list[Tensor]:
        """The whole tensors of this process's shards ``tensors`` (one per tracked parameter,
        shaped as this process's shard of it), by one all-gather where the parameters are
        sharded; the tensors themselves otherwise. Every process must call it, in the same
        order."""
        if self.layout is None:
            return tensors
        return self.layout.gather(tensors, list(range(len(tensors))))


@dataclass
class StepCache:
    """The work that several quantities of one step read, made by the first that needs it
    (see the functions that fill it: :func:`mean_gradient_norms` and the others below).
    Read-only once made.

    Attributes:
        g_norms: [||g^(1)||, ..., ||g^(K)||] of the mean gradient, in its dtype.
        g_sq_per_parameter: their squares, float64.
        g_sq: ||g||^2, their sum.
        sum_sq: sum_n g_{n,d}^2 flattened over all tracked parameters.
        params_copy: a copy of theta_t (see :meth:`StepData.params_copy`).
        distances: (a, b, [||a_k - b_k||]) of the last :func:`per_parameter_distances`, for
            the lists ``a`` and ``b`` themselves (UpdateSize and UpdateRatio both read
            ||theta_{t+1} - theta_t|| of the same shared copy of theta_t).
        curvature_diagonals: the curvature diagonals computed at this step, keyed by the
            settings of the quantities that asked (shared by HessTrace, TICDiag, TICTrace).
    """

    g_norms: Tensor | None = None
    g_sq_per_parameter: Tensor | None = None
    g_sq: Tensor | None = None
    sum_sq: Tensor | None = None
    params_copy: list[Tensor] | None = None
    distances: tuple | None = None
    curvature_diagonals: dict[tuple, Any] = field(default_factory=dict)


@dataclass
class StepData:
    """Everything a quantity may read at one step, after the backward, before the update.

    Attributes:
        step: the step number t.
        params: theta_t, the tracked parameters' values (detached; do not modify).
        names: the tracked parameters' names, in the order of every per-parameter list.
        loss: the loss the user backpropagated (detached).
        info: the ``info`` dict passed to ``cockpit(step, info)``.
        reduction: ``"mean"`` or ``"sum"``: how ``loss`` relates to the per-sample losses.
        batch_size: N, of the global batch (None when neither per-sample losses nor a batch
            size were given).
        individual_losses: the per-sample losses l_n (detached) of this process, or None.
        grads: ``p.grad`` of each tracked parameter (zeros where none arrived), detached.
        mean_grad: g = mean_n g_n (= ``p.grad`` for a mean-reduced loss, ``p.grad / N`` for
            a sum).
        graph_grads: ``p.grad`` as the backward left it, with its graph when the backward
            ran with ``create_graph=True`` (None where no gradient arrived).
        tracked: the tracked parameters themselves.
        graph_leaves: what ``graph_grads`` are the gradients with respect to, where not
            ``tracked``: under FSDP, the whole (unsharded) parameters FSDP keeps through a
            curvature step's backward (:mod:`avionics.step.sharded`). Differentiate against
            :attr:`leaves`.
        model: the network.
        active: the quantities active at this step (to share work between them).
        statistics: the per-sample statistics of the step's merged request, or None.
        captured: the step's :class:`~avionics.persample.CapturedStep` on steps with a
            non-empty request, else None: further statistics of *this* step's g_n on demand
            (Alpha projects them onto theta_{t+1} - theta_t once it is known). Keeping it
            keeps the step's captured layer inputs and output gradients alive: drop it as soon
            as it is used.
        totals: per quantity name, its :meth:`Quantity.sums` added over the processes.
        micro_batches: a step accumulated over k > 1 micro-batches (``cockpit(step, info,
            micro_batch=i, micro_batches=k)``): per micro-batch its captured calls with their
            graph, its per-sample losses with theirs and its share of the step's samples
            (:class:`MicroBatch`), for the curvature quantities that
            backpropagate through them; None for one batch. Everything else in the step's
            data is of all its micro-batches together, as one batch (``captured`` too, without
            a graph of its own), with ``info`` the last micro-batch's.
        parallel: the processes the batch is split over (:class:`Parallel`).
        cache: the work several quantities read (:class:`StepCache`).
    """

    step: int
    params: list[Tensor]
    names: list[str]
    loss: Tensor
    info: dict
    reduction: str
    batch_size: int | None
    individual_losses: Tensor | None
    grads: list[Tensor]
    mean_grad: list[Tensor]
    graph_grads: list[Tensor | None]
    tracked: list[nn.Parameter]
    model: nn.Module
    active: tuple[Quantity, ...] = ()
    statistics: Statistics | None = None
    captured: CapturedStep | None = None
    totals: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    micro_batches: list[MicroBatch] | None = None
    parallel: Parallel = field(default_factory=Parallel)
    cache: StepCache = field(default_factory=StepCache)
    graph_leaves: list[Tensor] | None = None

    @property
    def optimizer(self):
        return self.info.get("optimizer")

    @property
    def leaves(self) -> list[Tensor]:
        """The tensors ``graph_grads`` are the gradients with respect to (whole, to
        differentiate against): ``graph_leaves`` where given, else ``tracked``."""
        return self.tracked if self.graph_leaves is None else self.graph_leaves

    @property
    def share(self) -> float:
        """w_r: this process's loss times w_r, summed over the processes, is the global loss
        (N_r / N for a mean, 1 for a sum). Products of the step's graph (Hessian-vector
        products) are global as :meth:`Parallel.sum` of w_r times the local ones."""
        world = self.parallel.world
        if world.size == 1 or self.reduction == "sum":
            return 1.0
        return self.parallel.batch_sizes[world.rank] / self.batch_size

    def params_copy(self) -> list[Tensor]:
        """A copy of theta_t (``params`` before the update), made once per step and shared.

        Parameters' values, UpdateSize's theta_t, Distance's theta_0 and Alpha's theta_t are
        the same tensors at the same step: one copy serves them all, so a step keeps one
        model-sized copy, not one per quantity. Nobody may modify it in place.
        """
        if self.cache.params_copy is None:
            # (one fused clone of all of them; the values are detached already on every path
            # but under autograd's watch)
            self.cache.params_copy = list(torch._foreach_clone([detached(p) for p in self.params]))
        return self.cache.params_copy


class Quantity:
    """Base class of the cockpit's instruments: a schedule and the four hooks above.

    Subclasses set ``info_keys`` (keys of ``info`` they read besides ``"loss"``; those their
    request implies are added by :meth:`required_info`), ``create_graph`` (True when they
    differentiate the gradient again), ``output`` (what their value is), and implement
    :meth:`compute`; per-sample quantities override :meth:`request`. A quantity with state
    that a resumed run needs overrides :meth:`state_dict` and :meth:`load_state_dict`.

    ``per_layer=True`` reads a quantity defined as a sum over the tracked parameters (or a
    ratio of such sums) per parameter too: its class sets ``per_layer_output``, adds the
    per-parameter sums to :meth:`sums` (added over the processes like the global ones) and
    returns :meth:`layered` of the global value and the per-parameter ones. Other quantities
    refuse it when built.
    """

    info_keys: tuple[str, ...] = ()
    create_graph: bool = False
    # True where compute adds this process's per-sample terms over the processes itself
    # (with data.parallel.sum) instead of through sums: see check_data_parallel
    adds_over_processes: bool = False
    output: Output = SCALAR
    # The output of the value read per layer (``per_layer=True``, see :meth:`layered`):
    # ``per_parameter("sum")`` for a sum over the tracked parameters, ``PER_LAYER`` for a ratio
    # of such sums; None for a quantity without a per-layer reading.
    per_layer_output: Output | None = None

    def __init__(self, schedule: Schedule | None = None, per_layer: bool = False):
        if schedule is not None and not callable(schedule):
            raise TypeError(
                f"{type(self).__name__}(schedule=...) takes a schedule such as "
                f"avionics.schedules.linear(1), got {schedule!r}."
            )
        check_per_layer(type(self), per_layer)
        self.schedule = schedule if schedule is not None else linear(1)
        self.per_layer = per_layer
        if per_layer:
            self.output = self.per_layer_output

    def layered(self, global_value: Tensor, per_parameter: Tensor):
        """The value read per layer, from the global value and the same statistic of each
        tracked parameter alone (of that parameter's own sums; for a ratio of sums over the
        parameters, the ratio of that parameter's sums): ``per_parameter`` for a sum over the
        parameters (their sum is the global value), else ``{"global": global_value,
        "per_parameter": per_parameter}``."""
        if self.per_layer_output.is_per_parameter:
            return per_parameter
        return {"global": global_value, "per_parameter": per_parameter}

    @property
    def name(self) -> str:
        """The name the values are stored under: the class name."""
        return type(self).__name__

    def describe(self) -> str:
        layered = ", per_layer=True" if getattr(self, "per_layer", False) else ""
        return f"{self.name}({describe(self.schedule)}{layered})"

    def is_active(self, step: int) -> bool:
        """Whether :meth:`compute` must run at ``step``."""
        return self.schedule(step)

    def request(self, step: int) -> Request:
        """The per-sample statistics this quantity reads at ``step``."""
        return Request()

    def required_info(self, step: int) -> tuple[str, ...]:
        """The ``info`` keys the step needs: ``info_keys`` and those the request implies."""
        if self.request(step) and PER_SAMPLE_LOSSES not in self.info_keys:
            return (PER_SAMPLE_LOSSES, *self.info_keys)
        return self.info_keys

    def validate(self, step: int, info: dict) -> None:
        """Raise if ``info`` cannot serve this quantity at ``step`` (e.g. an optimizer it does
        not support). The cockpit calls it on entering a step the quantity is active at, after
        checking that the keys of :meth:`required_info` are present and before the backward:
        an error here leaves nothing computed, stored or logged."""

    def validate_forward(
        self, step: int, model: nn.Module, params: list[Tensor], roots: list, n: int | None
    ) -> None:
        """Raise if the step cannot be computed at a bounded cost, known from its forward: the
        cockpit calls it after :meth:`validate`, before the backward, with the model, the
        tracked parameters, the captured calls of the model itself in the latest forward
        (``roots``: :class:`~avionics.persample.capture.ModuleCall`, empty when nothing was
        captured) and the number of per-sample losses (None without them)."""

    def prepare(self, data: StepData) -> dict[str, list[Tensor]]:
        """Start-of-step work; return the directions (beyond "grad", the mean gradient) this
        quantity's request names, one tensor per parameter.

        Called at every step the quantity is active, after the backward and before the
        per-sample statistics are computed (visitors are called after it).
        """
        return {}

    def sums(self, data: StepData) -> dict[str, Tensor]:
        """This process's sums over its samples that :meth:`compute` reads back, added over
        the processes, from ``data.totals[self.name]`` (see the module's description)."""
        return {}

    def compute(self, data: StepData) -> dict[int, Any]:
        """Values keyed by the step they belong to (usually ``{data.step: value}``)."""
        raise NotImplementedError(f"{self.name} must implement compute(data).")

    def state_dict(self) -> dict:
        """What a resumed run needs to continue this quantity (tensors and plain values)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"{self.name} keeps no state, got {sorted(state)}.")


class TwoStepQuantity(Quantity):
    """A quantity measured between a start step t and the next tracked step, stored under t.

    Subclasses implement :meth:`start` (what step t keeps) and :meth:`finish` (the value from
    that and the next step's data, or None to store nothing). It is active at the steps of its
    schedule and at the step after each start; ``pending`` is the start awaiting its end.
    """

    def __init__(self, schedule: Schedule | None = None):
        super().__init__(schedule)
        self.pending: tuple[int, Any] | None = None

    def is_active(self, step: int) -> bool:
        return self.pending is not None or self.schedule(step)

    def start(self, data: StepData) -> Any:
        """What the start step keeps until the next tracked step."""
        raise NotImplementedError(f"{self.name} must implement start(data).")

    def finish(self, kept: Any, data: StepData) -> Any | None:
        """The value of the start that kept ``kept``, from the next tracked step's ``data``."""
        raise NotImplementedError(f"{self.name} must implement finish(kept, data).")

    def compute(self, data: StepData) -> dict[int, Any]:
        values = {}
        if self.pending is not None:
            (step, kept), self.pending = self.pending, None
            value = self.finish(kept, data)
            if value is not None:
                values[step] = value
        if self.schedule(data.step):
            self.pending = (data.step, self.start(data))
        return values

    def state_dict(self) -> dict:
        if self.pending is None:
            return {}
        step, kept = self.pending
        return {"pending_step": step, "pending": self.save_kept(kept)}

    def load_state_dict(self, state: dict) -> None:
        self.pending = None
        if state:
            self.pending = (int(state["pending_step"]), self.load_kept(state["pending"]))

    def save_kept(self, kept: Any) -> Any:
        """``kept`` as tensors and plain values (default: as it is)."""
        return kept

    def load_kept(self, saved: Any) -> Any:
        """The inverse of :meth:`save_kept`."""
        return saved


def mean_gradient_sq_norm(data: StepData) -> Tensor:
    """||g||^2 of the mean gradient, float64, computed once per step and shared: the sum of
    :func:`mean_gradient_sq_norms`."""
    if data.cache.g_sq is None:
        data.cache.g_sq = mean_gradient_sq_norms(data).sum()
    return data.cache.g_sq


def mean_gradient_sq_norms(data: StepData) -> Tensor:
    """[||g^(1)||^2, ..., ||g^(K)||^2] of the mean gradient per tracked parameter, float64,
    computed once per step and shared (their sum is :func:`mean_gradient_sq_norm`); of the
    whole parameters when ``data`` says they are sharded (sum_r ||shard_r||^2, one
    collective of K numbers)."""
    if data.cache.g_sq_per_parameter is None:
        squares = mean_gradient_norms(data).double().square()
        if data.parallel.sharded:
            (squares,) = data.parallel.sum([squares])
        data.cache.g_sq_per_parameter = squares
    return data.cache.g_sq_per_parameter


def mean_gradient_norms(data: StepData) -> Tensor:
    """[||g^(1)||, ..., ||g^(K)||] of this process's part of the mean gradient, in its dtype,
    computed once per step (one fused kernel for all parameters) and shared."""
    if data.cache.g_norms is None:
        data.cache.g_norms = torch.stack(torch._foreach_norm(data.mean_grad))
    return data.cache.g_norms


def per_parameter_rows(tensors: list[Tensor]) -> Tensor:
    """[K, N] in float64 from K per-parameter statistics of shape [N] (one row each): stacked
    in their common dtype (exact: every float dtype widens exactly), then widened at once."""
    return torch.stack(tensors).double()


def per_parameter_sums(flat: Tensor, data: StepData) -> Tensor:
    """[sum_{d in k} flat_d per tracked parameter k] of a tensor flattened over all tracked
    parameters in their order (as :func:`flat_sum_sq`)."""
    sizes = [p.numel() for p in data.tracked]  # (whole, also where data.params are shards)
    return torch.stack([chunk.sum() for chunk in flat.split(sizes)])


def check_per_layer(quantity: type, per_layer) -> None:
    """Raise unless ``per_layer`` is a bool that ``quantity`` (a :class:`Quantity` class)
    can take: True needs a per-layer reading (``quantity.per_layer_output``)."""
    name = quantity.__name__
    if not isinstance(per_layer, bool):
        raise TypeError(
            f"{name}(per_layer={per_layer!r}): per_layer must be True (also keep the value of "
            "each tracked parameter) or False."
        )
    if per_layer and quantity.per_layer_output is None:
        layered = sorted(
            c.__name__
            for c in _subclasses(Quantity)
            if c.per_layer_output is not None and not c.__name__.startswith("_")
        )
        why = (
            "its value is per parameter already"
            if quantity.output.is_per_parameter
            else "it is not a sum over the parameters nor a ratio of such sums"
        )
        raise ValueError(
            f"{name}(per_layer=True): {name} has no per-layer reading ({why}); drop "
            f"per_layer=True. The quantities that take it: {', '.join(layered)}."
        )


def user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, for a warning of the function that calls this one, of
    the nearest frame outside avionics and :mod:`contextlib` (which runs ``with
    cockpit(...)``): the user's line, however deep in the step the hook that warns runs."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE)
        or frame.f_code.co_filename == contextlib.__file__
    ):
        frame, level = frame.f_back, level + 1
    return level


def check_data_parallel(quantities: list[Quantity], world: World) -> None:
    """Under data parallelism, refuse by name each quantity that reads this process's
    per-sample statistics (it overrides :meth:`Quantity.request`) without stating its sums
    over the samples (:meth:`Quantity.sums`) or adding over the processes itself
    (``adds_over_processes``): its :meth:`~Quantity.compute` would see this process's samples
    only, and its value would silently be per process."""
    if world.size == 1:
        return
    per_process = [
        q.name
        for q in quantities
        if type(q).request is not Quantity.request
        and type(q).sums is Quantity.sums
        and not q.adds_over_processes
    ]
    if per_process:
        names = ", ".join(per_process)
        raise TypeError(
            f"{names} read this process's per-sample statistics (a request) but state no sums "
            f"over the samples: under data parallelism ({world.size} processes) compute would "
            "see this process's share of the batch only, and the value would differ between "
            "the processes. Return the sums over this process's samples from sums(data) (e.g. "
            '{"sq_norms": ...}) and read them added over the processes from '
            f'data.totals[{per_process[0]!r}][...] in compute (README, "Your own '
            'instrument"); a compute that adds them over the processes itself '
            "(data.parallel.sum) sets adds_over_processes = True on its class."
        )


def _subclasses(cls: type) -> list[type]:
    """Every subclass of ``cls``, recursively."""
    found = []
    for sub in cls.__subclasses__():
        found.extend([sub, *_subclasses(sub)])
    return found


def flat_sum_sq(data: StepData) -> Tensor:
    """sum_n g_{n,d}^2 of this process's samples, flattened over all tracked parameters: one
    tensor per step shared by the quantities that read it (returned as their sum of that
    name, it is added over the processes once). Read-only."""
    if data.cache.sum_sq is None:
        data.cache.sum_sq = torch.cat([t.reshape(-1) for t in data.statistics.sum_sq])
    return data.cache.sum_sq


def global_norm_squared(tensors: list[Tensor]) -> Tensor:
    """sum_k ||t_k||^2 over a list of tensors."""
    return sum(torch.linalg.vector_norm(t).square() for t in tensors)


def per_parameter_norms(tensors: list[Tensor], data: StepData | None = None) -> Tensor:
    """[||t_1||, ..., ||t_K||] as one tensor (one host transfer when converted); of the whole
    parameters when ``data`` says they are sharded (see :func:`whole_norms`)."""
    return whole_norms(torch.stack(torch._foreach_norm(tensors)), data)


def per_parameter_distances(
    a: list[Tensor], b: list[Tensor], data: StepData | None = None
) -> Tensor:
    """[||a_1 - b_1||, ..., ||a_K - b_K||] as one tensor, of the whole parameters when
    ``data`` says they are sharded; with ``data``, made once per step for the same lists
    ``a`` and ``b`` and shared (:attr:`StepCache.distances`).

    The differences are formed by fused kernels (``torch._foreach_sub``, ``_foreach_norm``)
    a group of parameters at a time, each group's differences within :data:`DIFFERENCE_BYTES`
    (all of them at once would be a model-sized temporary)."""
    cached = data.cache.distances if data is not None else None
    if cached is not None and cached[0] is a and cached[1] is b:
        return cached[2]
    if len(a) != len(b):
        raise ValueError(f"per_parameter_distances: {len(a)} tensors against {len(b)}.")
    norms: list[Tensor] = []
    for start, stop in _groups([x.numel() * x.element_size() for x in a], DIFFERENCE_BYTES):
        norms += torch._foreach_norm(torch._foreach_sub(a[start:stop], b[start:stop]))
    distances = whole_norms(torch.stack(norms), data)
    if data is not None:
        data.cache.distances = (a, b, distances)
    return distances


# Bytes the differences of one group of parameters may take (per_parameter_distances).
DIFFERENCE_BYTES = 8 * 2**20


def _groups(sizes: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive runs (start, stop) of ``sizes`` each summing to at most ``budget`` (a
    larger size alone in its run)."""
    runs, start, total = [], 0, 0
    for k, size in enumerate(sizes):
        if k > start and total + size > budget:
            runs.append((start, k))
            start, total = k, 0
        total += size
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


def whole_norms(norms: Tensor, data: StepData | None) -> Tensor:
    """The norms of whole parameters from their shards' (FSDP): sqrt(sum_r ||shard_r||^2),
    one collective; ``norms`` as they are otherwise."""
    if data is None or not data.parallel.sharded:
        return norms
    (squares,) = data.parallel.sum([norms.double().square()])
    return squares.sqrt().to(norms.dtype)
