"""Plain SGD: theta_{t+1} = theta_t - lr * p.grad, the update rule some quantities assume.

An optimizer counts as plain SGD when it is a ``torch.optim.SGD`` (or a subclass that keeps
its ``step``) whose every parameter group has no momentum, weight decay, Nesterov or
``maximize``, and all groups share one learning rate. CABS and EarlyStopping are defined for it
only; Alpha uses it to know the update before ``optimizer.step()``.
"""

from __future__ import annotations

import torch


def why_not_plain_sgd(optimizer) -> str | None:
    """None for plain SGD, else what keeps ``optimizer`` from being it (a sentence part)."""
    sgd = torch.optim.SGD
    if not isinstance(optimizer, sgd) or type(optimizer).step is not sgd.step:
        return f"info['optimizer'] is {type(optimizer).__name__}"
    lrs = set()
    for group in optimizer.param_groups:
        extras = {
            key: group.get(key)
            for key in ("momentum", "weight_decay", "nesterov", "maximize")
            if group.get(key)
        }
        if extras:
            settings = ", ".join(f"{key}={value}" for key, value in extras.items())
            return f"this SGD has {settings}"
        lrs.add(float(group["lr"]))
    if len(lrs) != 1:
        return f"the optimizer's parameter groups have the learning rates {sorted(lrs)}"
    return None


def plain_sgd_learning_rate(optimizer) -> float | None:
    """The learning rate of plain SGD, or None for any other update rule."""
    if why_not_plain_sgd(optimizer) is not None:
        return None
    return float(optimizer.param_groups[0]["lr"])


def require_plain_sgd(name: str, optimizer) -> float:
    """The learning rate of plain SGD; for anything else a clear error naming quantity
    ``name`` and what to do."""
    reason = why_not_plain_sgd(optimizer)
    if reason is not None:
        raise ValueError(
            f"{name} is defined for plain SGD only (torch.optim.SGD with one learning rate and "
            f"no momentum, weight decay, nesterov or maximize); {reason}. Change that or "
            f"remove {name} from the cockpit's quantities."
        )
    return float(optimizer.param_groups[0]["lr"])
