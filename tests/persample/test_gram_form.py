"""The Gram form of ||G_n||^2 (one batched product per factor) against the brute force, in
float64: on its own on grouped factors and ranges of samples, and through the engine on the
test models (tied weights, custom modules, shared axes) where only norms are asked."""

import models
import pytest
import torch

from avionics.persample import Request
from avionics.persample.rules.bilinear import Bilinear, position_sums


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("samples", [(0, 5), (1, 4)])
def test_the_gram_form_is_the_squared_norm_of_the_materialised_gradient(groups, samples):
    torch.manual_seed(0)
    n, t, i, o = 5, 7, 4, 6
    x, delta = torch.randn(n, groups, t, i).double(), torch.randn(n, groups, t, o).double()
    layer = Bilinear(lambda a, b: x[a:b], delta, torch.Size([groups * o, i]))
    start, stop = samples
    got = layer._closed_forms(Request(sq_norms=True), {}, "", start, stop)["sq_norms"]
    g = torch.einsum("ngto,ngti->ngoi", delta, x)[start:stop]  # G_n per group, by definition
    torch.testing.assert_close(got, g.pow(2).sum((1, 2, 3)), rtol=1e-12, atol=1e-12)
    sums = position_sums(delta)
    torch.testing.assert_close(sums, delta.sum(2).reshape(n, groups * o), rtol=0, atol=0)


@pytest.mark.parametrize("architecture", sorted(models.ARCHITECTURES))
def test_norms_alone_on_the_test_models(architecture):
    model, X, y, loss_fn = models.ARCHITECTURES[architecture](n=3)
    _, step, mean_grad, params = models.captured_engine_step(model, X, y, loss_fn)
    reference = models.per_sample_gradients(model, X, y, loss_fn, params)
    for request, directions in (
        (Request(sq_norms=True), {}),
        (Request(sq_norms=True, directions=frozenset({"grad"})), {"grad": mean_grad}),
    ):
        stats = step.statistics(request, directions, sample_mean="grad" if directions else None)
        for k, ref in enumerate(reference):
            flat = ref.reshape(ref.shape[0], -1)
            torch.testing.assert_close(
                stats.sq_norms[k], flat.pow(2).sum(1), rtol=1e-10, atol=1e-12
            )


class TiedSequenceModel(torch.nn.Module):
    """Wide layers on sequences (T = 3: the Gram form is the cheaper plan), one of them
    called twice and its weight tied to a second module's."""

    def __init__(self):
        super().__init__()
        self.inner, self.tied = torch.nn.Linear(24, 24), torch.nn.Linear(24, 24)
        self.tied.weight = self.inner.weight
        self.head = torch.nn.Linear(24, 30)

    def forward(self, x):
        h = torch.tanh(self.inner(torch.tanh(self.inner(x))))
        return self.head(torch.tanh(self.tied(h))).mean(1)


def test_norms_by_the_gram_form_with_tied_weights_and_repeated_calls(monkeypatch):
    import avionics.persample.rules.bilinear as bilinear

    torch.manual_seed(1)
    model, X = TiedSequenceModel().double(), torch.randn(4, 3, 24).double()
    y = torch.randint(0, 30, (4,))

    def loss_fn(out, y):
        return torch.nn.functional.cross_entropy(out, y, reduction="none")

    grams, original = [], bilinear._position_gram
    monkeypatch.setattr(bilinear, "_position_gram", lambda a: grams.append(a) or original(a))
    _, step, _, params = models.captured_engine_step(model, X, y, loss_fn)
    stats = step.statistics(Request(sq_norms=True), {})
    assert grams  # (the Gram form ran)
    for k, ref in enumerate(models.per_sample_gradients(model, X, y, loss_fn, params)):
        flat = ref.reshape(ref.shape[0], -1)
        torch.testing.assert_close(stats.sq_norms[k], flat.pow(2).sum(1), rtol=1e-10, atol=1e-12)
