"""Findings about anomalies: non-finite values, and spikes of the loss or gradient norm."""

from __future__ import annotations

import numpy as np

from avionics.diagnosis.evidence import robust_z
from avionics.diagnosis.finding import Finding
from avionics.records.series import scalar_names, series

SPIKE_Z = 6.0
SPIKE_WINDOW = 20
SPIKE_MIN_HISTORY = 8
SPIKY = (("Loss", "loss"), ("GradNorm", "gradient norm"))
OUTLIERS = "LossOutliers"
OUTLIER_STEPS_LISTED = 5  # spike steps whose per-sample outliers the evidence names


def non_finite_values(run) -> Finding | None:
    """Any recorded scalar that is nan or infinite, with the first step and the names."""
    first: dict[str, tuple[int, float, int]] = {}
    for name in scalar_names(run):
        steps, values = series(run, name)
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            first[name] = (int(steps[bad[0]]), float(values[bad[0]]), len(bad))
    if not first:
        return None
    order = sorted(first, key=lambda n: first[n][0])
    start = first[order[0]][0]
    parts = [f"{n} is {first[n][1]} at step {first[n][0]} ({first[n][2]} step(s))" for n in order]
    return Finding(
        check="non_finite_values",
        title=f"Non-finite values from step {start} on",
        evidence="; ".join(parts) + ".",
        advice="the training diverged or overflowed: lower the learning rate, clip the "
        "gradient norm, check the inputs and labels of those steps for nan/inf, and in mixed "
        "precision use a gradient scaler.",
        step=start,
    )


def _spike_episodes(steps, values, z) -> list[tuple[int, int]]:
    """``(index where it began, index of its largest z)`` of each run of consecutive spikes."""
    episodes, start = [], None
    for i, spike in enumerate(z > SPIKE_Z):
        if spike and start is None:
            start = i
        if start is not None and (not spike or i == len(z) - 1):
            end = i + 1 if spike else i
            episodes.append((start, start + int(np.nanargmax(z[start:end]))))
            start = None
    return episodes


def _outlier_evidence(run, spike_steps: list[int]) -> str:
    """The samples that LossOutliers recorded at the loss's spike steps (the peak of each of
    the first few spikes), by index in the batch, or that no sample stood out there."""
    parts = []
    for step in spike_steps[:OUTLIER_STEPS_LISTED]:
        found = run.steps.get(step, {}).get(OUTLIERS)
        if not isinstance(found, dict) or "indices" not in found:
            continue
        rule = f"above {found['median'] + found['k'] * found['scale']:.4g}"
        if not found["indices"]:
            parts.append(f"step {step}: none {rule} (the whole batch's loss rose)")
            continue
        listed = ", ".join(
            f"{i} ({loss:.4g})" for i, loss in zip(found["indices"], found["losses"], strict=True)
        )
        more = found["count"] - len(found["indices"])
        parts.append(
            f"step {step}: samples {listed}{f' and {more} more' if more > 0 else ''} {rule} "
            f"(batch median {found['median']:.4g})"
        )
    if not parts:
        return ""
    return (
        " Per-sample loss outliers, by index in the batch (loss), above median + k robust "
        "standard deviations of the batch's losses: " + "; ".join(parts) + "."
    )


def _spike_advice(name: str, samples: str) -> str:
    """What to try about a spike of ``name``, whose evidence names ``samples`` (or none)."""
    if samples:
        where = "the batches of those steps, first the samples named"
    elif name == "Loss":
        where = "the batches of those steps (record LossOutliers to name their outliers)"
    else:
        where = "the batches of those steps"
    return (
        f"look at {where} (outliers, bad labels); clip the gradient norm near its usual size, "
        "lower the learning rate or add warm-up."
    )


def spikes(run) -> list[Finding]:
    """Upward spikes of the loss and of the gradient norm: a value more than 6 robust
    standard deviations above the median of the 20 tracked values before it. A loss spike's
    evidence names the samples of the spike steps that LossOutliers recorded (those whose
    loss is far above the batch's median), so that the bad data can be found."""
    findings = []
    for name, label in SPIKY:
        steps, values = series(run, name)
        keep = np.isfinite(values)
        steps, values = steps[keep], values[keep]
        z = robust_z(values, SPIKE_WINDOW, SPIKE_MIN_HISTORY)
        episodes = _spike_episodes(steps, values, z)
        if not episodes:
            continue
        began = [int(steps[i]) for i, _ in episodes]
        top = max((peak for _, peak in episodes), key=lambda i: z[i])
        history = values[max(0, top - SPIKE_WINDOW) : top]
        listed = ", ".join(map(str, began[:10])) + (", ..." if len(began) > 10 else "")
        samples = ""
        if name == "Loss":
            samples = _outlier_evidence(run, [int(steps[peak]) for _, peak in episodes])
        findings.append(
            Finding(
                check=f"{name.lower()}_spikes",
                title=f"{label.capitalize()} spikes: "
                + ("once, at" if len(episodes) == 1 else f"{len(episodes)} times, the first at")
                + f" step {began[0]}",
                evidence=f"spikes began at steps {listed}; the largest, at step {steps[top]}, "
                f"is {values[top]:.4g} against a median of {np.median(history):.4g} over the "
                f"{len(history)} tracked steps before it (robust z-score {z[top]:.3g} > "
                f"{SPIKE_Z:g})." + samples,
                advice=_spike_advice(name, samples),
                step=began[0],
            )
        )
    return findings
