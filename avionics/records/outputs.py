"""What a quantity's stored value is, so that readers, exports and panels need not know it.

Every quantity class declares its ``output`` (with the names re-exported by
:mod:`avionics.quantities.outputs`); the cockpit writes the declarations of its quantities into
the run log's metadata (``{"outputs": {name: description}}``), and the log
reader, the CSV and TensorBoard exports and the dashboard's generic panels read a value
through its declaration:

* :data:`SCALAR`: one number per step;
* :func:`per_parameter`: one number per tracked parameter (a list in parameter order), with
  how the list reduces to one number: ``"rss"`` (root of the sum of squares, for norms:
  ||theta|| = sqrt(sum_k ||theta^(k)||^2)), ``"sum"`` (traces) or ``"mean"``;
* :data:`PER_LAYER`: ``{"global": x, "per_parameter": [x_1, ..., x_K]}``, a ratio of sums over
  the parameters (NormTest, ...) and the same ratio of each parameter's own sums, which do not
  reduce to the global value (a quantity read with ``per_layer=True``);
* :data:`HISTOGRAM_1D`: ``{"hist": counts [bins], "edges": [bins + 1]}``;
* :data:`HISTOGRAM_2D`: ``{"hist": counts [x bins, y bins], "edges": [x edges, y edges]}``;
* :data:`TENSORS`: anything else (e.g. copies of the parameters): stored, never reduced.

A log whose metadata declares nothing (an older log, the reference tool's JSON) reads the
built-in quantities through :data:`BUILTIN_OUTPUTS`. This module imports no quantity: reading
a log loads no instrument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

REDUCTIONS = ("rss", "sum", "mean")


def is_number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class Output:
    """The kind of a stored value (see the module docstring). ``reduce`` is set for
    per-parameter values only."""

    kind: str
    reduce: str | None = None

    @property
    def is_per_parameter(self) -> bool:
        return self.kind == "per_parameter"

    @property
    def has_parameter_values(self) -> bool:
        """Whether a value holds one number per tracked parameter (:meth:`parameter_values`)."""
        return self.kind in ("per_parameter", "per_layer")

    @property
    def histogram(self) -> bool:
        return self.kind in ("histogram_1d", "histogram_2d")

    def scalar(self, value) -> float | None:
        """The one number that summarises ``value``, or None where there is none."""
        if is_number(value):
            return float(value)
        if self.kind == "per_layer":
            whole = value.get("global") if isinstance(value, dict) else None
            return float(whole) if is_number(whole) else None
        if not (self.is_per_parameter and isinstance(value, list) and value):
            return None
        if not all(is_number(v) for v in value):
            return None
        if self.reduce == "sum":
            return float(math.fsum(value))
        if self.reduce == "mean":
            return float(math.fsum(value)) / len(value)
        return math.sqrt(math.fsum(float(v) ** 2 for v in value))

    def parameter_values(self, value) -> list[float] | None:
        """The numbers of the tracked parameters, in parameter order, of a per-parameter or
        per-layer value; None for other kinds or a value that is not one."""
        if self.kind == "per_layer" and isinstance(value, dict):
            value = value.get("per_parameter")
        elif self.kind != "per_parameter":
            return None
        if not (isinstance(value, list) and all(is_number(v) for v in value)):
            return None
        return [float(v) for v in value]

    def describe(self) -> dict:
        """JSON-ready description, for the log's metadata."""
        if self.reduce is None:
            return {"kind": self.kind}
        return {"kind": self.kind, "reduce": self.reduce}

    @classmethod
    def from_description(cls, description) -> Output:
        """The inverse of :meth:`describe`; an unknown description reads as :data:`TENSORS`."""
        if not isinstance(description, dict) or description.get("kind") not in KINDS:
            return TENSORS
        reduce = description.get("reduce")
        if description["kind"] == "per_parameter":
            return per_parameter(reduce if reduce in REDUCTIONS else "rss")
        return cls(description["kind"])


def per_parameter(reduce: str = "rss") -> Output:
    """A list with one number per tracked parameter that reduces by ``reduce``."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"PerParameter(reduce={reduce!r}): choose one of {REDUCTIONS}.")
    return Output("per_parameter", reduce)


KINDS = ("scalar", "per_parameter", "per_layer", "histogram_1d", "histogram_2d", "tensors")
SCALAR = Output("scalar")
PER_LAYER = Output("per_layer")
HISTOGRAM_1D = Output("histogram_1d")
HISTOGRAM_2D = Output("histogram_2d")
TENSORS = Output("tensors")


# How the values of the built-in quantities read (each class's ``output``; a test checks that
# they agree), for logs whose metadata does not say.
BUILTIN_OUTPUTS: dict[str, Output] = {
    **dict.fromkeys(("ActivationHealth", "LossOutliers", "Parameters", "Ranks"), TENSORS),
    **dict.fromkeys(("Distance", "GradNorm", "UpdateSize"), per_parameter("rss")),
    "GradHist1d": HISTOGRAM_1D,
    "GradHist2d": HISTOGRAM_2D,
    "HessTrace": per_parameter("sum"),
    "UpdateRatio": PER_LAYER,
    **dict.fromkeys(
        (
            "Alpha",
            "CABS",
            "EarlyStopping",
            "GradCovTrace",
            "GradientNoiseScale",
            "HessMaxEV",
            "InnerTest",
            "Loss",
            "MeanGSNR",
            "NormTest",
            "OrthoTest",
            "PreconditionedSharpness",
            "SimpleNoiseScale",
            "TICDiag",
            "TICTrace",
            "Time",
            "TrueGradSqNorm",
        ),
        SCALAR,
    ),
}
