"""Loss: the mini-batch loss L_t as the user backpropagated it; LossOutliers: the samples of the
batch whose loss is far above the others', to find bad data."""

from __future__ import annotations

import math
import sys

from torch import Tensor

from avionics.quantities.arguments import checked_int, checked_real
from avionics.quantities.base import PER_SAMPLE_LOSSES, Quantity, StepData
from avionics.quantities.deferred import Deferred
from avionics.quantities.outputs import TENSORS
from avionics.schedules import Schedule

MAD_TO_STD = 1.4826  # the MAD of a normal distribution times this is its standard deviation
# The robust scale is at least this fraction of |median|, so that a batch of (nearly) equal
# losses does not make every wiggle an outlier (as the diagnosis' robust z-scores).
MIN_RELATIVE_SCALE = 0.01


class Loss(Quantity):
    """The mini-batch loss L_t as the user reduced it: ``info["loss"]`` (the mean or the sum
    of the per-sample losses, as backpropagated)."""

    def compute(self, data: StepData):
        return {data.step: data.loss}


class LossOutliers(Quantity):
    """The samples of the batch whose per-sample loss is far above the batch's median, by
    index:

        l_n > median + k * s,  s = max(1.4826 * MAD, 0.01 |median|),  MAD = median |l - median|

    over the global batch (under data parallelism the concatenation of the processes' batches
    in rank order, so an index n is the n-th sample of that concatenation). A non-finite l_n
    is always an outlier; the median and MAD are those of the finite losses. ``k = 6`` by
    default, the diagnosis' spike threshold: of normally distributed losses, about one sample in
    10^9 is an outlier.

    Stored every tracked step: ``{"indices": [...], "losses": [...], "count": c, "median": m,
    "scale": s, "k": k}``: the (at most ``max_listed``) largest outliers, largest first, and
    the number c of all outliers (``indices`` empty when there are none). It needs
    ``info["individual_losses"]`` only: no per-sample gradients, no capture.

    Args:
        schedule: the steps to track (default every step).
        k: robust standard deviations above the median that make an outlier, > 0.
        max_listed: the most outliers stored per step, >= 1.
    """

    info_keys = (PER_SAMPLE_LOSSES,)
    output = TENSORS

    def __init__(self, schedule: Schedule | None = None, k: float = 6.0, max_listed: int = 5):
        super().__init__(schedule)
        self.k = checked_real(self.name, "k", k, "robust standard deviations", above=0)
        self.max_listed = checked_int(
            self.name, "max_listed", max_listed, 1, "outliers stored per step"
        )

    def sums(self, data: StepData) -> dict[str, Tensor]:
        """This process's losses at their place in the global batch, zeros elsewhere: added
        over the processes, the concatenation of the batches."""
        losses = data.individual_losses.detach().reshape(-1).double()
        sizes = data.parallel.batch_sizes or (len(losses),)
        offset = sum(sizes[: data.parallel.world.rank])
        placed = losses.new_zeros(sum(sizes))
        placed[offset : offset + len(losses)] = losses
        return {"losses": placed}

    def compute(self, data: StepData):
        # found on the host, from the losses read with the step's one host transfer
        return {data.step: Deferred((data.totals[self.name]["losses"],), self._found)}

    def _found(self, losses: list[float], _) -> dict:
        return {**outliers_of(losses, self.k, self.max_listed), "k": self.k}


def outliers(losses: Tensor, k: float, max_listed: int) -> dict:
    """The outliers of ``losses`` [N] by the rule of :class:`LossOutliers` (one host
    transfer)."""
    return outliers_of(losses.double().tolist(), k, max_listed)


def outliers_of(losses: list[float], k: float, max_listed: int) -> dict:
    """The outliers of the per-sample ``losses``, on the host, by the rule of
    :class:`LossOutliers`, in plain Python (a batch's few hundred numbers: a sort is
    microseconds where numpy's calls take hundreds)."""
    kept = sorted(x for x in losses if math.isfinite(x))
    median = _median(kept)
    mad = _median(sorted(abs(x - median) for x in kept))
    scale = max(MAD_TO_STD * mad, MIN_RELATIVE_SCALE * abs(median))
    bound = median + k * scale
    indices = [n for n, x in enumerate(losses) if not math.isfinite(x) or x > bound]
    # non-finite first: nan, then inf, then the finite ones by loss, largest first, -inf last
    listed = sorted(indices, key=lambda n: _descending(losses[n]))[:max_listed]
    return {
        "indices": listed,
        "losses": [losses[n] for n in listed],
        "count": len(indices),
        "median": median,
        "scale": scale,
    }


def _median(ordered: list[float]) -> float:
    """The median of the sorted ``ordered`` (the mean of the middle two of an even count, as
    ``numpy.median``), nan if it is empty."""
    n = len(ordered)
    if n == 0:
        return math.nan
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _descending(x: float) -> float:
    """The sort key of a loss, largest first, nan before inf and -inf after every finite
    loss (the order of ``-numpy.nan_to_num(x, nan=inf)``: +-inf as +-the largest float)."""
    if math.isnan(x):
        return -math.inf
    return -max(min(x, sys.float_info.max), -sys.float_info.max)
