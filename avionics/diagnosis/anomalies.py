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


def spikes(run) -> list[Finding]:
    """Upward spikes of the loss and of the gradient norm: a value more than 6 robust
    standard deviations above the median of the 20 tracked values before it."""
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
        findings.append(
            Finding(
                check=f"{name.lower()}_spikes",
                title=f"{label.capitalize()} spikes: "
                + ("once, at" if len(episodes) == 1 else f"{len(episodes)} times, the first at")
                + f" step {began[0]}",
                evidence=f"spikes began at steps {listed}; the largest, at step {steps[top]}, "
                f"is {values[top]:.4g} against a median of {np.median(history):.4g} over the "
                f"{len(history)} tracked steps before it (robust z-score {z[top]:.3g} > "
                f"{SPIKE_Z:g}).",
                advice="look at the batches of those steps (outliers, bad labels); clip the "
                "gradient norm near its usual size, lower the learning rate or add warm-up.",
                step=began[0],
            )
        )
    return findings
