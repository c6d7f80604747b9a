"""The generic rule's re-runs leave the model as the user's forward left it: a tracked step
changes buffers (BatchNorm's running statistics, a user's counter), parameters and the random
state exactly as the same step untracked. And they reproduce the user's forward: a BatchNorm
in train mode inside a module the generic rule re-runs normalises by the batch's statistics,
so that the per-sample gradients are each sample's share of the batch gradient (the engine's
definition for train-mode BatchNorm, docs: SPEC section 5), checked against a brute force that
gives every sample its own copy of the module's weight (float64)."""

from __future__ import annotations

import copy
import warnings

import models
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from avionics import Cockpit, configuration, quantities
from avionics.persample import Request
from avionics.persample.rules import generic


class Mixer(nn.Module):
    """tanh(norm(x)) mixed across channels by a weight used in this forward (no closed-form
    rule: the generic rule re-runs it); ``x`` is [N, C, *spatial]."""

    def __init__(self, channels: int, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self.mix = nn.Parameter(torch.linspace(-1, 1, channels * channels).reshape(channels, -1))

    def forward(self, x):
        return torch.einsum("nc...,cd->nd...", torch.tanh(self.norm(x)), self.mix)


class Counted(nn.Module):
    """A module with a buffer its forward updates in place (a call counter), and a weight the
    generic rule handles."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.weight = nn.Parameter(torch.linspace(-1, 1, width * width).reshape(width, -1))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(x) @ self.weight


def _model(norm: nn.Module, spatial: tuple[int, ...]) -> nn.Sequential:
    torch.manual_seed(0)
    c = norm.num_features
    size = c * int(torch.tensor(spatial).prod()) if spatial else c
    return nn.Sequential(
        nn.Linear(6, size),
        nn.Unflatten(1, (c, *spatial)) if spatial else nn.Identity(),
        Mixer(c, norm),
        nn.Flatten(),
        Counted(size),
        nn.Linear(size, 3),
    ).double()


CASES = [(nn.BatchNorm1d, ()), (nn.BatchNorm1d, (3,)), (nn.BatchNorm2d, (2, 2))]


def _data(n: int = 6):
    torch.manual_seed(1)
    return torch.randn(n, 6, dtype=torch.float64) * 2 + 1, torch.randint(0, 3, (n,))


def _loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _presets() -> dict[str, list]:
    """economy, business, and business with the exact GGN diagonal (the generic rule's column
    sums: business's "auto" takes the Hessian diagonal by probes on these small models)."""
    exact = [quantities.TICDiag(curvature="diag_ggn_exact")]
    exact.append(quantities.HessTrace(curvature="diag_ggn_exact"))
    return {
        "economy": configuration("economy"),
        "business": configuration("business"),
        "business, exact GGN": configuration("economy") + exact,
    }


def _train(model, X, y, cockpit=None, steps: int = 2):
    """``steps`` SGD steps, tracked by ``cockpit`` if given; the state dict and random state
    after them."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        losses = _loss_fn(model(X), y)
        loss = losses.mean()
        if cockpit is None:
            loss.backward()
        else:
            info = {"loss": loss, "individual_losses": losses, "batch_size": len(X)}
            with cockpit(step, info={**info, "optimizer": opt}):
                loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()
        torch.rand(())  # (a draw after each step: the random state is the user's)
    return model.state_dict(), torch.get_rng_state()


@pytest.mark.parametrize("preset", list(_presets()))
@pytest.mark.parametrize(("norm", "spatial"), CASES)
def test_a_tracked_step_changes_buffers_parameters_and_random_state_as_an_untracked_one(
    norm, spatial, preset
):
    model = _model(norm(3), spatial).train()
    X, y = _data()
    torch.manual_seed(5)
    expected, expected_rng = _train(copy.deepcopy(model), X, y)
    torch.manual_seed(5)
    cockpit = Cockpit(model, _presets()[preset])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (BatchNorm in train mode, the curvature's choice)
        found, found_rng = _train(model, X, y, cockpit)
    assert list(found) == list(expected)
    for name, t in expected.items():
        assert torch.equal(found[name], t), name
    assert torch.equal(found_rng, expected_rng)


def _shares(model: nn.Sequential, X, y) -> torch.Tensor:
    """N times d(mean loss) / d(mix_n) for every sample's own copy mix_n of the Mixer's weight,
    the Mixer's normalisation by F.batch_norm on the batch (its running statistics untouched):
    [N, C, C]."""
    mixer = model[2]
    norm = mixer.norm
    n = len(X)
    mix = mixer.mix.detach().expand(n, -1, -1).clone().requires_grad_()

    def own_copies(module, args, output):
        x_hat = F.batch_norm(args[0], None, None, norm.weight, norm.bias, True, 0.0, norm.eps)
        return torch.einsum("nc...,ncd->nd...", torch.tanh(x_hat), mix)

    handle = mixer.register_forward_hook(own_copies)
    try:
        loss = _loss_fn(model(X), y).mean()
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(loss, [mix])
    return n * grad


@pytest.mark.parametrize(("norm", "spatial"), CASES)
def test_per_sample_gradients_of_a_module_around_train_mode_batchnorm_are_the_shares(
    norm, spatial
):
    model = _model(norm(3), spatial).train()
    with torch.no_grad():
        model[2].norm.weight.uniform_(0.5, 2)
        model[2].norm.bias.uniform_(-1, 1)
    X, y = _data()
    reference = _shares(copy.deepcopy(model), X, y).flatten(1)
    with pytest.warns(UserWarning, match="share of the batch gradient"):
        engine, step, mean_grad, params = models.captured_engine_step(model, X, y, _loss_fn)
    other = [torch.randn_like(p) for p in params]
    request = Request(sq_norms=True, sum_sq=True, directions=frozenset({"grad", "other"}))
    stats = step.statistics(request, {"grad": mean_grad, "other": other}, sample_mean="grad")
    k = next(i for i, p in enumerate(params) if p is model[2].mix)
    assert not engine.rerouted(k)
    torch.testing.assert_close(stats.sq_norms[k], reference.square().sum(1), rtol=1e-10, atol=0)
    torch.testing.assert_close(
        stats.sum_sq[k].flatten(), reference.square().sum(0), rtol=1e-10, atol=0
    )
    for name, v in (("grad", mean_grad[k]), ("other", other[k])):
        torch.testing.assert_close(
            stats.projections[name][k], reference @ v.flatten(), rtol=1e-10, atol=1e-12
        )
    torch.testing.assert_close(reference.mean(0), mean_grad[k].flatten(), rtol=1e-10, atol=1e-12)


class Dropped(nn.Module):
    """Dropout, then a weight used in this forward: the generic rule's re-runs draw masks."""

    def __init__(self, width: int):
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.weight = nn.Parameter(torch.linspace(-1, 1, width * width).reshape(width, -1))

    def forward(self, x):
        return self.drop(x) @ self.weight


def test_the_generic_rules_draws_leave_the_random_state_as_an_untracked_step_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), Dropped(4), nn.Linear(4, 3)).double().train()
    X, y = _data()
    torch.manual_seed(5)
    expected, expected_rng = _train(copy.deepcopy(model), X, y)
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (masks drawn again: the gradients do not sum)
        found, found_rng = _train(model, X, y, Cockpit(model, configuration("economy")))
    for name, t in expected.items():
        assert torch.equal(found[name], t), name
    assert torch.equal(found_rng, expected_rng)


@pytest.mark.parametrize("alone", [False, True])
def test_the_one_sample_rerun_runs_once_a_step_whatever_the_columns(monkeypatch, alone):
    """The batch axes of the generic rule's outputs are found once per call and step, not
    again for each of the exact GGN diagonal's columns (the column sums copy the calls): in
    the preset, and with HessTrace ``alone``, which asks for no per-sample statistics (the
    preset's come first and find the axes on the calls the columns copy)."""
    curvature = _presets()["business, exact GGN"]
    curvature = curvature[-1:] if alone else curvature
    found = []

    def counted(call, one, n):
        found.append(call.module)
        return output_batch_axes(call, one, n)

    output_batch_axes = generic._output_batch_axes
    monkeypatch.setattr(generic, "_output_batch_axes", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), Mixer(4, nn.Identity()), nn.Linear(4, 3)).double()
    X, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the curvature's cost)
        _train(model, X, y, Cockpit(model, curvature), steps=3)
    assert found == [model[1]] * 3


class MixedFirst(Mixer):
    """The weight used before the BatchNorm: the statistics depend on it."""

    def forward(self, x):
        return torch.tanh(self.norm(torch.einsum("nc...,cd->nd...", x, self.mix)))


def test_a_weight_used_before_train_mode_batchnorm_inside_is_warned_of():
    """The re-runs hold the batch's statistics fixed, so the per-sample gradients of a weight
    the statistics depend on miss that dependence and do not sum to the batch gradient: the
    engine's check reroutes it and says so (forward_state's docstring)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3), MixedFirst(3, nn.BatchNorm1d(3)), nn.Linear(3, 3))
    model = model.double().train()
    X, y = _data()
    with pytest.warns(UserWarning, match="1.mix do not sum to the batch gradient"):
        engine, _, _, params = models.captured_engine_step(model, X, y, _loss_fn)
    assert [engine.rerouted(k) for k in range(len(params))] == [p is model[1].mix for p in params]
