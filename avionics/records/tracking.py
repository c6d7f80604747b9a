"""What the experiment trackers' sinks (W&B, MLflow) show of a step: its values read through
their declared outputs (:mod:`avionics.records.outputs`) as the numbers and histograms a
tracker charts.

* every value with one number (:meth:`~avionics.records.outputs.Output.scalar`) is a scalar
  under its quantity's name;
* a per-parameter or per-layer value also gives one number per tracked parameter, named as
  the metadata names the parameters (``{"parameters": {name: shape}}``), ``param_<i>``
  where it does not;
* a 1d histogram is a histogram under its name; a 2d one is its two marginals,
  ``Name/gradient`` (the counts summed over axis 1) and ``Name/parameter`` (over axis 0), as
  the TensorBoard sink draws them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from avionics.records.outputs import Output
from avionics.records.run import output_of


@dataclass
class TrackedStep:
    """One step's values as a tracker shows them.

    Attributes:
        scalars: quantity name -> its one number.
        parameters: quantity name -> {parameter name: number}, for values with one number per
            tracked parameter.
        histograms: tag -> (counts [bins], edges [bins + 1]), float64; histograms that
            counted nothing are left out.
    """

    scalars: dict[str, float] = field(default_factory=dict)
    parameters: dict[str, dict[str, float]] = field(default_factory=dict)
    histograms: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


class Tracking:
    """The declared outputs and parameter names a tracker sink learns from the run's metadata,
    and :meth:`read`, a step's values as :class:`TrackedStep`."""

    def __init__(self):
        self.outputs: dict[str, Output] = {}
        self.parameter_names: list[str] = []

    def update_metadata(self, metadata: dict) -> None:
        self.outputs.update(
            {name: Output.from_description(d) for name, d in metadata.get("outputs", {}).items()}
        )
        if isinstance(metadata.get("parameters"), dict):
            self.parameter_names = list(metadata["parameters"])

    def read(self, values: dict) -> TrackedStep:
        """The scalars, per-parameter numbers and histograms among ``values`` (plain Python,
        as a sink receives them); values of other kinds (tensors) are left out."""
        tracked = TrackedStep()
        for name, value in values.items():
            output = output_of(name, self.outputs, value)
            scalar = output.scalar(value)
            if scalar is not None:
                tracked.scalars[name] = scalar
                numbers = output.parameter_values(value)
                if numbers:
                    tracked.parameters[name] = dict(zip(self._names(len(numbers)), numbers))
            elif output.histogram and isinstance(value, dict):
                for tag, counts, edges in _marginals(name, output, value):
                    if counts.sum() > 0:
                        tracked.histograms[tag] = (counts, edges)
        return tracked

    def counted_histogram(self, name: str, value) -> bool:
        """Whether ``value`` is a histogram that counted something."""
        output = output_of(name, self.outputs, value)
        return output.histogram and isinstance(value, dict) and np.sum(value["hist"]) > 0

    def _names(self, count: int) -> list[str]:
        if len(self.parameter_names) == count:
            return self.parameter_names
        return [f"param_{i}" for i in range(count)]


def _marginals(name: str, output: Output, value: dict):
    """(tag, counts, edges) of a 1d histogram, or of each marginal of a 2d one."""
    hist = np.asarray(value["hist"], dtype=np.float64)
    if output.kind == "histogram_1d":
        yield name, hist, np.asarray(value["edges"], dtype=np.float64)
        return
    xedges, yedges = (np.asarray(e, dtype=np.float64) for e in value["edges"])
    yield f"{name}/gradient", hist.sum(axis=1), xedges
    yield f"{name}/parameter", hist.sum(axis=0), yedges


QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def histogram_summary(counts, edges, quantiles=QUANTILES) -> dict[str, float]:
    """The mean and the ``quantiles`` of the distribution that spreads each bin's count
    uniformly over the bin: ``{"mean": sum_i c_i m_i / C, "p05": ..., "p50": ..., ...}``
    with bin centres m_i and C = sum_i c_i; the q-quantile is the point where the piecewise
    linear cumulative count reaches q C (within one bin width of the quantile of the values
    counted; values the histogram clamped into its outer bins count there)."""
    counts, edges = np.asarray(counts, dtype=np.float64), np.asarray(edges, dtype=np.float64)
    total = counts.sum()
    centres = (edges[1:] + edges[:-1]) / 2
    summary = {"mean": float((centres * counts).sum() / total)}
    cumulative = np.cumsum(counts)
    for q in quantiles:
        target = q * total
        i = min(int(np.searchsorted(cumulative, target, side="left")), len(counts) - 1)
        below = cumulative[i] - counts[i]
        fraction = (target - below) / counts[i] if counts[i] > 0 else 0.0
        summary[f"p{round(q * 100):02d}"] = float(edges[i] + fraction * (edges[i + 1] - edges[i]))
    return summary


def flat_parameters(metadata: dict, skip=(), prefix: str = "") -> dict[str, str]:
    """The numbers and strings of ``metadata``, nested keys joined by "." (list items by their
    index), as strings: what a tracker shows as a run's parameters. Keys in ``skip`` (at the
    top level) are left out."""
    flat = {}
    items = metadata.items() if isinstance(metadata, dict) else enumerate(metadata)
    for key, value in items:
        if not prefix and key in skip:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list, tuple)):
            flat.update(flat_parameters(value, prefix=name + "."))
        elif value is not None:
            flat[name] = str(value)
    return flat
