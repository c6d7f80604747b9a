"""The primary dashboard of a "transformer" preset run: its instruments without a primary
panel of their own (UpdateRatio, ActivationHealth, GradientNoiseScale, PreconditionedSharpness)
take the places of the empty panels, so that only the curvature diagonals, which the preset
does not run, say "no data"; an economy run's dashboard is as it was."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn import functional as F

from avionics import Cockpit, configuration
from avionics.dashboard.figure import plot


def run(preset: str, optimizer=torch.optim.AdamW):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 3))
    opt = optimizer(model.parameters(), lr=1e-2)
    cockpit = Cockpit(model, configuration(preset))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            X, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            losses = F.cross_entropy(model(X), y, reduction="none")
            info = {"loss": losses.mean(), "individual_losses": losses, "optimizer": opt}
            with cockpit(step, info={**info, "batch_size": 8}):
                losses.mean().backward(create_graph=cockpit.create_graph(step))
            opt.step()
            opt.zero_grad()
    return cockpit


def empty_and_titles(fig):
    empty = [t.get_text() for ax in fig.axes for t in ax.texts if "no data" in t.get_text()]
    return empty, [ax.get_title() for ax in fig.axes]


def test_the_transformer_preset_fills_every_panel():
    """Its nine places hold its instruments: UpdateSize in the distance panel, GradNorm,
    GradHist1d, and the six without a primary panel; none empty, nothing left out."""
    fig = plot(run("transformer"))
    empty, titles = empty_and_titles(fig)
    assert empty == []
    for title in (
        "Update-to-weight ratio",
        "Activation RMS",
        "GradientNoiseScale",
        "PreconditionedSharpness",
        "Gradient norm",
        "Distance and update size",
        "Loss outliers",
    ):
        assert title in titles, titles
    assert any(t.startswith("Dead units") for t in titles), titles
    assert not [t for t in fig.texts if t.get_text().startswith("Not recorded")]


def test_an_economy_run_keeps_its_panels_and_names_those_it_lacks():
    fig = plot(run("economy", torch.optim.SGD))
    empty, titles = empty_and_titles(fig)
    assert "Update-to-weight ratio" not in titles and "Loss outliers" not in titles
    assert empty == [] and "Largest Hessian eigenvalue" not in titles
    (gradients, curvature) = [t.get_text() for t in fig.texts if "Not recorded" in t.get_text()]
    assert "Largest Hessian eigenvalue: HessMaxEV" in curvature
    assert "Gradient/parameter histogram: GradHist2d" in gradients
