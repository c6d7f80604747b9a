"""TensorBoard sink: scalars and histograms of a run as TensorBoard event files.

Values are read through their quantity's declared output (:mod:`avionics.records.outputs`):
read as the trackers' sinks read them (:class:`~avionics.records.tracking.Tracking`): every
value with a scalar becomes a scalar under its name; per-parameter values also get
``Name/<parameter name>`` (``Name/param_<i>`` where the metadata names no parameters). A 1d
histogram becomes a histogram; a 2d one becomes its two marginal histograms,
``Name/gradient`` and ``Name/parameter`` (axis 0, axis 1). Needs the ``tensorboard``
package (the ``tensorboard`` extra).
"""

from __future__ import annotations

import os

import numpy as np
from tqdm import tqdm

from avionics.records.outputs import Output
from avionics.records.run import Run
from avionics.records.tracking import Tracking


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
    """Writes step values to TensorBoard event files in ``logdir``: a
    :class:`~avionics.records.sink.Sink`, like :class:`~avionics.records.writer.RunWriter`.

    ``outputs`` ({name: Output}) say how values read; the metadata a cockpit hands its sinks
    adds its quantities' declarations."""

    def __init__(self, logdir: str | os.PathLike, outputs: dict[str, Output] | None = None):
        self.logdir = str(logdir)
        self._tracking = Tracking()
        self._tracking.outputs.update(outputs or {})
        self._writer = _summary_writer(self.logdir)

    def update_metadata(self, metadata: dict) -> None:
        """Take the declared outputs of the run's quantities and its parameters' names (the
        rest of the metadata has no place in TensorBoard)."""
        self._tracking.update_metadata(metadata)

    def write(self, step: int, values: dict) -> None:
        """Add the scalars and histograms among ``values`` at ``step``, and flush."""
        tracked = self._tracking.read(values)
        for name, scalar in tracked.scalars.items():
            self._writer.add_scalar(name, scalar, global_step=step)
        for name, by_parameter in tracked.parameters.items():
            for parameter, v in by_parameter.items():
                self._writer.add_scalar(f"{name}/{parameter}", v, global_step=step)
        for tag, (counts, edges) in tracked.histograms.items():
            add_histogram(self._writer, tag, counts, edges, step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def to_tensorboard(run: Run, logdir: str | os.PathLike, progress: bool = False) -> str:
    """Write a whole run to TensorBoard event files in ``logdir``; return ``logdir``. With
    ``progress``, show a progress bar over the steps."""
    writer = TensorBoardWriter(logdir, run.outputs)
    writer.update_metadata({"parameters": run.metadata.get("parameters")})
    try:
        items = run.steps.items()
        if progress:
            items = tqdm(items, desc="tensorboard", unit="step")
        for step, values in items:
            writer.write(step, values)
    finally:
        writer.close()
    return str(logdir)


def add_histogram(writer, tag: str, counts, edges, step: int) -> None:
    """Counts over the bins ``edges`` as a TensorBoard histogram (``SummaryWriter.
    add_histogram_raw``: bucket limits are the right edges; sum and sum of squares from the
    bin centres)."""
    counts, edges = np.asarray(counts, dtype=np.float64), np.asarray(edges, dtype=np.float64)
    if counts.sum() <= 0:
        return
    centers = (edges[1:] + edges[:-1]) / 2
    writer.add_histogram_raw(
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
