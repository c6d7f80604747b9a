"""Per-step series of a run: one float per step for every scalar quantity or metric
(:func:`series`), and layers x steps arrays of the per-parameter ones
(:func:`parameter_series`; not to be confused with
:func:`avionics.records.outputs.per_parameter`, which declares such an output).

Each value is read through its quantity's declared output (:mod:`avionics.records.outputs`):
per-parameter values reduce to their global value as declared (the root-sum-of-squares of
norms, the sum of traces); histograms and parameter copies have no scalar value.

A per-parameter value also reads per module (:func:`per_module`): the parameters named
``0.weight`` and ``0.bias`` in the log's metadata belong to module ``0``, and a module's value
is its parameters' reduced as the quantity declares (the RSS of their norms, the sum of their
traces), the value the module would have as the only part of the model. A per-layer ratio
(:data:`~avionics.records.outputs.PER_LAYER`, e.g. ``NormTest(per_layer=True)``) has no such
reduction: it reads per parameter only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROOT = "(model)"  # the label of the parameters used directly by the model's own forward


def global_value(run, name: str, value) -> float | None:
    """The scalar value of one recorded value, or None if it has none (histogram, text)."""
    return run.output(name, value).scalar(value)


def parameter_values(run, name: str, value) -> list[float] | None:
    """The numbers of the tracked parameters in one recorded value (per-parameter or
    per-layer), or None if it has none."""
    return run.output(name, value).parameter_values(value)


def series(run, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of ``name`` over the steps where it has a scalar value, sorted by
    step; non-finite values are kept. Empty arrays when it was never recorded."""
    points = []
    for step, values in run.steps.items():
        if name in values:
            value = global_value(run, name, values[name])
            if value is not None:
                points.append((step, value))
    points.sort()
    steps = np.array([p[0] for p in points], dtype=np.int64)
    return steps, np.array([p[1] for p in points], dtype=np.float64)


def scalar_names(run) -> list[str]:
    """The names that have a scalar value at one step at least, sorted."""
    names = set()
    for values in run.steps.values():
        names.update(k for k, v in values.items() if global_value(run, k, v) is not None)
    return sorted(names)


def latest(run, name: str):
    """``(step, value)`` of the last step that recorded ``name``, or ``(None, None)``."""
    for step in reversed(run.steps):
        if name in run.steps[step]:
            return step, run.steps[step][name]
    return None, None


def parameter_histograms(hist2d: dict) -> list[dict]:
    """The per-parameter histograms of a GradHist2d value as ``{"hist", "edges"}`` dicts;
    entries stored as bare count matrices share the global histogram's edges."""
    return [
        entry if isinstance(entry, dict) else {"hist": entry, "edges": hist2d["edges"]}
        for entry in hist2d.get("param_hist", [])
    ]


@dataclass(frozen=True)
class LayerSeries:
    """One number per layer (a tracked parameter or a module) and step: ``values[i, j]`` is
    layer ``labels[i]`` at step ``steps[j]``."""

    labels: list[str]
    steps: np.ndarray
    values: np.ndarray


def layered_names(run) -> list[str]:
    """The names with one number per tracked parameter at one step at least, sorted."""
    return sorted(
        name
        for name in run.names
        if any(
            run.output(name, v[name]).parameter_values(v[name])
            for v in run.steps.values()
            if name in v
        )
    )


def parameter_series(run, name: str) -> LayerSeries:
    """``name``'s number of every tracked parameter at every step that has one per parameter
    (labels: the parameter names of the log's metadata, else ``parameter i``). Empty when
    ``name`` has no per-parameter values; steps whose count of parameters differs from the
    last step's are left out."""
    rows = []
    for step, values in run.steps.items():
        numbers = parameter_values(run, name, values.get(name))
        if numbers:
            rows.append((step, numbers))
    count = len(rows[-1][1]) if rows else 0
    rows = [(step, numbers) for step, numbers in rows if len(numbers) == count]
    names = run.parameter_names
    labels = names if len(names) == count else [f"parameter {i}" for i in range(count)]
    steps = np.array([step for step, _ in rows], dtype=np.int64)
    values = np.array([numbers for _, numbers in rows], dtype=np.float64)
    return LayerSeries(labels, steps, values.reshape(len(rows), count).T)


def module_of(parameter: str) -> str:
    """The module that holds a parameter, from its name: ``0.weight`` -> ``0``,
    ``block.attn.in_proj_weight`` -> ``block.attn``, ``pos`` -> :data:`ROOT`."""
    return parameter.rpartition(".")[0] or ROOT


def per_module(run, name: str) -> LayerSeries:
    """``name``'s number of every module at every step (see the module docstring): the
    parameters of a module, named by the log's metadata, reduced as the quantity declares
    (``rss``, ``sum`` or ``mean``); modules in the order of their first parameter. Empty when
    ``name`` has no per-parameter values.

    Raises:
        ValueError: ``name`` is a per-layer ratio (read it with :func:`parameter_series`), or the
            log does not name as many parameters as ``name`` has numbers.
    """
    output = run.output(name)
    if output.kind == "per_layer":
        raise ValueError(
            f"per_module(run, {name!r}): {name} is a ratio of sums over each parameter, which "
            "do not combine into a module's ratio; read it per parameter with "
            f"parameter_series(run, {name!r})."
        )
    layers = parameter_series(run, name)
    if not layers.labels:
        return layers
    if len(layers.labels) != len(run.parameter_names):
        raise ValueError(
            f"per_module(run, {name!r}): the log names {len(run.parameter_names)} parameters "
            f"but {name} has {len(layers.labels)} numbers per step, so its parameters cannot be "
            "grouped by module; read it per parameter with "
            f"parameter_series(run, {name!r}) (a log written by a Cockpit names its parameters)."
        )
    modules = list(dict.fromkeys(module_of(p) for p in layers.labels))
    members = {m: [i for i, p in enumerate(layers.labels) if module_of(p) == m] for m in modules}
    reduce = {"rss": _root_sum_of_squares, "sum": np.sum, "mean": np.mean}[output.reduce]
    values = np.array([reduce(layers.values[members[m]], axis=0) for m in modules])
    return LayerSeries(modules, layers.steps, values.reshape(len(modules), len(layers.steps)))


def _root_sum_of_squares(values: np.ndarray, axis: int) -> np.ndarray:
    return np.sqrt(np.sum(np.square(values), axis=axis))
