"""The per-rank view of a run (the ``Ranks`` quantity) as arrays: one row per step, one
column per process."""

from __future__ import annotations

import numpy as np

RANKS = "Ranks"
FIELDS = ("loss", "grad_norm", "batch_size", "step_time")


def rank_series(run) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(steps, {field: values [steps, processes]})`` of the steps whose ``Ranks`` value has
    every field with the same number of processes (the most common one), sorted by step; nan
    where a value is missing. Empty arrays when the run recorded none."""
    rows = []
    for step, values in run.steps.items():
        value = values.get(RANKS)
        if isinstance(value, dict) and all(isinstance(value.get(f), list) for f in FIELDS):
            rows.append((step, [[np.nan if v is None else v for v in value[f]] for f in FIELDS]))
    widths = [len(fields[0]) for _, fields in rows]
    if not rows:
        return np.zeros(0, dtype=np.int64), {f: np.zeros((0, 0)) for f in FIELDS}
    width = max(set(widths), key=widths.count)
    rows = sorted(r for r in rows if all(len(column) == width for column in r[1]))
    steps = np.array([step for step, _ in rows], dtype=np.int64)
    arrays = np.array([fields for _, fields in rows], dtype=np.float64)  # [steps, fields, W]
    return steps, {f: arrays[:, i, :] for i, f in enumerate(FIELDS)}


def ratios_to_the_others(values: np.ndarray) -> np.ndarray:
    """[steps, W]: each rank's value over the median of the other ranks' at the same step
    (nan where that median is not positive or a value is not finite)."""
    out = np.full(values.shape, np.nan)
    for rank in range(values.shape[1]):
        others = np.nanmedian(np.delete(values, rank, axis=1), axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = values[:, rank] / others
        out[:, rank] = np.where((others > 0) & np.isfinite(ratio), ratio, np.nan)
    return out


def processes(run) -> int:
    """The number of processes the run's per-rank view has (0 without one)."""
    return rank_series(run)[1]["loss"].shape[1]
