"""The GGN diagonal of nn.LSTM, nn.GRU and nn.RNN with a group of columns through one re-run
of the recurrence on copies of the batch, against the dense float64 J^T H J."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from avionics.persample.rules import recurrent
from avionics.persample.rules.base import COLUMN_GROUP, ColumnSums
from avionics.quantities import TICDiag
from tests import real_models
from tests.quantities.test_curvature_instruments import _params, _run, dense_ggn


class _Stacked(nn.Module):
    """Two layers, both directions, a given initial state, packed or padded, called twice
    (the calls' steps add up before the square), 5 classes (4 columns)."""

    def __init__(self, cell, packed: bool):
        super().__init__()
        self.packed = packed
        self.rnn = cell(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.out = nn.Linear(8, 5)

    def forward(self, x):
        h0 = torch.tanh(x[:, 0, :1]).expand(-1, 4)[None].expand(4, -1, -1).contiguous()
        state = (h0, torch.zeros_like(h0)) if isinstance(self.rnn, nn.LSTM) else h0
        lengths = (x.abs().sum(-1) != 0).sum(1)  # (each sample's own: zeros pad)
        inputs = pack_padded_sequence(x, lengths, True, False) if self.packed else x
        out, _ = self.rnn(inputs, state)
        if self.packed:
            out = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]
        again, _ = self.rnn(torch.tanh(x[:, :2]))
        return self.out(out.sum(1) + again.mean(1))


def _stacked(cell, packed):
    torch.manual_seed(7)
    X, y = torch.randn(3, 5, 3, dtype=torch.float64), torch.randint(0, 5, (3,))
    X[1, 2:], X[2, 4:] = 0, 0  # lengths 5, 2, 4

    def loss_fn(o, t):
        return nn.functional.cross_entropy(o, t, reduction="none")

    return _Stacked(cell, packed).double(), X, y, loss_fn


CASES = {
    "lstm_lm": lambda: real_models.lstm_lm(n=3, t=6, vocab=8),
    "packed_gru": lambda: real_models.packed_gru(n=3, t=4),
    "lstm_stacked_packed": lambda: _stacked(nn.LSTM, True),
    "gru_stacked": lambda: _stacked(nn.GRU, False),
    "rnn_stacked_packed": lambda: _stacked(nn.RNN, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_columns_give_the_exact_diagonal(case, monkeypatch):
    """Every parameter's diagonal equals the dense GGN's; the recurrent module's columns go
    through RecurrentColumnSums a group at a time (the LM's 35 columns: 16, 16 and 3), never
    through the default one-column path."""
    model, X, y, loss_fn = CASES[case]()
    seen = {"groups": [], "one_column": [], "diagonals": []}
    reduce = recurrent.RecurrentColumnSums._reduce

    def spy_reduce(self):
        seen["groups"].append(len(self.pending))
        return reduce(self)

    def spy_one_column(self, grad_outputs):
        seen["one_column"].append(self.module)
        return one_column(self, grad_outputs)

    from avionics.curvature.step import ggn_diagonal

    diagonal, one_column = ggn_diagonal.ggn_diagonal, ColumnSums.add

    def spy_diagonal(*args, **kwargs):
        found = diagonal(*args, **kwargs)
        seen["diagonals"].append([d.clone() for d in found])
        return found

    monkeypatch.setattr(recurrent.RecurrentColumnSums, "_reduce", spy_reduce)
    monkeypatch.setattr(ColumnSums, "add", spy_one_column)
    monkeypatch.setattr("avionics.quantities.curvature.ggn_diagonal", spy_diagonal)
    _run(model, X, y, loss_fn, [TICDiag(curvature="diag_ggn_exact")])
    rnn = next(m for m in model.modules() if isinstance(m, nn.RNNBase))
    assert rnn not in seen["one_column"] and seen["groups"]
    if case == "lstm_lm":
        assert seen["groups"][:2] == [COLUMN_GROUP] * 2  # (one re-run, reused)
    expected = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    sizes = [p.numel() for p in _params(model)]
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    (found,) = seen["diagonals"]
    for name, e, f in zip(names, expected.split(sizes), found, strict=True):
        torch.testing.assert_close(f.reshape(-1), e, rtol=1e-9, atol=1e-12, msg=name)


def test_copies_of_the_batch_give_each_column_its_own_gradients():
    """A re-run on K copies of the batch gives column j's factors in row j: the same as K
    re-runs of one copy."""
    torch.manual_seed(2)
    lstm = nn.LSTM(3, 4, num_layers=2, bidirectional=True).double()
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    from avionics.persample.capture import Capture

    capture = Capture(lstm, [lstm])
    capture.arm()
    out, (h, c) = lstm(x)
    capture.disarm()
    (call,) = capture.calls
    columns = [[torch.randn_like(out), torch.randn_like(h), torch.randn_like(c)] for _ in range(3)]
    together = recurrent.ReRun(lstm, call, 3, copies=3).factors(columns)
    for j, column in enumerate(columns):
        alone = recurrent.ReRun(lstm, call, 3).factors([column])
        for name, (x_j, d_j) in alone.items():
            torch.testing.assert_close(together[name][0], x_j, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(together[name][1][j], d_j[0], rtol=1e-12, atol=1e-14)


class _TimeMajorLM(nn.Module):
    """Time-major token ids [T, N] to logits [T, N, V] through a batch_first=False LSTM."""

    def __init__(self, vocab=7, width=4):
        super().__init__()
        self.embed, self.rnn = nn.Embedding(vocab, width), nn.LSTM(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.rnn(self.embed(tokens))[0])


def _time_major_lm():
    torch.manual_seed(3)
    X, y = torch.randint(0, 7, (5, 3)), torch.randint(0, 7, (3, 5))

    def loss_fn(out, labels):  # (out [T, N, V], labels [N, T])
        return nn.functional.cross_entropy(out.permute(1, 2, 0), labels, reduction="none").sum(1)

    return _TimeMajorLM().double(), X, y, loss_fn


TIME_MAJOR = {
    # (a batch-first output [N, 3] with N == 3: two axes of N entries)
    "lstm, 3 samples": lambda: real_models.recurrent("lstm", batch_first=False, n=3),
    "packed gru, 3 samples": lambda: real_models.recurrent("gru", True, False, n=3),
    # (refused before: the root call's batch axis, 1, is its input's)
    "gru, 4 samples": lambda: real_models.recurrent("gru", batch_first=False, n=4),
    "packed lstm, 4 samples": lambda: real_models.recurrent("lstm", True, False, n=4),
    "time-major output": _time_major_lm,
}


@pytest.mark.parametrize("case", list(TIME_MAJOR))
def test_the_ggn_diagonal_of_time_major_recurrent_models(case, monkeypatch):
    """Token ids [T, N] give the model's call batch axis 1 (its input's): the GGN diagonal
    takes its output's own batch axis, the one axis of N entries or, where several have N,
    the one sample 0's loss alone reads (it summed over the classes as samples when N was
    the number of classes, and refused N != classes)."""
    from avionics import Cockpit
    from avionics.curvature.step import ggn_diagonal

    model, X, y, loss_fn = TIME_MAJOR[case]()
    seen, diagonal = [], ggn_diagonal.ggn_diagonal

    def spy(*args, **kwargs):
        found = diagonal(*args, **kwargs)
        seen.append([d.clone() for d in found])
        return found

    monkeypatch.setattr("avionics.quantities.curvature.ggn_diagonal", spy)
    cockpit = Cockpit(model, quantities=[TICDiag(curvature="diag_ggn_exact")])
    losses = loss_fn(model(X), y)
    with cockpit(0, {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(y)}):
        losses.mean().backward(create_graph=cockpit.create_graph(0))
    expected = torch.diagonal(dense_ggn(model, X, y, loss_fn, axis=1))
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    sizes = [p.numel() for p in _params(model)]
    (found,) = seen
    for name, e, f in zip(names, expected.split(sizes), found, strict=True):
        torch.testing.assert_close(f.reshape(-1), e, rtol=1e-9, atol=1e-12, msg=name)
