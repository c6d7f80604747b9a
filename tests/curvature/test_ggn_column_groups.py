"""The GGN diagonal's columns in groups: the root parameters' closed forms mapped a group of
columns at a time, and the columns backpropagated through convolutions one backward each,
against the dense float64 J^T H J (and the hand-written floor of benchmarks/ggn_floor.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from avionics.curvature.step import ggn_diagonal
from avionics.persample.rules import broadcast
from avionics.quantities import HessTrace, TICDiag
from benchmarks.ggn_floor import GGNFloor
from tests.quantities.test_curvature_instruments import (
    _cross_entropy,
    _params,
    _run,
    _TinyViT,
    dense_ggn,
)
from tests.real_models import basic_block_resnet


def _vit(n=3, seed=8, classes=20):
    """A ViT's class token (expanded) and position table (added) on 20 classes: 19 columns,
    groups of 16 and 3."""
    torch.manual_seed(seed)
    X, y = torch.randn(n, 2, 4, 4), torch.randint(0, classes, (n,))
    return _TinyViT(classes=classes).double(), X.double(), y, _cross_entropy


def _cnn(n=3, seed=9):
    """Two convolutions (the second's input needs a gradient) with BatchNorm by running
    statistics (eval mode: the dense per-sample J^T H J is the reference), 12 classes."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Tanh(),
        nn.Conv2d(3, 4, 3, stride=2), nn.BatchNorm2d(4), nn.Tanh(), nn.Flatten(),
        nn.Linear(16, 12),
    )  # fmt: skip
    for bn in (model[1], model[4]):
        bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.uniform_(0.5, 1.5), bn.bias.data.uniform_(-0.5, 0.5)
    X, y = torch.randn(n, 2, 5, 5), torch.randint(0, 12, (n,))
    return model.double().eval(), X.double(), y, _cross_entropy


def _spied(monkeypatch) -> dict:
    """The diagonals ggn_diagonal returned, the column groups the root parameters' sums
    reduced, and whether the columns went back batched."""
    seen = {"diagonals": [], "reduced": [], "batched": []}
    diagonal, reduce = ggn_diagonal.ggn_diagonal, broadcast.SharedParameterColumnSums._reduce
    batches_well = ggn_diagonal._batches_well

    def spy_diagonal(*args, **kwargs):
        found = diagonal(*args, **kwargs)
        seen["diagonals"].append([d.clone() for d in found])  # (TICDiag overwrites it)
        return found

    def spy_reduce(self):
        seen["reduced"].append(len(self.pending))
        return reduce(self)

    def spy_batches_well(calls):
        seen["batched"].append(batches_well(calls))
        return seen["batched"][-1]

    monkeypatch.setattr("avionics.quantities.curvature.ggn_diagonal", spy_diagonal)
    monkeypatch.setattr(broadcast.SharedParameterColumnSums, "_reduce", spy_reduce)
    monkeypatch.setattr(ggn_diagonal, "_batches_well", spy_batches_well)
    return seen


def _assert_dense(model, X, y, loss_fn, found) -> None:
    expected = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    sizes = [p.numel() for p in _params(model)]
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    for name, e, f in zip(names, expected.split(sizes), found, strict=True):
        torch.testing.assert_close(f.reshape(-1), e, rtol=1e-9, atol=1e-12, msg=name)
        assert f.abs().sum() > 0, name


def test_root_parameters_in_column_groups_give_the_exact_diagonal(monkeypatch):
    """The class token and the position table take 19 columns in two groups (16, 3): every
    parameter's diagonal equals the dense GGN's, the columns went back batched."""
    model, X, y, loss_fn = _vit()
    seen = _spied(monkeypatch)
    _run(model, X, y, loss_fn, [TICDiag(curvature="diag_ggn_exact")])
    assert seen["reduced"] == [16, 3] and seen["batched"] == [True]
    (found,) = seen["diagonals"]
    _assert_dense(model, X, y, loss_fn, found)


def test_root_parameters_in_column_groups_give_the_exact_traces(monkeypatch):
    """With traces alone (HessTrace), the grouped sums are the dense GGN's traces."""
    model, X, y, loss_fn = _vit(seed=10)
    seen = _spied(monkeypatch)
    (out,) = _run(model, X, y, loss_fn, [HessTrace(curvature="diag_ggn_exact")])
    assert seen["reduced"] == [16, 3]
    h = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    traces = torch.stack([d.sum() for d in h.split([p.numel() for p in _params(model)])])
    torch.testing.assert_close(
        torch.tensor(out["HessTrace"], dtype=torch.float64), traces, rtol=1e-9, atol=1e-12
    )


def test_a_column_that_misses_a_use_node_adds_nothing_there():
    """A column with no gradient at one use node (None) is a zero in the group: the sums
    equal those of the columns that reached it."""
    n, shape = 3, (1, 2)
    use = [(0, lambda dh: 2.0 * dh.reshape(n, *shape))]  # (edge 0: dh [N, 2] -> [N, 1, 2])
    sums = broadcast.SharedParameterColumnSums(["p"], [[]], traces=False)
    sums.uses, sums.edges = [use], [None]
    columns = [torch.randn(n, 2, dtype=torch.float64) for _ in range(3)]
    for g in (columns[0], None, columns[2]):
        sums.add([g])
    (total,) = sums.result(1.0)
    expected = sum((2 * c.reshape(n, *shape)).square().sum(0) for c in (columns[0], columns[2]))
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=0)


def test_columns_through_convolutions_go_back_one_at_a_time_and_are_exact(monkeypatch):
    """Where a convolution's input needs a gradient, the 11 columns go back one backward
    each: the diagonal (convolutions, BatchNorm, Linear) equals the dense GGN's, and equals
    the batched backward's."""
    model, X, y, loss_fn = _cnn()
    seen = _spied(monkeypatch)
    _run(model, X, y, loss_fn, [TICDiag(curvature="diag_ggn_exact")])
    assert seen["batched"] == [False]
    (found,) = seen["diagonals"]
    _assert_dense(model, X, y, loss_fn, found)
    monkeypatch.setattr(ggn_diagonal, "_batches_well", lambda calls: True)
    _run(model, X, y, loss_fn, [TICDiag(curvature="diag_ggn_exact")])
    for a, b in zip(found, seen["diagonals"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.slow
def test_the_hand_written_floor_forms_the_same_diagonal(monkeypatch):
    """benchmarks/ggn_floor.py's diagonal of the ResNet (eval mode: in train mode BatchNorm
    couples the samples, and the samples' shares of a column depend on which root of the
    loss Hessian pairs their columns) equals avionics' (so the benchmark times the same
    work), and it refuses a model with layers it has no kernel for."""
    model, X, y, loss_fn = basic_block_resnet(n=3, image=8)
    model.eval()
    floor = GGNFloor(copy.deepcopy(model), loss_fn)
    floor.opt.param_groups[0]["lr"] = 0.0
    floor.step(0, X, y)
    seen = _spied(monkeypatch)
    _run(model, X, y, loss_fn, [TICDiag(curvature="diag_ggn_exact")])
    assert seen["batched"] == [False]
    for (name, _), ours, by_hand in zip(
        model.named_parameters(), seen["diagonals"][0], floor.diagonal, strict=True
    ):
        torch.testing.assert_close(ours, by_hand, rtol=1e-10, atol=1e-14, msg=name)
    with pytest.raises(ValueError, match="no kernel for LayerNorm"):
        GGNFloor(nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3)), loss_fn)
