"""Every curvature operator, turned dense (A @ I), against a dense autograd reference."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import (
    dense_empirical_fisher,
    dense_ggn,
    dense_hessian,
    dense_jacobian,
    problem,
)

from avionics.curvature import (
    EFOperator,
    GGNOperator,
    HessianOperator,
    JacobianOperator,
    MCFisherOperator,
    _data,
)

CURVATURES = {
    "hessian": (HessianOperator, dense_hessian),
    "ggn": (GGNOperator, dense_ggn),
    "ef": (EFOperator, dense_empirical_fisher),
}
MLP_CASES = [(loss, reduction) for loss in ("mse", "ce", "bce") for reduction in ("mean", "sum")]


def dense(A) -> torch.Tensor:
    return A @ torch.eye(A.shape[1], dtype=A.dtype)


@pytest.mark.parametrize("loss_name,reduction", MLP_CASES)
@pytest.mark.parametrize("curvature", CURVATURES)
def test_mlp_every_loss_and_reduction(curvature, loss_name, reduction):
    model, loss_fn, data, _ = problem("mlp", loss_name, reduction)
    operator, reference = CURVATURES[curvature]
    A = operator(model, loss_fn, None, data)
    torch.testing.assert_close(dense(A), reference(model, loss_fn, data))


def test_named_parameter_subset():
    model, loss_fn, data, _ = problem("mlp")
    names = ["2.weight", "0.bias"]
    H = HessianOperator(model, loss_fn, names, data)
    assert H.in_shapes == [model[2].weight.shape, model[0].bias.shape]
    full = dense_hessian(model, loss_fn, data)
    # positions of the chosen parameters in the full flat vector
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    offsets, start = {}, 0
    for n, size in sizes.items():
        offsets[n] = torch.arange(start, start + size)
        start += size
    index = torch.cat([offsets[n] for n in names])
    torch.testing.assert_close(dense(H), full[index][:, index])
    # the same subset given as parameter tensors
    H2 = HessianOperator(model, loss_fn, [model[2].weight, model[0].bias], data)
    torch.testing.assert_close(dense(H2), dense(H))


def test_function_model_with_dict_params():
    model, loss_fn, data, _ = problem("mlp")
    params = {n: p.detach() for n, p in model.named_parameters()}

    def function(p, X):
        hidden = torch.tanh(X @ p["0.weight"].T + p["0.bias"])
        return hidden @ p["2.weight"].T + p["2.bias"]

    G = GGNOperator(function, loss_fn, params, data)
    torch.testing.assert_close(dense(G), dense_ggn(model, loss_fn, data))


def test_any_loss_module_with_a_reduction():
    """The exact Hessian and GGN take losses without a closed form (here: Huber)."""
    model, _, data, _ = problem("mlp", "mse")
    loss_fn = torch.nn.HuberLoss(reduction="sum", delta=0.5)
    torch.testing.assert_close(
        dense(GGNOperator(model, loss_fn, None, data)), dense_ggn(model, loss_fn, data)
    )
    torch.testing.assert_close(
        dense(HessianOperator(model, loss_fn, None, data)), dense_hessian(model, loss_fn, data)
    )


def test_num_data_given_is_the_number_of_samples():
    """A given num_data saves the counting pass and must be the size of data itself (a
    mismatch is an error: test_operator_reliability.py)."""
    model, loss_fn, data, _ = problem("mlp")
    counted = HessianOperator(model, loss_fn, None, data)
    given = HessianOperator(model, loss_fn, None, data, num_data=9)
    assert counted.num_data == given.num_data == 9
    torch.testing.assert_close(dense(given), dense(counted), rtol=0, atol=0)


def test_linearisation_bytes_count_the_saved_activations_not_the_parameters():
    # Linear saves its input [5, 3] for the weight's gradient (the weight, a parameter, is
    # left out); tanh saves its output [5, 4]: float64, 8 bytes an entry
    layer = torch.nn.Linear(3, 4).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    params = list(layer.parameters())
    assert _data.linearisation_bytes(lambda: layer(x), params) == 5 * 3 * 8
    assert _data.linearisation_bytes(lambda: torch.tanh(layer(x)), params) == (5 * 3 + 5 * 4) * 8


def _dense_in_blocks(operator, monkeypatch, columns_per_block: int) -> torch.Tensor:
    """``dense(operator)`` with ``COLUMN_BLOCK_BYTES`` set so that a vmapped block holds
    ``columns_per_block`` columns (1: the columns go one at a time)."""
    first_batch = operator._data[0][0]
    saved = _data.linearisation_bytes(
        lambda: operator._output(operator._leaves, first_batch), operator._leaves
    )
    monkeypatch.setattr(_data, "COLUMN_BLOCK_BYTES", columns_per_block * saved)
    operator._linearisation_bytes = None
    assert operator._columns_per_block(first_batch) == columns_per_block
    return dense(operator)


@pytest.mark.parametrize("columns_per_block", [1, 2])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
@pytest.mark.parametrize("curvature", CURVATURES)
def test_columns_in_blocks_or_one_at_a_time_are_exact(monkeypatch, curvature, name,
                                                      columns_per_block):  # fmt: skip
    model, loss_fn, data, _ = problem(name)
    operator, reference = CURVATURES[curvature]
    A = operator(model, loss_fn, None, data)
    blocks = _dense_in_blocks(A, monkeypatch, columns_per_block)
    torch.testing.assert_close(blocks, reference(model, loss_fn, data))


@pytest.mark.parametrize("columns_per_block", [1, 2])
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_jacobians_in_blocks_or_one_at_a_time_are_exact(monkeypatch, name, columns_per_block):
    model, _, data, _ = problem(name)
    J = JacobianOperator(model, None, data)
    reference = dense_jacobian(model, data)
    torch.testing.assert_close(_dense_in_blocks(J, monkeypatch, columns_per_block), reference)
    transposed = _dense_in_blocks(J.adjoint(), monkeypatch, columns_per_block)
    torch.testing.assert_close(transposed, reference.T)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_mc_fisher_columns_one_at_a_time_share_the_sample_of_all_at_once(monkeypatch, name):
    model, loss_fn, data, _ = problem(name)
    F = MCFisherOperator(model, loss_fn, None, data, mc_samples=2, seed=3)
    all_at_once = dense(F)
    torch.testing.assert_close(_dense_in_blocks(F, monkeypatch, 1), all_at_once)
    torch.testing.assert_close(all_at_once, all_at_once.T)
