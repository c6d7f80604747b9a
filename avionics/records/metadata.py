"""Run metadata learnt during training: the optimizer's description."""

from __future__ import annotations

import torch


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict:
    """``{"name": class name, "param_groups": [hyperparameters of each group]}``; tensors
    among the hyperparameters become numbers, other objects their ``repr``. The diagnosis
    reads ``name``, ``lr`` and ``momentum`` from it."""
    groups = []
    for group in optimizer.param_groups:
        hyper = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if not isinstance(value, (bool, int, float, str, type(None), list, tuple)):
                value = repr(value)
            hyper[key] = value
        groups.append(hyper)
    return {"name": type(optimizer).__name__, "param_groups": groups}
