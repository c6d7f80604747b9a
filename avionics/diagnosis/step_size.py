"""Findings about the step size: alpha too large or too small, the edge of stability."""

from __future__ import annotations

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


def edge_of_stability(run) -> Finding | None:
    """lr * HessMaxEV near or above 2 (2 (1 + momentum) with heavy-ball momentum): where
    gradient descent on a quadratic stops converging. Only for SGD, or when the log does not
    name the optimizer (said so in the evidence)."""
    name = optimizer(run).get("name")
    if name not in (None, "SGD"):
        return None
    steps, max_ev = finite_series(run, "HessMaxEV")
    if not len(steps):
        return None
    product = learning_rate_at(run, steps) * max_ev
    known = np.isfinite(product)
    if not known.any():
        return None
    steps, product, max_ev = steps[known], product[known], max_ev[known]
    momentum = hyperparameter(run, "momentum") or 0.0
    limit = 2 * (1 + float(momentum))
    recent = latest_part(product, 0.25, 3)
    level = float(np.median(recent))
    if level < STABILITY_BAND[0] * limit:
        return None
    beyond = level > STABILITY_BAND[1] * limit
    lr = float(level / np.median(latest_part(max_ev, 0.25, 3)))
    first = int(steps[np.argmax(product >= STABILITY_BAND[0] * limit)])
    assumption = "" if name else " The log does not name the optimizer; this assumes plain SGD."
    return Finding(
        check="edge_of_stability",
        title=(
            "The run is beyond the edge of stability"
            if beyond
            else "The run sits at the edge of stability"
        )
        + " (lr * HessMaxEV near 2)",
        evidence=f"lr * largest Hessian eigenvalue = {level:.3g} (median of the latest "
        f"{len(recent)} tracked steps, first near the limit at step {first}); gradient descent "
        f"with momentum {float(momentum):g} is stable on a quadratic only below {limit:g}."
        + assumption,
        advice=f"expect oscillating or spiking loss; to leave the edge, lower the learning "
        f"rate below {limit:g} / lambda_max = {limit * lr / level:.3g}, or add warm-up.",
        step=first,
    )
