"""The GGN diagonal of nn.MultiheadAttention with all columns of a group through one re-run
and one batched vector-Jacobian product, against the dense float64 J^T H J."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from avionics.curvature.step import ggn_diagonal
from avionics.persample.rules import attention_columns, linear
from avionics.persample.rules.attention import AttentionRule
from avionics.persample.rules.base import Rule
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

    def __init__(self, width=4, classes=20, dropout=0.0):
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.attn = nn.MultiheadAttention(width, 2, dropout=dropout)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x).transpose(0, 1)  # [T, N, E]
        mask = torch.zeros(x.shape[:2], dtype=torch.bool)
        mask[:, -1] = x[:, -1, 0] > 0  # (a sample's own: its dense GGN is its own forward's)
        a, _ = self.attn(h, h, h, key_padding_mask=mask, need_weights=False)
        b, _ = self.attn(torch.tanh(a), h, h)
        return self.head(b.mean(0))


def _two_calls(n=3, seed=3, dropout=0.0):
    torch.manual_seed(seed)
    X, y = torch.randn(n, 5, 3), torch.randint(0, 20, (n,))

    def loss_fn(o, t):
        return nn.functional.cross_entropy(o, t, reduction="none")

    return _TwoCalls(dropout=dropout).double(), X.double(), y, loss_fn


def _spied(monkeypatch, source="inside"):
    """The diagonals ggn_diagonal returned, the column groups the attention reduced, the
    sources of its projections' gradients, and the modules the generic rule re-ran; with
    ``source="re-run"`` the attention re-runs its calls for the columns."""
    seen = {"diagonals": [], "reduced": [], "reruns": [], "shared_axes": [], "sources": []}
    if source == "re-run":
        monkeypatch.setattr(attention_columns, "_taken_inside", lambda *args: False)
    for kind in (attention_columns._Inside, attention_columns._ReRun):
        made = kind.__init__

        def spy_source(self, *args, made=made, kind=kind):
            seen["sources"].append(kind.__name__)
            made(self, *args)

        monkeypatch.setattr(kind, "__init__", spy_source)
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

    shared_axes = linear.SharedAxesColumnSums._reduce

    def spy_shared_axes(self):
        seen["shared_axes"].append(len(self.pending))
        return shared_axes(self)

    monkeypatch.setattr("avionics.quantities.curvature.ggn_diagonal", spy_diagonal)
    monkeypatch.setattr(linear.SharedAxesColumnSums, "_reduce", spy_shared_axes)
    monkeypatch.setattr(attention_columns.AttentionColumnSums, "_reduce", spy_reduce)
    monkeypatch.setattr(GenericRule, "_call_gradients", spy_rerun)
    return seen


@pytest.mark.parametrize("source", ["inside", "re-run"])
def test_grouped_columns_give_the_exact_diagonal(source, monkeypatch):
    """Two groups of columns (16 and 3), two calls of one module summed before the square:
    every parameter's diagonal equals the dense GGN's, and the attention is re-run by the
    column sums (two reductions), never by the generic rule, from the projections' gradients
    read inside the columns' backward or from one re-run of each call; the embedding (a
    Linear over positions) sums its columns a group at a time too."""
    model, X, y, loss_fn = _two_calls()
    seen = _spied(monkeypatch, source)
    _run(model, X, y, loss_fn, [TICDiag(curvature="diag_ggn_exact")])
    assert seen["reduced"] == [16, 3] and seen["shared_axes"] == [16, 3]
    kind = "_Inside" if source == "inside" else "_ReRun"
    assert seen["sources"] == [kind, kind]
    assert model.attn not in seen["reruns"]
    expected = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    sizes = [p.numel() for p in _params(model)]
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    (found,) = seen["diagonals"]
    for name, e, f in zip(names, expected.split(sizes), found, strict=True):
        torch.testing.assert_close(f.reshape(-1), e, rtol=1e-9, atol=1e-12, msg=name)
    assert all(f.abs().sum() > 0 for f in found)


@pytest.mark.parametrize("source", ["inside", "re-run"])
def test_grouped_columns_give_the_exact_traces(source, monkeypatch):
    """With traces alone, the attention's sums are the dense GGN's per-parameter traces."""
    model, X, y, loss_fn = _two_calls(seed=4)
    seen = _spied(monkeypatch, source)
    (out,) = _run(model, X, y, loss_fn, [HessTrace(curvature="diag_ggn_exact")])
    assert seen["reduced"] == [16, 3]
    h = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    traces = torch.stack([d.sum() for d in h.split([p.numel() for p in _params(model)])])
    torch.testing.assert_close(
        torch.tensor(out["HessTrace"], dtype=torch.float64), traces, rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("source", ["inside", "re-run"])
def test_dropout_in_train_mode_matches_the_column_by_column_re_run(source, monkeypatch):
    """Attention dropout in train mode (no dense reference: the masks are the step's): the
    grouped columns (their gradients read inside the backward, or one re-run drawing the
    call's masks again) give the diagonal of the rule re-run once per column, and both
    differ from the masks' absence."""
    model, X, y, loss_fn = _two_calls(seed=5, dropout=0.5)
    if source == "re-run":
        monkeypatch.setattr(attention_columns, "_taken_inside", lambda *args: False)
    found = {}
    diagonal = ggn_diagonal.ggn_diagonal

    def per_column(cls, module, calls, names, n, traces):
        return Rule.column_sums.__func__(cls, module, calls, names, n, traces)

    def both(*args, **kwargs):
        grouped = diagonal(*args, **kwargs)
        found["grouped"] = [d.clone() for d in grouped]
        with pytest.MonkeyPatch.context() as m:
            m.setattr(AttentionRule, "column_sums", classmethod(per_column))
            found["per column"] = diagonal(*args, **kwargs)
        return grouped

    monkeypatch.setattr("avionics.quantities.curvature.ggn_diagonal", both)
    _run(model, X, y, loss_fn, [TICDiag(curvature="diag_ggn_exact")])
    for g, c in zip(found["grouped"], found["per column"], strict=True):
        torch.testing.assert_close(g, c, rtol=1e-10, atol=1e-14)
    model.eval()  # (no dropout: another diagonal)
    undropped = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    sizes = [p.numel() for p in _params(model)]
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    attn = dict(zip(names, undropped.split(sizes), strict=True))["attn.in_proj_weight"]
    assert not torch.allclose(
        found["grouped"][names.index("attn.in_proj_weight")].reshape(-1), attn
    )
