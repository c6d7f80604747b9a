"""LossOutliers: the samples whose loss is far above the batch's median, against a direct
count; named by the loss-spike finding at a spike step built with corrupted labels, none on
the clean steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from avionics import Cockpit
from avionics.diagnosis import diagnose
from avionics.quantities import Loss, LossOutliers
from avionics.quantities.loss import outliers, outliers_of
from avionics.records import Run


def _direct(losses: np.ndarray, k: float) -> list[int]:
    """Indices with l_n > median + k max(1.4826 MAD, 0.01 |median|), or not finite."""
    finite = losses[np.isfinite(losses)]
    median = np.median(finite)
    scale = max(1.4826 * np.median(np.abs(finite - median)), 0.01 * abs(median))
    with np.errstate(invalid="ignore"):
        return sorted(np.flatnonzero(~np.isfinite(losses) | (losses > median + k * scale)))


@pytest.mark.parametrize("n", [7, 32, 1000])
def test_the_outliers_match_a_direct_count(n):
    rng = np.random.default_rng(n)
    losses = rng.gamma(4.0, 0.1, n)
    losses[rng.choice(n, 3, replace=False)] = [9.0, 40.0, 6.0]
    for k in (1.0, 3.0, 6.0):
        found = outliers(torch.tensor(losses), k, max_listed=n)
        expected = _direct(losses, k)
        assert sorted(found["indices"]) == expected and found["count"] == len(expected)
        assert found["losses"] == sorted(losses[expected], reverse=True)
        assert found["median"] == pytest.approx(np.median(losses), rel=1e-12)


def test_non_finite_losses_come_first_and_the_list_is_bounded():
    losses = torch.tensor([1.0, 1.1, 0.9, math.nan, 50.0, 1.0, 30.0, math.inf, 1.05, 0.95])
    found = outliers(losses, 6.0, max_listed=3)
    assert found["indices"][:2] in ([3, 7], [7, 3]) and found["indices"][2] == 4
    assert found["count"] == 4 and found["median"] == pytest.approx(1.025)  # of the finite


def test_the_host_rule_equals_numpy_s_on_batches_with_every_kind_of_loss():
    """The plain-Python rule against the same rule in numpy (median, MAD, the order of
    -nan_to_num(l, nan=inf)): equal numbers, lists and order on random batches mixing
    finite losses, ties, nan, +-inf, +-the largest float and signed zeros."""
    rng = np.random.default_rng(0)
    specials = [math.nan, math.inf, -math.inf, 1.7976931348623157e308, -1.7976931348623157e308,
                0.0, -0.0, 0.5]  # fmt: skip
    for _ in range(400):
        n = int(rng.integers(0, 30))
        losses = np.where(rng.random(n) < 0.3, rng.choice(specials, n), rng.gamma(2.0, 1.0, n))
        k, listed = float(rng.choice([0.5, 3.0, 6.0])), int(rng.integers(1, 8))
        found = outliers_of(losses.tolist(), k, listed)
        finite = losses[np.isfinite(losses)]
        with np.errstate(all="ignore"):
            median = float(np.median(finite)) if len(finite) else math.nan
            mad = float(np.median(np.abs(finite - median))) if len(finite) else math.nan
            scale = max(1.4826 * mad, 0.01 * abs(median))
            indices = np.flatnonzero(~np.isfinite(losses) | (losses > median + k * scale))
        order = np.argsort(-np.nan_to_num(losses[indices], nan=math.inf), kind="stable")
        expected = indices[order[:listed]].tolist()
        assert found["indices"] == expected and found["count"] == len(indices)
        assert np.array_equal(found["losses"], losses[expected], equal_nan=True)
        assert np.array_equal([found["median"], found["scale"]], [median, scale], equal_nan=True)


def test_equal_losses_have_no_outliers():
    found = outliers(torch.full((16,), 0.25, dtype=torch.float64), 6.0, 5)
    assert found["indices"] == [] and found["count"] == 0
    assert found["scale"] == pytest.approx(0.0025)  # 1 % of the median


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"k": 0}, ValueError, r"LossOutliers\(k=0\): k must be a finite number > 0"),
        ({"k": "6"}, TypeError, r"LossOutliers\(k='6'\)"),
        ({"max_listed": 0}, ValueError, r"LossOutliers\(max_listed=0\): max_listed must be an"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        LossOutliers(**kwargs)


def test_the_per_sample_losses_are_required():
    model = nn.Linear(2, 2)
    cockpit = Cockpit(model, [LossOutliers()])
    loss = model(torch.randn(3, 2)).sum()
    with pytest.raises(KeyError, match="individual_losses"):
        with cockpit(0, {"loss": loss}):
            pass


CORRUPTED = [3, 17, 25]


def _train_with_corrupted_labels(spike_step=14, steps=18):
    """Two well-separated classes; at ``spike_step`` the labels of CORRUPTED are flipped."""
    torch.manual_seed(0)
    y = torch.arange(32) % 2
    X = 3.0 * (2 * y[:, None] - 1) * torch.ones(32, 4) + 0.3 * torch.randn(32, 4)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cockpit = Cockpit(model, [Loss(), LossOutliers()])
    for step in range(steps):
        labels = y.clone()
        if step == spike_step:
            labels[CORRUPTED] = 1 - labels[CORRUPTED]
        opt.zero_grad()
        losses = F.cross_entropy(model(X), labels, reduction="none")
        with cockpit(step, {"loss": losses.mean(), "individual_losses": losses}):
            losses.mean().backward()
        opt.step()
    return cockpit


def test_a_spike_from_corrupted_labels_names_those_samples():
    cockpit = _train_with_corrupted_labels()
    output = cockpit.get_output()
    assert sorted(output[14]["LossOutliers"]["indices"]) == CORRUPTED
    assert all(output[s]["LossOutliers"]["indices"] == [] for s in (12, 13, 15))
    (spike,) = [f for f in diagnose(cockpit) if f.check == "loss_spikes"]
    assert spike.step == 14
    named = "step 14: samples " + ", ".join(
        f"{i} ({output[14]['LossOutliers']['losses'][j]:.4g})"
        for j, i in enumerate(output[14]["LossOutliers"]["indices"])
    )
    assert named in spike.evidence
    assert "first the samples named" in spike.advice


def test_without_loss_outliers_the_advice_says_what_to_record():
    cockpit = _train_with_corrupted_labels()
    run = {s: {"Loss": v["Loss"]} for s, v in cockpit.get_output().items()}
    (spike,) = [f for f in diagnose(Run.from_output(run)) if f.check == "loss_spikes"]
    assert "Per-sample loss outliers" not in spike.evidence
    assert "record LossOutliers to name their outliers" in spike.advice
