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


def output_summary(module: nn.Module, output, batch_axis: int) -> dict[str, Tensor] | None:
    """The counts and sums of one call's output (None for a module that is no activation):
    ``alive`` [units]: the samples where each unit is nonzero; ``moments``: [values, sum_y,
    sum_y^2, saturated values], float64.

    Each is one reduction of the output as it is (no float64 copy of it): the nonzero count
    along the batch axis, the sum, the norm, and the count of the saturation mask.
    """
    if not isinstance(output, Tensor) or not is_activation(module):
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


def healths(modules: dict[str, nn.Module], totals: dict[str, Tensor]) -> dict[str, dict]:
    """Each module's statistics (see the module docstring) from its calls' ``alive`` counts
    (concatenated) and ``moments`` (added), over the calls and the processes, for the
    ``"alive NAME"`` / ``"moments NAME"`` entries of ``totals``: one transfer to the host for
    all modules ([dead fraction, moments] per module, stacked)."""
    names = [key.split(" ", 1)[1] for key in totals if key.startswith("alive ")]
    if not names:
        return {}
    packed = torch.stack(
        [
            torch.cat([(totals[f"alive {name}"] == 0).double().mean()[None],
                       totals[f"moments {name}"]])
            for name in names
        ]
    ).tolist()  # fmt: skip
    result = {}
    for name, (dead, values, total, squares, saturated) in zip(names, packed, strict=True):
        result[name] = {"dead": dead, "mean": total / values, "rms": (squares / values) ** 0.5}
        if saturation_of(modules[name]) is not None:
            result[name]["saturated"] = saturated / values
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

    def request(self, step: int) -> Request:
        return Request(module_outputs=(output_summary,))

    def sums(self, data: StepData) -> dict[str, Tensor]:
        names = {m: name for name, m in data.model.named_modules()}
        alive: dict[str, list[Tensor]] = {}
        moments: dict[str, Tensor] = {}
        for call in data.captured.calls.get(data.model, []):
            for visit, module, summary in call.summaries:
                # (the capture summarises every module's forward until the model's own call
                # returns: another model's modules are not the tracked model's)
                name = names.get(module)
                if visit is not output_summary or name is None:
                    continue
                alive.setdefault(name, []).append(summary["alive"])
                moments[name] = moments.get(name, 0) + summary["moments"]
        sums = {f"alive {name}": torch.cat(counts) for name, counts in alive.items()}
        sums.update({f"moments {name}": m for name, m in moments.items()})
        return sums

    def _warn_once(self, data: StepData, seen: bool) -> None:
        """Once: the layers whose activation is a function (not seen); else, once, a forward
        without any activation module."""
        if self._warned:
            return
        functional = functional_activations(data.model)
        if functional:
            self._warned = True
            more = f" and {len(functional) - 4} more" if len(functional) > 4 else ""
            warnings.warn(
                f"Step {data.step}: ActivationHealth does not see the activations of "
                f"{', '.join(map(repr, functional[:4]))}{more}: nn.TransformerEncoderLayer and "
                "nn.TransformerDecoderLayer apply theirs as a function. Build them with "
                "activation=nn.GELU() (or nn.ReLU()), a module, to watch it (said once).",
                stacklevel=3,
            )
        elif not seen:
            self._warned = True
            warnings.warn(
                f"Step {data.step}: ActivationHealth saw no activation module in the forward "
                "(it watches the modules of avionics.quantities.activation_health.ACTIVATIONS, "
                "nn.ReLU, nn.GELU, nn.Tanh, ..., and those of transformers.activations). An "
                "activation applied as a function (F.relu(x)) is not a module: use the module "
                "(nn.ReLU()) to watch it.",
                stacklevel=3,
            )

    def compute(self, data: StepData):
        totals = data.totals[self.name]
        self._warn_once(data, bool(totals))
        return {data.step: healths(dict(data.model.named_modules()), totals)}
