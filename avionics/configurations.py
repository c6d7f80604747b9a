"""The presets of SPEC section 2: which quantities a cockpit runs by default."""

from __future__ import annotations

from avionics import quantities
from avionics.schedules import Schedule

ECONOMY = [
    "Alpha",
    "Distance",
    "GradHist1d",
    "GradNorm",
    "InnerTest",
    "Loss",
    "NormTest",
    "OrthoTest",
    "UpdateSize",
]
BUSINESS = ECONOMY + ["TICDiag", "HessTrace"]
FULL = BUSINESS + ["HessMaxEV", "GradHist2d"]
PRESETS = {"economy": ECONOMY, "business": BUSINESS, "full": FULL}


def configuration(label: str, schedule: Schedule | None = None) -> list[quantities.Quantity]:
    """New instances of the quantities of preset ``label``, each on ``schedule``."""
    if label not in PRESETS:
        raise ValueError(
            f"Unknown configuration {label!r}; choose one of {', '.join(map(repr, PRESETS))}."
        )
    return [getattr(quantities, name)(schedule=schedule) for name in PRESETS[label]]
