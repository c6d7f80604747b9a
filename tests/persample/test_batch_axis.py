"""The batch axis is never decided by a size that happens to equal N.

A step whose number of samples N equals a sequence length, a width or 1: position ids
``arange(T)[None]`` ([1, T]) or ``arange(T)`` ([T]) shared by all samples must not be taken
as carrying the batch (BERT with N == T took the position ids' axis 1 as the batch: wrong
per-sample gradients, and a crash under gradient accumulation). Each case against the float64
loop over samples (``assert_exact``), and accumulated over micro-batches against one batch.
"""

import warnings

import models
import pytest
import real_models
import torch
from compare import assert_same_output
from test_accumulation import run
from test_engine import assert_exact
from torch import nn

from avionics import configuration


class PositionTable(nn.Module):
    """Token embedding plus a position table looked up by ``arange(T)[None]`` ("row") or
    ``arange(T)`` ("flat"), added to every sample."""

    def __init__(self, ids: str, vocab: int = 13, width: int = 5, context: int = 16):
        super().__init__()
        self.ids = ids
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)
        positions = positions[None] if self.ids == "row" else positions
        return self.head((self.tok(x) + self.pos(positions)).tanh().mean(1))


def position_table(ids: str):
    def build(n: int, t: int):
        torch.manual_seed(0)
        X, y = torch.randint(0, 13, (n, t)), torch.randint(0, 3, (n,))
        return PositionTable(ids).double(), X, y, models._classification_losses

    return build


def tiny_gpt(n: int, t: int):
    model, X, y, loss_fn = models.transformer(n=n)  # (T = 6, width 8)
    return model, X[:, :t], y[:, :t], loss_fn


def bert(n: int, t: int):
    model, X, y, loss_fn = real_models.bert_classifier(n=n, t=t, width=8)
    return model.eval(), X, y, loss_fn


MODELS = {
    "row": position_table("row"),
    "flat": position_table("flat"),
    "tiny_gpt": tiny_gpt,
    "bert": bert,
}
# (N, T): N == T, N == 1, N == the width 8 of tiny_gpt and bert, N == the width 5 of the
# position tables, and N unlike any size
SIZES = [(8, 8), (6, 6), (1, 6), (8, 5), (5, 6), (7, 6)]


@pytest.mark.parametrize("n, t", SIZES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_sample_gradients_when_n_equals_another_size(name, n, t):
    model, X, y, loss_fn = MODELS[name](n, t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a slow path's warning is no error here)
        assert_exact(model, X, y, loss_fn)


@pytest.mark.parametrize(
    "n, t, sizes",
    [(8, 8, None), (8, 4, None), (6, 6, [2, 4]), (2, 6, None), (12, 6, [6, 6])],
    ids=["N=T", "micro=T", "unequal", "micro=1", "micro=T,N=2T"],
)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_accumulated_steps_when_n_equals_another_size(name, n, t, sizes):
    """Two micro-batches (each micro-batch's size, or N, equal to T) give one batch's
    economy values: the merged call of a shared table is neither concatenated nor re-axed."""
    model, X, y, loss_fn = MODELS[name](n, t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = run(model, X, y, loss_fn, 1, lambda: configuration("economy"))
        two = run(model, X, y, loss_fn, 2, lambda: configuration("economy"), sizes=sizes)
    assert_same_output(two, one, rel=1e-9, abs=1e-12)
