"""KFAC's two conventions: avionics' (the default) and curvlinops' (every output row a datum,
the type-2 square-root columns backpropagated for all rows at once), against a brute-force
float64 reference of the stated factors and against curvlinops itself where it is installed."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import _weights, problem
from test_kfac_features import (
    KFAC_PARAMS,
    _input_covariances,
    blockwise_dense,
    dense,
    kronecker,
)
from torch import nn

from avionics.curvature import EFOperator, EKFACOperator, KFACOperator
from avionics.curvature._data import MathAttention

DT = torch.float64
NAMES = ["mlp", "cnn", "transformer"]
LOSSES = ["ce", "mse", "bce"]


def _row_square_roots(loss_fn, output: torch.Tensor) -> torch.Tensor:
    """S_r [rows, C, C] of every output row r (class axis split off), by curvlinops' formula:
    CE diag(sqrt p) - p sqrt(p)^T, MSE sqrt(2 c) I, BCE sqrt(c sigma (1 - sigma)) I, with
    c = 1 / (number of loss terms) for "mean"."""
    axis = 1 if isinstance(loss_fn, nn.CrossEntropyLoss) else -1
    rows = output.movedim(axis, -1).reshape(-1, output.shape[axis])
    C = rows.shape[1]
    mean = loss_fn.reduction == "mean"
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        p = rows.softmax(dim=1)
        roots = torch.diag_embed(p.sqrt()) - p.unsqueeze(2) * p.sqrt().unsqueeze(1)
        return roots / (len(rows) if mean else 1) ** 0.5
    c = 1.0 / output.numel() if mean else 1.0
    if isinstance(loss_fn, nn.MSELoss):
        return (2 * c) ** 0.5 * torch.eye(C, dtype=DT).expand(len(rows), C, C)
    sigma = rows.sigmoid()
    return torch.diag_embed((c * sigma * (1 - sigma)).sqrt())


def _check_row_square_roots(loss_fn, output, y):
    """S_r S_r^T is the Hessian of the batch loss in row r (autograd, double backward)."""
    axis = 1 if isinstance(loss_fn, nn.CrossEntropyLoss) else output.ndim - 1
    moved_shape = output.movedim(axis, -1).shape
    rows = output.movedim(axis, -1).reshape(-1, moved_shape[-1])

    def loss_of_rows(r):
        return loss_fn(r.reshape(moved_shape).movedim(-1, axis), y)

    hessian = torch.autograd.functional.hessian(loss_of_rows, rows)  # [R, C, R, C]
    diagonal_blocks = torch.stack([hessian[r, :, r] for r in range(len(rows))])
    roots = _row_square_roots(loss_fn, output)
    torch.testing.assert_close(roots @ roots.transpose(1, 2), diagonal_blocks)


def _layer_rows(layer, t: torch.Tensor) -> torch.Tensor:
    """The rows of a layer's output (or output gradient): one per sample and position."""
    if isinstance(layer, nn.Conv2d):
        t = t.movedim(1, -1)
    return t.reshape(-1, t.shape[-1])


def curvlinops_factors_by_autograd(model, loss_fn, data, layers, fisher_type):
    """B of every layer in curvlinops' convention, brute force: per batch b, the vectors
    v_c (type-2: column c of every row's S_r; empirical: sqrt(rho_b) dL_b/df) backpropagated
    one by one with autograd to the layer outputs z, B = sum_b w_b sum_c sum_rows g g^T."""
    B, outputs = {layer: 0 for layer in layers}, {}
    for w, (X, y) in zip(_weights(loss_fn, data), data):
        handles = [layer.register_forward_hook(lambda m, args, out: outputs.__setitem__(m, out))
                   for layer in layers]  # fmt: skip
        with MathAttention():
            f = model(X)
        for handle in handles:
            handle.remove()
        axis = 1 if isinstance(loss_fn, nn.CrossEntropyLoss) else f.ndim - 1
        if fisher_type == "type-2":
            _check_row_square_roots(loss_fn, f.detach(), y)
            roots = _row_square_roots(loss_fn, f.detach())  # [rows, C, C]
            shape = f.movedim(axis, -1).shape
            vectors = [roots[:, :, c].reshape(shape).movedim(-1, axis)
                       for c in range(roots.shape[2])]  # fmt: skip
        else:
            (G,) = torch.autograd.grad(loss_fn(f, y), f, retain_graph=True)
            rho = 1.0  # rows (CE) or rows times C (MSE, BCE) for "mean"
            if loss_fn.reduction == "mean":
                ce = isinstance(loss_fn, nn.CrossEntropyLoss)
                rho = G.numel() // G.shape[1] if ce else G.numel()
            vectors = [rho**0.5 * G]
        for v in vectors:
            grads = torch.autograd.grad(f, [outputs[m] for m in layers], v, retain_graph=True)
            for layer, g in zip(layers, grads):
                rows = _layer_rows(layer, g)
                B[layer] = B[layer] + w * rows.T @ rows
    return B


@pytest.mark.parametrize("fisher_type", ["type-2", "empirical"])
@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("name", [*NAMES, "tied"])
def test_curvlinops_convention_is_its_formula(name, loss_name, fisher_type):
    for reduction in ("mean", "sum"):
        model, loss_fn, data, _ = problem(name, loss_name, reduction)
        K = KFACOperator(model, loss_fn, KFAC_PARAMS[name], data, fisher_type=fisher_type,
                         convention="curvlinops")  # fmt: skip
        layers = list({id(b.layer): b.layer for b in K.blocks}.values())
        B = curvlinops_factors_by_autograd(model, loss_fn, data, layers, fisher_type)
        A = _input_covariances(model, data, layers)
        expected = blockwise_dense(K, lambda b, A=A, B=B: kronecker(B[b.layer], A[b.layer], b))
        torch.testing.assert_close(dense(K), expected)


def test_the_conventions_side_by_side():
    """Without positions: the same for CrossEntropyLoss, the empirical B C times for MSE with
    "mean"; with positions (the transformer) different."""
    model, loss_fn, data, _ = problem("mlp", "ce")
    for fisher_type in ("type-2", "empirical", "forward-only"):
        ours = KFACOperator(model, loss_fn, None, data, fisher_type=fisher_type)
        theirs = KFACOperator(model, loss_fn, None, data, fisher_type=fisher_type,
                              convention="curvlinops")  # fmt: skip
        torch.testing.assert_close(dense(theirs), dense(ours))
    model, loss_fn, data, _ = problem("mlp", "mse")
    ours = KFACOperator(model, loss_fn, None, data, fisher_type="empirical")
    theirs = KFACOperator(model, loss_fn, None, data, fisher_type="empirical",
                          convention="curvlinops")  # fmt: skip
    for mine, other in zip(ours.blocks, theirs.blocks):
        torch.testing.assert_close(other.B, 3.0 * mine.B)
        torch.testing.assert_close(other.A, mine.A)
    model, loss_fn, data, _ = problem("transformer")
    for fisher_type in ("type-2", "empirical"):
        ours = KFACOperator(model, loss_fn, KFAC_PARAMS["transformer"], data,
                            fisher_type=fisher_type)  # fmt: skip
        theirs = KFACOperator(model, loss_fn, KFAC_PARAMS["transformer"], data,
                              fisher_type=fisher_type, convention="curvlinops")  # fmt: skip
        assert (dense(theirs) - dense(ours)).abs().max() > 1e-3
    # the convention is part of the state
    assert theirs.state_dict()["configuration"]["convention"] == "curvlinops"
    loaded = KFACOperator.from_state_dict(theirs.state_dict(), model, loss_fn,
                                          KFAC_PARAMS["transformer"], data)  # fmt: skip
    torch.testing.assert_close(dense(loaded), dense(theirs), rtol=0, atol=0)


def _curvlinops_dense(curvlinops_class, model, loss_fn, params, data, **kwargs):
    named = dict(model.named_parameters())
    names = params or list(named)
    with MathAttention():
        reference = curvlinops_class(model, loss_fn, [named[n] for n in names], data, **kwargs)
        return dense(reference)


@pytest.mark.parametrize("fisher_type", ["type-2", "empirical", "forward-only"])
@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("name", NAMES)
def test_curvlinops_convention_equals_curvlinops_kfac(name, loss_name, fisher_type):
    curvlinops = pytest.importorskip("curvlinops")
    for reduction in ("mean", "sum"):
        model, loss_fn, data, _ = problem(name, loss_name, reduction)
        for kfac_approx in ("expand", "reduce"):
            for separate in (True, False):
                options = {"fisher_type": fisher_type, "kfac_approx": kfac_approx,
                           "separate_weight_and_bias": separate}  # fmt: skip
                expected = _curvlinops_dense(curvlinops.KFACLinearOperator, model, loss_fn,
                                             KFAC_PARAMS[name], data, **options)  # fmt: skip
                K = KFACOperator(model, loss_fn, KFAC_PARAMS[name], data,
                                 convention="curvlinops", **options)  # fmt: skip
                torch.testing.assert_close(dense(K), expected)


@pytest.mark.parametrize("fisher_type", ["type-2", "empirical"])
@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("name", ["mlp", "cnn"])  # curvlinops' EKFAC takes [N, C] outputs only
def test_curvlinops_convention_equals_curvlinops_ekfac(name, loss_name, fisher_type):
    """(expand: with "reduce" the CNN's A has a null space, whose eigenbasis, and so EKFAC,
    is not unique)"""
    curvlinops = pytest.importorskip("curvlinops")
    for reduction in ("mean", "sum"):
        model, loss_fn, data, _ = problem(name, loss_name, reduction)
        for separate in (True, False):
            options = {"fisher_type": fisher_type, "separate_weight_and_bias": separate}
            expected = _curvlinops_dense(curvlinops.EKFACLinearOperator, model, loss_fn, None,
                                         data, **options)  # fmt: skip
            E = EKFACOperator(model, loss_fn, None, data, convention="curvlinops", **options)
            torch.testing.assert_close(dense(E), expected)


@pytest.mark.parametrize(
    ("operator", "options"), [(EFOperator, {}), (KFACOperator, {"fisher_type": "type-2"})]
)
def test_bad_conventions_are_refused(operator, options):
    """(for both operators with a convention, EF and KFAC)"""
    model, loss_fn, data, _ = problem("mlp")
    with pytest.raises(ValueError, match=r"convention must be one of \('avionics', 'curvl"):
        operator(model, loss_fn, None, data, convention="backpack", **options)
    with pytest.raises(ValueError, match=r"defined for MSELoss, CrossEntropyLoss and BCEWith"):
        operator(model, nn.HuberLoss(), None, data, convention="curvlinops", **options)
