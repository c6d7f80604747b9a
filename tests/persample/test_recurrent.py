"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) in the per-sample engine, against brute force.

Their per-sample gradients come from one batched re-run of the recurrence
(:mod:`avionics.persample.rules.recurrent`): padded and packed inputs, batch_first either way,
float64 and float32, several layers, both directions and a given initial state; a variant the
re-run does not reproduce takes the generic rule's per-sample loop and says so once.
"""

import warnings

import pytest
import real_models
import torch
from test_engine import assert_exact, ce, engine_statistics
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from avionics.persample.rules import RecurrentRule, recurrent, rule_for

VARIANTS = [
    (kind, packed, batch_first)
    for kind in ("lstm", "gru", "rnn")
    for packed in (False, True)
    for batch_first in (True, False)
]


@pytest.mark.parametrize(("kind", "packed", "batch_first"), VARIANTS)
def test_recurrent_classifiers_equal_brute_force_in_float64(kind, packed, batch_first):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no slow path, no coupled samples
        assert_exact(*real_models.recurrent(kind, packed, batch_first))


@pytest.mark.parametrize(("kind", "packed", "batch_first"), VARIANTS)
def test_recurrent_classifiers_in_float32(kind, packed, batch_first):
    model, X, y, loss_fn = real_models.recurrent(kind, packed, batch_first, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats, *_ = engine_statistics(model, X, y, loss_fn)
    reference_model = real_models.recurrent(kind, packed, batch_first)[0]
    from models import per_sample_gradients

    reference = per_sample_gradients(reference_model, X, y, loss_fn)
    for k, ref in enumerate(reference):
        expected = ref.reshape(ref.shape[0], -1).pow(2).sum(1)
        torch.testing.assert_close(stats.sq_norms[k].double(), expected, rtol=1e-4, atol=1e-7)


class Stacked(nn.Module):
    """Two layers, both directions, a given initial state, packed or padded."""

    def __init__(self, cell, packed: bool, **options):
        super().__init__()
        self.packed = packed
        self.rnn = cell(3, 4, num_layers=2, bidirectional=True, batch_first=True, **options)
        self.h0 = nn.Linear(3, 4 * 4)  # the initial state from the first input
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        n = x.shape[0]
        h0 = torch.tanh(self.h0(x[:, 0])).reshape(n, 4, 4).transpose(0, 1).contiguous()
        state = (h0, torch.zeros_like(h0)) if isinstance(self.rnn, nn.LSTM) else h0
        lengths = torch.tensor([5, 2, 4])
        inputs = pack_padded_sequence(x, lengths, True, False) if self.packed else x
        out, _ = self.rnn(inputs, state)
        if self.packed:
            out = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]
        return self.out(out.sum(1))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    ("cell", "options"),
    [
        (nn.LSTM, {}),
        (nn.LSTM, {"bias": False}),
        (nn.GRU, {}),
        (nn.GRU, {"bias": False}),
        (nn.RNN, {"nonlinearity": "relu"}),
        (nn.RNN, {}),
    ],
)
def test_stacked_bidirectional_layers_with_an_initial_state(cell, options, packed):
    torch.manual_seed(5)
    model = Stacked(cell, packed, **options).double()
    assert rule_for(model.rnn, ["weight_ih_l1_reverse"]) is RecurrentRule
    X = torch.randn(3, 5, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_exact(model, X, torch.randint(0, 2, (3,)), ce)


def test_a_variant_the_rerun_cannot_reproduce_takes_the_loop_and_says_so_once():
    """An LSTM with a projection (proj_size) goes to the generic rule, which vmap cannot batch
    over an LSTM: it warns once per engine, naming the parameters and the measured cost."""

    class Projected(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(3, 4, batch_first=True, proj_size=2)
            self.out = nn.Linear(2, 2)

        def forward(self, x):
            return self.out(self.rnn(x)[0].sum(1))

    torch.manual_seed(6)
    model = Projected().double()
    X, y = torch.randn(3, 5, 3, dtype=torch.float64), torch.randint(0, 2, (3,))
    assert rule_for(model.rnn, ["weight_hr_l0"]) is not RecurrentRule
    with pytest.warns(UserWarning) as caught:
        engine = assert_exact(model, X, y, ce)
    slow = [str(w.message) for w in caught if "one sample at a time" in str(w.message)]
    assert len(slow) == 1
    assert "Module 'rnn' (LSTM)" in slow[0] and "rnn.weight_hr_l0" in slow[0]
    assert " s for 3 samples" in slow[0] and "ms per sample" in slow[0]
    with warnings.catch_warnings():  # the same engine does not repeat it
        warnings.simplefilter("error")
        engine.warn_slow_path(model.rnn, ["weight_hr_l0"], "no batching rule", 0.1, 3)


def test_dropout_between_layers_in_train_mode_is_not_rerun():
    """The masks of nn.LSTM(dropout=p) in train mode cannot be drawn again: the recurrent
    rule is not used then (in eval mode it is)."""
    lstm = nn.LSTM(3, 4, num_layers=2, dropout=0.5)
    assert rule_for(lstm, ["weight_ih_l0"]) is not RecurrentRule
    assert rule_for(lstm.eval(), ["weight_ih_l0"]) is RecurrentRule


@pytest.mark.parametrize(("kind", "packed", "batch_first"), VARIANTS)
def test_sequences_of_one_step(kind, packed, batch_first):
    """T = 1: a GRU's per-step gradients c_t are stacked into [1, N, 3 H] (they were taken
    as [N, 3 H], and its re-run crashed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_exact(*real_models.recurrent(kind, packed, batch_first, n=4, t=1))


@pytest.mark.parametrize("n", [4, 5])
@pytest.mark.parametrize(
    ("kind", "packed"), [(k, p) for k in ("lstm", "gru", "rnn") for p in (0, 1)]
)
def test_time_major_tokens_with_as_many_steps_as_samples(kind, packed, n):
    """Time-major token ids [T, N] with T == N below a root without ``batch_first``: the
    embedding's (and the root's) batch axis is the one the batch_first=False RNN reads, axis
    1, found through the graph (through pack_padded_sequence for a PackedSequence), not the
    inherited axis 0 (which gave the embedding wrong per-sample gradients)."""
    model, X, y, loss_fn = real_models.recurrent(kind, bool(packed), False, n=n, t=n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_exact(model, X, y, loss_fn)


@pytest.mark.parametrize("packed", [False, True])
def test_an_lstm_re_run_step_by_step_as_off_the_cpu(packed, monkeypatch):
    """Off the CPU an LSTM's re-run takes the linearised backward (autograd's through the
    fused kernel on the CPU only): that path, forced here, is exact too."""
    monkeypatch.setattr(recurrent, "by_kernel", lambda module, x: False)
    torch.manual_seed(5)
    model = Stacked(nn.LSTM, packed).double()
    X = torch.randn(3, 5, 3, dtype=torch.float64)
    assert_exact(model, X, torch.randint(0, 2, (3,)), ce)
