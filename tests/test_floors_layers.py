"""benchmarks/floors.py's kernels for BatchNorm2d and Hugging Face's Conv1D: the floor's
gradient tests equal those of per-sample gradients by a loop over samples (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.floors import Floor


def _reference(model, X, y, loss_fn):
    """NormTest and InnerTest from per-sample gradients by a loop over samples."""
    params = list(model.parameters())
    losses = loss_fn(model(X), y)
    n = len(losses)
    mean = torch.autograd.grad(losses.mean(), params, retain_graph=True)
    per = [torch.autograd.grad(losses[i], params, retain_graph=True) for i in range(n)]
    g_sq = sum(g.square().sum() for g in mean)
    sq = sum(sum(a.square().sum() for a in g) for g in per)
    proj = torch.stack([sum((a * b).sum() for a, b in zip(g, mean)) for g in per])
    scale = (n - 1) * n * g_sq
    return ((sq - n * g_sq) / scale).sqrt().item(), ((proj - g_sq).square().sum() / (
        scale * g_sq)).sqrt().item()  # fmt: skip


def _losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


class Conv1DNet(nn.Module):
    """Two HF Conv1D over a token axis (T = 3 positions shared by a sample), then a head."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.a, self.b = Conv1D(8, 5), Conv1D(4, 8)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.b(torch.tanh(self.a(x))).flatten(1))


def bn_net():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 5 * 5, 3),
    )  # fmt: skip


@pytest.mark.parametrize("build, shape", [(bn_net, (6, 2, 5, 5)), (Conv1DNet, (6, 3, 5))])
def test_the_floor_equals_per_sample_gradients_by_a_loop(build, shape):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build().double().eval()  # (BatchNorm by its running statistics: samples apart)
    X, y = torch.randn(*shape, dtype=torch.float64), torch.randint(0, 3, (shape[0],))
    reference = copy.deepcopy(model)
    floor = Floor(model, _losses, "sgd", "three tests")
    floor.step(0, X, y)
    norm, inner = _reference(reference, X, y, _losses)
    assert floor.values[0]["NormTest"] == pytest.approx(norm, rel=1e-10)
    assert floor.values[0]["InnerTest"] == pytest.approx(inner, rel=1e-10)


class TiedLM(nn.Module):
    """An embedding, a LayerNorm, a Linear over positions (T = 4 shared by a sample) and a
    head tied to the embedding: every kind of b_n the economy floor counts (materialised by
    its kernel, the sum of two uses, and a Linear without shared axes from its factors)."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Embedding(7, 6), nn.LayerNorm(6)
        self.mix, self.out = nn.Linear(6, 6), nn.Linear(24, 6)
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.norm(self.embed(tokens))))
        return self.head(self.out(h.flatten(1)))


@pytest.mark.parametrize("build, shape", [(bn_net, (6, 2, 5, 5)), (TiedLM, None)])
def test_the_economy_floor_counts_what_grad_hist_1d_counts(build, shape):
    from avionics import Cockpit
    from avionics.quantities import GradHist1d

    torch.manual_seed(0)
    model = build().double().eval()
    X = torch.randint(0, 7, (9, 4)) if shape is None else torch.randn(*shape, dtype=torch.float64)
    y = torch.randint(0, 3, (len(X),))
    reference = copy.deepcopy(model)
    floor = Floor(model, _losses, "sgd", "economy")
    floor.step(0, X, y)
    cockpit = Cockpit(reference, [GradHist1d()])
    losses = _losses(reference(X), y)
    with cockpit(0, {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(X)}):
        losses.mean().backward()
    expected = cockpit.get_output()[0]["GradHist1d"]["hist"]
    counted = floor.values[0]["GradHist1d"]
    assert sum(counted) == len(X) * sum(p.numel() for p in model.parameters())
    assert counted == [float(c) for c in expected]
    assert sum(1 for c in counted if c > 0) > 10  # (the values spread over many bins)


@pytest.mark.parametrize("name", ["encoder", "vit", "gpt2", "bert"])
def test_the_economy_floor_of_attention_and_root_parameters_equals_avionics(name):
    """nn.MultiheadAttention's in-projection (the floor's own self-attention, with a padding
    mask on the encoder) and the root parameters (the encoder's position table, the ViT's
    class token and position table), and the position tables that indices [1, T] look up for
    every sample (GPT-2, BERT): the floor's gradient tests and histogram counts equal
    the cockpit's (float64)."""
    from avionics import configuration
    from benchmarks.tools import Avionics
    from tests.real_models import ALL_MODELS

    model, X, y, loss_fn = ALL_MODELS[name](dtype=torch.float64, n=6)
    model.eval()  # (no dropout: the two steps draw no random numbers)
    floor = Floor(copy.deepcopy(model), loss_fn, "sgd", "economy")
    ours = Avionics(copy.deepcopy(model), loss_fn, "sgd", configuration("economy"))
    floor.step(0, X, y)
    ours.step(0, X, y)
    expected = ours.cockpit.get_output()[0]
    for test in ("NormTest", "InnerTest", "OrthoTest"):
        assert floor.values[0][test] == pytest.approx(expected[test], rel=1e-10)
    counted = floor.values[0]["GradHist1d"]
    assert counted == [float(c) for c in expected["GradHist1d"]["hist"]]
    assert sum(counted) == len(X) * sum(p.numel() for p in model.parameters())


def test_the_economy_floor_of_the_resnet_in_train_mode_equals_avionics():
    """BatchNorm by the batch's statistics (each sample's share of the batch gradient, as
    tests/persample/test_batchnorm.py checks avionics' against a brute force): the floor's
    gradient tests and histogram counts equal the cockpit's (float64)."""
    from avionics import configuration
    from benchmarks.tools import Avionics
    from tests.real_models import ALL_MODELS

    model, X, y, loss_fn = ALL_MODELS["resnet"](dtype=torch.float64, n=6, image=8)
    model.train()
    model.dropout.p = 0.0  # (the two steps draw no random numbers)
    floor = Floor(copy.deepcopy(model), loss_fn, "sgd", "economy")
    ours = Avionics(copy.deepcopy(model), loss_fn, "sgd", configuration("economy"))
    floor.step(0, X, y)
    with pytest.warns(UserWarning, match="share of the batch gradient"):
        ours.step(0, X, y)
    expected = ours.cockpit.get_output()[0]
    for test in ("NormTest", "InnerTest", "OrthoTest"):
        assert floor.values[0][test] == pytest.approx(expected[test], rel=1e-10)
    assert floor.values[0]["GradHist1d"] == [float(c) for c in expected["GradHist1d"]["hist"]]


@pytest.mark.parametrize("kernel", ["grouped conv", "unfold+bmm", "samples as groups"])
def test_every_conv_kernel_of_the_floor_equals_per_sample_gradients_by_a_loop(kernel):
    """Each kernel the floor measures for a Conv2d weight, taken for every convolution (a
    dilated one with padding, a strided one with an uneven kernel)."""
    from benchmarks.floors import _ConvUse

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=2, dilation=2), nn.Tanh(),
        nn.Conv2d(3, 4, (2, 3), stride=2, padding=1), nn.Tanh(),
        nn.Flatten(), nn.LazyLinear(3),
    ).double()  # fmt: skip
    X, y = torch.randn(5, 2, 6, 7, dtype=torch.float64), torch.randint(0, 3, (5,))
    model(X)  # materialise the lazy layer
    reference = copy.deepcopy(model)
    floor = Floor(model, _losses, "sgd", "three tests")
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            _ConvUse.methods[m] = kernel
    floor.step(0, X, y)
    assert set(floor.kernels().values()) == {kernel}
    norm, inner = _reference(reference, X, y, _losses)
    assert floor.values[0]["NormTest"] == pytest.approx(norm, rel=1e-10)
    assert floor.values[0]["InnerTest"] == pytest.approx(inner, rel=1e-10)
