"""The random state of a call, so that a rule's re-run of the module draws the same numbers.

A rule that re-runs a module's forward on its captured inputs (the attention's closed form)
must reproduce the dropout masks the module drew: the capture keeps the state of the random
generator of the call's device as the call begins (:func:`state_before`, only for modules
that draw in their own forward), and the re-run runs under :func:`replayed`, which restores it
and afterwards puts back the state it found, so that the user's next draws are unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn


def draws_in_forward(module: nn.Module) -> bool:
    """Whether ``module``'s own forward draws random numbers that a closed-form rule re-runs
    (nn.MultiheadAttention's dropout on the attention weights, in train mode)."""
    return isinstance(module, nn.MultiheadAttention) and module.training and module.dropout > 0


def state_before(args: tuple) -> tuple[torch.device, Tensor]:
    """(device, generator state) for a call whose first tensor argument is on that device."""
    device = next((a.device for a in args if isinstance(a, Tensor)), torch.device("cpu"))
    if device.type == "cpu":
        return device, torch.get_rng_state()
    return device, torch.get_device_module(device.type).get_rng_state(device)


@contextmanager
def replayed(state: tuple[torch.device, Tensor]):
    """Run the block with the generator of ``state``'s device set to it; restore it after."""
    device, saved = state
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(saved)
            yield
        return
    with torch.random.fork_rng(devices=[device], device_type=device.type):
        torch.get_device_module(device.type).set_rng_state(saved, device)
        yield
