"""What the engine looks up once and reuses across steps, against brute force in float64.

The rule of a module class is looked up once per (class, forward, parameter names); an
Embedding's materialised per-sample gradients (what the histograms visit) come straight from
its positions, without the distinct-rows pass of its closed forms. Each is checked against a
loop over samples, and across a change of the batch's shape between steps.
"""

import models
import torch
from torch import nn
from torch.nn import functional as F

from avionics.persample import Request
from avionics.persample.rules import GenericRule, LinearRule, rule_for


def seq_ce(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).sum(1)


class Tokens(nn.Module):
    """A token table with a padding row, a position table looked up without the batch axis
    (shared by all samples) and a head."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(6, 3, padding_idx=0)
        self.pos = nn.Embedding(8, 3)
        self.out = nn.Linear(3, 6)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1])
        return self.out(torch.tanh(self.tok(idx) + self.pos(positions)))


def visited_gradients(model, X, y):
    """The engine's materialised g_n as the visitors see them, and the brute force's."""
    engine, step, mean_grad, params = models.captured_engine_step(model, X, y, seq_ce)
    seen: dict[int, list] = {}
    request = Request(sq_norms=True, visitors=(lambda k, c: seen.setdefault(k, []).append(c),))
    stats = step.statistics(request, {})
    visited = [torch.cat([c if isinstance(c, torch.Tensor) else c.materialize() for c in seen[k]])
               for k in range(len(params))]  # fmt: skip
    return visited, stats, models.per_sample_gradients(model, X, y, seq_ce, params)


def test_embedding_materialised_gradients_and_norms_against_a_loop_across_shapes():
    torch.manual_seed(0)
    model = Tokens().double()
    # repeated tokens within a sample (summed rows), padding (zero rows); then other shapes
    for n, t in ((4, 5), (2, 7), (5, 3)):
        X = torch.randint(0, 6, (n, t))
        X[:, 0], X[0, 1] = 2, 2
        X[-1, -1] = 0
        visited, stats, reference = visited_gradients(model, X, torch.randint(0, 6, (n, t)))
        for k, ref in enumerate(reference):
            assert visited[k].shape == ref.shape
            torch.testing.assert_close(visited[k], ref, rtol=1e-10, atol=1e-12)
            flat = ref.reshape(n, -1)
            torch.testing.assert_close(stats.sq_norms[k], flat.pow(2).sum(1), rtol=1e-10,
                                       atol=1e-12)  # fmt: skip
        assert visited[0][:, 0].abs().max() == 0  # the padding row gets no gradient


def test_rule_lookup_follows_a_class_whose_forward_is_replaced():
    class Scaled(nn.Linear):
        pass

    layer = Scaled(2, 2)
    assert rule_for(layer, ["weight", "bias"]) is LinearRule
    original = Scaled.forward
    try:
        Scaled.forward = lambda self, x: 2 * original(self, x)  # no longer Linear's forward
        assert rule_for(layer, ["weight", "bias"]) is GenericRule
    finally:
        Scaled.forward = original
    assert rule_for(layer, ["weight", "bias"]) is LinearRule
    assert rule_for(layer, ["weight", "other"]) is GenericRule


def test_visitors_of_a_new_request_are_called_with_the_engine_index_not_the_last_ones():
    torch.manual_seed(1)
    model = Tokens().double()
    engine, step, _, params = models.captured_engine_step(
        model, torch.randint(0, 6, (3, 4)), torch.randint(0, 6, (3, 4)), seq_ce
    )
    first: dict[int, list] = {}
    request = Request(visitors=(lambda k, c: first.setdefault(k, []).append(c),))
    for _ in range(2):  # the same request twice: its indexed copy reused
        first.clear()
        step.statistics(request, {})
        assert sorted(first) == list(range(len(params)))
        for k, p in enumerate(params):
            assert tuple(first[k][0].shape[1:]) == tuple(p.shape)
    first.clear()
    second: dict[int, int] = {}
    step.statistics(Request(visitors=(lambda k, c: second.setdefault(k, len(c)),)), {})
    assert second == {k: 3 for k in range(len(params))}
    assert not first  # the previous request's visitor is not called
    assert len(engine.indexed_requests) <= 4
