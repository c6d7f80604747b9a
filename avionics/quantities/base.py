"""The protocol every cockpit instrument follows.

A quantity says, for a step, whether it is active, which ``info`` keys it reads, which
per-sample statistics it needs (a :class:`~avionics.persample.Request`) and whether it needs
the backward graph; after the backward it turns a :class:`StepData` into values keyed by the
step they belong to (two-step quantities store under their start step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from avionics.persample import Request, Statistics
from avionics.schedules import Schedule, describe, linear


@dataclass
class StepData:
    """Everything a quantity may read at one step, after the backward, before the update.

    ``mean_grad`` is g = mean_n g_n (= p.grad for a mean-reduced loss, p.grad / N for a sum);
    ``statistics`` holds the per-sample statistics requested for this step.

    ``per_sample(request, directions, params=None) -> Statistics`` (set on steps that captured
    per-sample information, else None) computes further statistics of *this* step's per-sample
    gradients on demand, e.g. projections onto a direction only known later (Alpha projects
    the start step's g_n onto theta_{t+1} - theta_t). It stays valid as long as a quantity keeps
    a reference to it, which keeps this step's captured layer inputs and output gradients
    alive: drop it as soon as it is used. Once the parameters have changed (after
    ``optimizer.step()``), pass ``params``, their values at this step: they are swapped in
    while it runs, for the rules that re-run a module's forward.
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
    statistics: Statistics | None = None
    extra: dict = field(default_factory=dict)
    per_sample: Callable[..., Statistics] | None = None
    _params_copy: list[Tensor] | None = field(default=None, init=False, repr=False)

    @property
    def optimizer(self):
        return self.info.get("optimizer")

    def params_copy(self) -> list[Tensor]:
        """A copy of theta_t (``params`` before the update), made once per step and shared.

        Parameters' values, UpdateSize's theta_t, Distance's theta_0 and Alpha's theta_t are
        the same tensors at the same step: one copy serves them all, so a step keeps one
        model-sized copy, not one per quantity. Nobody may modify it in place.
        """
        if self._params_copy is None:
            self._params_copy = [p.detach().clone() for p in self.params]
        return self._params_copy


class Quantity:
    """Base class: a schedule, the info keys read, and :meth:`compute`.

    Subclasses set ``info_keys`` (keys of ``info`` they read besides ``"loss"``),
    ``create_graph`` (True when they differentiate the gradient again), and implement
    :meth:`compute`; per-sample quantities override :meth:`request`.
    """

    info_keys: tuple[str, ...] = ()
    create_graph: bool = False

    def __init__(self, schedule: Schedule | None = None):
        if schedule is not None and not callable(schedule):
            raise TypeError(
                f"{type(self).__name__}(schedule=...) takes a schedule such as "
                f"avionics.schedules.linear(1), got {schedule!r}."
            )
        self.schedule = schedule if schedule is not None else linear(1)

    @property
    def name(self) -> str:
        return type(self).__name__

    def describe(self) -> str:
        return f"{self.name}({describe(self.schedule)})"

    def is_active(self, step: int) -> bool:
        """Whether :meth:`compute` must run at ``step``."""
        return self.schedule(step)

    def request(self, step: int) -> Request:
        """The per-sample statistics this quantity reads at ``step``."""
        return Request()

    def directions(self, data: StepData) -> dict[str, list[Tensor]]:
        """Directions (beyond "grad") this quantity projects per-sample gradients on.

        Called on steps with a non-empty request, after the backward and before the engine
        runs (the last point where a quantity sees ``data`` before its visitors are called).
        """
        return {}

    def compute(self, data: StepData) -> dict[int, Any]:
        """Values keyed by the step they belong to (usually ``{data.step: value}``)."""
        raise NotImplementedError


def global_norm_squared(tensors: list[Tensor]) -> Tensor:
    """sum_k ||t_k||^2 over a list of tensors."""
    # vector_norm reads each tensor once without a squared copy: ~3x faster than pow(2).sum()
    return sum(torch.linalg.vector_norm(t).square() for t in tensors)


def per_parameter_norms(tensors: list[Tensor]) -> Tensor:
    """[||t_1||, ..., ||t_K||] as one tensor (one host transfer when converted)."""
    return torch.stack([t.norm() for t in tensors])


def per_parameter_distances(a: list[Tensor], b: list[Tensor]) -> Tensor:
    """[||a_1 - b_1||, ..., ||a_K - b_K||] as one tensor; one difference exists at a time (the
    differences of all parameters at once would be a model-sized temporary)."""
    return torch.stack([(x - y).norm() for x, y in zip(a, b, strict=True)])


def require_plain_sgd(quantity: Quantity, optimizer) -> float:
    """The learning rate of a plain SGD optimizer; a clear error for anything else."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(
            f"{quantity.name} is defined for plain SGD only (torch.optim.SGD without momentum "
            f"or weight decay); info['optimizer'] is {type(optimizer).__name__}. Remove "
            f"{quantity.name} from the cockpit's quantities for this optimizer."
        )
    lrs = set()
    for group in optimizer.param_groups:
        if group.get("momentum", 0) or group.get("weight_decay", 0) or group.get("nesterov"):
            raise ValueError(
                f"{quantity.name} is defined for plain SGD only; this SGD has momentum="
                f"{group.get('momentum')}, weight_decay={group.get('weight_decay')}. Set them "
                f"to 0 or remove {quantity.name}."
            )
        lrs.add(float(group["lr"]))
    if len(lrs) != 1:
        raise ValueError(
            f"{quantity.name} needs one learning rate; the optimizer's parameter groups have "
            f"{sorted(lrs)}."
        )
    return lrs.pop()
