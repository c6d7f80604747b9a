"""The rows of KFAC's factors: layer inputs and backpropagated vectors as rows, and their
Gram matrices."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from avionics.persample.rules.conv import _padded

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def accumulate_gram(sums: list, i: int, rows: Tensor, weight: float) -> None:
    """sums[i] += weight rows^T rows (sums[i] made at the first batch). Of a wide Gram matrix
    (d >= 512) only the blocks on and above the diagonal are multiplied, in 4 row blocks,
    and mirrored: 5/8 of the products (for 128 rows of 784 on one thread, 1.2 ms for 1.6)."""
    d = rows.shape[1]
    first = sums[i] is None
    if first:
        sums[i] = rows.new_empty(d, d)
    gram, parts = sums[i], 4 if d >= 512 else 1
    edges = [d * k // parts for k in range(parts + 1)]
    for start, end in zip(edges[:-1], edges[1:]):
        # beta = 0 ignores the uninitialised entries of a new sum
        gram[start:end, start:].addmm_(rows[:, start:end].T, rows[:, start:],
                                       beta=0.0 if first else 1.0, alpha=weight)  # fmt: skip
        gram[end:, start:end].copy_(gram[start:end, end:].T)


def input_rows(layer: nn.Module, a: Tensor, joint_bias: bool) -> Tensor:
    """The rows a_r of the layer input, [N, R, d_in] (+ a column of ones for a joint bias):
    for a convolution its unfolded patches, one row per output position."""
    if isinstance(layer, CONVOLUTIONS):
        a = patch_rows(layer, a)
    a = a.reshape(a.shape[0], -1, a.shape[-1])
    if joint_bias:
        a = torch.cat([a, torch.ones_like(a[..., :1])], dim=-1)
    return a


def output_rows(layer: nn.Module, g: Tensor) -> Tensor:
    """The rows g_{k,n,r} of the vectors backpropagated to the layer output, [K, N, R, d_out]."""
    if isinstance(layer, CONVOLUTIONS):
        g = g.flatten(3).transpose(-1, -2)  # [K, N, positions, C_out]
    return g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])


def patch_rows(layer: nn.Module, x: Tensor) -> Tensor:
    """The unfolded patches of a convolution's input [N, C_in, *spatial] as rows
    [N, positions, C_in prod(kernel)] (the weight's column layout; any padding, padding
    mode, stride and dilation), gathered in one copy from the windows of the channels-last
    input. (F.unfold's [N, C_in prod(kernel), positions], transposed, took two copies: the
    3c3d's three layers 127 ms, these 67.)"""
    x, padding = _padded(layer, x)
    dims = x.dim() - 2
    padding = (padding,) * dims if isinstance(padding, int) else tuple(padding)
    if any(padding):
        x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])  # zeros on both sides
    x = x.movedim(1, -1).contiguous()  # [N, *spatial, C_in]
    step = x.stride()[1:-1]
    positions = [(size - dilation * (k - 1) - 1) // stride + 1
                 for size, k, stride, dilation in zip(x.shape[1:-1], layer.kernel_size,
                                                      layer.stride, layer.dilation)]  # fmt: skip
    windows = x.as_strided(
        (len(x), *positions, x.shape[-1], *layer.kernel_size),  # [N, *positions, C_in, *kernel]
        (x.stride(0), *(s * t for s, t in zip(step, layer.stride)), 1,
         *(s * d for s, d in zip(step, layer.dilation))),
    )  # fmt: skip
    return windows.reshape(len(x), math.prod(positions), -1)
