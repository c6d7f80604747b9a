"""The state a rule's re-run of a module reads: that of the user's forward, written by none of it.

A rule that re-runs a module's forward on its captured inputs (the generic rule, per sample)
must compute what the user's forward computed and leave the model as that forward left it:

* Buffers: :func:`rerun` gives the forward fresh copies of the module's buffers
  (``torch.func.functional_call``), so that a forward that updates a buffer in place
  (BatchNorm's running statistics and ``num_batches_tracked``, a user's counter) updates the
  copies, and reads the buffer's value as the step left it. (A buffer created outside a
  torch.func transform cannot be written inside it at all: the copies are made inside.)
* BatchNorm that normalises with the statistics of the batch (train mode, or no running
  statistics): re-run on one sample it would normalise by that sample's statistics (and
  BatchNorm1d refuses a [1, C] input in train mode). :class:`BatchStatistics` has it
  normalise by the batch's instead, as constants, x_hat = (x - mean) / sqrt(var + eps) with the
  mean and the biased variance over the batch and the other axes of each channel, recorded
  by one re-run on the whole batch: row n of a re-run on sample n is then row n of the user's
  forward. A parameter the re-run differentiates that is used after the BatchNorm gets each
  sample's share of the batch gradient exactly (the engine's definition for train-mode
  BatchNorm); one used before it misses the dependence of the statistics on it, its
  per-sample gradients do not sum to the batch gradient, and the engine's check reroutes and
  warns of it (:meth:`~avionics.persample.engine.PerSampleEngine.check`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

_BatchNorm = nn.modules.batchnorm._BatchNorm


class BatchStatistics:
    """The batch statistics (mean, biased variance) [C] of each call of each BatchNorm inside
    a module that normalises with them, in call order, from one forward of the module on the
    whole batch (:meth:`recording`); re-runs normalise with them (:meth:`normalising`)."""

    def __init__(self, module: nn.Module):
        self.norms = [
            m for m in module.modules()
            if isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)
        ]  # fmt: skip
        self.calls: dict[nn.Module, list[tuple[Tensor, Tensor]]] = {m: [] for m in self.norms}
        self._recording = False

    @contextmanager
    def recording(self):
        """Within: each BatchNorm records the statistics of its input, and normalises by them."""
        self._recording = True
        try:
            with self.normalising():
                yield
        finally:
            self._recording = False

    @contextmanager
    def normalising(self):
        """Within: the k-th call of each BatchNorm in a forward normalises with its k-th
        recorded statistics (its own forward, which would also update the running
        statistics, is not called)."""
        used = dict.fromkeys(self.norms, 0)
        own = {m: vars(m).pop("forward", None) for m in self.norms}
        for m in self.norms:
            m.forward = _Normalised(self, m, used)
        try:
            yield
        finally:
            for m, forward in own.items():
                del m.forward
                if forward is not None:
                    m.forward = forward

    def _normalise(self, module: nn.Module, used: dict, x: Tensor) -> Tensor:
        if self._recording:
            var, mean = torch.var_mean(x, [0, *range(2, x.dim())], correction=0)
            self.calls[module].append((mean, var))
        mean, var = self.calls[module][used[module]]
        used[module] += 1
        return F.batch_norm(x, mean, var, module.weight, module.bias, False, 0.0, module.eps)


class _Normalised:
    """A BatchNorm's forward within :meth:`BatchStatistics.normalising` (a callable object,
    not a closure: nothing of the module refers back to it once it is removed)."""

    __slots__ = ("statistics", "module", "used")

    def __init__(self, statistics: BatchStatistics, module: nn.Module, used: dict):
        self.statistics, self.module, self.used = statistics, module, used

    def __call__(self, x: Tensor) -> Tensor:
        return self.statistics._normalise(self.module, self.used, x)


def rerun(
    module: nn.Module,
    state: tuple[dict[str, Tensor], ...],
    args: tuple,
    kwargs: dict,
    statistics: BatchStatistics,
):
    """``module(*args, **kwargs)`` with the parameters and buffers of the dicts ``state``
    (``functional_call``), every other buffer a fresh copy, and its batch-statistics
    BatchNorms normalising by ``statistics``."""
    given = {name for d in state for name in d}
    copies = {name: b.clone() for name, b in module.named_buffers() if name not in given}
    with statistics.normalising():
        return functional_call(module, (*state, copies), args, kwargs, strict=False)
