"""TensorBoard sink: scalars and histograms of a run as TensorBoard event files.

Every value with a scalar (see :mod:`avionics.records.series`) becomes a scalar under its
name; per-parameter quantities also get ``Name/param_<i>``. ``GradHist1d`` becomes a
histogram; ``GradHist2d`` becomes its two marginal histograms, ``GradHist2d/gradient`` and
``GradHist2d/parameter``. Needs the ``tensorboard`` package (the ``tensorboard`` extra).
"""

from __future__ import annotations

import os

import numpy as np
from tqdm import tqdm

from avionics.records.run import Run
from avionics.records.series import NORM_QUANTITIES, SUM_QUANTITIES, global_value


def _summary_writer(logdir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            "TensorBoard output needs the tensorboard package: "
            "pip install -c constraints.txt 'avionics[tensorboard]'"
        ) from error
    return SummaryWriter(log_dir=logdir)


class TensorBoardWriter:
    """Writes step values to TensorBoard event files in ``logdir``; same interface as
    :class:`~avionics.records.writer.RunWriter` (``write(step, values)``, ``close()``)."""

    def __init__(self, logdir: str | os.PathLike):
        self.logdir = str(logdir)
        self._writer = _summary_writer(self.logdir)

    def _histogram(self, tag: str, counts, edges, step: int) -> None:
        counts, edges = np.asarray(counts, dtype=np.float64), np.asarray(edges, dtype=np.float64)
        if counts.sum() <= 0:
            return
        centers = (edges[1:] + edges[:-1]) / 2
        self._writer.add_histogram_raw(
            tag,
            min=float(edges[0]),
            max=float(edges[-1]),
            num=float(counts.sum()),
            sum=float((centers * counts).sum()),
            sum_squares=float((centers**2 * counts).sum()),
            bucket_limits=edges[1:].tolist(),
            bucket_counts=counts.tolist(),
            global_step=step,
        )

    def write(self, step: int, values: dict) -> None:
        """Add the scalars and histograms among ``values`` at ``step``, and flush."""
        for name, value in values.items():
            scalar = global_value(name, value)
            if scalar is not None:
                self._writer.add_scalar(name, scalar, global_step=step)
                if name in NORM_QUANTITIES + SUM_QUANTITIES:
                    for i, v in enumerate(value):
                        self._writer.add_scalar(f"{name}/param_{i}", float(v), global_step=step)
            elif name == "GradHist1d" and isinstance(value, dict):
                self._histogram(name, value["hist"], value["edges"], step)
            elif name == "GradHist2d" and isinstance(value, dict):
                hist = np.asarray(value["hist"], dtype=np.float64)
                xedges, yedges = value["edges"]
                self._histogram(f"{name}/gradient", hist.sum(axis=1), xedges, step)
                self._histogram(f"{name}/parameter", hist.sum(axis=0), yedges, step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def to_tensorboard(run: Run, logdir: str | os.PathLike, progress: bool = False) -> str:
    """Write a whole run to TensorBoard event files in ``logdir``; return ``logdir``. With
    ``progress``, show a progress bar over the steps."""
    writer = TensorBoardWriter(logdir)
    try:
        items = run.steps.items()
        if progress:
            items = tqdm(items, desc="tensorboard", unit="step")
        for step, values in items:
            writer.write(step, values)
    finally:
        writer.close()
    return str(logdir)
