"""What one engine keeps from a step for the next, against a float64 loop over samples.

The engine keeps the batch axes it found for a step's calls (a walk of the autograd graph
where N equals another size) while the calls' modules and shapes repeat. Each test runs
several steps on one engine, the batch or the model changed between them, and checks every
step's statistics against the brute force: a value kept from an earlier step fails them
(the first test fails where the key of the kept axes leaves out the calls' shapes; the
second guards what else a step could keep: a parameter's new value, BatchNorm's running
statistics after a switch to train mode and back).
"""

import models
import torch
from torch import nn
from torch.nn import functional as F

from avionics.persample import Request


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def assert_step_exact(engine, model, X, y):
    """One captured step of ``model`` on ``engine`` (None: a new one); its squared norms, sums
    of squares and projections onto the mean gradient and another direction against the loop
    over samples. The engine."""
    engine, step, mean_grad, params = models.captured_engine_step(model, X, y, ce, engine=engine)
    other = [torch.randn_like(p) for p in params]
    request = Request(sq_norms=True, sum_sq=True, directions=frozenset({"grad", "other"}))
    stats = step.statistics(request, {"grad": mean_grad, "other": other}, sample_mean="grad")
    reference = models.per_sample_gradients(model, X, y, ce, params)
    for k, ref in enumerate(reference):
        flat = ref.reshape(len(ref), -1)
        close = {"rtol": 1e-10, "atol": 1e-12}
        torch.testing.assert_close(stats.sq_norms[k], flat.pow(2).sum(1), **close)
        torch.testing.assert_close(stats.sum_sq[k], ref.pow(2).sum(0), **close)
        for name, v in (("grad", mean_grad[k]), ("other", other[k])):
            torch.testing.assert_close(stats.projections[name][k], flat @ v.reshape(-1), **close)
    return engine


class SometimesTimeMajor(nn.Module):
    """Features [N, T, F] through a Linear, batch first or (``time_major``) transposed to
    [T, N, F] before it (the Linear then has the batch on axis 1), a head on the mean over
    time."""

    def __init__(self, features=3, width=4, classes=3):
        super().__init__()
        self.time_major = False
        self.body = nn.Linear(features, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        if self.time_major:
            return self.head(torch.tanh(self.body(x.transpose(0, 1))).mean(0))
        return self.head(torch.tanh(self.body(x)).mean(1))


def test_batch_axes_are_found_again_when_the_layout_or_the_batch_size_changes():
    torch.manual_seed(0)
    model, engine = SometimesTimeMajor().double(), None
    # batch first, time-major with the same N and T (the same calls, other shapes), a smaller
    # last batch, N == T (the axes read off the graph), then batch first again
    for n, t, time_major in (
        (4, 5, False),
        (4, 5, True),
        (3, 5, True),
        (5, 5, True),
        (4, 5, False),
    ):
        model.time_major = time_major
        X, y = torch.randn(n, t, 3).double(), torch.randint(0, 3, (n,))
        engine = assert_step_exact(engine, model, X, y)


def test_steps_after_a_parameter_is_replaced_and_a_train_eval_switch_are_exact():
    """In train mode BatchNorm couples the samples (no per-sample gradient to compare): the
    train step between the eval steps is run, not checked; it moves the running statistics
    the next eval step normalises with."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
    model = model.double().eval()
    engine = None
    for change in ("none", "replace", "train", "eval"):
        if change == "replace":  # a new tensor behind the parameter, of another value
            model[0].weight.data = torch.randn(4, 3).double()
        model.train(change == "train")
        X, y = torch.randn(5, 3).double() + 1, torch.randint(0, 3, (5,))
        if change == "train":
            engine, *_ = models.captured_engine_step(model, X, y, ce, engine=engine)
        else:
            engine = assert_step_exact(engine, model, X, y)
