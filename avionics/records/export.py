"""Exporting a run: a CSV of its scalar series, and the reference Cockpit tool's JSON layout.

The reference layout (what ``cockpit.Cockpit.write`` produces and ``cockpit.CockpitPlotter``
reads) is ``{"step": {"QuantityClassName": value}}`` written by ``json_tricks``: numpy arrays
are objects ``{"__ndarray__": [...], "dtype": ..., "shape": [...]}`` (plus ``"Corder": true``
for more than one dimension), per-parameter 2d histograms are ``"param_groups": n`` and
``"param_<i>": {"hist", "edges"}`` next to the global one, and the epoch is ``epoch_count``.
Non-finite floats are written as the ``NaN`` / ``Infinity`` tokens that Python's and
json_tricks' readers accept.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import numpy as np

from avionics.records.run import Run
from avionics.records.series import (
    global_value,
    parameter_histograms,
    parameter_values,
    scalar_names,
)

_RENAMED_FOR_COCKPIT = {"epoch": "epoch_count"}


def _csv_cell(value: float | None) -> str:
    if value is None:
        return ""
    return repr(value) if math.isfinite(value) else str(value)  # nan, inf, -inf


def to_csv(run: Run, path: str | os.PathLike) -> Path:
    """Write one row per step and one column per scalar series (per-parameter and per-layer
    quantities as their global value plus one column ``Name[parameter]`` per parameter, named
    as in the model, e.g. ``GradNorm[0.weight]``, or ``Name[i]`` where the log does not name
    the parameters); return the path."""
    names = scalar_names(run)
    numbers = {
        name: {
            step: parameter_values(run, name, v[name])
            for step, v in run.steps.items()
            if name in v
        }
        for name in names
    }
    per_parameter = {
        name: max(len(v) for v in by_step.values() if v)
        for name, by_step in numbers.items()
        if any(by_step.values())
    }
    parameters = list(run.metadata.get("parameters") or {})
    header = ["step"]
    for name in names:
        count = per_parameter.get(name, 0)
        labels = parameters if len(parameters) == count else [str(i) for i in range(count)]
        header.append(name)
        header.extend(f"{name}[{label}]" for label in labels)
    path = Path(path)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for step, values in run.steps.items():
            row = [str(step)]
            for name in names:
                value = values.get(name)
                row.append(_csv_cell(None if value is None else global_value(run, name, value)))
                listed = numbers[name].get(step) or []
                for i in range(per_parameter.get(name, 0)):
                    row.append(_csv_cell(listed[i] if i < len(listed) else None))
            writer.writerow(row)
    return path


def _ndarray(values) -> dict:
    array = np.asarray(values, dtype=np.float64)
    tagged = {"__ndarray__": array.tolist(), "dtype": "float64", "shape": list(array.shape)}
    if array.ndim > 1:
        tagged["Corder"] = True
    return tagged


def _cockpit_histogram(value: dict) -> dict:
    hist = {"hist": _ndarray(value["hist"])}
    edges = value["edges"]
    nested = bool(edges) and isinstance(edges[0], list)
    hist["edges"] = [_ndarray(e) for e in edges] if nested else _ndarray(edges)
    for i, param_hist in enumerate(parameter_histograms(value)):
        hist[f"param_{i}"] = _cockpit_histogram(param_hist)
    if "param_hist" in value:
        hist["param_groups"] = len(value["param_hist"])
    return hist


def to_cockpit_dict(run: Run) -> dict:
    """The run in the reference tool's layout, ready for ``json.dump``."""
    output = {}
    for step, values in run.steps.items():
        entry = {}
        for name, value in values.items():
            if run.output(name).histogram and isinstance(value, dict):
                value = _cockpit_histogram(value)
            entry[_RENAMED_FOR_COCKPIT.get(name, name)] = value
        output[str(step)] = entry
    return output


def to_cockpit_json(run: Run, path: str | os.PathLike) -> Path:
    """Write the run as the reference tool's JSON log; return the path. The reference
    plotter opens it with ``CockpitPlotter().plot(str(path)[:-len(".json")])``."""
    path = Path(path)
    with open(path, "w") as f:
        json.dump(to_cockpit_dict(run), f, indent=4, sort_keys=True)
    return path


def _from_cockpit_value(value):
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return np.asarray(value["__ndarray__"], dtype=np.float64).tolist()
        plain = {k: _from_cockpit_value(v) for k, v in value.items()}
        groups = plain.pop("param_groups", None)
        if groups is not None:  # bare counts where the edges are the global ones
            entries = [plain.pop(f"param_{i}") for i in range(int(groups))]
            plain["param_hist"] = [
                e["hist"] if e["edges"] == plain["edges"] else e for e in entries
            ]
        return plain
    if isinstance(value, list):
        return [_from_cockpit_value(v) for v in value]
    return value


def read_cockpit_json(path: str | os.PathLike) -> Run:
    """A run from a JSON log of the reference tool (``cockpit.Cockpit.write``)."""
    path = Path(path)
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not a valid JSON file: {error}") from error
    if not isinstance(data, dict) or not all(k.lstrip("-").isdigit() for k in data):
        raise ValueError(
            f"{path} is not a Cockpit JSON log (expected an object keyed by step numbers)."
        )
    steps = {}
    for step, values in data.items():
        steps[int(step)] = {
            ("epoch" if name == "epoch_count" else name): _from_cockpit_value(value)
            for name, value in values.items()
        }
    run = Run.from_output(steps, metadata={"source": "cockpit-json", "file": str(path)})
    run.path = path
    return run
