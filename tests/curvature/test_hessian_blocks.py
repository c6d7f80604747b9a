"""The Hessian's block-diagonal option (block_sizes) against the dense Hessian's blocks."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import block_diagonal_part, dense_hessian, problem

from avionics.curvature import HessianOperator


def dense(A) -> torch.Tensor:
    return A @ torch.eye(A.shape[1], dtype=A.dtype)


def _groups(block_sizes: list[int]) -> list[list[int]]:
    starts = [sum(block_sizes[:i]) for i in range(len(block_sizes))]
    return [list(range(start, start + size)) for start, size in zip(starts, block_sizes)]


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_blocks_are_the_diagonal_blocks_of_the_dense_hessian(name):
    model, loss_fn, data, _ = problem(name)
    num_params = len(list(model.parameters()))
    full = dense_hessian(model, loss_fn, data)
    for block_sizes in ([1] * num_params, [2, num_params - 2], [num_params]):
        H = HessianOperator(model, loss_fn, None, data, block_sizes=block_sizes)
        expected = block_diagonal_part(full, model, _groups(block_sizes))
        # all columns together (torch.func) and a single vector (plain autograd)
        torch.testing.assert_close(dense(H), expected)
        v = torch.randn(H.shape[1], dtype=torch.float64)
        torch.testing.assert_close(H @ v, expected @ v)
        if len(block_sizes) > 1:  # the blocks drop something: the comparison can fail
            assert (full - expected).abs().max() > 1e-3


def test_block_sizes_with_a_parameter_subset():
    model, loss_fn, data, _ = problem("mlp")
    names = ["2.weight", "0.bias", "2.bias"]
    H = HessianOperator(model, loss_fn, names, data, block_sizes=[1, 2])
    full = dense(HessianOperator(model, loss_fn, names, data))
    expected = full.clone()
    expected[:15, 15:] = 0
    expected[15:, :15] = 0
    torch.testing.assert_close(dense(H), expected)


@pytest.mark.parametrize(
    ("block_sizes", "message"),
    [([1, 1], r"sum to 2, but the operator has 4 parameter tensors"),
     ([2, 0, 2], r"every entry of block_sizes must be a positive integer, got 0"),
     ([2, 1.5, 0.5], r"must be a positive integer, got 1.5"),
     (3, r"block_sizes must be a list of positive integers, got 3")],
)  # fmt: skip
def test_bad_block_sizes_are_refused(block_sizes, message):
    model, loss_fn, data, _ = problem("mlp")
    with pytest.raises(ValueError, match=message):
        HessianOperator(model, loss_fn, None, data, block_sizes=block_sizes)
