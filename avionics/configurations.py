"""The presets of SPEC section 2: which quantities a cockpit runs by default."""

from __future__ import annotations

import avionics.quantities as q
from avionics.schedules import Schedule

ECONOMY = [
    q.Alpha, q.Distance, q.GradHist1d, q.GradNorm, q.InnerTest, q.Loss, q.NormTest, q.OrthoTest,
    q.UpdateSize,
]  # fmt: skip
BUSINESS = ECONOMY + [q.TICDiag, q.HessTrace]
FULL = BUSINESS + [q.HessMaxEV, q.GradHist2d]
PRESETS = {"economy": ECONOMY, "business": BUSINESS, "full": FULL}


def configuration(label: str, schedule: Schedule | None = None) -> list[q.Quantity]:
    """New instances of the quantities of preset ``label``, each on ``schedule``."""
    if label not in PRESETS:
        raise ValueError(
            f"Unknown configuration {label!r}; choose one of {', '.join(map(repr, PRESETS))}."
        )
    return [cls(schedule=schedule) for cls in PRESETS[label]]
