"""PreconditionedSharpness: the largest eigenvalue of P^{-1/2} H P^{-1/2}, H the Hessian of the
loss as the user reduced it (as HessMaxEV's) and P the diagonal preconditioner that an Adam,
AdamW or RMSprop step is about to apply (Cohen et al. 2022, "Adaptive Gradient Methods at the
Edge of Stability", arXiv:2207.14484, section 2: the "preconditioned sharpness"
lambda_1(P^{-1} H), the eigenvalues of P^{-1} H being those of P^{-1/2} H P^{-1/2}).

The preconditioner of step t (t - 1 steps taken, read from the optimizer's state before
``optimizer.step()``), from the gradient g_t of the step's loss (``p.grad``), with
g_hat = g_t + weight_decay * theta_t for Adam and RMSprop (none for AdamW, whose decay is
decoupled) -- exactly what torch.optim's step computes (single-tensor, foreach, fused and
capturable implementations alike):

* Adam, AdamW: v_t = beta2 v_{t-1} + (1 - beta2) g_hat^2, v_hat = v_t / (1 - beta2^t) (with
  ``amsgrad``: v_hat = max(v_max, v_t) / (1 - beta2^t)), P = diag(sqrt(v_hat) + eps). The
  first moment's bias correction 1 / (1 - beta1^t), which Cohen et al. fold into P, scales the
  step instead and is left out: it is within 1 % of 1 from t = 44 on with beta1 = 0.9.
* RMSprop: v_t = alpha v_{t-1} + (1 - alpha) g_hat^2 (``centered``: minus m_t^2, m_t =
  alpha m_{t-1} + (1 - alpha) g_hat), P = diag(sqrt(v_t) + eps); no bias correction.

At the optimizer's first step (no state yet: v_0 = 0, t = 1) this is Adam's own first
preconditioner, P = diag(|g_hat| + eps), and it is computed like any other; it is usually far
larger than later values (coordinates with tiny gradients get a large P^{-1/2}). A tracked
parameter the optimizer does not hold, or whose gradient is None at the step (the optimizer
skips it), does not move: its block of P^{-1/2} is 0. A gradient changed between the backward
and ``optimizer.step()`` (clipping) is not seen: P is that of the unclipped gradient.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from avionics.curvature.algorithms.lanczos import BlockOperator
from avionics.persample.precision import computing
from avionics.quantities.base import StepData
from avionics.quantities.curvature import _graph_grads
from avionics.quantities.hess_max_ev import (
    WarmStartedTopEigenvalue,
    _HessianProduct,
    _leaves,
)

ADAPTIVE = (torch.optim.Adam, torch.optim.RMSprop)  # AdamW is an Adam (same step)


def why_unsupported(optimizer) -> str | None:
    """None when P can be read from ``optimizer``, else what keeps it from being read (a
    sentence part): not a torch.optim Adam, AdamW or RMSprop (or a subclass with its own
    step), ``maximize`` (the step ascends: its stability is that of -H), complex parameters,
    or parameter groups whose learning rates or beta1 (momentum) differ (the stability
    threshold they set is one number)."""
    kind = next((cls for cls in ADAPTIVE if isinstance(optimizer, cls)), None)
    # (torch wraps a class's step when its first instance is built: compare what is wrapped)
    if kind is None or inspect.unwrap(type(optimizer).step) is not inspect.unwrap(kind.step):
        return f"info['optimizer'] is {type(optimizer).__name__}"
    groups = optimizer.param_groups
    if any(group.get("maximize") for group in groups):
        return "it has maximize=True"
    if any(p.is_complex() for group in groups for p in group["params"]):
        return "it holds complex parameters"
    settings = {(float(g["lr"]), _momentum(g)) for g in groups}
    if len(settings) > 1:
        return (
            "its parameter groups have different (lr, beta1 or momentum) settings "
            f"{sorted(settings)}"
        )
    return None


def require_supported(name: str, optimizer) -> None:
    """Raise a clear error naming quantity ``name`` when P cannot be read from ``optimizer``."""
    reason = why_unsupported(optimizer)
    if reason is not None:
        raise ValueError(
            f"{name} reads the preconditioner of torch.optim.Adam, AdamW or RMSprop without "
            f"maximize, with real parameters and one lr and beta1 (momentum) over all "
            f"parameter groups; {reason}. Use such an optimizer, or HessMaxEV instead of "
            f"{name} (for SGD)."
        )


def _momentum(group: dict) -> float:
    """beta1 of an Adam group, the momentum of an RMSprop group."""
    return float(group["betas"][0]) if "betas" in group else float(group["momentum"])


def _adam_preconditioner(g: Tensor, state: dict, group: dict) -> Tensor:
    """sqrt(v_hat_t) + eps of the coming Adam(W) step (module docstring)."""
    beta2 = float(group["betas"][1])
    v = (1 - beta2) * g.square()
    if not state:  # t = 1
        return (v / (1 - beta2)).sqrt() + group["eps"]
    v = v + beta2 * state["exp_avg_sq"]
    if group["amsgrad"]:
        v = torch.maximum(v, state["max_exp_avg_sq"])
    # t = the step count + 1, in float64 where the count is (a CPU tensor, or the parameters'
    # device for a capturable or fused Adam): its value is not read on the host
    t = torch.as_tensor(state["step"]).to(torch.float64) + 1
    return (v / (1 - beta2**t)).sqrt() + group["eps"]


def _rmsprop_preconditioner(g: Tensor, state: dict, group: dict) -> Tensor:
    """sqrt(v_t) + eps of the coming RMSprop step, centered or not (module docstring)."""
    alpha = float(group["alpha"])
    v = (1 - alpha) * g.square() + (alpha * state["square_avg"] if state else 0)
    if group["centered"]:
        m = (1 - alpha) * g + (alpha * state["grad_avg"] if state else 0)
        v = v - m.square()
    return v.sqrt() + group["eps"]


def _local(tensor):
    """This process's part of a sharded tensor (FSDP's DTensor), a tensor or value as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def inverse_sqrt_preconditioner(data: StepData) -> list[Tensor]:
    """P^{-1/2} per tracked parameter (zeros for one the step does not move), whole: under
    FSDP each process makes its shards' from its shards of the gradient, the parameters and
    the optimizer's state, and the shards are all-gathered (one collective of the
    parameters' size per step, :meth:`~avionics.quantities.base.Parallel.whole`)."""
    optimizer = data.optimizer
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    adam = isinstance(optimizer, torch.optim.Adam)
    scales = []
    for p, g, graph_grad in zip(data.tracked, data.grads, data.graph_grads, strict=True):
        group = group_of.get(id(p))
        if group is None or graph_grad is None:
            scales.append(torch.zeros_like(g))
            continue
        g = computing(g)  # (of a 16-bit model: in float32)
        coupled = not (adam and group.get("decoupled_weight_decay"))
        if group["weight_decay"] and coupled:
            g = g + group["weight_decay"] * _local(p.detach())
        state = {key: _local(value) for key, value in optimizer.state.get(p, {}).items()}
        precondition = _adam_preconditioner if adam else _rmsprop_preconditioner
        scales.append(precondition(g, state, group).rsqrt())
    return data.parallel.whole(scales)


class PreconditionedSharpness(WarmStartedTopEigenvalue):
    """The largest algebraic eigenvalue of P^{-1/2} H P^{-1/2}, P the diagonal preconditioner
    of the coming Adam, AdamW or RMSprop step (``info["optimizer"]``; exactly as stated in
    the module docstring) and H the Hessian of the loss as the user reduced it
    (``info["loss"]``, as HessMaxEV's).

    An adaptive step theta -= lr P^{-1} m is stable on a quadratic while lr times this value
    stays below the optimizer's threshold: (2 + 2 beta1) / (1 - beta1) (38 for beta1 = 0.9)
    for Adam (Cohen et al. 2022), 2 (1 + momentum) for RMSprop; the diagnosis
    (:func:`avionics.diagnosis.step_size.edge_of_stability`) compares them.

    The same warm-started Lanczos as :class:`HessMaxEV` (its stopping rule, warning and warm
    start), on the products v -> P^{-1/2} H (P^{-1/2} v): one Hessian-vector product each,
    global under data parallelism (every process computes the same P from the global
    gradient and its replica of the optimizer's state). An optimizer it cannot read (see
    :func:`why_unsupported`) is refused when the step is entered, before any work.

    Args:
        schedule: the steps to track (default every step).
        tol: the relative accuracy of the eigenvalue, in [0, 1).
        max_products: the most Hessian-vector products per step, >= 1.
        seed: the seed of the first step's start vector, in [0, 2**32).
    """

    info_keys = ("optimizer",)

    def validate(self, step: int, info: dict) -> None:
        require_supported(self.name, info["optimizer"])

    def operator(self, data: StepData) -> BlockOperator:
        hvp = _HessianProduct(_graph_grads(data), _leaves(data), data)
        product = _PreconditionedProduct(hvp, inverse_sqrt_preconditioner(data))
        return BlockOperator(product, hvp.slices, hvp.dtype, hvp.device)


class _PreconditionedProduct:
    """v -> S H (S v), S = P^{-1/2} diagonal, per leaf (None where H v does not reach)."""

    def __init__(self, hvp: _HessianProduct, scales: list[Tensor]):
        self.hvp, self.scales = hvp, scales
        self.flat_scale = torch.cat([s.reshape(-1) for s in scales])

    def __call__(self, v: Tensor) -> list[Tensor | None]:
        parts = self.hvp(v * self.flat_scale)
        return [p if p is None else p * s for p, s in zip(parts, self.scales, strict=True)]
