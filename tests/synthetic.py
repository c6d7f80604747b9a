"""Constructed runs for the log, dashboard, diagnosis and command-line tests.

Values follow the formats of ``cockpit.get_output()``; they look like a healthy training run
(decaying loss, alpha around 0, small gradient-test values) unless told otherwise.
"""

from __future__ import annotations

import numpy as np

from avionics.records import Run, RunWriter

PER_STEP = (
    "Loss",
    "NormTest",
    "InnerTest",
    "OrthoTest",
    "MeanGSNR",
    "CABS",
    "EarlyStopping",
    "HessMaxEV",
    "TICDiag",
    "TICTrace",
    "Time",
    "GradNorm",
    "Distance",
    "HessTrace",
    "GradHist1d",
    "GradHist2d",
    "Parameters",
    "ActivationHealth",
)
LATE = ("Alpha", "UpdateSize", "UpdateRatio")  # two-step quantities: the value of t arrives at t+1
ALL = PER_STEP + LATE
NUM_PARAMS = 3


def _hist1d(rng, scale):
    edges = np.linspace(-2, 2, 101)
    counts, _ = np.histogram(np.clip(rng.normal(0, scale, 5000), -2, 2), bins=edges)
    return {"hist": counts.tolist(), "edges": edges.tolist()}


def _hist2d(rng, scale):
    xedges, yedges = np.linspace(-1, 1, 41), np.linspace(-2, 2, 51)
    g = np.clip(rng.normal(0, scale, 4000), -1, 1)
    theta = np.clip(rng.normal(0, 0.5, 4000), -2, 2)
    hist, _, _ = np.histogram2d(g, theta, bins=[xedges, yedges])
    return {"hist": hist.tolist(), "edges": [xedges.tolist(), yedges.tolist()]}


def step_values(step: int, rng, names=ALL, lr: float = 0.1) -> dict:
    """Healthy-looking values of ``names`` at ``step``."""
    loss = 2.3 * np.exp(-step / 40) + 0.1 + 0.02 * rng.standard_normal()
    values = {
        "Loss": float(loss),
        "NormTest": float(0.3 + 0.05 * rng.random()),
        "InnerTest": float(0.2 + 0.05 * rng.random()),
        "OrthoTest": float(0.4 + 0.05 * rng.random()),
        "MeanGSNR": float(1.5 + 0.1 * rng.random()),
        "CABS": float(100 + 10 * rng.random()),
        "EarlyStopping": float(-1.0 - rng.random()),
        "HessMaxEV": float(5.0 + rng.random()),
        "TICDiag": float(2.0 + 0.2 * rng.random()),
        "TICTrace": float(1.0 + 0.1 * rng.random()),
        "Time": 1.7e9 + 0.01 * step,
        "GradNorm": (0.5 + 0.1 * rng.random(NUM_PARAMS)).tolist(),
        "Distance": (0.01 * np.sqrt(step + 1) * np.arange(1, NUM_PARAMS + 1)).tolist(),
        "HessTrace": (10 + rng.random(NUM_PARAMS)).tolist(),
        "GradHist1d": _hist1d(rng, 0.3),
        "GradHist2d": {
            **_hist2d(rng, 0.2),
            "param_hist": [_hist2d(rng, 0.1 * (i + 1))["hist"] for i in range(NUM_PARAMS)],
        },
        "Parameters": [rng.standard_normal((2, 2)).tolist() for _ in range(NUM_PARAMS)],
        "Alpha": float(-0.1 + 0.3 * rng.standard_normal()),
        "UpdateSize": (lr * (0.5 + 0.1 * rng.random(NUM_PARAMS))).tolist(),
        # healthy values that draw no random numbers (the others' draws stay as they were)
        "ActivationHealth": {"1": {"dead": 0.0, "mean": 0.3, "rms": 0.6}},
        "UpdateRatio": {"global": 1e-3, "per_parameter": [1e-3] * NUM_PARAMS},
    }
    return {k: v for k, v in values.items() if k in names}


def records(num_steps: int = 60, names=ALL, seed: int = 0, log_every: int = 10):
    """``(step, values)`` records in the order a Cockpit writes them: late values of t with
    step t+1, and ``cockpit.log`` metrics every ``log_every`` steps."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(num_steps):
        values = step_values(step, rng, names)
        out.append((step, {k: v for k, v in values.items() if k not in LATE}))
        late = {k: v for k, v in values.items() if k in LATE}
        if step + 1 < num_steps and late:  # the last step's two-step values never finish
            out.append((step, late))
        if step % log_every == 0:
            acc = 1 - 0.9 * np.exp(-step / 30)
            out.append(
                (
                    step,
                    {
                        "epoch": step // log_every,
                        "train_accuracy": float(acc),
                        "valid_accuracy": float(acc - 0.05),
                        "learning_rate": 0.1,
                    },
                )
            )
    return out


def synthetic_run(num_steps: int = 60, names=ALL, seed: int = 0) -> Run:
    """A run in memory, built from :func:`records`."""
    steps: dict[int, dict] = {}
    for step, values in records(num_steps, names, seed):
        steps.setdefault(step, {}).update(values)
    return Run.from_output(steps, metadata={"optimizer": {"name": "SGD"}})


def write_run(path, num_steps: int = 60, names=ALL, seed: int = 0, metadata=None):
    """Write the records of :func:`records` to a run log at ``path``; return ``path``."""
    with RunWriter(path, metadata or {"optimizer": {"name": "SGD"}}) as writer:
        for step, values in records(num_steps, names, seed):
            writer.write(step, values)
    return path
