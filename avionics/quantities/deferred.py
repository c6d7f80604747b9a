"""Deferred: a value whose last part is decided on the host, read with the step's one transfer.

A quantity whose value needs a few numbers on the host (a fit in float64, a warning that
depends on a device value, a value stored or not) returns ``Deferred(tensors, finish, value)``
instead of waiting for the device: ``tensors`` are on the device, and ``finish(floats, value)``
gets their numbers as Python floats (each tensor flattened, in order), with ``value`` (the
value as far as the device computes it: tensors, or None), and returns the value to store
(None: nothing is stored), warning where it must. The cockpit reads the tensors of every
deferred value of a step together with the finiteness of its values in one host transfer
when the step is stored (:mod:`avionics.step.transfer`), so that a tracked step waits for the
device once; ``value`` reaches ``finish`` as plain Python where the step's values go to sinks,
else as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class Deferred:
    """A value finished on the host (see the module docstring)."""

    tensors: tuple[Tensor, ...]
    finish: Callable[[list[float], Any], Any]
    value: Any = None

    def then(self, after: Callable[[Any], Any]) -> Deferred:
        """The value ``after(finish(floats, value))``: a further host step on the result."""
        return Deferred(self.tensors, lambda floats, v: after(self.finish(floats, v)), self.value)
