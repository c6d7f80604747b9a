"""Output: a finished step's values, kept in memory and handed to the sinks, converted once.

Each step's values, {step they belong to: {name: value}}, joined by the step's learning rates,
cross to the host in one transfer (:mod:`avionics.step.transfer`): their deferred values are
finished there, they are checked for NaN and infinities (a warning naming the quantities),
and, where there are sinks, converted to plain Python and written to them. They are kept in
memory: all of them without a log, the last ``window`` steps with one. Without a sink the
conversion waits for :meth:`Storage.output`, so that a tracked step copies only the few
numbers it reads to the host.
"""

from __future__ import annotations

import reprlib
import warnings
from collections import defaultdict
from typing import Any

from torch import Tensor

from avionics.quantities.loss import Loss
from avionics.records.encoding import to_python
from avionics.step.transfer import read
from avionics.step.values import Batch

# Where each tracked step's learning rate is stored (info["optimizer"]'s, as cockpit.log would).
LEARNING_RATE = "learning_rate"


class StepValues(dict):
    """What :meth:`~avionics.cockpit.Cockpit.get_output` returns: a plain dict of the full
    values, {step: {quantity or metric name: value}}, whose repr shows the first steps and
    the first entries of long lists only."""

    def __repr__(self) -> str:
        return _SHORT.repr(dict(self))


def _short_repr() -> reprlib.Repr:
    short = reprlib.Repr()  # (keyword arguments only from Python 3.12)
    short.maxlevel, short.maxdict, short.maxlist, short.maxtuple = 4, 12, 6, 6
    short.maxstring = short.maxother = 60
    return short


_SHORT = _short_repr()


class Storage:
    """The values of the finished steps: in memory (the last ``window`` steps, or all for
    None) and in ``sinks``."""

    def __init__(self, sinks: list, window: int | None):
        self.sinks, self.window = sinks, window
        self._values: dict[int, dict[str, Any]] = defaultdict(dict)
        self._unconverted: list[tuple[int, str]] = []
        self._described_training = False

    def store(self, values: dict[int, dict[str, Any]], stacklevel: int) -> None:
        """Keep a step's values and hand them to the sinks, converted once, after one host
        transfer (``stacklevel``: warnings.warn's, from here, of a warning of non-finite
        values)."""
        values, non_finite = read(values, convert=bool(self.sinks))
        warn_non_finite(non_finite, stacklevel + 1)
        for step, named in sorted(values.items()):
            if self.sinks:
                for sink in self.sinks:
                    sink.write(step, named)
            else:
                self._unconverted.extend((step, name) for name in named)
            self._values[step].update(named)
        self._forget_old_steps()

    def log(self, step: int, metrics: dict) -> None:
        """Store epoch-level metrics at ``step``."""
        values = {key: to_python(value) for key, value in metrics.items()}
        for sink in self.sinks:
            sink.write(step, values)
        self._values[step].update(values)
        self._forget_old_steps()

    def output(self) -> StepValues:
        """Every step's values in memory, converted to plain Python, sorted by step."""
        for step, name in self._unconverted:
            self._values[step][name] = to_python(self._values[step][name])
        self._unconverted = []
        return StepValues({step: dict(values) for step, values in sorted(self._values.items())})

    def describe_training(self, info: dict, batch: Batch, world_size: int) -> None:
        """Add the optimizer and batch size to the sinks' metadata, once they are known."""
        if not self.sinks or self._described_training:
            return
        from avionics.records.metadata import describe_optimizer

        optimizer = info.get("optimizer")
        if optimizer is not None:
            update = {"optimizer": describe_optimizer(optimizer), "batch_size": batch.size}
            if world_size > 1:
                update["batch_sizes"] = list(batch.sizes)
            for sink in self.sinks:
                sink.update_metadata(update)
            self._described_training = True

    def close(self) -> None:
        """Close the sinks."""
        for sink in self.sinks:
            sink.close()

    def _forget_old_steps(self) -> None:
        """Keep only the last ``window`` steps in memory."""
        if self.window is not None:
            while len(self._values) > self.window:
                del self._values[min(self._values)]


def opened_sinks(
    log, sinks: list, metadata: dict, rank: int, exist: str, fsync: bool
) -> tuple[list, bool]:
    """The sinks of the cockpit's process, told ``metadata`` (with a ``log``, its
    :class:`~avionics.records.RunWriter` first), and whether this process writes a log.
    Rank 0 writes what every process computes; a log path holding ``{rank}`` gives each
    process its own log (and its sinks the values)."""
    per_rank = log is not None and "{rank}" in str(log)
    if not per_rank and rank != 0:
        return [], False
    if log is not None:
        from avionics.records import RunWriter

        path = str(log).format(rank=rank) if per_rank else log
        writer = RunWriter(path, metadata=metadata, exist=exist, fsync=fsync)
    for sink in sinks:
        sink.update_metadata(metadata)
    return ([writer, *sinks] if log is not None else sinks), log is not None


def add_learning_rates(values: dict, step: int, info: dict) -> None:
    """Store the learning rate of ``info["optimizer"]`` at ``step`` (under "learning_rate",
    the name the dashboard and the diagnosis read): one number, or one per parameter group
    where the groups' differ, so that a scheduler's rates are in the run's record."""
    groups = getattr(info.get("optimizer"), "param_groups", None)
    if not groups or not all(isinstance(g.get("lr"), (int, float, Tensor)) for g in groups):
        return
    rates = [float(g["lr"]) for g in groups]
    values[step][LEARNING_RATE] = rates[0] if len(set(rates)) == 1 else rates


def warn_non_finite(non_finite: dict[int, list[str]], stacklevel: int) -> None:
    """Warn, per step, of the quantities whose values are NaN or infinite (``non_finite``,
    from :func:`avionics.step.transfer.read`; a non-finite loss is said where the step is
    skipped; ``stacklevel``: warnings.warn's, from here)."""
    for step, names in non_finite.items():
        bad = [name for name in names if name != Loss.__name__]
        if bad:
            warnings.warn(
                f"Step {step}: {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} NaN or "
                "infinite (recorded as computed): the step's gradients or curvature were not "
                "finite.",
                stacklevel=stacklevel,
            )
