"""The kinds of a quantity's stored value, to declare a quantity's ``output`` with.

Defined in :mod:`avionics.records.outputs` (reading a log needs them and no quantity); see
there for what each kind stores and how it reduces.
"""

from avionics.records.outputs import (
    HISTOGRAM_1D,
    HISTOGRAM_2D,
    PER_LAYER,
    SCALAR,
    TENSORS,
    Output,
    per_parameter,
)

__all__ = [
    "HISTOGRAM_1D",
    "HISTOGRAM_2D",
    "PER_LAYER",
    "SCALAR",
    "TENSORS",
    "Output",
    "per_parameter",
]
