"""benchmarks/recurrent_floor.py: the floor's per-sample gradients of nn.LSTM / GRU / RNN
parameters (from the gate gradients of the step's own backward) equal those of a loop over
samples, and its economy step equals the cockpit's (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from benchmarks.floor_capture import Capture
from benchmarks.floors import Direction, Floor, _uses, parameter_statistics
from tests.real_models import ALL_MODELS, recurrent
from tests.test_floors_layers import _reference


class TwoLayers(nn.Module):
    """A time-major 2-layer RNN given an initial state, on inputs [T, N, I]."""

    def __init__(self, kind):
        super().__init__()
        self.rnn = {"gru": nn.GRU, "rnn": nn.RNN}[kind](3, 4, num_layers=2)
        self.head = nn.Linear(4, 3)
        self.h0 = torch.randn(2, 1, 4, dtype=torch.float64)

    def forward(self, x):
        return self.head(self.rnn(x, self.h0.expand(-1, x.shape[1], -1).contiguous())[0][-1])


def _two_layers(kind: str):
    torch.manual_seed(0)
    model = TwoLayers(kind).double()
    X = torch.randn(4, 5, 3, dtype=torch.float64)
    return model, X, torch.randint(0, 3, (5,)), _ce


def _ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


# (built anew for each test: the floor replaces the recurrent module's forward)
MODELS = {
    "lstm_lm": lambda: ALL_MODELS["lstm_lm"](dtype=torch.float64, n=5),
    "packed_gru": lambda: ALL_MODELS["packed_gru"](dtype=torch.float64, n=5),
    "packed lstm": lambda: recurrent("lstm", packed=True, n=5),
    "packed time-major lstm": lambda: recurrent("lstm", packed=True, batch_first=False, n=5),
    "time-major lstm": lambda: recurrent("lstm", batch_first=False, n=5),
    "time-major 2-layer gru": lambda: _two_layers("gru"),
    "time-major 2-layer rnn": lambda: _two_layers("rnn"),
}


def _batch_axis(model) -> int:
    """The axis of X that holds the samples."""
    if isinstance(model, TwoLayers):
        return 1
    return 1 - model.time_axis if hasattr(model, "time_axis") else 0


@pytest.mark.parametrize("name", list(MODELS))
def test_the_floor_gives_the_per_sample_norms_and_projections_of_a_loop(name):
    model, X, y, loss_fn = MODELS[name]()
    reference = copy.deepcopy(model)
    capture = Capture(model)
    losses = loss_fn(model(X), y)
    losses.mean().backward()
    uses = _uses(capture.calls)
    axis = _batch_axis(model)
    n = X.shape[axis]
    rnn = next(m for m in reference.modules() if isinstance(m, nn.RNNBase))
    names = [name for name, _ in rnn.named_parameters()]
    params = dict(model.named_parameters())
    per_sample = []  # [N] of {name: b_n = the gradient of loss_n / N}
    for i in range(n):
        x = X.narrow(axis, i, 1)
        grads = torch.autograd.grad(loss_fn(reference(x), y[i : i + 1]).sum() / n,
                                    list(rnn.parameters()))  # fmt: skip
        per_sample.append(dict(zip(names, grads, strict=True)))
    prefix = next(k for k, m in model.named_modules() if isinstance(m, nn.RNNBase))
    assert len(names) >= 4
    for short in names:
        p = params[f"{prefix}.{short}"]
        sq, (projection,) = parameter_statistics(p, uses[p], True, [Direction(p.grad)])
        expected = torch.stack([g[short].square().sum() for g in per_sample])
        torch.testing.assert_close(sq, expected, rtol=1e-10, atol=1e-14)
        expected = torch.stack([(g[short] * p.grad).sum() for g in per_sample])
        torch.testing.assert_close(projection, expected, rtol=1e-10, atol=1e-14)
        assert expected.abs().max() > 0
        # (the recurrence's own output and gradients unchanged by the floor's forward)
        torch.testing.assert_close(p.grad, sum(g[short] for g in per_sample), rtol=1e-10,
                                   atol=1e-14)  # fmt: skip


@pytest.mark.parametrize("name", ["lstm_lm", "packed_gru", "packed lstm"])
def test_the_economy_floor_of_recurrent_models_equals_avionics(name):
    """Two steps (the second projects onto the first's mean gradient): the floor's gradient
    tests and histogram counts equal the cockpit's economy preset (batch-first models: the
    floor's Embedding and Linear kernels take the samples on the first axis)."""
    from avionics import configuration
    from benchmarks.tools import Avionics

    model, X, y, loss_fn = MODELS[name]()
    floor = Floor(copy.deepcopy(model), loss_fn, "sgd", "economy")
    ours = Avionics(copy.deepcopy(model), loss_fn, "sgd", configuration("economy"))
    for k in range(2):
        floor.step(k, X, y)
        ours.step(k, X, y)
        expected = ours.cockpit.get_output()[k]
        for test in ("NormTest", "InnerTest", "OrthoTest"):
            assert floor.values[k][test] == pytest.approx(expected[test], rel=1e-10)
        counted = floor.values[k]["GradHist1d"]
        assert counted == [float(c) for c in expected["GradHist1d"]["hist"]]
        assert sum(counted) == len(y) * sum(p.numel() for p in model.parameters())


def test_the_floor_refuses_a_bidirectional_layer():
    model, *_ = recurrent("lstm", n=3)
    model.rnn = nn.LSTM(5, 6, bidirectional=True, batch_first=True)
    with pytest.raises(ValueError, match="unidirectional"):
        Floor(model, _ce, "sgd", "economy")


class TimeMajorTokens(nn.Module):
    """Time-major ids [T, N]: an embedding, a LayerNorm and a Linear on [T, N, W] (T shared
    by a sample), the mean over time, a head on [N, W]."""

    def __init__(self, vocab=9, width=5):
        super().__init__()
        self.embed, self.norm = nn.Embedding(vocab, width), nn.LayerNorm(width)
        self.mix, self.head = nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.norm(self.embed(ids)))).mean(0))


def _time_major_tokens(t: int, n: int):
    torch.manual_seed(0)
    model = TimeMajorTokens().double()
    return model, torch.randint(0, 9, (t, n)), torch.randint(0, 3, (n,)), _ce


TIME_MAJOR = {
    "time-major lstm": lambda: recurrent("lstm", batch_first=False, n=5),
    "packed time-major lstm": lambda: recurrent("lstm", packed=True, batch_first=False, n=5),
    "time-major tokens, N != T": lambda: _time_major_tokens(4, 6),
    "time-major tokens, N == T": lambda: _time_major_tokens(4, 4),
}


@pytest.mark.parametrize("name", list(TIME_MAJOR))
def test_the_economy_floor_of_time_major_models_equals_avionics(name):
    """The floor of ``batch_axis=1`` (ids [T, N]): its Embedding, LayerNorm and Linear
    kernels read the samples on axis 1 of [T, N, .], the head's on axis 0 of [N, W]; two
    steps' gradient tests and histogram counts equal the cockpit's economy preset, and the
    first step's tests those of the float64 loop over samples."""
    from avionics import Cockpit, configuration

    model, X, y, loss_fn = TIME_MAJOR[name]()
    loop = _reference(copy.deepcopy(model), X, y, loss_fn)  # (NormTest, InnerTest of step 0)
    floor = Floor(copy.deepcopy(model), loss_fn, "sgd", "economy", batch_axis=1)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=floor.opt.param_groups[0]["lr"])
    cockpit = Cockpit(reference, configuration("economy"))
    for k in range(2):
        floor.step(k, X, y)
        opt.zero_grad()
        losses = loss_fn(reference(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(y)}
        with cockpit(k, {**info, "optimizer": opt}):
            losses.mean().backward()
        opt.step()
        expected = cockpit.get_output()[k]
        for test in ("NormTest", "InnerTest", "OrthoTest"):
            assert floor.values[k][test] == pytest.approx(expected[test], rel=1e-10)
        counted = floor.values[k]["GradHist1d"]
        assert counted == [float(c) for c in expected["GradHist1d"]["hist"]]
        assert sum(counted) == len(y) * sum(p.numel() for p in model.parameters())
    assert (floor.values[0]["NormTest"], floor.values[0]["InnerTest"]) == pytest.approx(
        loop, rel=1e-10
    )
