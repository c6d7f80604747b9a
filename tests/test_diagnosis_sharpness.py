"""The edge-of-stability diagnosis by the optimizer's own rule: PreconditionedSharpness against
Adam's (2 + 2 beta1) / ((1 - beta1) lr) and RMSprop's (2 + 2 momentum) / lr, HessMaxEV against
SGD's 2 / lr (heavy-ball and Nesterov momentum): on constructed logs, and on an Adam run on a
quadratic built to exceed its threshold."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from avionics import Cockpit
from avionics.dashboard import plot
from avionics.diagnosis import diagnose, report
from avionics.quantities import Loss, PreconditionedSharpness
from avionics.records import Run


def _optimizer(name, **group):
    return {"optimizer": {"name": name, "param_groups": [group]}}


ADAM = _optimizer("Adam", lr=0.01, betas=[0.9, 0.999])


def _run(metadata, num_steps=40, **columns) -> Run:
    steps = {s: {name: f(s) for name, f in columns.items()} for s in range(num_steps)}
    return Run.from_output(steps, metadata=metadata)


def _edge(run):
    found = [f for f in diagnose(run) if f.check == "edge_of_stability"]
    return found[0] if found else None


def test_adam_at_and_beyond_its_threshold_names_the_rule():
    at = _edge(_run(ADAM, PreconditionedSharpness=lambda s: 4000.0))  # lr * 4000 = 40
    assert at.title == (
        "The run sits at the edge of stability (lr * PreconditionedSharpness near 38)"
    )
    assert "lr * preconditioned sharpness (largest eigenvalue of P^-1/2 H P^-1/2) = 40" in (
        at.evidence
    )
    assert "Adam with beta1 = 0.9 is stable on a quadratic only below (2 + 2 beta1) / (1 - " in (
        at.evidence
    )
    assert "Cohen et al. 2022" in at.evidence and "here 38." in at.evidence
    assert "below 38 / lambda_max = 0.0095" in at.advice
    beyond = _edge(_run(ADAM, PreconditionedSharpness=lambda s: 5000.0))
    assert beyond.title.startswith("The run is beyond the edge of stability")


@pytest.mark.parametrize(
    "metadata, sharpness, limit",
    [
        (_optimizer("AdamW", lr=0.01, betas=[0.5, 0.9]), 600.0, "6"),  # (2 + 1) / 0.5
        (_optimizer("RMSprop", lr=0.01, momentum=0.5), 300.0, "3"),
        (_optimizer("RMSprop", lr=0.01, momentum=0.0), 200.0, "2"),
    ],
)
def test_each_adaptive_optimizer_has_its_own_limit(metadata, sharpness, limit):
    finding = _edge(_run(metadata, PreconditionedSharpness=lambda s: sharpness))
    assert finding.title.endswith(f"(lr * PreconditionedSharpness near {limit})")
    assert f"here {limit}." in finding.evidence
    assert _edge(_run(metadata, PreconditionedSharpness=lambda s: sharpness / 2)) is None


def test_adam_ignores_hess_max_ev_and_sgd_ignores_the_preconditioned_sharpness():
    assert _edge(_run(ADAM, HessMaxEV=lambda s: 1e6)) is None
    sgd = _optimizer("SGD", lr=0.1, momentum=0.0)
    assert _edge(_run(sgd, PreconditionedSharpness=lambda s: 1e6)) is None


def test_sgd_rules_plain_heavy_ball_and_nesterov():
    plain = _edge(_run(_optimizer("SGD", lr=0.1, momentum=0.0), HessMaxEV=lambda s: 21.0))
    assert plain.title == "The run sits at the edge of stability (lr * HessMaxEV near 2)"
    assert "gradient descent with momentum 0 is stable on a quadratic only below 2 (Cohen" in (
        plain.evidence
    )
    heavy = _edge(_run(_optimizer("SGD", lr=0.1, momentum=0.9), HessMaxEV=lambda s: 38.0))
    assert "only below 2 + 2 beta" in heavy.evidence and "here 3.8." in heavy.evidence
    nesterov = _optimizer("SGD", lr=0.1, momentum=0.9, nesterov=True)  # 3.8 / 2.8 = 1.357
    found = _edge(_run(nesterov, HessMaxEV=lambda s: 13.6))
    assert "Nesterov momentum beta = 0.9" in found.evidence and "here 1.36." in found.evidence
    assert _edge(_run(nesterov, HessMaxEV=lambda s: 10.0)) is None


def test_the_finding_begins_where_the_latest_stretch_at_the_limit_began():
    """Adam's first steps (P = |g| + eps) are far above the limit: not where it began."""
    values = [1e5] * 3 + [1000.0] * 27 + [4000.0] * 10
    finding = _edge(_run(ADAM, PreconditionedSharpness=lambda s: values[s]))
    assert finding.step == 30 and "near or above the limit since step 30" in finding.evidence


def test_the_report_checks_the_edge_of_stability_from_either_quantity():
    text = report(_run(ADAM, PreconditionedSharpness=lambda s: 100.0))
    assert "edge of stability (needs" not in text


def _adam_on_a_quadratic(tmp_path, factor, steps=4):
    """Least squares with Adam whose eps dominates sqrt(v_hat) (the start is 1e-6 from the
    minimum): P ~ eps, so lr * PreconditionedSharpness ~ factor until the iterates grow."""
    torch.manual_seed(0)
    X = torch.randn(32, 4, dtype=torch.float64)
    w = torch.randn(1, 4, dtype=torch.float64)
    model = nn.Linear(4, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w + 1e-6 * torch.randn(1, 4, dtype=torch.float64))
    top = float(torch.linalg.eigvalsh(2 * X.T @ X / len(X))[-1])  # of the mean squared error
    lr = factor / top
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1.0)
    cockpit = Cockpit(model, [Loss(), PreconditionedSharpness(tol=1e-8)], log=tmp_path / "run")
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = (model(X) - X @ w.T).square().squeeze(1)
        with cockpit(step, {"loss": losses.mean(), "individual_losses": losses, "optimizer": opt}):
            losses.mean().backward(create_graph=cockpit.create_graph(step))
        opt.step()
    model.weight.grad = None
    cockpit.close()
    return lr, cockpit.get_output()


def test_an_adam_run_built_to_exceed_its_threshold(tmp_path):
    lr, output = _adam_on_a_quadratic(tmp_path, factor=45.0)
    # P = |g| + eps with |g| ~ 1e-6: lr * lambda_max(H) / eps = 45
    assert lr * output[0]["PreconditionedSharpness"] == pytest.approx(45.0, rel=1e-4)
    finding = _edge(tmp_path / "run")
    assert finding.title == (
        "The run is beyond the edge of stability (lr * PreconditionedSharpness near 38)"
    )
    assert "(2 + 2 beta1) / (1 - beta1)" in finding.evidence and finding.step == 0


def test_the_same_run_below_its_threshold_is_quiet(tmp_path):
    _adam_on_a_quadratic(tmp_path, factor=20.0)
    assert _edge(tmp_path / "run") is None


def test_the_dashboard_draws_it_beside_hess_max_ev():
    run = _run(ADAM, PreconditionedSharpness=lambda s: 100.0 + s, HessMaxEV=lambda s: 2.0)
    (panel,) = [ax for ax in plot(run).axes if ax.get_title() == "Largest eigenvalues"]
    labels = [t.get_text() for t in panel.get_legend().get_texts()]
    assert labels[0] == "HessMaxEV" and "preconditioned" in labels
    twin = [
        ax for ax in panel.figure.axes if ax is not panel and ax.bbox.bounds == panel.bbox.bounds
    ]
    assert twin and twin[0].collections[0].get_offsets()[-1].tolist() == [39.0, 139.0]
