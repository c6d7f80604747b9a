"""The presets (docs/definitions.md, section 11): which quantities a cockpit runs by default."""

from __future__ import annotations

import avionics.quantities as q
from avionics.schedules import Schedule, logarithmic

ECONOMY = [
    q.Alpha, q.Distance, q.GradHist1d, q.GradNorm, q.InnerTest, q.Loss, q.NormTest, q.OrthoTest,
    q.UpdateSize,
]  # fmt: skip
BUSINESS = ECONOMY + [q.TICDiag, q.HessTrace]
FULL = BUSINESS + [q.HessMaxEV, q.GradHist2d]
# For Adam, AdamW or RMSprop on transformers: per-layer update ratios, activation health, the
# gradient noise scale and the bad samples of a spike at every step; the per-sample gradient
# histogram and the sharpness the optimiser sees on a logarithmic schedule (about 10 steps a
# decade: 0, 1, 2, 3, 5, 6, 7, 10, 12, 15, 19, 25, ...), where they cost many backward passes.
TRANSFORMER = [
    q.ActivationHealth, q.GradNorm, q.GradientNoiseScale, q.Loss, q.LossOutliers, q.UpdateRatio,
    q.UpdateSize,
]  # fmt: skip
TRANSFORMER_SPARSE = [q.GradHist1d, q.PreconditionedSharpness]
PRESETS = {
    "economy": ECONOMY,
    "business": BUSINESS,
    "full": FULL,
    "transformer": TRANSFORMER + TRANSFORMER_SPARSE,
}


def sparse_schedule() -> Schedule:
    """The logarithmic schedule of the expensive quantities of the "transformer" preset."""
    return logarithmic(0, 6, steps=61)


def configuration(label: str, schedule: Schedule | None = None) -> list[q.Quantity]:
    """New instances of the quantities of preset ``label``, each on ``schedule`` (by default
    every step, and :func:`sparse_schedule` for ``TRANSFORMER_SPARSE`` in "transformer")."""
    if label not in PRESETS:
        raise ValueError(
            f"Unknown configuration {label!r}; choose one of {', '.join(map(repr, PRESETS))}."
        )
    quantities = []
    for cls in PRESETS[label]:
        own = sparse_schedule() if label == "transformer" and cls in TRANSFORMER_SPARSE else None
        quantities.append(cls(schedule=schedule or own))
    return quantities
