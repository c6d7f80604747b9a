"""A root parameter added to a time-major input (a position table ``pos[:T]`` of shape
[T_max, 1, W] added to token embeddings [T, N, W]) against the loop over samples in float64:
its per-sample gradients reduce over the batch axis the model's data has (axis 1), as for
its batch-first twin (axis 0), also where N equals T (where a guess by size would fail)."""

import models
import pytest
import torch
from test_engine import assert_exact
from torch import nn

from avionics import Cockpit, configuration
from avionics.persample.rules.broadcast import SharedParameterRule


def sequence_body(body: str, width: int, batch_first: bool) -> nn.Module:
    """An LSTM ("lstm") or a transformer encoder layer of ``width``, either batch axis."""
    if body == "lstm":
        return nn.LSTM(width, width, batch_first=batch_first)
    return nn.TransformerEncoderLayer(width, 2, 12, dropout=0.0, batch_first=batch_first)


class PositionalTokens(nn.Module):
    """Embedding plus a learned position table of the root, then ``body`` (an LSTM or a
    transformer layer, batch_first either way), a head on the mean over time."""

    def __init__(self, body: str, batch_first: bool, vocab=11, width=6, t_max=7, classes=3):
        super().__init__()
        self.time_axis = 1 if batch_first else 0
        self.embed = nn.Embedding(vocab, width)
        shape = (1, t_max, width) if batch_first else (t_max, 1, width)
        self.pos = nn.Parameter(torch.randn(shape))
        self.body = sequence_body(body, width, batch_first)
        self.head = nn.Linear(width, classes)

    def forward(self, ids):
        t = ids.shape[self.time_axis]
        pos = self.pos[:, :t] if self.time_axis == 1 else self.pos[:t]
        h = self.body(self.embed(ids) + pos)
        h = h[0] if isinstance(h, tuple) else h
        return self.head(h.mean(self.time_axis))


def _losses(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize(("n", "t"), [(3, 5), (4, 4)])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("body", ["lstm", "transformer"])
def test_a_position_table_added_to_time_major_tokens(body, batch_first, n, t):
    torch.manual_seed(0)
    model = PositionalTokens(body, batch_first).double()
    ids = torch.randint(0, 11, (n, t) if batch_first else (t, n))
    assert_exact(model, ids, torch.randint(0, 3, (n,)), _losses)


def _per_sample_gradients(model, ids, y, parameter):
    """The engine's per-sample gradients of ``parameter`` (a root parameter: its closed
    form, :class:`SharedParameterRule`) and the float64 loop's, [N, *shape] each."""
    engine, step, _, params = models.captured_engine_step(model, ids, y, _losses)
    rule = step.rules[model]
    assert isinstance(rule, SharedParameterRule), type(rule)
    (found,) = rule.materialize(0, len(y))
    (reference,) = models.per_sample_gradients(model, ids, y, _losses, [parameter])
    return found, reference


@pytest.mark.parametrize(("n", "t"), [(3, 5), (4, 4)])
@pytest.mark.parametrize("batch_first", [False, True])
def test_the_position_table_takes_its_closed_form_summing_to_the_gradient(batch_first, n, t):
    """The table's g_n (not the generic rule's) equal the loop's, and their sum is the
    batch gradient of the summed losses."""
    torch.manual_seed(1)
    model = PositionalTokens("lstm", batch_first).double()
    ids = torch.randint(0, 11, (n, t) if batch_first else (t, n))
    y = torch.randint(0, 3, (n,))
    found, reference = _per_sample_gradients(model, ids, y, model.pos)
    torch.testing.assert_close(found, reference, rtol=1e-10, atol=1e-12)
    model.zero_grad()
    _losses(model(ids), y).sum().backward()
    torch.testing.assert_close(found.sum(0), model.pos.grad, rtol=1e-10, atol=1e-12)
    # rows of the table past T are not used
    assert not found.narrow(1 + model.time_axis, t, 7 - t).any()


class ScaledTokens(nn.Module):
    """Time-major token embeddings [T, N, W] times a root scale [W], then an LSTM: the scale
    is broadcast along both T and N, so with T == N only the batch axis tells them apart."""

    def __init__(self, vocab=11, width=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.scale = nn.Parameter(torch.randn(width))
        self.lstm = nn.LSTM(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, ids):
        return self.head(self.lstm(self.embed(ids) * self.scale)[0].mean(0))


@pytest.mark.parametrize("n", [3, 4])
def test_a_scale_of_time_major_tokens_is_exact_without_a_batch_first_attribute(n):
    """The scale's per-sample map is taken in the backward, before the batch size is known:
    of its broadcast axes 0 and 1 it took the root's, 0, while the batch is on axis 1, and the
    engine refused. The product's output is the LSTM's input, whose batch axis its
    ``batch_first=False`` declares: read off the graph, axis 1, exact also where T == N,
    with or without the model's own ``batch_first``."""
    torch.manual_seed(2)
    model = ScaledTokens().double()
    ids, y = torch.randint(0, 11, (4, n)), torch.randint(0, 3, (n,))
    assert_exact(model, ids, y, _losses)
    model.batch_first = False
    assert_exact(model, ids, y, _losses)


@pytest.mark.parametrize("body", ["lstm", "transformer"])
def test_the_economy_preset_tracks_a_time_major_model_with_a_position_table(body):
    """The cockpit's run that crashed in ``sum_to_size`` (every instrument of the preset)."""
    torch.manual_seed(3)
    model = PositionalTokens(body, False).double()
    ids, y = torch.randint(0, 11, (5, 4)), torch.randint(0, 3, (4,))
    cockpit = Cockpit(model, configuration("economy"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = _losses(model(ids), y)
    loss = losses.mean()
    info = {"loss": loss, "individual_losses": losses, "batch_size": 4, "optimizer": opt}
    with cockpit(0, info):
        loss.backward()
    assert cockpit.get_output()
