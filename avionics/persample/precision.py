"""The dtype the per-sample engine computes in: 16-bit floats (a half-precision model, or a
forward under autocast) are computed from in float32; every other dtype as it is."""

from __future__ import annotations

import torch
from torch import Tensor

# The 16-bit floats (cast up by avionics.persample.capture.at_least_float32).
LOW_PRECISION = (torch.float16, torch.bfloat16)


def computing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics of tensors in ``dtype`` are computed in: float32 for 16-bit
    floats, else ``dtype`` itself."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def computing(t: Tensor) -> Tensor:
    """``t`` (a parameter, a direction) in the dtype the engine computes in: float32 where
    it is a 16-bit float, else itself."""
    return t.float() if t.dtype in LOW_PRECISION else t
