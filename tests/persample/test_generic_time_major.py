"""A root parameter the generic rule takes (a matmul h @ W of time-major tokens [T, N, W],
which no closed form covers) against the loop over samples in float64, and its batch-first
twin. The rule re-runs the model on one sample at a time, so it needs the batch axis of each
output, which a time-major root does not share with its input (ids [T, N] -> logits [N, C]):
it was guessed from the sizes and crashed ("grad_output [3, 1] vs output [1, 3]") where C ==
N, also with ``batch_first`` given. Where T == N and nothing tells the batch axis, the engine
refuses, naming the parameters and the remedy, rather than give wrong numbers."""

import models
import pytest
import torch
from test_broadcast_time_major import sequence_body
from test_engine import assert_exact
from torch import nn

from avionics.persample.rules.generic import GenericRule

CLASSES = 3


class MatmulTokens(nn.Module):
    """Embedding, a root matrix applied by ``torch.matmul`` (no closed form: the generic
    rule), then ``body`` (an LSTM or a transformer layer, batch_first either way) and a head
    on the mean over time. ``flag``: the model's ``batch_first`` attribute (None: none)."""

    def __init__(self, body: str, batch_first: bool, flag=None, vocab=11, width=6):
        super().__init__()
        self.time_axis = 1 if batch_first else 0
        if flag is not None:
            self.batch_first = flag
        self.embed = nn.Embedding(vocab, width)
        self.W = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.body = sequence_body(body, width, batch_first)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, ids):
        h = self.body(torch.matmul(self.embed(ids), self.W))
        h = h[0] if isinstance(h, tuple) else h
        return self.head(h.mean(self.time_axis))


def _losses(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def _data(n, t, batch_first, seed):
    torch.manual_seed(seed)
    ids = torch.randint(0, 11, (n, t) if batch_first else (t, n))
    return ids, torch.randint(0, CLASSES, (n,))


# (N, T): N == the number of classes (the crash), N unlike any size, N == T
SIZES = [(3, 5), (4, 5), (4, 4), (3, 3)]


@pytest.mark.parametrize(("n", "t"), SIZES)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("body", ["lstm", "transformer"])
def test_a_root_matmul_of_tokens_is_exact_with_the_batch_axis_given(body, batch_first, n, t):
    torch.manual_seed(0)
    model = MatmulTokens(body, batch_first, flag=batch_first).double()
    assert_exact(model, *_data(n, t, batch_first, 1), _losses)


@pytest.mark.parametrize(
    ("batch_first", "n", "t"),
    [(False, n, t) for n, t in SIZES if n != t] + [(True, n, t) for n, t in SIZES if n == t],
)
@pytest.mark.parametrize("body", ["lstm", "transformer"])
def test_a_root_matmul_of_tokens_is_exact_without_a_batch_first_attribute(body, batch_first, n, t):
    """Time-major with T != N: the ids' one axis of size N is the batch's. Batch-first with
    T == N: every module agrees with the batch-first default, nothing to refuse."""
    torch.manual_seed(0)
    model = MatmulTokens(body, batch_first).double()
    assert_exact(model, *_data(n, t, batch_first, 1), _losses)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("body", ["lstm", "transformer"])
def test_time_major_tokens_with_n_equal_to_t_are_refused_until_the_batch_axis_is_given(body, n):
    """ids [N, N]: the root and the embedding would take the batch-first default, axis 0,
    while the body has the batch on axis 1. Refused, naming the parameters and the remedy;
    exact with it."""
    torch.manual_seed(0)
    model = MatmulTokens(body, False).double()
    ids, y = _data(n, n, False, 1)
    with pytest.raises(ValueError, match=r"'embed\.weight', 'W'.*`batch_first`"):
        models.captured_engine_step(model, ids, y, _losses)
    model.batch_first = False
    assert_exact(model, ids, y, _losses)


class TanhTokens(nn.Module):
    """Time-major tokens through a function (tanh, flipped in time) into an LSTM: no root
    parameter; with T == N the embedding's per-sample gradients were taken over time steps
    (wrong numbers that sum to the right gradient), then refused."""

    def __init__(self, vocab=11, width=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, ids):
        return self.head(self.lstm(self.embed(ids).tanh().flip(0))[0].mean(0))


def test_an_embedding_of_time_major_tokens_with_n_equal_to_t_is_exact_through_a_function():
    """tanh and flip(0) keep the LSTM's batch axis 1: the engine follows it back through the
    autograd graph to the embedding's output, without a ``batch_first`` attribute."""
    torch.manual_seed(0)
    model = TanhTokens().double()
    ids, y = _data(4, 4, False, 2)
    assert_exact(model, ids, y, _losses)


@pytest.mark.parametrize(("n", "t"), SIZES)
@pytest.mark.parametrize("batch_first", [False, True])
def test_the_generic_rule_gives_the_matrix_per_sample_gradients_of_the_loop(batch_first, n, t):
    """W's g_n from the generic rule (no closed form) equal the loop's, and sum to the
    batch gradient of the summed losses."""
    torch.manual_seed(3)
    model = MatmulTokens("lstm", batch_first, flag=batch_first).double()
    ids, y = _data(n, t, batch_first, 4)
    _, step, _, _ = models.captured_engine_step(model, ids, y, _losses)
    rule = step.rules[model]
    assert type(rule) is GenericRule, type(rule)
    (found,) = rule.materialize(0, n)
    (reference,) = models.per_sample_gradients(model, ids, y, _losses, [model.W])
    torch.testing.assert_close(found, reference, rtol=1e-10, atol=1e-12)
    model.zero_grad()
    _losses(model(ids), y).sum().backward()
    torch.testing.assert_close(found.sum(0), model.W.grad, rtol=1e-10, atol=1e-12)
