"""The protocol of everything a cockpit writes its values to.

A sink receives each finished step's values once they are plain Python (numbers, lists,
dicts: see :func:`avionics.records.encoding.to_python`), and the run's metadata: the whole of
it when the cockpit starts, and what is learnt later (the optimizer, at the first step). The
metadata's ``"outputs"`` say how each quantity's value reads (see
:mod:`avionics.records.outputs`). The run log (:class:`~avionics.records.RunWriter`) and
TensorBoard (:class:`~avionics.records.TensorBoardWriter`) are sinks; so is any object with
these three methods.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Sink(Protocol):
    def write(self, step: int, values: dict) -> None:
        """Take the values of ``step`` (all of a step's, or values that arrived later)."""

    def update_metadata(self, metadata: dict) -> None:
        """Take metadata of the run (merged into what was given before)."""

    def close(self) -> None:
        """Flush and release; no write follows."""
