"""The per-layer diagnosis: update-to-weight ratios out of range, dead and saturated units. It
fires on trained runs built to show each condition (a ReLU layer killed by its bias, Adam with
an exploding learning rate) and on constructed runs at the step the condition began, and
stays quiet on a healthy run."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from avionics import Cockpit
from avionics.diagnosis import diagnose, report
from avionics.quantities import ActivationHealth, UpdateRatio
from avionics.records import Run

WEIGHTS = {"parameters": {"0.weight": [4, 3], "0.bias": [4], "1.weight": [2, 4]}}


def trained(lr: float, dead: bool = False, steps: int = 12):
    """A small ReLU/Tanh MLP trained with Adam at ``lr`` under UpdateRatio and
    ActivationHealth; ``dead`` kills the first ReLU layer with a large negative bias."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    )
    if dead:
        with torch.no_grad():
            model[0].bias.fill_(-100.0)
    X, y = torch.randn(64, 10), torch.randint(0, 3, (64,))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    cockpit = Cockpit(model, [UpdateRatio(), ActivationHealth()])
    for step in range(steps):
        optimizer.zero_grad()
        losses = F.cross_entropy(model(X), y, reduction="none")
        info = {"loss": losses.mean(), "individual_losses": losses, "optimizer": optimizer}
        with cockpit(step, info=info):
            losses.mean().backward()
        optimizer.step()
    cockpit.close()
    return cockpit


def layer_checks(source) -> list[str]:
    layered = ("update_ratio_too_large", "update_ratio_too_small", "dead_units")
    return [f.check for f in diagnose(source) if f.check in (*layered, "saturated_units")]


def finding(source, check):
    (found,) = [f for f in diagnose(source) if f.check == check]
    assert re.search(r"\d", found.evidence), "a finding must state its numbers"
    return found


def test_a_healthy_run_is_quiet():
    cockpit = trained(lr=3e-4)
    output = cockpit.get_output()
    ratios = [v["UpdateRatio"]["global"] for v in output.values() if "UpdateRatio" in v]
    assert len(ratios) == 11 and all(1e-4 < r < 1e-2 for r in ratios)  # a healthy run
    assert layer_checks(cockpit) == []
    assert "update-to-weight ratio" not in report(cockpit).split("Not checked")[-1]


def test_an_exploding_learning_rate_is_an_update_ratio_too_large():
    found = finding(trained(lr=0.5), "update_ratio_too_large")
    assert "0.weight" in found.evidence and "2.weight" in found.evidence
    assert "0.bias" not in found.evidence  # the heuristic judges weights
    assert "0.0001 to 0.01 per step" in found.evidence and "CS231n" in found.evidence
    assert found.step == 0


def test_a_layer_killed_by_its_bias_is_dead_from_the_first_step():
    found = finding(trained(lr=3e-4, dead=True), "dead_units")
    assert "'1' from step 0 (median 100%" in found.evidence
    assert "'3'" not in found.evidence  # the tanh after it is saturated by nothing, not dead


@pytest.mark.parametrize("steps, died", [(30, 13), (200, 40)])
def test_dead_units_are_found_from_the_step_they_died(steps, died):
    """Also when they died before the latest 50 tracked steps that flag them."""

    def health(step):
        return {"1": {"dead": 0.0 if step < died else 0.9, "mean": 0.1, "rms": 0.3}}

    run = Run.from_output({s: {"ActivationHealth": health(s)} for s in range(steps)})
    found = finding(run, "dead_units")
    assert found.step == died
    since = f"median 90% over the {steps - died} tracked steps since"
    assert f"'1' from step {died} ({since})" in found.evidence


@pytest.mark.parametrize("recovered", [100, 150])
def test_units_that_died_and_recovered_are_not_a_finding(recovered):
    def health(step):
        return {"1": {"dead": 0.9 if step < recovered else 0.1, "mean": 0.1, "rms": 0.3}}

    run = Run.from_output({s: {"ActivationHealth": health(s)} for s in range(160)})
    assert layer_checks(run) == []


def test_saturation_is_found_and_a_passing_episode_is_not():
    def health(step):
        tanh = 0.95 if step >= 5 else 0.1
        passing = 0.9 if 10 <= step < 14 else 0.0  # saturated for 4 of the 30 steps
        return {
            "3": {"dead": 0.0, "saturated": tanh, "mean": 0.0, "rms": 0.9},
            "5": {"dead": 0.0, "saturated": passing, "mean": 0.0, "rms": 0.5},
        }

    run = Run.from_output({s: {"ActivationHealth": health(s)} for s in range(30)})
    found = finding(run, "saturated_units")
    assert found.step == 5 and "'3' from step 5" in found.evidence
    assert "'5'" not in found.evidence


def test_update_ratios_below_the_range_name_the_weights_and_their_medians():
    def ratios(step):
        return {"global": 1e-5, "per_parameter": [2e-6, 5e-2, 1e-3 if step % 2 else 1e-6]}

    run = Run.from_output({s: {"UpdateRatio": ratios(s)} for s in range(20)}, WEIGHTS)
    found = finding(run, "update_ratio_too_small")
    assert "0.weight (median 2e-06)" in found.evidence
    assert "1.weight" not in found.evidence  # below the range at half of the steps only
    assert "tracked steps 0-19" in found.evidence
    assert layer_checks(run) == ["update_ratio_too_small"]  # 0.bias is not judged


def test_too_few_steps_are_not_judged():
    short = {s: {"UpdateRatio": {"global": 1.0, "per_parameter": [1.0] * 3}} for s in range(4)}
    assert layer_checks(Run.from_output(short, WEIGHTS)) == []
