"""The gradient check on one process reads ``p.grad`` where every tracked ``p.grad`` was None
as the block began (no parameter hooks), and hooks the parameters otherwise: both give the
same routing and the same per-sample values, against the brute-force float64 loop."""

import copy

import torch
from torch import nn
from torch.nn import functional as F

import avionics.cockpit
from avionics import Cockpit, quantities
from avionics.step import batch


class Tied(nn.Module):
    """An embedding whose weight is also used outside nn.Embedding (the logits): the check
    must see the mismatch and route it through the root's generic rule."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, idx):
        return F.linear(torch.tanh(self.mix(self.emb(idx))), self.emb.weight)


def _losses(model, X, y):
    return F.cross_entropy(model(X).transpose(1, 2), y, reduction="none").mean(1)


def _norm_test(model, X, y, stale: bool):
    """NormTest at step 0, and whether emb.weight was rerouted; ``stale``: p.grad holds an
    earlier backward's gradient as the block begins (then the parameters are hooked)."""
    cockpit = Cockpit(model, [quantities.NormTest()], first_step=0)
    losses = _losses(model, X, y)
    if stale:
        _losses(model, X, y).mean().backward(retain_graph=False)
    with cockpit(0, {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(X)}):
        losses.mean().backward()
    rerouted = [cockpit._engine._param_name(k) for k in sorted(cockpit._engine._from_root)]
    return cockpit.get_output()[0]["NormTest"], rerouted


def _brute_norm_test(model, X, y) -> float:
    """NormTest of a mean loss, sqrt(sum_n ||g_n - g||^2 / (N (N - 1) ||g||^2)), from a
    loop over the samples."""
    params = list(model.parameters())
    rows = []
    for n in range(len(X)):
        loss = _losses(model, X[n : n + 1], y[n : n + 1]).sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    g_n = torch.stack(rows)
    g = g_n.mean(0)
    n = len(X)
    return float((((g_n - g) ** 2).sum() / (n * (n - 1) * g.square().sum())).sqrt())


def test_fresh_and_hooked_gradients_check_alike(monkeypatch):
    torch.manual_seed(0)
    model = Tied().double()
    X, y = torch.randint(0, 7, (4, 5)), torch.randint(0, 7, (4, 5))
    hooked_calls = []
    original = batch.record_gradients

    def spy(*args, **kwargs):
        hooked_calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(batch, "record_gradients", spy)
    fresh, rerouted = _norm_test(copy.deepcopy(model), X, y, stale=False)
    assert hooked_calls == []  # nothing hooked: p.grad was None as the block began
    assert rerouted == ["emb.weight"]
    torch.testing.assert_close(fresh, _brute_norm_test(model, X, y), rtol=1e-9, atol=0)
    # with a stale p.grad the parameters are hooked, and the check sees the same mismatch
    _, rerouted = _norm_test(copy.deepcopy(model), X, y, stale=True)
    assert hooked_calls == [1] and rerouted == ["emb.weight"]
    assert avionics.cockpit.record_fresh_gradients is batch.record_fresh_gradients
