"""ActivationHealth: dead and saturated units, mean and RMS of each activation module's output.

Which modules: the activation modules of the model (:data:`ACTIVATIONS`: ``nn.ReLU``,
``nn.GELU``, ``nn.Tanh``, ``nn.Sigmoid``, ``nn.Hardtanh``, ...), named as in
``model.named_modules()``. Activations applied as functions (``F.relu`` inside a forward) are
not modules and are not seen: use the module (``nn.ReLU()``) to watch them.

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

import torch
from torch import Tensor, nn

from avionics.persample import Request
from avionics.quantities.base import Quantity, StepData
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


def output_summary(module: nn.Module, output, batch_axis: int) -> dict[str, Tensor] | None:
    """The counts and sums of one call's output (None for a module that is no activation):
    ``alive`` [units]: the samples where each unit is nonzero; ``moments``: [values, sum_y,
    sum_y^2, saturated values], float64.

    Each is one reduction of the output as it is (no float64 copy of it): the nonzero count
    along the batch axis, the sum, the norm, and the count of the saturation mask.
    """
    if not isinstance(module, ACTIVATIONS) or not isinstance(output, Tensor):
        return None
    alive = torch.count_nonzero(output, dim=batch_axis).flatten().double()
    saturated = saturation_of(module)
    zero = output.new_zeros((), dtype=torch.float64)
    moments = torch.stack(
        [
            zero + output.numel(),
            output.sum().double(),
            torch.linalg.vector_norm(output).double().square(),
            saturated(module, output).sum().double() if saturated is not None else zero,
        ]
    )
    return {"alive": alive, "moments": moments}


def health(module: nn.Module, alive: Tensor, moments: Tensor) -> dict[str, float]:
    """``module``'s statistics (see the module docstring) from its calls' ``alive`` counts
    (concatenated) and ``moments`` (added), over the calls and the processes."""
    values, total, squares, saturated = moments.tolist()
    result = {
        "dead": float((alive == 0).double().mean()),
        "mean": total / values,
        "rms": (squares / values) ** 0.5,
    }
    if saturation_of(module) is not None:
        result["saturated"] = saturated / values
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
        self._warned = False  # about a forward without activation modules, once

    def request(self, step: int) -> Request:
        return Request(module_outputs=(output_summary,))

    def sums(self, data: StepData) -> dict[str, Tensor]:
        names = {m: name for name, m in data.model.named_modules()}
        alive: dict[str, list[Tensor]] = {}
        moments: dict[str, Tensor] = {}
        for call in data.captured.calls.get(data.model, []):
            for visit, module, summary in call.summaries:
                if visit is not output_summary:
                    continue
                name = names[module]
                alive.setdefault(name, []).append(summary["alive"])
                moments[name] = moments.get(name, 0) + summary["moments"]
        sums = {f"alive {name}": torch.cat(counts) for name, counts in alive.items()}
        sums.update({f"moments {name}": m for name, m in moments.items()})
        return sums

    def compute(self, data: StepData):
        totals = data.totals[self.name]
        if not totals and not self._warned:
            self._warned = True
            warnings.warn(
                f"Step {data.step}: ActivationHealth saw no activation module in the forward "
                "(it watches the modules of avionics.quantities.activation_health.ACTIVATIONS, "
                "nn.ReLU, nn.GELU, nn.Tanh, ...). An activation applied as a function "
                "(F.relu(x)) is not a module: use the module (nn.ReLU()) to watch it.",
                stacklevel=2,
            )
        modules = dict(data.model.named_modules())
        value = {}
        for key, alive in totals.items():
            kind, name = key.split(" ", 1)
            if kind == "alive":
                moments = totals[f"moments {name}"]
                value[name] = health(modules[name], alive, moments)
        return {data.step: value}
