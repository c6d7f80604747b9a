"""The GGN diagonal of nn.MultiheadAttention with all columns of a group through one re-run
and one batched vector-Jacobian product, against the dense float64 J^T H J."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from avionics.curvature.step import ggn_diagonal
from avionics.persample.rules import attention_columns
from avionics.persample.rules.generic import GenericRule
from avionics.quantities import HessTrace, TICDiag
from tests.quantities.test_curvature_instruments import _params, _run, dense_ggn


@pytest.fixture(autouse=True)
def math_attention():
    with sdpa_kernel(SDPBackend.MATH):
        yield


class _TwoCalls(nn.Module):
    """One time-major attention called twice: self-attention with a padding mask, then
    cross-attention (queries from the first call, keys and values from the embedding), and
    more classes than a column group holds (19 columns: groups of 16 and 3)."""

    def __init__(self, width=4, classes=20):
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.attn = nn.MultiheadAttention(width, 2)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x).transpose(0, 1)  # [T, N, E]
        mask = torch.zeros(x.shape[:2], dtype=torch.bool)
        mask[:, -1] = x[:, -1, 0] > 0  # (a sample's own: its dense GGN is its own forward's)
        a, _ = self.attn(h, h, h, key_padding_mask=mask, need_weights=False)
        b, _ = self.attn(torch.tanh(a), h, h)
        return self.head(b.mean(0))


def _two_calls(n=3, seed=3):
    torch.manual_seed(seed)
    X, y = torch.randn(n, 5, 3), torch.randint(0, 20, (n,))

    def loss_fn(o, t):
        return nn.functional.cross_entropy(o, t, reduction="none")

    return _TwoCalls().double(), X.double(), y, loss_fn


def _spied(monkeypatch):
    """The diagonals ggn_diagonal returned, the column groups the attention reduced, and the
    modules the generic rule re-ran."""
    seen = {"diagonals": [], "reduced": [], "reruns": []}
    diagonal = ggn_diagonal.ggn_diagonal
    reduce = attention_columns.AttentionColumnSums._reduce
    gradients = GenericRule._call_gradients

    def spy_diagonal(*args, **kwargs):
        found = diagonal(*args, **kwargs)
        seen["diagonals"].append([d.clone() for d in found])  # (TICDiag overwrites it)
        return found

    def spy_reduce(self):
        seen["reduced"].append(len(self.pending))
        return reduce(self)

    def spy_rerun(self, call, start, stop):
        seen["reruns"].append(self.module)
        return gradients(self, call, start, stop)

    monkeypatch.setattr("avionics.quantities.curvature.ggn_diagonal", spy_diagonal)
    monkeypatch.setattr(attention_columns.AttentionColumnSums, "_reduce", spy_reduce)
    monkeypatch.setattr(GenericRule, "_call_gradients", spy_rerun)
    return seen


def test_grouped_columns_give_the_exact_diagonal(monkeypatch):
    """Two groups of columns (16 and 3), two calls of one module summed before the square:
    every parameter's diagonal equals the dense GGN's, and the attention is re-run by the
    column sums (two reductions), never by the generic rule."""
    model, X, y, loss_fn = _two_calls()
    seen = _spied(monkeypatch)
    _run(model, X, y, loss_fn, [TICDiag(curvature="diag_ggn_exact")])
    assert seen["reduced"] == [16, 3]
    assert model.attn not in seen["reruns"]
    expected = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    sizes = [p.numel() for p in _params(model)]
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    (found,) = seen["diagonals"]
    for name, e, f in zip(names, expected.split(sizes), found, strict=True):
        torch.testing.assert_close(f.reshape(-1), e, rtol=1e-9, atol=1e-12, msg=name)
    assert all(f.abs().sum() > 0 for f in found)


def test_grouped_columns_give_the_exact_traces(monkeypatch):
    """With traces alone, the attention's sums are the dense GGN's per-parameter traces."""
    model, X, y, loss_fn = _two_calls(seed=4)
    seen = _spied(monkeypatch)
    (out,) = _run(model, X, y, loss_fn, [HessTrace(curvature="diag_ggn_exact")])
    assert seen["reduced"] == [16, 3]
    h = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    traces = torch.stack([d.sum() for d in h.split([p.numel() for p in _params(model)])])
    torch.testing.assert_close(
        torch.tensor(out["HessTrace"], dtype=torch.float64), traces, rtol=1e-9, atol=1e-12
    )
