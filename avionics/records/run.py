"""A run: the steps, metadata and reading problems of one run log."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from avionics.records.outputs import BUILTIN_OUTPUTS, SCALAR, TENSORS, Output, is_number


@dataclass
class Run:
    """The contents of a run log.

    Attributes:
        steps: step -> {quantity or metric name -> value}, sorted by step; records of the
            same step are merged, later values winning.
        metadata: the first session's metadata, with its updates merged in.
        sessions: the metadata of every session (one per time the log was opened).
        problems: what could not be read, each naming its line number (or, for an empty
            log, that it holds no records); shown by ``avionics diagnose`` and the CLI.
        path: the log file, or None for a run built in memory.
    """

    steps: dict[int, dict] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    sessions: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    path: Path | None = None

    @classmethod
    def from_output(cls, output: dict, metadata: dict | None = None) -> Run:
        """A run from ``{step: {name: value}}``, e.g. a live ``cockpit.get_output()``."""
        steps = {int(step): dict(values) for step, values in sorted(output.items())}
        metadata = dict(metadata or {})
        return cls(steps=steps, metadata=metadata, sessions=[metadata] if metadata else [])

    @property
    def parameter_names(self) -> list[str]:
        """Names of the tracked parameters, in the order of per-parameter values, when the
        metadata has them (``{"parameters": {name: shape}}``), else an empty list."""
        parameters = self.metadata.get("parameters")
        return list(parameters) if isinstance(parameters, dict) else []

    @property
    def outputs(self) -> dict[str, Output]:
        """How each quantity's value reads, as the metadata declares it (``{"outputs": {name:
        description}}``, see :mod:`avionics.records.outputs`)."""
        declared = self.metadata.get("outputs")
        if not isinstance(declared, dict):
            return {}
        return {name: Output.from_description(d) for name, d in declared.items()}

    def output(self, name: str, value=None) -> Output:
        """How the values stored under ``name`` read (see
        :func:`output_of`)."""
        return output_of(name, self.outputs, value)

    @property
    def names(self) -> list[str]:
        """The names of everything recorded, sorted."""
        return sorted({name for values in self.steps.values() for name in values})

    def to_dataframe(self):
        """A pandas DataFrame: one row per step (index ``step``), one column per name; values
        that are lists or dicts (per-parameter values, histograms) are kept as objects."""
        try:
            import pandas as pd
        except ImportError as error:
            raise ImportError(
                "Run.to_dataframe needs pandas: pip install pandas (or use run.steps)."
            ) from error
        frame = pd.DataFrame.from_dict(self.steps, orient="index", columns=self.names)
        frame.index.name = "step"
        return frame


def output_of(name: str, declared: dict[str, Output], value=None) -> Output:
    """How the values stored under ``name`` read: as ``declared`` (by a log's metadata), else
    as the built-in quantity of that name declares it (older logs, the reference tool's), else
    a scalar for a number (an epoch-level metric from ``cockpit.log``), else
    :data:`~avionics.records.outputs.TENSORS`."""
    if name in declared:
        return declared[name]
    if name in BUILTIN_OUTPUTS:
        return BUILTIN_OUTPUTS[name]
    return SCALAR if is_number(value) else TENSORS
