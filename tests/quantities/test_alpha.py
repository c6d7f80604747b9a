"""Alpha against a brute-force reference: per-sample gradients by loop, the fit written out."""

import models
import numpy as np
import pytest
import torch
from torch import nn

from avionics import Cockpit, quantities, schedules

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "sgd_groups": lambda params: torch.optim.SGD(
        [{"params": params[:1], "lr": 0.1}, {"params": params[1:], "lr": 0.05}]
    ),
}


def reference_alpha(before: dict, after: dict) -> float:
    """Alpha by its definition, from per-sample losses and gradients at both points."""
    s = after["theta"] - before["theta"]
    tau = float(np.linalg.norm(s))
    u = s / tau
    proj0, proj1 = before["G"] @ u, after["G"] @ u
    y = np.array([before["losses"].mean(), after["losses"].mean(), proj0.mean(), proj1.mean()])
    var = np.array(
        [
            np.var(before["losses"], ddof=1),
            np.var(after["losses"], ddof=1),
            np.var(proj0, ddof=1),
            np.var(proj1, ddof=1),
        ]
    )
    var[var == 0] = 1e-10
    phi = np.array([[1, 0, 0], [1, tau, tau**2], [0, 1, 0], [0, 1, 2 * tau]], dtype=float)
    weights = np.diag(1 / var)
    w = np.linalg.solve(phi.T @ weights @ phi, phi.T @ weights @ y)
    if w[2] < 0:
        return -1.0
    x_star = -w[1] / (2 * w[2])
    return tau / x_star - 1


def snapshot(model, X, y, loss_fn) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    G = torch.cat([g.reshape(g.shape[0], -1) for g in models.per_sample_gradients(
        model, X, y, loss_fn)], 1)  # fmt: skip
    with torch.no_grad():
        losses = loss_fn(model(X), y)
    return {
        "G": G.numpy(),
        "losses": losses.numpy(),
        "theta": torch.cat([p.detach().reshape(-1) for p in params]).numpy().copy(),
    }


def train(model, X, y, loss_fn, opt, cockpit, steps, reduction="mean", reference=True):
    snapshots = []
    for step in range(steps):
        if reference:
            snapshots.append(snapshot(model, X, y, loss_fn))
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        loss = losses.mean() if reduction == "mean" else losses.sum()
        info = {"loss": loss, "individual_losses": losses, "batch_size": len(X), "optimizer": opt}
        with cockpit(step, info=info):
            loss.backward()
        opt.step()
    return snapshots


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("architecture", sorted(models.ARCHITECTURES))
def test_alpha_matches_brute_force(architecture, optimizer):
    model, X, y, loss_fn = models.ARCHITECTURES[architecture](n=4)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    cockpit = Cockpit(model, [quantities.Alpha()])
    snapshots = train(model, X, y, loss_fn, opt, cockpit, steps=4)
    output = cockpit.get_output()
    # the last start step has no end: stored nothing
    assert [s for s in output if "Alpha" in output[s]] == [0, 1, 2]
    for t in range(3):
        expected = reference_alpha(snapshots[t], snapshots[t + 1])
        assert output[t]["Alpha"] == pytest.approx(expected, rel=1e-7, abs=1e-9), t


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_alpha_sum_reduction_and_sparse_schedule(optimizer):
    model, X, y, loss_fn = models.cnn(n=3)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    cockpit = Cockpit(model, [quantities.Alpha(schedule=schedules.linear(2, offset=1))])
    snapshots = train(model, X, y, loss_fn, opt, cockpit, steps=5, reduction="sum")
    output = cockpit.get_output()
    assert [s for s in output if "Alpha" in output[s]] == [1, 3]
    for t in (1, 3):
        expected = reference_alpha(snapshots[t], snapshots[t + 1])
        assert output[t]["Alpha"] == pytest.approx(expected, rel=1e-7, abs=1e-9)


def quadratic_problem(n=6, d=5, seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(d, 1, bias=False).double()
    X, y = torch.randn(n, d).double(), torch.randn(n).double()

    def loss_fn(out, target):
        return 0.5 * (out.squeeze(1) - target) ** 2

    return model, X, y, loss_fn


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_alpha_on_an_exact_quadratic_is_the_closed_form(optimizer):
    model, X, y, loss_fn = quadratic_problem()
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    cockpit = Cockpit(model, [quantities.Alpha()])
    thetas = []
    for step in range(4):
        thetas.append(model.weight.detach().reshape(-1).clone())
        train_one(model, X, y, loss_fn, opt, cockpit, step)
    output = cockpit.get_output()
    for t in range(3):
        s = thetas[t + 1] - thetas[t]
        tau = s.norm()
        r = X @ thetas[t] - y  # residuals at the start
        a = X @ s / tau  # slope of each residual along the unit step
        # f(x) = mean_n 0.5 (r_n + a_n x)^2 = const + b x + c x^2
        b, c = (r * a).mean(), 0.5 * (a**2).mean()
        x_star = -b / (2 * c)
        assert output[t]["Alpha"] == pytest.approx(float(tau / x_star - 1), rel=1e-8)


def train_one(model, X, y, loss_fn, opt, cockpit, step, info_drop=()):
    opt.zero_grad()
    losses = loss_fn(model(X), y)
    info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(X),
            "optimizer": opt}  # fmt: skip
    for key in info_drop:
        info.pop(key)
    with cockpit(step, info=info):
        losses.mean().backward()
    opt.step()


@pytest.mark.parametrize("key", ["individual_losses", "batch_size", "optimizer"])
def test_missing_info_is_a_clear_error(key):
    model, X, y, loss_fn = models.mlp(n=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [quantities.Alpha()])
    with pytest.raises(KeyError, match=rf"Alpha reads info\['{key}'\]"):
        train_one(model, X, y, loss_fn, opt, cockpit, 0, info_drop=(key,))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_zero_update_warns_and_stores_minus_one(optimizer):
    model, X, y, loss_fn = models.mlp(n=4)
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(model.parameters(), lr=0)
    cockpit = Cockpit(model, [quantities.Alpha()])
    train_one(model, X, y, loss_fn, opt, cockpit, 0)
    with pytest.warns(UserWarning, match="length zero"):
        train_one(model, X, y, loss_fn, opt, cockpit, 1)
    assert cockpit.get_output()[0]["Alpha"] == -1.0


class OwnSGD:
    """A user's own optimizer: a step method, no torch.optim step hooks."""

    def __init__(self, params, lr):
        self.params, self.lr = list(params), lr

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p in self.params:
            p.sub_(self.lr * p.grad.sign())


def test_alpha_keeps_no_per_sample_gradients():
    """Between the steps Alpha holds nothing N x D: with a torch optimizer it projects when
    optimizer.step() returns and keeps the update only; with an optimizer without step hooks,
    theta_t and the start's engine inputs until the next step."""
    model, X, y, loss_fn = models.mlp(n=4)
    shapes = [p.shape for p in model.parameters()]
    for opt, at_step in [
        (torch.optim.Adam(model.parameters(), lr=0.01), True),
        (OwnSGD(model.parameters(), lr=0.01), False),
    ]:
        alpha = quantities.Alpha()
        cockpit = Cockpit(model, [alpha])
        train_one(model, X, y, loss_fn, opt, cockpit, 0)
        step, start = alpha.pending
        if at_step:  # the start's capture and theta_t are released already
            assert start.captured is None and start.params is None
            assert [u.shape for u in start.unit] == shapes and start.projections.shape == (4,)
        else:
            assert start.captured is not None and start.unit is None
            assert [p.shape for p in start.params] == shapes
        train_one(model, X, y, loss_fn, opt, cockpit, 1)
        assert 0 in cockpit.get_output() and "Alpha" in cockpit.get_output()[0]
        # the start of step 0 was released; step 1 is the new start
        assert alpha.pending[0] == 1 and alpha.pending[1].step == 1


def test_own_optimizer_matches_brute_force():
    model, X, y, loss_fn = models.cnn(n=4)
    opt = OwnSGD(model.parameters(), lr=0.01)
    cockpit = Cockpit(model, [quantities.Alpha()])
    snapshots = train(model, X, y, loss_fn, opt, cockpit, steps=3)
    output = cockpit.get_output()
    for t in range(2):
        expected = reference_alpha(snapshots[t], snapshots[t + 1])
        assert output[t]["Alpha"] == pytest.approx(expected, rel=1e-7, abs=1e-9), t


def test_parameters_changed_after_the_step_warn_and_switch_to_measuring_at_the_next_step():
    """Weight clipping after optimizer.step(): the update measured when the step returned is
    not theta_{t+1} - theta_t. That start stores nothing (warned); later ones are exact."""
    model, X, y, loss_fn = models.mlp(n=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    alpha = quantities.Alpha()
    cockpit = Cockpit(model, [alpha])
    snapshots = []
    for step in range(4):
        snapshots.append(snapshot(model, X, y, loss_fn))
        if step == 1:
            with pytest.warns(UserWarning, match="parameters changed between optimizer.step"):
                train_one(model, X, y, loss_fn, opt, cockpit, step)
        else:
            train_one(model, X, y, loss_fn, opt, cockpit, step)
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.3, 0.3)
    output = cockpit.get_output()
    assert [s for s in output if "Alpha" in output[s]] == [1, 2]
    assert alpha.pending[1].captured is not None  # keeps the capture now
    for t in (1, 2):
        expected = reference_alpha(snapshots[t], snapshots[t + 1])
        assert output[t]["Alpha"] == pytest.approx(expected, rel=1e-7, abs=1e-9), t


def wide_mlp(n=4, seed=0):
    """Linear layers wider than the batch: plain SGD keeps their unit step as factors."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 16), nn.Tanh())
    model.append(nn.Linear(16, 3))
    X, y = torch.randn(n, 12), torch.randint(0, 3, (n,))
    return model.double(), X.double(), y, models._classification_losses


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_plain_sgd_keeps_factors_and_matches_brute_force(reduction):
    from avionics.persample.rules.factored import FactoredDirection

    model, X, y, loss_fn = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alpha = quantities.Alpha()
    cockpit = Cockpit(model, [alpha, quantities.NormTest()])
    snapshots = []
    for step in range(4):
        snapshots.append(snapshot(model, X, y, loss_fn))
        opt.zero_grad(set_to_none=False)  # the gradients are overwritten in place
        losses = loss_fn(model(X), y)
        loss = losses.mean() if reduction == "mean" else losses.sum()
        info = {"loss": loss, "individual_losses": losses, "batch_size": len(X),
                "optimizer": opt}  # fmt: skip
        with cockpit(step, info=info):
            loss.backward()
        opt.step()
        kinds = [isinstance(u, FactoredDirection) for u in alpha.pending[1].unit]
        # the two wide weights as factors, the last weight and the biases dense
        assert kinds == [True, False, True, False, False, False]
        X.mul_(1.01)  # a data buffer refilled in place: the kept factors hold a copy
    output = cockpit.get_output()
    for t in range(3):
        expected = reference_alpha(snapshots[t], snapshots[t + 1])
        assert output[t]["Alpha"] == pytest.approx(expected, rel=1e-7, abs=1e-9), t
