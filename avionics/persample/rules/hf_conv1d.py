"""Hugging Face ``transformers.pytorch_utils.Conv1D``: y = x W + b, W of shape [in, out].

It is an ``nn.Linear`` with a transposed weight (GPT-2's attention and MLP projections). Per
sample n, positions t of all calls of one forward concatenated,

    grad W = sum_t x_t delta_t^T   ([in, out]),      grad b = sum_t delta_t,

which is the bilinear form G_n = sum_t a_t b_t^T of :mod:`bilinear` with the roles of the two
factors exchanged: a = x (the inputs) on the weight's first axis, b = delta (the output
gradients) on its second. The rule reuses :class:`~avionics.persample.rules.linear.LinearRule`
on the exchanged factors; only the bias, sum_t delta_t, reads the output gradients itself.

transformers is never imported here: a module is matched by the class that
``transformers.pytorch_utils`` defines once the user's code has imported it.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from avionics.persample.rules.bilinear import position_sums
from avionics.persample.rules.linear import LinearColumnSums, LinearRule

# where transformers defines the layer
HF_MODULE, HF_CLASS = "transformers.pytorch_utils", "Conv1D"


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.pytorch_utils.Conv1D`` running Conv1D's own
    forward (a subclass with its own forward is left to the generic rule)."""
    return is_hf_conv1d_class(type(module))


def is_hf_conv1d_class(kind: type) -> bool:
    """:func:`is_hf_conv1d` of a module of class ``kind``."""
    defining = sys.modules.get(HF_MODULE)
    cls = getattr(defining, HF_CLASS, None)
    return cls is not None and issubclass(kind, cls) and kind.forward is cls.forward


class HFConv1DRule(LinearRule):
    """Per-sample gradients of a Conv1D's ``weight`` [in, out] and ``bias`` [out]."""

    def __init__(self, module: nn.Module, calls, names, n, output_gradient_factor):
        super().__init__(module, calls, names, n, output_gradient_factor)
        # LinearRule forms G_n = sum_t delta_t x_t^T of shape [out, in]; exchanging the
        # factors gives sum_t x_t delta_t^T, the weight's [in, out]. The output-gradient
        # factor stays where LinearRule put it: in one of the two, or in delta_scale.
        self.x, self.delta = self.delta, self.x

    def _bias(self) -> Tensor:
        """sum_t delta_t: the output gradients are ``self.x`` after the exchange."""
        bias = position_sums(self.x)
        return bias if self.delta_scale == 1 else bias * self.delta_scale

    @staticmethod
    def in_features(module: nn.Module) -> int:
        return module.weight.shape[0]  # (stored [in, out])


class TransposedColumnSums(LinearColumnSums):
    """:class:`LinearColumnSums` for a weight stored as [in, out]."""

    def result(self, scale: float) -> list[Tensor | None]:
        out = super().result(scale)
        return [
            torch.t(s) if name == "weight" and not self.traces and s is not None else s
            for name, s in zip(self.names, out, strict=True)
        ]


HFConv1DRule.column_sums_class = TransposedColumnSums
