"""How values are written to and read from a JSON log line.

Standard JSON has no NaN or infinity. A non-finite float is written as a one-key object,
``{"$float": "NaN"}``, ``{"$float": "Infinity"}`` or ``{"$float": "-Infinity"}`` (the spellings
of JavaScript and of the protobuf JSON mapping), so that every line is strict JSON that any
tool can parse, and reading gives back exactly the float that was written. Tuples become
lists; numpy and torch scalars and arrays become Python numbers and (nested) lists.
"""

from __future__ import annotations

import json
import math
from typing import Any

FLOAT_TAG = "$float"
_NONFINITE_NAMES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _nonfinite_name(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    return "Infinity" if x > 0 else "-Infinity"


def to_python(value: Any) -> Any:
    """``value`` as plain Python: tensors and numpy arrays and scalars become (nested) lists
    and numbers, tuples lists, dicts keep their keys; anything else is returned as it is.
    The one conversion of a cockpit's values, for its output and its sinks."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy and torch scalars and arrays
    if callable(tolist):
        if hasattr(value, "detach"):
            value = value.detach().cpu()
        return tolist()
    return value


def to_plain(value: Any, where: str = "value") -> Any:
    """``value`` as JSON-ready Python: dicts with str keys, lists, str, bool, int, finite
    float, None; non-finite floats tagged. ``where`` names the value in error messages."""
    return _tagged(to_python(value), where)


def _tagged(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {FLOAT_TAG: _nonfinite_name(value)}
    if isinstance(value, dict):
        return {str(k): _tagged(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list):
        return [_tagged(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"{where} is a {type(value).__name__}, which the log cannot store. Pass numbers, "
        "strings, lists, dicts, numpy arrays or tensors (convert other objects first)."
    )


def from_plain(value: Any) -> Any:
    """The inverse of :func:`to_plain`: tagged non-finite floats become floats again."""
    if isinstance(value, dict):
        if len(value) == 1 and FLOAT_TAG in value:
            name = value[FLOAT_TAG]
            if name not in _NONFINITE_NAMES:
                raise ValueError(f"unknown non-finite float {name!r}")
            return _NONFINITE_NAMES[name]
        return {k: from_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    return value


def encode_line(record: dict) -> bytes:
    """One record as one line of strict JSON (no NaN tokens), newline-terminated."""
    text = json.dumps(to_plain(record), allow_nan=False, separators=(",", ":"))
    return (text + "\n").encode("utf-8")


def decode_line(line: str) -> dict:
    """The record of one log line; raises ``ValueError`` when the line is not a JSON object."""
    record = from_plain(json.loads(line))
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record
