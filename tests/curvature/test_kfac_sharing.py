"""KFAC with weight sharing across modules and calls: a weight held by two modules (tied) and
a layer called twice, in both conventions, against brute-force float64 references of the
stated factors and against curvlinops itself where it is installed."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import problem
from test_kfac_features import dense
from torch import nn

from avionics.curvature import EKFACOperator, KFACOperator
from avionics.curvature._data import MathAttention

DT = torch.float64
FISHER_TYPES = ["type-2", "empirical", "forward-only"]


class Twice(nn.Module):
    """One Linear layer called twice, on a different number of positions per call (3 rows
    per sample, then 1), then a head."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # x [N, 3, 4]
        h = torch.tanh(self.shared(x))
        h = torch.tanh(self.shared(h.mean(dim=1)))
        return self.head(h)


def twice_problem(loss_name: str = "ce", reduction: str = "mean"):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = Twice().double().eval()
    data = []
    for n in (3, 2, 4):
        X = torch.randn(n, 3, 4, generator=generator, dtype=DT)
        if loss_name == "ce":
            y = torch.randint(0, 3, (n,), generator=generator)
        else:
            y = torch.randn(n, 3, generator=generator, dtype=DT)
        data.append((X, y))
    loss_fn = nn.CrossEntropyLoss if loss_name == "ce" else nn.MSELoss
    return model, loss_fn(reduction=reduction), data


def _curvlinops_dense(curvlinops_class, model, loss_fn, data, **options):
    params = [p for p in model.parameters() if p.requires_grad]
    with MathAttention():
        return dense(curvlinops_class(model, loss_fn, params, data, **options))


def _call_inputs(model, data, layer) -> list[list[torch.Tensor]]:
    """Per batch, the rows [N, R_c, d_in] of each call c of ``layer``, by a forward hook."""
    calls, batches = [], []
    handle = layer.register_forward_pre_hook(
        lambda module, args: calls.append(args[0].detach().reshape(len(args[0]), -1, 4))
    )
    with torch.no_grad():
        for X, _ in data:
            calls.clear()
            model(X)
            batches.append(list(calls))
    handle.remove()
    return batches


def _outer_mean(rows: list[torch.Tensor]) -> torch.Tensor:
    """(1 / len(rows)) sum_r a_r a_r^T, one outer product at a time."""
    return sum(torch.outer(a, a) for a in rows) / len(rows)


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_a_layer_called_twice_gets_the_stated_input_factor(kfac_approx):
    """A, brute force by loops over samples, calls and rows: avionics takes all calls' rows
    together (expand: A = mean over all rows; reduce: of every sample's mean row over all its
    calls' rows); curvlinops adds each call's A (expand: (1/N) sum_c (1/R_c) sum_{n, r}
    a a^T; reduce: (1/N) sum_c sum_n of the outer products of the call's mean rows)."""
    model, loss_fn, data = twice_problem()
    batches = _call_inputs(model, data, model.shared)
    samples = [[c[n] for c in calls] for calls in batches for n in range(len(calls[0]))]
    N = len(samples)
    if kfac_approx == "expand":
        ours = _outer_mean([a for sample in samples for rows in sample for a in rows])
        theirs = sum(_outer_mean([a for sample in samples for a in sample[c]]) for c in (0, 1))
    else:
        ours = _outer_mean([torch.cat(sample).mean(dim=0) for sample in samples])
        theirs = sum(_outer_mean([s[c].mean(dim=0) for s in samples]) for c in (0, 1))
    assert N == 9 and (theirs - ours).abs().max() > 1e-2
    for convention, A in {"avionics": ours, "curvlinops": theirs}.items():
        K = KFACOperator(model, loss_fn, ["shared.weight"], data, fisher_type="forward-only",
                         kfac_approx=kfac_approx, convention=convention)  # fmt: skip
        torch.testing.assert_close(K.blocks[0].A, A)


@pytest.mark.parametrize("fisher_type", FISHER_TYPES)
@pytest.mark.parametrize("loss_name", ["ce", "mse"])
def test_a_layer_called_twice_equals_curvlinops(loss_name, fisher_type):
    curvlinops = pytest.importorskip("curvlinops")
    for reduction in ("mean", "sum"):
        model, loss_fn, data = twice_problem(loss_name, reduction)
        for kfac_approx in ("expand", "reduce"):
            for separate in (True, False):
                options = {"fisher_type": fisher_type, "kfac_approx": kfac_approx,
                           "separate_weight_and_bias": separate}  # fmt: skip
                expected = _curvlinops_dense(curvlinops.KFACLinearOperator, model, loss_fn,
                                             data, **options)  # fmt: skip
                K = KFACOperator(model, loss_fn, None, data, convention="curvlinops", **options)
                torch.testing.assert_close(dense(K), expected)


@pytest.mark.parametrize("fisher_type", FISHER_TYPES)
@pytest.mark.parametrize("loss_name", ["ce", "mse"])
def test_a_tied_weight_equals_curvlinops(loss_name, fisher_type):
    """curvlinops gives a weight two modules hold the block of the last one (each module's
    bias keeps its own); so does convention="curvlinops"."""
    curvlinops = pytest.importorskip("curvlinops")
    for reduction in ("mean", "sum"):
        model, loss_fn, data, _ = problem("tied", loss_name, reduction)
        for kfac_approx in ("expand", "reduce"):
            options = {"fisher_type": fisher_type, "kfac_approx": kfac_approx}
            expected = _curvlinops_dense(curvlinops.KFACLinearOperator, model, loss_fn, data,
                                         **options)  # fmt: skip
            K = KFACOperator(model, loss_fn, None, data, convention="curvlinops", **options)
            torch.testing.assert_close(dense(K), expected)


def test_a_tied_weight_gets_the_first_or_the_last_module_s_block():
    """The tied weight's block is the first module's (avionics) or the second's
    (curvlinops): A the Gram matrix of that module's inputs (brute force by hooks)."""
    model, loss_fn, data, _ = problem("tied")
    inputs = {model.first: [], model.second: []}
    handles = [m.register_forward_pre_hook(lambda m, args: inputs[m].append(args[0].detach()))
               for m in inputs]  # fmt: skip
    with torch.no_grad():
        for X, _ in data:
            model(X)
    for handle in handles:
        handle.remove()
    for convention, layer in (("avionics", model.first), ("curvlinops", model.second)):
        K = KFACOperator(model, loss_fn, None, data, fisher_type="forward-only",
                         convention=convention)  # fmt: skip
        (block,) = [b for b in K.blocks if b.names == ["first.weight"]]
        assert block.layer is layer
        rows = torch.cat(inputs[layer])
        torch.testing.assert_close(block.A, rows.T @ rows / len(rows))
        assert [b.names for b in K.blocks if not b.has_weight] == [
            ["first.bias"],
            ["second.bias"],
            ["head.bias"],
        ]


def test_curvlinops_sharing_cases_without_a_defined_matrix_are_refused():
    """A tied weight with joint biases (curvlinops' product is not symmetric there) and
    EKFAC of a layer called twice (curvlinops pairs every call's gradients with the last
    call's inputs): clear errors, before any pass over the data."""
    model, loss_fn, data, _ = problem("tied")
    with pytest.raises(ValueError, match=r"'first.weight' is shared by several modules"):
        KFACOperator(model, loss_fn, None, data, convention="curvlinops",
                     separate_weight_and_bias=False)  # fmt: skip
    # avionics' convention takes both: the first module's block for the tied weight
    K = KFACOperator(model, loss_fn, None, data, separate_weight_and_bias=False)
    assert [b.names for b in K.blocks][0] == ["first.weight", "first.bias"]
    model, loss_fn, data = twice_problem()
    with pytest.raises(ValueError, match=r"called 2 times .* curvlinops' EKFAC pairs"):
        EKFACOperator(model, loss_fn, None, data, fisher_type="type-2", convention="curvlinops")
    E = EKFACOperator(model, loss_fn, None, data, fisher_type="type-2")
    assert torch.isfinite(dense(E)).all()
