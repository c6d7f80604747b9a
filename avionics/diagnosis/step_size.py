"""Findings about the step size: alpha too large or too small, the edge of stability (of plain
or momentum SGD on the Hessian, of Adam, AdamW and RMSprop on the preconditioned Hessian)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from avionics.diagnosis.evidence import (
    finite_series,
    hyperparameter,
    latest_part,
    learning_rate_at,
    optimizer,
)
from avionics.diagnosis.finding import Finding

MIN_ALPHAS = 5  # fewer tracked alphas say nothing about "mostly"
MOSTLY = 0.5  # more than this share of the recent steps makes a finding
NEAR_MINUS_ONE = -0.8
STABILITY_BAND = (0.9, 1.1)  # lr * lambda_max within this factor of the limit: "at the edge"
PRECONDITIONED = "PreconditionedSharpness"
PRECONDITIONED_MEASURE = "preconditioned sharpness (largest eigenvalue of P^-1/2 H P^-1/2)"


def _recent_alpha(run):
    """``(steps, alpha)`` of the latest half of the tracked alphas, or None if too few."""
    steps, alpha = finite_series(run, "Alpha")
    if len(alpha) < MIN_ALPHAS:
        return None
    recent = latest_part(alpha, 0.5, MIN_ALPHAS)
    return steps[-len(recent) :], recent


def _alpha_summary(steps, alpha, hits) -> str:
    return (
        f"{hits.sum()} of the latest {len(alpha)} tracked steps ({hits.mean():.0%}, steps "
        f"{steps[0]}-{steps[-1]}); their median alpha is {np.median(alpha):.3g}"
    )


def step_size_too_large(run) -> Finding | None:
    """Alpha above 1 at most of the latest half of the tracked steps: the steps overshoot the
    minimum along their direction and land higher than they started."""
    if (recent := _recent_alpha(run)) is None:
        return None
    steps, alpha = recent
    above = alpha > 1
    if above.mean() <= MOSTLY:
        return None
    return Finding(
        check="step_size_too_large",
        title="The step size is too large: most steps overshoot (alpha above 1)",
        evidence=f"alpha > 1 at {_alpha_summary(steps, alpha, above)}. Alpha 0 is a step onto "
        "the minimum of the local parabola, 1 onto the mirror point at the start's height.",
        advice="lower the learning rate (divide it by 2 to 10), or add warm-up or a "
        "decaying schedule; a little above 0 is usually best.",
        step=int(steps[above][0]),
    )


def step_size_too_small(run) -> Finding | None:
    """Alpha near -1 at most of the latest half of the tracked steps: the steps barely move
    along the local parabola."""
    if (recent := _recent_alpha(run)) is None:
        return None
    steps, alpha = recent
    near = alpha < NEAR_MINUS_ONE
    if near.mean() <= MOSTLY:
        return None
    return Finding(
        check="step_size_too_small",
        title="The step size is too small: most steps barely move (alpha near -1)",
        evidence=f"alpha < {NEAR_MINUS_ONE} at {_alpha_summary(steps, alpha, near)}. Alpha -1 "
        "is no motion (it is also reported where the loss is locally concave along the step).",
        advice="raise the learning rate (multiply it by 2 to 10) and watch alpha move towards 0.",
        step=int(steps[near][0]),
    )


@dataclass(frozen=True)
class StabilityRule:
    """Where the optimizer's step stops converging on a quadratic: lr * ``quantity`` below
    ``limit``; ``measure`` says what ``quantity`` is, ``rule`` states the rule and its source."""

    quantity: str
    limit: float
    measure: str
    rule: str


def stability_rule(run) -> StabilityRule | None:
    """The stability rule of the run's optimizer (from the log's optimizer description):

    * SGD (or an optimizer the log does not name): lr * lambda_max(H) < 2, with heavy-ball
      momentum beta 2 + 2 beta, with Nesterov momentum (2 + 2 beta) / (1 + 2 beta) (Cohen et
      al. 2021, "Gradient Descent on Neural Networks Typically Occurs at the Edge of
      Stability", ICLR, appendix on momentum);
    * Adam, AdamW: lr * lambda_1(P^{-1} H) < (2 + 2 beta1) / (1 - beta1), 38 for beta1 = 0.9,
      on the preconditioned sharpness (Cohen et al. 2022, "Adaptive Gradient Methods at the
      Edge of Stability", section 2: Adam as preconditioned heavy-ball momentum with EMA
      weights);
    * RMSprop: lr * lambda_1(P^{-1} H) < 2 + 2 momentum (preconditioned gradient descent, with
      heavy-ball momentum when it has some);

    None for any other optimizer (no rule is known here)."""
    name = optimizer(run).get("name")
    if name in ("Adam", "AdamW"):
        betas = hyperparameter(run, "betas")
        logged = isinstance(betas, (list, tuple)) and betas
        beta1 = float(betas[0]) if logged else 0.9
        return StabilityRule(
            PRECONDITIONED,
            (2 + 2 * beta1) / (1 - beta1),
            PRECONDITIONED_MEASURE,
            f"{name} with beta1 = {beta1:g}{'' if logged else ' (not in the log: assumed)'} is "
            "stable on a quadratic only below (2 + 2 beta1) / (1 - beta1) (Cohen et al. 2022, "
            "Adaptive Gradient Methods at the Edge of Stability)",
        )
    momentum = float(hyperparameter(run, "momentum") or 0.0)
    if name == "RMSprop":
        return StabilityRule(
            PRECONDITIONED,
            2 + 2 * momentum,
            PRECONDITIONED_MEASURE,
            f"RMSprop (preconditioned gradient descent) with momentum {momentum:g} is stable "
            "on a quadratic only below 2 + 2 momentum (Cohen et al. 2022)",
        )
    if name not in (None, "SGD"):
        return None
    if hyperparameter(run, "nesterov") and momentum:
        limit, form = (2 + 2 * momentum) / (1 + 2 * momentum), "(2 + 2 beta) / (1 + 2 beta)"
        kind = f"with Nesterov momentum beta = {momentum:g}"
    else:
        limit, form = 2 + 2 * momentum, "2 + 2 beta" if momentum else "2"
        kind = f"with momentum {momentum:g}"
    return StabilityRule(
        "HessMaxEV",
        limit,
        "largest Hessian eigenvalue",
        f"gradient descent {kind} is stable on a quadratic only below {form} (Cohen et al. "
        "2021, Gradient Descent on Neural Networks Typically Occurs at the Edge of Stability)",
    )


def _latest_stretch_start(near: np.ndarray) -> int:
    """The index where the latest run of True values of ``near`` (one at least) began."""
    last = np.flatnonzero(near)[-1]
    below = np.flatnonzero(~near[:last])
    return int(below[-1]) + 1 if len(below) else 0


def edge_of_stability(run) -> Finding | None:
    """lr times the sharpness that the optimizer's stability rule (:func:`stability_rule`)
    reads, near or above the rule's limit, over the latest quarter of the tracked steps: where
    the step stops converging on a quadratic. HessMaxEV for SGD (or when the log does not
    name the optimizer: said so in the evidence), PreconditionedSharpness for Adam, AdamW and
    RMSprop; the finding names the rule that fired."""
    rule = stability_rule(run)
    if rule is None:
        return None
    steps, sharpness = finite_series(run, rule.quantity)
    if not len(steps):
        return None
    product = learning_rate_at(run, steps) * sharpness
    known = np.isfinite(product)
    if not known.any():
        return None
    steps, product, sharpness = steps[known], product[known], sharpness[known]
    limit = rule.limit
    recent = latest_part(product, 0.25, 3)
    level = float(np.median(recent))
    if level < STABILITY_BAND[0] * limit:
        return None
    beyond = level > STABILITY_BAND[1] * limit
    lr = float(level / np.median(latest_part(sharpness, 0.25, 3)))
    first = int(steps[_latest_stretch_start(product >= STABILITY_BAND[0] * limit)])
    named = optimizer(run).get("name")
    assumption = "" if named else " The log does not name the optimizer; this assumes plain SGD."
    return Finding(
        check="edge_of_stability",
        title=(
            "The run is beyond the edge of stability"
            if beyond
            else "The run sits at the edge of stability"
        )
        + f" (lr * {rule.quantity} near {limit:.3g})",
        evidence=f"lr * {rule.measure} = {level:.3g} (median of the latest {len(recent)} "
        f"tracked steps, near or above the limit since step {first}); the rule that fired: "
        f"{rule.rule}, here {limit:.3g}." + assumption,
        advice=f"expect oscillating or spiking loss; to leave the edge, lower the learning "
        f"rate below {limit:.3g} / lambda_max = {limit * lr / level:.3g}, or add warm-up.",
        step=first,
    )
