"""The diagnosis of a run: plain-language findings, each with its evidence and advice.

Every check is a small pure function of a :class:`~avionics.records.Run` that returns its
findings only when the data supports them.
"""

from __future__ import annotations

from avionics.diagnosis.anomalies import non_finite_values, spikes
from avionics.diagnosis.finding import Finding
from avionics.diagnosis.layers import dead_units, saturated_units, update_ratio_out_of_range
from avionics.diagnosis.noise import cabs_batch_size, early_stopping, gradient_noise
from avionics.diagnosis.ranks import outlier_shards, straggler_ranks
from avionics.diagnosis.step_size import (
    edge_of_stability,
    step_size_too_large,
    step_size_too_small,
)
from avionics.records.reader import as_run

CHECKS = (
    non_finite_values,
    step_size_too_large,
    step_size_too_small,
    edge_of_stability,
    gradient_noise,
    cabs_batch_size,
    early_stopping,
    spikes,
    update_ratio_out_of_range,
    dead_units,
    saturated_units,
    straggler_ranks,
    outlier_shards,
)
# What each group of checks reads; a group is "not checked" when none of them was recorded.
NEEDS = {
    "step size (alpha)": ("Alpha",),
    "edge of stability": ("HessMaxEV", "PreconditionedSharpness"),
    "gradient noise and batch size": ("NormTest", "GradientNoiseScale"),
    "CABS batch size": ("CABS",),
    "early stopping": ("EarlyStopping",),
    "loss and gradient-norm spikes": ("Loss", "GradNorm"),
    "update-to-weight ratio": ("UpdateRatio",),
    "dead and saturated activations": ("ActivationHealth",),
    "stragglers and outlier shards": ("Ranks",),
}
# Groups that apply to a run of several processes only (its metadata's world_size > 1).
DATA_PARALLEL = ("stragglers and outlier shards",)


def diagnose(source) -> list[Finding]:
    """The findings about ``source`` (a run log path, a Run, or a live Cockpit), ordered by
    the step where each began."""
    run = as_run(source)
    findings = []
    for check in CHECKS:
        found = check(run)
        findings.extend(found if isinstance(found, list) else [found] if found else [])
    return sorted(findings, key=lambda f: (f.step is None, f.step or 0))


def report(source, findings: list[Finding] | None = None) -> str:
    """The diagnosis as text: what was read, the findings (or that there are none), the
    checks that had no data, and any lines of the log that could not be read."""
    run = as_run(source)
    findings = diagnose(run) if findings is None else findings
    where = str(run.path.parent if run.path and run.path.name == "log.jsonl" else run.path)
    span = f"steps {min(run.steps)}-{max(run.steps)}" if run.steps else "no steps"
    name = where if run.path else "a live run"
    lines = [f"Diagnosis of {name}: {len(run.steps)} tracked steps ({span})"]
    if findings:
        lines += [f"{len(findings)} finding(s):", *map(str, findings)]
    else:
        lines.append("No problems found by the checks that had data.")
    recorded = set(run.names)
    several = (run.metadata.get("world_size") or 1) > 1
    missing = [
        group
        for group, names in NEEDS.items()
        if not recorded & set(names) and (several or group not in DATA_PARALLEL)
    ]
    if missing:
        lines.append(
            "Not checked, no data: "
            + "; ".join(f"{group} (needs {' or '.join(NEEDS[group])})" for group in missing)
            + "."
        )
    if run.problems:
        lines.append(f"{len(run.problems)} problem(s) reading the log:")
        lines += [f"  {problem}" for problem in run.problems[:10]]
    return "\n".join(lines)


__all__ = ["CHECKS", "Finding", "diagnose", "report"]
