"""Findings about single layers: update-to-weight ratios far from the usual range, and
activation modules whose units die or saturate.

A layer is flagged when its value is out of bounds at most (:data:`MOST`, 80 %) of several
tracked steps, not at one step: a single large update at the start of training, or a batch
where a unit happens to be silent, is no finding. An update ratio is judged over the latest
:data:`WINDOW` tracked steps. A module dies or saturates from the earliest step since which
its fraction is out of bounds at most of the tracked steps, at least :data:`MIN_STEPS` of
them, and at most of the latest :data:`MIN_STEPS` (one that recovered is no finding).
"""

from __future__ import annotations

import numpy as np

from avionics.diagnosis.finding import Finding

# The usual range of ||theta_{t+1} - theta_t|| / ||theta_t|| of a weight per step: about 1e-3
# (CS231n, "Neural Networks Part 3: Learning and Evaluation", section "Ratio of
# weights:updates"; Karpathy 2019, "A Recipe for Training Neural Networks"), a heuristic; a
# decade either side is still usual.
RATIO_RANGE = (1e-4, 1e-2)
SOURCE = (
    'a heuristic, CS231n "Neural Networks Part 3" (ratio of updates to weights ~1e-3) and '
    'Karpathy, "A Recipe for Training Neural Networks" (2019)'
)
WINDOW = 50  # the latest tracked steps judged
MOST = 0.8  # the share of them that must be out of bounds
MIN_STEPS = 5  # fewer tracked steps are not judged
DEAD_FRACTION = 0.5  # of a module's units, zero for every sample of the batch
SATURATED_FRACTION = 0.5  # of a module's values, in the flat region of its activation


def _latest(points: list[tuple[int, object]]) -> list[tuple[int, object]]:
    return sorted(points)[-WINDOW:]


def _weights(run, count: int) -> list[tuple[int, str]]:
    """(index, name) of the parameters judged: the weights (two axes or more) when the
    metadata has the shapes (the heuristic is about weights; biases start at 0), else all."""
    described = run.metadata.get("parameters")
    if isinstance(described, dict) and len(described) == count:
        return [
            (k, name)
            for k, (name, shape) in enumerate(described.items())
            if isinstance(shape, list) and len(shape) >= 2
        ]
    return [(k, f"parameter {k}") for k in range(count)]


def update_ratio_out_of_range(run) -> list[Finding]:
    """Weights whose UpdateRatio ||theta_{t+1} - theta_t|| / ||theta_t|| stays above 1e-2 or
    below 1e-4 at 80 % of the latest 50 tracked steps (:data:`RATIO_RANGE`, a heuristic of
    CS231n and Karpathy 2019); one finding for each side, with the layers, their median
    ratios and the steps."""
    points = []
    for step, values in run.steps.items():
        if "UpdateRatio" in values:
            ratios = run.output("UpdateRatio", values["UpdateRatio"]).parameter_values(
                values["UpdateRatio"]
            )
            if ratios:
                points.append((step, ratios))
    points = _latest(points)
    if len(points) < MIN_STEPS or len({len(r) for _, r in points}) != 1:
        return []
    steps = [s for s, _ in points]
    ratios = np.array([r for _, r in points], dtype=np.float64)  # [steps, parameters]
    low, high = RATIO_RANGE
    findings = []
    for side, outside, bound in (
        ("above", ratios > high, high),
        ("below", ratios < low, low),
    ):
        layers = [
            (name, float(np.nanmedian(ratios[:, k])))
            for k, name in _weights(run, ratios.shape[1])
            if outside[:, k].mean() >= MOST
        ]
        if layers:
            findings.append(_ratio_finding(side, bound, layers, steps))
    return findings


def _ratio_finding(side: str, bound: float, layers, steps: list[int]) -> Finding:
    listed = ", ".join(f"{name} (median {median:.3g})" for name, median in layers[:8])
    more = f" and {len(layers) - 8} more" if len(layers) > 8 else ""
    advice = {
        "above": "lower the learning rate (of those layers, or globally), add or lengthen "
        "warm-up, clip the gradient norm; updates this large relative to the weights rewrite "
        "them every few steps.",
        "below": "raise the learning rate of those layers, check that they receive gradient "
        "(frozen, vanishing through saturated activations), and that weight decay or a "
        "schedule has not shrunk the step to nothing.",
    }[side]
    return Finding(
        check=f"update_ratio_too_{'large' if side == 'above' else 'small'}",
        title=f"Update-to-weight ratio {side} {bound:g} in {len(layers)} layer(s)",
        evidence=f"||theta_(t+1) - theta_t|| / ||theta_t|| of {listed}{more} was {side} "
        f"{bound:g} at {MOST:.0%} or more of the {len(steps)} tracked steps {steps[0]}-"
        f"{steps[-1]}; the usual range is {RATIO_RANGE[0]:g} to {RATIO_RANGE[1]:g} per step "
        f"({SOURCE}).",
        advice=advice,
        step=steps[0],
    )


def _onset(steps: list[int], flags: np.ndarray) -> int | None:
    """The earliest step, flagged itself, from which ``flags`` hold at :data:`MOST` of the
    tracked steps up to the latest, or None."""
    for i in range(len(flags)):
        if flags[i] and flags[i:].mean() >= MOST:
            return steps[i]
    return None


def _health_findings(run, key: str, bound: float, check: str, title: str, advice: str):
    series: dict[str, list[tuple[int, float]]] = {}
    for step, values in run.steps.items():
        value = values.get("ActivationHealth")
        if not isinstance(value, dict):
            continue
        for name, stats in value.items():
            if isinstance(stats, dict) and isinstance(stats.get(key), (int, float)):
                series.setdefault(name, []).append((step, float(stats[key])))
    found = []
    for name, points in series.items():
        points.sort()
        if len(points) < MIN_STEPS:
            continue
        steps = [s for s, _ in points]
        fractions = np.array([f for _, f in points])
        flags = fractions >= bound
        # still so at the latest steps; since when, over the whole run
        began = _onset(steps, flags) if flags[-MIN_STEPS:].mean() >= MOST else None
        since = fractions[steps.index(began) :] if began is not None else []
        if len(since) >= MIN_STEPS:
            found.append((began, name, float(np.median(since)), len(since)))
    if not found:
        return []
    found.sort()
    listed = "; ".join(
        f"'{name or 'the model'}' from step {began} (median {median:.0%} over the {count} "
        "tracked steps since)"
        for began, name, median, count in found[:8]
    )
    return [
        Finding(
            check=check,
            title=f"{title} in {len(found)} module(s), from step {found[0][0]}",
            evidence=f"{key} fraction at least {bound:.0%}: {listed} (ActivationHealth).",
            advice=advice,
            step=found[0][0],
        )
    ]


def dead_units(run) -> list[Finding]:
    """Activation modules where half of the units or more are zero for every sample of the
    batch, at 80 % of the tracked steps since some step (see the module docstring): from
    which step, and the median fraction since."""
    return _health_findings(
        run,
        "dead",
        DEAD_FRACTION,
        "dead_units",
        "Dead units",
        "a unit that is zero for every sample gets no gradient and does not recover: lower "
        "the learning rate, initialise with He/Kaiming scaling and zero or small positive "
        "biases, normalise the layer's input, or use LeakyReLU/GELU instead of ReLU.",
    )


def saturated_units(run) -> list[Finding]:
    """Saturating activation modules (Tanh, Sigmoid, Hardtanh, ...) with half of their values
    or more in the flat region, at 80 % of the tracked steps since some step."""
    return _health_findings(
        run,
        "saturated",
        SATURATED_FRACTION,
        "saturated_units",
        "Saturated activations",
        "saturated units pass almost no gradient back: scale the inputs or the "
        "initialisation down (Xavier/Glorot for tanh), normalise the layer's input, or lower "
        "the learning rate.",
    )
