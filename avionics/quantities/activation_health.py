"""ActivationHealth: dead and saturated units, mean and RMS of each activation module's output.

Which modules (:func:`is_activation`): the activation modules of the tracked model, named as
in ``model.named_modules()``: those of :data:`ACTIVATIONS` (``nn.ReLU``, ``nn.GELU``,
``nn.Tanh``, ``nn.Sigmoid``, ``nn.Hardtanh``, ...) and their subclasses, and every module
class defined in a module of :data:`ACTIVATION_MODULES` (Hugging Face's
``transformers.activations``: ``NewGELUActivation``, ``GELUActivation``,
``FastGELUActivation``, ``QuickGELUActivation``, ``GELUTanh``, ``SiLUActivation``, ...),
except the identity ``LinearActivation``. Modules of any other model that runs a forward
while the step is captured (an EMA copy, a teacher, a validation copy) are left out.

Activations applied as functions (``F.relu`` inside a forward) are not modules and are not
seen: use the module (``nn.ReLU()``) to watch them. ``nn.TransformerEncoderLayer`` and
``nn.TransformerDecoderLayer`` apply theirs as a function unless given a module: pass
``activation=nn.GELU()`` (or ``nn.ReLU()``) to watch it; the layers that apply a function are
named in a warning, once.

For one module's output y over the step's batch (all its calls in the backpropagated
forward; a unit is one position of the output without its batch axis: a feature of a dense
layer, one (channel, row, column) of a conv map, one (token, feature) of a sequence):

* ``dead``: the fraction of units that are zero for every sample of the batch (dead ReLUs,
  Lu et al. 2019, "Dying ReLU and Initialization");
* ``saturated`` (saturating activations only, see :data:`SATURATED`): the fraction of the
  values y[n, u] in the flat region, where the derivative nearly vanishes (Glorot & Bengio
  2010, "Understanding the difficulty of training deep feedforward neural networks"):
  |y| > 0.99 for Tanh and Softsign, y < 0.01 or y > 0.99 for Sigmoid, y at or beyond its
  limits for Hardtanh, ReLU6 and Hardsigmoid;
* ``mean`` and ``rms``: mean_{n,u} y[n, u] and sqrt(mean_{n,u} y[n, u]^2).

The statistics are computed by the cockpit's capture at forward time (an output visitor of
:class:`~avionics.persample.Request`), under ``torch.no_grad``: each output is reduced once
when the module returns it and is not kept, and no extra forward or backward runs. Only the
forward the loss was backpropagated through counts. Under data parallelism the counts and
sums are added over the processes (the processes' outputs must have the same units).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch import Tensor, nn

from avionics.persample import Request
from avionics.quantities.base import Quantity, StepData, user_stacklevel
from avionics.quantities.deferred import Deferred
from avionics.quantities.outputs import TENSORS

ACTIVATIONS = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Softplus,
    nn.Hardswish,
    nn.Tanh,
    nn.Softsign,
    nn.Sigmoid,
    nn.Hardtanh,  # and its subclass ReLU6
    nn.Hardsigmoid,
)
# Modules whose every nn.Module class is an activation (except NOT_ACTIVATIONS).
ACTIVATION_MODULES = ("transformers.activations",)
NOT_ACTIVATIONS = ("LinearActivation",)
# Layers that apply their ``activation`` attribute as a function unless it is a module.
FUNCTIONAL_ACTIVATION_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def is_activation(module: nn.Module) -> bool:
    """Whether ActivationHealth watches ``module`` (the module docstring's rule)."""
    if isinstance(module, ACTIVATIONS):
        return True
    kind = type(module)
    return kind.__module__ in ACTIVATION_MODULES and kind.__name__ not in NOT_ACTIVATIONS


def functional_activations(model: nn.Module) -> list[str]:
    """The names of ``model``'s layers that apply their activation as a function (not
    seen)."""
    return [
        name or "the model"
        for name, m in model.named_modules()
        if isinstance(m, FUNCTIONAL_ACTIVATION_LAYERS)
        and not isinstance(getattr(m, "activation", None), nn.Module)
    ]


# |y| beyond this is saturated for Tanh and Softsign; y within SIGMOID_MARGIN of 0 or 1 for
# Sigmoid.
TANH_LIMIT = 0.99
SIGMOID_MARGIN = 0.01


def _tanh_saturated(module, y: Tensor) -> Tensor:
    return y.abs() > TANH_LIMIT


def _sigmoid_saturated(module, y: Tensor) -> Tensor:
    return (y - 0.5).abs() > 0.5 - SIGMOID_MARGIN


def _hardtanh_saturated(module, y: Tensor) -> Tensor:
    return (y <= module.min_val) | (y >= module.max_val)


def _hardsigmoid_saturated(module, y: Tensor) -> Tensor:
    return (y <= 0) | (y >= 1)


# type -> the mask of saturated values of its output (types without one do not saturate)
SATURATED = {
    nn.Tanh: _tanh_saturated,
    nn.Softsign: _tanh_saturated,
    nn.Sigmoid: _sigmoid_saturated,
    nn.Hardtanh: _hardtanh_saturated,
    nn.Hardsigmoid: _hardsigmoid_saturated,
}


def saturation_of(module: nn.Module):
    """The saturation mask function of ``module``'s type, or None if it does not saturate."""
    for kind in type(module).__mro__:
        if kind in SATURATED:
            return SATURATED[kind]
    return None


class CallSummary(NamedTuple):
    """What the capture keeps of one call's output y, one reduction each of y as it is (no
    float64 copy of it): ``alive`` [*units] (int64), the samples where each unit is nonzero;
    ``total`` = sum y and ``squares`` = ||y||^2 (0-d float64: the sum and the norm in y's
    dtype, widened); ``saturated``, the number of saturated values (0-d int64; the int 0 for
    an activation that does not saturate); ``values``, the number of values of y. Every field
    adds over micro-batches (a tuple: :func:`~avionics.step.accumulation.added_summaries`
    adds its leaves)."""

    alive: Tensor
    total: Tensor
    squares: Tensor
    saturated: Tensor | int
    values: int


def output_summary(module: nn.Module, output, batch_axis: int) -> CallSummary | None:
    """The :class:`CallSummary` of one call's output (None for a module that is no
    activation)."""
    if not isinstance(output, Tensor) or not is_activation(module):
        return None
    saturated = saturation_of(module)
    return CallSummary(
        alive=torch.count_nonzero(output, dim=batch_axis),
        total=output.sum().double(),
        squares=torch.linalg.vector_norm(output).double().square(),
        saturated=saturated(module, output).sum() if saturated is not None else 0,
        values=output.numel(),
    )


def packed_sums(summaries: list[CallSummary], processes: int = 1) -> dict[str, Tensor]:
    """The sums of the step's calls, in call order, as a few tensors for all of them (a few
    operations a step, not a chain per call): ``"alive"``, the calls' ``alive`` counts
    flattened and concatenated (int64); ``"moments"``, float64 [sum y of each call, ||y||^2
    of each call, the saturated count of each saturating call] (``torch.stack`` into a
    float64 buffer widens each count by itself: one above 2^24 is exact). With several
    ``processes``, also ``"values"``, each call's number of values, to add over them (with
    one process the host knows them)."""
    device = summaries[0].total.device
    counts = [s.saturated for s in summaries if isinstance(s.saturated, Tensor)]
    moments = torch.empty(2 * len(summaries) + len(counts), dtype=torch.float64, device=device)
    torch.stack([*(s.total for s in summaries), *(s.squares for s in summaries), *counts],
                out=moments)  # fmt: skip
    sums = {"alive": torch.cat([s.alive.reshape(-1) for s in summaries]), "moments": moments}
    if processes > 1:
        values = [float(s.values) for s in summaries]
        sums["values"] = torch.tensor(values, dtype=torch.float64, device=device)
    return sums


def dead_counts(alive: Tensor, summaries: list[CallSummary]) -> Tensor:
    """[the units of each call that are zero for every sample] from the concatenated
    ``alive`` counts of :func:`packed_sums` (added over the processes)."""
    units = [s.alive.numel() for s in summaries]
    return torch.stack([dead.sum() for dead in (alive == 0).split(units)])


def healths(
    calls: list[tuple[str, nn.Module, CallSummary]],
    dead: list[float],
    moments: list[float],
    values: list[float],
) -> dict[str, dict]:
    """Each module's statistics (see the module docstring), on the host, from its calls'
    dead units ``dead`` (of :func:`dead_counts`), ``moments`` (of :func:`packed_sums`) and
    numbers of ``values``, read as Python floats: the counts and sums of a module's calls are
    added in call order, in float64."""
    count = len(calls)
    saturated = iter(moments[2 * count :])
    totals: dict[str, list] = {}  # name -> [dead units, units, values, sum y, sum y^2, saturated]
    for (name, _, summary), dead_units, total, squares, call_values in zip(
        calls, dead, moments[:count], moments[count : 2 * count], values, strict=True
    ):
        row = totals.setdefault(name, [0, 0, 0, 0.0, 0.0, 0.0])
        row[0] += dead_units
        row[1] += summary.alive.numel()
        row[2] += call_values
        row[3] += total
        row[4] += squares
        if isinstance(summary.saturated, Tensor):
            row[5] += next(saturated)
    modules = {name: module for name, module, _ in calls}
    result = {}
    for name, (dead_units, units, values, total, squares, saturated_values) in totals.items():
        result[name] = {"dead": dead_units / units, "mean": total / values,
                        "rms": (squares / values) ** 0.5}  # fmt: skip
        if saturation_of(modules[name]) is not None:
            result[name]["saturated"] = saturated_values / values
    return result


class ActivationHealth(Quantity):
    """Per activation module: the fraction of dead units, of saturated values (saturating
    activations), and the mean and RMS of its output, from the step's own forward.

    The value is ``{module name: {"dead", "saturated" (saturating types only), "mean",
    "rms"}}``, modules in call order. It reads the forward only: no loss enters it.
    """

    output = TENSORS

    def __init__(self, schedule=None):
        super().__init__(schedule)
        self._warned = False  # about activations it cannot see, once
        # the tracked model's module -> name, of one walk of its modules, walked again when a
        # summarised module is not in it (and for another model)
        self._model: nn.Module | None = None
        self._names: dict[nn.Module, str] = {}

    def request(self, step: int) -> Request:
        return Request(module_outputs=(output_summary,))

    def calls(self, data: StepData) -> list[tuple[str, nn.Module, CallSummary]]:
        """(name, module, summary) of each call of the tracked model's activation modules in
        the step's forward, in call order. The capture summarises every module's forward
        until the model's own call returns: another model's modules are not the tracked
        model's."""
        found = [
            (module, summary)
            for call in data.captured.calls.get(data.model, [])
            for visit, module, summary in call.summaries
            if visit is output_summary
        ]
        if self._model is not data.model or any(m not in self._names for m, _ in found):
            self._model = data.model
            self._names = {m: name for name, m in data.model.named_modules()}
            self._warn_of_functional(data)
        names = self._names
        return [(names[m], m, summary) for m, summary in found if m in names]

    def sums(self, data: StepData) -> dict[str, Tensor]:
        """The calls' sums packed by :func:`packed_sums` (none without a call)."""
        summaries = [summary for _, _, summary in self.calls(data)]
        return packed_sums(summaries, data.parallel.world.size) if summaries else {}

    def _warn_of_functional(self, data: StepData) -> None:
        """Once: the layers whose activation is a function (not seen)."""
        functional = functional_activations(data.model)
        if functional and not self._warned:
            self._warned = True
            more = f" and {len(functional) - 4} more" if len(functional) > 4 else ""
            warnings.warn(
                f"Step {data.step}: ActivationHealth does not see the activations of "
                f"{', '.join(map(repr, functional[:4]))}{more}: nn.TransformerEncoderLayer and "
                "nn.TransformerDecoderLayer apply theirs as a function. Build them with "
                "activation=nn.GELU() (or nn.ReLU()), a module, to watch it (said once).",
                stacklevel=user_stacklevel(),
            )

    def _warn_of_none(self, data: StepData) -> None:
        """Once: a forward without any activation module."""
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"Step {data.step}: ActivationHealth saw no activation module in the forward "
                "(it watches the modules of avionics.quantities.activation_health.ACTIVATIONS, "
                "nn.ReLU, nn.GELU, nn.Tanh, ..., and those of transformers.activations). An "
                "activation applied as a function (F.relu(x)) is not a module: use the module "
                "(nn.ReLU()) to watch it.",
                stacklevel=user_stacklevel(),
            )

    def compute(self, data: StepData):
        totals = data.totals[self.name]
        calls = self.calls(data)
        if not calls:
            self._warn_of_none(data)
            return {data.step: {}}
        summaries = [summary for _, _, summary in calls]
        dead = dead_counts(totals["alive"], summaries)
        count, moments = len(calls), totals["moments"].numel()
        # (the numbers of values added over the processes, else this process's own)
        added = (totals["values"],) if "values" in totals else ()
        own = [float(s.values) for s in summaries]

        def finished(floats: list[float], _) -> dict[str, dict]:
            values = floats[count + moments :] or own
            return healths(calls, floats[:count], floats[count : count + moments], values)

        # finished on the host, from the numbers read with the step's one host transfer
        return {data.step: Deferred((dead, totals["moments"], *added), finished)}
