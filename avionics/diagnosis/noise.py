"""Findings from gradient noise: batch size (gradient noise scale, norm test, CABS) and early
stopping."""

from __future__ import annotations

import numpy as np

from avionics.diagnosis.evidence import batch_size, finite_series, latest_part
from avionics.diagnosis.finding import Finding

NORM_TEST_THRESHOLD = 1.0  # theta of the norm test: noise norm at most the gradient norm
CABS_FACTOR = 2.0  # CABS must differ from the batch size by this factor to be a finding
RECENT = 5
MIN_STEPS = 3  # tracked steps a batch-size finding needs


def gradient_noise(run) -> Finding | None:
    """The mini-batch gradient's noise larger than the gradient, with the batch size that
    would fix it: from the smoothed gradient noise scale when the run has it and its batch
    size is known, else from the norm test."""
    _, noise_scale = finite_series(run, "GradientNoiseScale")
    if len(noise_scale) >= MIN_STEPS and batch_size(run):
        return _noise_scale_finding(run)
    return _norm_test_finding(run)


def _noise_scale_finding(run) -> Finding | None:
    """The smoothed simple noise scale B_simple = tr(Sigma) / |G|^2 (GradientNoiseScale, the
    critical batch size of McCandlish et al. 2018) above theta^2 B at the latest tracked step,
    B the batch size: the noise of the mini-batch gradient, tr(Sigma) / B, is then larger
    than theta^2 times the squared gradient |G|^2 (the norm test's criterion with the true
    gradient). The advice is a batch of about B_simple. A negative B_simple (a negative
    smoothed |G|^2 estimate) means the gradient is lost in the noise: a finding, without a
    size."""
    steps, noise_scale = finite_series(run, "GradientNoiseScale")
    size = batch_size(run)
    noisy = (noise_scale < 0) | (noise_scale > NORM_TEST_THRESHOLD**2 * size)
    if not noisy[-1]:
        return None
    quiet = np.flatnonzero(~noisy)
    since = int(steps[quiet[-1] + 1]) if len(quiet) else int(steps[0])
    level = float(noise_scale[-1])
    if level > 0:
        suggestion = f"a batch size of about {int(np.ceil(level))} (now {size})"
        relation = f"above the batch size {size}"
    else:
        suggestion = f"a much larger batch size (now {size})"
        relation = "negative (its smoothed |G|^2 is: the gradient is not resolved from the noise)"
    return Finding(
        check="gradient_noise",
        title="Gradient noise dominates: the gradient noise scale suggests " + suggestion,
        evidence=f"smoothed gradient noise scale B_simple = tr(Sigma) / |G|^2 = {level:.1f} at "
        f"step {steps[-1]}, {relation} since step {since} (B_simple is McCandlish et al. "
        "2018's estimate of the critical batch size; above the batch size, the mini-batch "
        "gradient's noise is larger than the gradient itself).",
        advice=f"use {suggestion}, or average gradients over more samples (accumulation): up "
        "to the critical batch size, the steps needed fall almost in proportion to the batch "
        "size; alternatively lower the learning rate to average the noise over more steps.",
        step=since,
    )


def _norm_test_finding(run) -> Finding | None:
    """The norm test above 1 over the latest half of the run: the noise in the mini-batch
    gradient is larger than the gradient. The batch size that would bring it to 1 is
    B * test^2, since the test falls as 1 / sqrt(B). It is tr(S) / ||g||^2, with the
    mini-batch gradient's ||g||^2 = |G|^2 + tr(S) / B in place of |G|^2: B_simple / (1 +
    B_simple / B), close to the gradient noise scale B_simple only where the test is << 1."""
    steps, test = finite_series(run, "NormTest")
    if len(test) < MIN_STEPS:
        return None
    recent = latest_part(test, 0.5, MIN_STEPS)
    level = float(np.median(recent))
    if level <= NORM_TEST_THRESHOLD:
        return None
    factor = level**2 / NORM_TEST_THRESHOLD**2
    size = batch_size(run)
    suggestion = (
        f"a batch size of about {int(np.ceil(size * factor))} (now {size})"
        if size
        else f"a batch size about {factor:.1f} times the current one"
    )
    return Finding(
        check="gradient_noise",
        title="Gradient noise dominates: the norm test suggests " + suggestion,
        evidence=f"norm test median {level:.2f} over the latest {len(recent)} tracked steps "
        f"(steps {steps[-len(recent)]}-{steps[-1]}; above {NORM_TEST_THRESHOLD:g} means the "
        "mini-batch gradient's noise is larger than the gradient itself).",
        advice=f"use {suggestion}, or average gradients over more samples (accumulation); "
        "alternatively lower the learning rate to average the noise over more steps.",
        step=int(steps[-len(recent)]),
    )


def cabs_batch_size(run) -> Finding | None:
    """The CABS batch-size suggestion (lr * gradient variance / loss), when it differs from the
    batch size in use by a factor of 2, or when the log does not record the batch size."""
    steps, cabs = finite_series(run, "CABS")
    if not len(cabs):
        return None
    recent = latest_part(cabs, 0, RECENT)
    suggested = float(np.median(recent))
    size = batch_size(run)
    if size and 1 / CABS_FACTOR < suggested / size < CABS_FACTOR:
        return None
    now = f"the batch size in use, {size}" if size else "the batch size (not in the log)"
    return Finding(
        check="cabs_batch_size",
        title=f"CABS suggests a batch size of about {suggested:.0f}",
        evidence=f"CABS median {suggested:.1f} over the latest {len(recent)} tracked steps "
        f"(steps {steps[-len(recent)]}-{steps[-1]}), against {now}.",
        advice="CABS couples the batch size to the learning rate: try a batch size near "
        f"{suggested:.0f} with the same learning rate (or scale the learning rate instead).",
        step=int(steps[-1]),
    )


def early_stopping(run) -> Finding | None:
    """The early-stopping criterion above 0 at most of the latest tracked steps: the gradient
    can no longer be told apart from its noise, so further steps mostly fit noise."""
    steps, criterion = finite_series(run, "EarlyStopping")
    if len(criterion) < 3:
        return None
    recent = latest_part(criterion, 0, RECENT)
    positive = recent > 0
    if positive.mean() <= 0.5:
        return None
    below = np.flatnonzero(criterion <= 0)
    since = int(steps[below[-1] + 1]) if len(below) else int(steps[0])
    return Finding(
        check="early_stopping",
        title="The early-stopping criterion says stop",
        evidence=f"criterion > 0 at {positive.sum()} of the latest {len(recent)} tracked steps "
        f"(latest {criterion[-1]:.2f}; positive since step {since}).",
        advice="stop here or lower the learning rate; check a validation loss before going on, "
        "since the criterion only sees the training mini-batches.",
        step=since,
    )
