"""A batch-first model that transposes its activations into a time-major module (an LSTM or
a transformer layer with batch_first=False) by ``x.transpose(0, 1)`` in its forward, against
the loop over samples in float64, also where N == T and N == the number of classes. With
N == T the token ids [N, N] do not tell the batch axis by size; the engine reads it off the
autograd graph (the transpose maps the body's batch axis 1 back to the embedding's axis 0).
It refused these models, asking for a ``batch_first`` attribute."""

import pytest
import torch
from test_broadcast_time_major import sequence_body
from test_engine import assert_exact
from torch import nn

CLASSES = 3


class TransposedTokens(nn.Module):
    """Embedding of ids [N, T], transposed to [T, N, W] for a time-major ``body``, a head on
    the mean over time (``tagger``: on every position, transposed back, summed over T)."""

    def __init__(self, body: str, tagger: bool = False, vocab=11, width=6):
        super().__init__()
        self.tagger = tagger
        self.embed = nn.Embedding(vocab, width)
        self.body = sequence_body(body, width, False)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, ids):
        h = self.body(self.embed(ids).transpose(0, 1))
        h = h[0] if isinstance(h, tuple) else h
        if self.tagger:
            return self.head(h.transpose(0, 1)).sum(1)
        return self.head(h.mean(0))


def _losses(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


# (N, T): N == T (the refusal), N == T == the number of classes, N unlike any size
@pytest.mark.parametrize(("n", "t"), [(4, 4), (3, 3), (4, 5)])
@pytest.mark.parametrize("tagger", [False, True])
@pytest.mark.parametrize("body", ["lstm", "transformer"])
def test_a_batch_first_model_transposed_into_a_time_major_body_is_exact(body, tagger, n, t):
    torch.manual_seed(0)
    model = TransposedTokens(body, tagger).double()
    torch.manual_seed(1)
    ids, y = torch.randint(0, 11, (n, t)), torch.randint(0, CLASSES, (n,))
    assert_exact(model, ids, y, _losses)
