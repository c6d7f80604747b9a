"""The per-sample engine's statistics against brute-force per-sample gradients.

Covers every closed-form rule, the generic rule, the loop fallback, tied weights, modules
called several times, parameters used directly in a parent's forward and in-place layers.
"""

import models
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from avionics.persample import Request


def engine_statistics(model, X, y, loss_fn, reduction="mean"):
    """Run one captured forward/backward and return (statistics, brute-force g_n, grads)."""
    engine, step, mean_grad, params = models.captured_engine_step(model, X, y, loss_fn, reduction)
    request = Request(sq_norms=True, sum_sq=True, directions=frozenset({"grad", "other"}))
    other = [torch.randn_like(p) for p in params]
    stats = step.statistics(request, {"grad": mean_grad, "other": other}, sample_mean="grad")
    # projections alone: tied weights sum the closed forms of their contributions
    only = Request(directions=frozenset({"grad", "other"}))
    stats.only = step.statistics(only, {"grad": mean_grad, "other": other}, sample_mean="grad")
    # one direction (Alpha's requests): a layer may project instead of materialising G_n
    one = Request(directions=frozenset({"other"}))
    stats.one = step.statistics(one, {"other": other})
    reference = models.per_sample_gradients(model, X, y, loss_fn, params)
    return stats, reference, mean_grad, other, engine


def assert_exact(model, X, y, loss_fn, reduction="mean"):
    stats, reference, mean_grad, other, engine = engine_statistics(model, X, y, loss_fn, reduction)
    for k, ref in enumerate(reference):
        flat = ref.reshape(ref.shape[0], -1)
        torch.testing.assert_close(stats.sq_norms[k], flat.pow(2).sum(1), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(stats.sum_sq[k], ref.pow(2).sum(0), rtol=1e-10, atol=1e-12)
        for name, v in (("grad", mean_grad[k]), ("other", other[k])):
            for projections in (stats.projections, stats.only.projections):
                torch.testing.assert_close(
                    projections[name][k], flat @ v.reshape(-1), rtol=1e-10, atol=1e-12
                )
        torch.testing.assert_close(
            stats.one.projections["other"][k], flat @ other[k].reshape(-1), rtol=1e-10, atol=1e-12
        )
    # the brute force is a loop of autograd.grad: its mean is the gradient
    for ref, g in zip(reference, mean_grad):
        torch.testing.assert_close(ref.mean(0), g, rtol=1e-10, atol=1e-12)
    return engine


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("architecture", sorted(models.ARCHITECTURES))
def test_test_models(architecture, reduction):
    assert_exact(*models.ARCHITECTURES[architecture](n=3), reduction=reduction)


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def seq_ce(out, y):
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)


def classification(model, shape, n=3, classes=3):
    torch.manual_seed(1)
    return model.double(), torch.randn(n, *shape).double(), torch.randint(0, classes, (n,)), ce


def test_convolutions_of_every_dimension_and_option():
    for model, shape in [
        (
            nn.Sequential(
                nn.Conv1d(2, 4, 3, stride=2, dilation=2, padding=2), nn.Flatten(), nn.LazyLinear(3)
            ),
            (2, 11),
        ),
        (
            nn.Sequential(
                nn.Conv2d(4, 6, (3, 2), groups=2, padding="same", padding_mode="circular"),
                nn.Tanh(),
                nn.Flatten(),
                nn.LazyLinear(3),
            ),
            (4, 5, 6),
        ),
        (
            nn.Sequential(
                nn.Conv3d(2, 3, 2, stride=(1, 2, 1), padding=1, padding_mode="reflect"),
                nn.Flatten(),
                nn.LazyLinear(3),
            ),
            (2, 3, 4, 3),
        ),
    ]:
        model(torch.randn(1, *shape))  # materialise the lazy layer
        assert_exact(*classification(model, shape))


class ConvTwice(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, padding_mode="circular")

    def forward(self, x):
        return self.conv(torch.tanh(self.conv(x)))


def test_convolutions_by_the_weight_gradient_of_the_samples_as_groups(monkeypatch):
    """Convolutions with enough input channels and at least _MANY_POSITIONS output positions
    form G_n by the weight gradient of one convolution with the samples as groups
    (ConvRule.kernels), not by unfolding: padding modes, dilation, a layer called twice."""
    from avionics.persample.rules import conv

    used = []
    by_groups = conv.ConvRule._sample_group_gradients

    def spy(self, start, stop):
        g = by_groups(self, start, stop)
        used.append(g is not None)
        return g

    monkeypatch.setattr(conv.ConvRule, "_sample_group_gradients", spy)
    c = conv._WIDE_CHANNELS
    for layers, shape in [
        ([nn.Conv2d(c, 3, (3, 2), padding=(1, 2), dilation=(2, 1))], (c, 9, 8)),  # 7 x 11
        ([nn.Conv2d(c, 3, 3, padding="same", padding_mode="reflect", bias=False)], (c, 8, 9)),
        ([nn.Conv2d(c, 4, (1, 4), padding="valid"), nn.ReLU()], (c, 8, 11)),  # 8 x 8
        ([ConvTwice(c)], (c, 8, 8)),
    ]:
        used.clear()
        model = nn.Sequential(*layers, nn.Flatten(), nn.LazyLinear(3))
        model(torch.randn(1, *shape))  # materialise the lazy layer
        assert_exact(*classification(model, shape))
        assert used and all(used)


def test_convolutions_project_through_their_own_convolution(monkeypatch):
    """G_n . V of a 2d convolution, narrow or wide, comes from the layer's own convolution,
    exact; its chunks of samples (and the chunked unfolding) are exercised with chunks of one
    sample."""
    from avionics.persample.rules import base, bilinear, conv

    calls = []
    convolved = conv.ConvRule._convolved_projection
    monkeypatch.setattr(
        conv.ConvRule,
        "_convolved_projection",
        lambda self, v, *r: calls.append(self.module.in_channels) or convolved(self, v, *r),
    )
    for module in (bilinear, base, conv):
        monkeypatch.setattr(module, "chunk_size", lambda n, numel, size: 1)
    c = conv._WIDE_CHANNELS
    model = nn.Sequential(
        nn.Conv2d(1, c + 4, 3, padding=1),  # narrow, more outputs than inputs (9 per output)
        nn.Tanh(),
        nn.Conv2d(c + 4, c - 1, 2),  # wide
        nn.Tanh(),
        nn.Conv2d(c - 1, 2, (2, 3)),  # narrow, fewer outputs than inputs
        nn.Flatten(),
        nn.LazyLinear(3),
    )
    model(torch.randn(1, 1, 6, 7))  # materialise the lazy layer
    assert_exact(*classification(model, (1, 6, 7)))
    assert calls and set(calls) == {1, c + 4, c - 1}


def test_normalisation_layers_and_batchnorm_in_eval():
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.BatchNorm2d(4),
        nn.GroupNorm(2, 4),
        nn.Flatten(1, 2),
        nn.LayerNorm([16, 4]),
        nn.RMSNorm(4),
        nn.Flatten(),
        nn.Linear(64, 3),
    )
    model[1].running_mean.uniform_()
    model[1].running_var.uniform_(0.5, 2)
    model.eval()
    assert_exact(*classification(model, (2, 6, 6)))


def test_batchnorm_in_train_mode_warns_and_says_what_it_computes():
    model, X, y, loss_fn = classification(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), (4,))
    with pytest.warns(UserWarning, match="Module '1' .*share of the batch gradient"):
        stats, *_ = engine_statistics(model, X, y, loss_fn)
    assert stats.sq_norms[0].shape == (3,)


class TwiceAndFunctional(nn.Module):
    """A layer called twice, a weight also used functionally, a table added in forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(5, 4))
        self.mix = nn.Linear(4, 4)

    def forward(self, idx):
        h = self.emb(idx) + self.pos
        h = self.mix(torch.tanh(self.mix(h)))
        return F.linear(h, self.emb.weight)  # logits tied to the embedding, no module call


def test_modules_called_twice_functional_ties_and_direct_parameters():
    torch.manual_seed(2)
    model = TwiceAndFunctional().double()
    X = torch.randint(0, 7, (3, 5))
    X[0, :2] = 0  # the padding index gets no gradient
    engine = assert_exact(model, X, torch.randint(0, 7, (3, 5)), seq_ce)
    # the embedding's weight is also used outside nn.Embedding: routed through the root
    assert engine._param_name(min(engine._from_root)) == "emb.weight"


def test_multihead_attention_sequence_first():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2)  # batch_first=False: [T, N, E]
            self.out = nn.Linear(4, 3)

        def forward(self, x):
            h = self.attn(x, x, x)[0]
            return self.out(h.mean(0))

    torch.manual_seed(3)
    model = Attention().double()
    X = torch.randn(5, 3, 4).double()  # T=5, N=3
    assert_exact(model, X, torch.randint(0, 3, (3,)), ce)


def test_gru_uses_the_exact_per_sample_loop():
    assert_exact(*models.rnn(n=3, cell=nn.GRU))


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
def test_recurrent_layers_in_float32(cell):
    # float32 on CPU runs oneDNN's RNN kernel, whose backward torch.func cannot replay
    model, X, y, loss_fn = models.rnn(n=3, cell=cell)
    model, X = model.float(), X.float()
    stats, reference, *_ = engine_statistics(model, X, y, loss_fn)
    for k, ref in enumerate(reference):
        expected = ref.reshape(ref.shape[0], -1).double().pow(2).sum(1)
        torch.testing.assert_close(stats.sq_norms[k].double(), expected, rtol=1e-4, atol=1e-7)


def test_tied_weights_with_two_modules():
    model, X, y, loss_fn = models.transformer(n=2)
    assert model.head.weight is model.tok.weight
    assert_exact(model, X, y, loss_fn)


def test_in_place_modification_of_a_captured_input_is_an_error():
    class AddBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return x + self.bias  # autograd saves nothing here, so it cannot notice

    class Mutates(nn.Module):
        def __init__(self):
            super().__init__()
            self.add = AddBias()

        def forward(self, x):
            h = x * 1.0
            out = self.add(h)
            h.mul_(2)  # changes AddBias's input after it was used
            return out + h

    model, X, y, loss_fn = classification(Mutates(), (3,))
    with pytest.raises(RuntimeError, match="input of module 'add' was modified in place"):
        engine_statistics(model, X, y, loss_fn)


def test_a_position_table_looked_up_without_the_batch_axis():
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(7, 4)
            self.pos = nn.Embedding(5, 4)
            self.out = nn.Linear(4, 7)

        def forward(self, idx):
            positions = torch.arange(idx.shape[1])  # [T]: no batch axis
            return self.out(torch.tanh(self.tok(idx) + self.pos(positions)))

    torch.manual_seed(4)
    model = Positions().double()
    assert_exact(model, torch.randint(0, 7, (3, 5)), torch.randint(0, 7, (3, 5)), seq_ce)


def test_wide_layers_take_the_gram_form_of_the_mean_projection():
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 3))
    model, X, y, loss_fn = classification(model, (20,))
    from avionics.persample.rules.bilinear import Bilinear

    layer = Bilinear(torch.randn(3, 1, 1, 20), torch.randn(3, 1, 1, 30), torch.Size([30, 20]))
    assert layer._mean_projection_by_gram()
    for reduction in ("mean", "sum"):
        assert_exact(model, X, y, loss_fn, reduction)


def test_a_module_the_engine_cannot_handle_is_named():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))
            self.calls = torch.zeros(())  # a plain attribute: not a buffer the re-runs copy

        def forward(self, x):
            self.calls.add_(1)  # state mutated in forward: no functional transform can replay it
            return x @ torch.diag(self.weight)  # (no closed form: x * weight has one)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = Counting()

        def forward(self, x):
            return self.scale(x)

    model, X, y, loss_fn = classification(Model(), (3,))
    with pytest.raises(RuntimeError, match="Module 'scale' \\(Counting\\)"):
        engine_statistics(model, X, y, loss_fn)


def test_embedding_that_scales_by_frequency_is_refused_by_name():
    model = nn.Sequential(
        nn.Embedding(5, 3, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(6, 2)
    )
    torch.manual_seed(0)
    model = model.double()
    with pytest.raises(
        NotImplementedError, match="Module '0' \\(Embedding\\).*scale_grad_by_freq"
    ):
        engine_statistics(model, torch.randint(0, 5, (3, 2)), torch.randint(0, 2, (3,)), ce)
