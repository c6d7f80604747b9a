"""Weights & Biases sink: a run's values as W&B charts, histograms and config.

Each step's values (read as :mod:`avionics.records.tracking` reads them) are one
``run.log`` row: ``"Loss"``, ``"GradNorm"``, one number per tracked parameter under
``"GradNorm/<parameter name>"`` (a section of its own in W&B's workspace, which groups
charts by the prefix before "/"), and each histogram as a ``wandb.Histogram`` built from the
cockpit's own counts and edges (``np_histogram=``, no re-binning; more than W&B's 512 bins
are merged in runs of adjacent bins). The run's metadata is the run's config under
``"avionics"``.

Steps: W&B's own step (``run.log(step=...)``) may only grow, and a two-step quantity's value
of step t (Alpha, UpdateSize) arrives after step t + 1 has been written; W&B would drop it.
So every key is charted against the step metric ``"step"`` (``run.define_metric(key,
step_metric="step")``) and each row carries its step. In a run shared with your own logging,
chart your values the same way rather than with ``run.log(..., step=...)``. Needs the ``wandb``
package (the ``wandb`` extra).
"""

from __future__ import annotations

import numpy as np

from avionics.records.tracking import Tracking

STEP = "step"
MAX_BINS = 512  # wandb.Histogram.MAX_LENGTH


def _wandb():
    try:
        import wandb
    except ImportError as error:
        raise ImportError(
            "The W&B sink needs the wandb package: pip install -c constraints.txt "
            "'avionics[wandb]'"
        ) from error
    return wandb


class WandbSink:
    """Writes a cockpit's values to a W&B run: a :class:`~avionics.records.sink.Sink`.

    Args:
        run: a run of yours (``wandb.init(...)``), which this sink writes to and leaves open;
            None: the sink starts one with ``wandb.init(**init)`` when the cockpit first hands
            it the run's metadata, and finishes it on :meth:`close`. Under data parallelism
            the cockpit hands its sinks the values on rank 0 only, so that only rank 0
            starts a run, though every process builds the sink.
        **init: arguments of ``wandb.init`` (``project``, ``name``, ``dir``, ``mode``,
            ...), without ``run``.

    Example (offline: the run is written under ``dir`` and uploaded later with ``wandb sync``)::

        sink = WandbSink(project="exp", name="lr-0.1", mode="offline", dir="wandb-runs")
        cockpit = Cockpit(model, log="runs/lr-0.1", sinks=[sink])
    """

    def __init__(self, run=None, **init):
        wandb = _wandb()
        if run is not None and init:
            raise TypeError(
                f"WandbSink(run=..., {', '.join(init)}=...): the arguments of wandb.init are "
                "for a run the sink starts itself; give either your run or them."
            )
        self._init, self._histogram = wandb.init, wandb.Histogram
        self._owned, self._arguments = run is None, init
        self.run = run
        self._charted: set[str] = set()
        self._tracking = Tracking()
        self._metadata: dict = {}

    def update_metadata(self, metadata: dict) -> None:
        """Take the outputs and parameter names; the metadata, merged, is the config's
        ``"avionics"``."""
        self._tracking.update_metadata(metadata)
        self._metadata.update(metadata)
        self._started().config.update({"avionics": self._metadata}, allow_val_change=True)

    def write(self, step: int, values: dict) -> None:
        """Log the scalars, per-parameter numbers and histograms among ``values`` as one row
        at ``step``."""
        tracked = self._tracking.read(values)
        row = dict(tracked.scalars)
        for name, numbers in tracked.parameters.items():
            row.update({f"{name}/{parameter}": v for parameter, v in numbers.items()})
        for tag, (counts, edges) in tracked.histograms.items():
            row[tag] = self._histogram(np_histogram=at_most_bins(counts, edges, MAX_BINS))
        if not row:
            return
        run = self._started()
        for key in row.keys() - self._charted:
            run.define_metric(key, step_metric=STEP)
            self._charted.add(key)
        run.log({STEP: step, **row})

    def close(self) -> None:
        """Finish the run if the sink started it."""
        if self._owned and self.run is not None:
            self.run.finish()

    def _started(self):
        """The run, started (``wandb.init``) if it is the sink's own and has not been, with
        the step metric defined."""
        if self.run is None:
            self.run = self._init(**self._arguments)
        if STEP not in self._charted:
            self.run.define_metric(STEP)
            self._charted.add(STEP)
        return self.run


def at_most_bins(counts: np.ndarray, edges: np.ndarray, most: int):
    """(counts, edges) with runs of k = ceil(bins / most) adjacent bins merged (their counts
    added, the inner edges dropped), so that at most ``most`` bins remain; exact, as no count
    moves out of its span of edges."""
    k = -(-len(counts) // most)
    if k == 1:
        return counts, edges
    starts = np.arange(0, len(counts), k)
    return np.add.reduceat(counts, starts), np.append(edges[starts], edges[-1])
