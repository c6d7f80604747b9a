"""The Hessian of the data-set loss w.r.t. the parameters, in full or block-diagonal."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.func import grad, vjp

from avionics.curvature._data import ModelDataOperator, check_positive_int


class HessianOperator(ModelDataOperator):
    r"""The Hessian of the data-set loss, H = sum_b w_b d2 L_b / dtheta2, or its blocks.

    With L_b the loss of batch b and w_b its weight (B_b / N for reduction "mean", 1 for
    "sum"; see :mod:`avionics.curvature._data`, eq. (1)),

    .. math:: H v = \sum_b w_b \, \nabla_\theta \big( \nabla_\theta L_b(\theta)^\top v \big),

    a Hessian-vector product by reverse-over-reverse differentiation (Pearlmutter, "Fast
    exact multiplication by the Hessian", 1994): per batch one forward and one backward
    pass build the gradient, then every column costs one backward through the gradient; all
    columns go through that backward together (torch.func.vmap over the vjp of the
    gradient; a single vector by plain autograd double backward).

    ``block_sizes`` [n_1, ..., n_G] (positive, summing to the number of parameter tensors)
    splits the parameters, in their order, into G consecutive groups: the first n_1 tensors,
    the next n_2, ... The operator is then the block-diagonal part of H,

    .. math:: \operatorname{blockdiag}(H_{11}, \dots, H_{GG}), \qquad
              H_{gg} = \sum_b w_b \, \partial^2 L_b / \partial \theta_g^2,

    zero between groups (the ``block_sizes`` of curvlinops' HessianLinearOperator: ``[len
    (params)]`` is the full Hessian, ``[1, 1, ...]`` one block per tensor). Each block costs
    one gradient of its own group and one backward through it per product.

    With ``data`` a shard of a data set across torch.distributed processes (``distributed``,
    on by default when torch.distributed is initialised with several processes), H is that of
    the whole data set, the same on every process: each process sums its batches (weights
    B_b / N with N the whole data set's size) and one all_reduce per product adds the sums.

    Args:
        model: The network (an ``nn.Module``) or a function ``model(params, X)``.
        loss_fn: Any loss module ``loss_fn(output, y)`` with reduction "mean" or "sum".
        params: The parameters (see :class:`~avionics.curvature._data.ModelDataOperator`);
            ``None`` for all that require grad.
        data: A re-iterable of (X, y) batches.
        block_sizes: ``None`` (the full Hessian) or the sizes of the consecutive parameter
            groups whose diagonal blocks the operator keeps.
        **kwargs: ``num_data``, ``batch_size_fn``, ``check_deterministic``, ``progressbar``,
            ``chunk_size``, ``distributed`` (see
            :class:`~avionics.curvature._data.ModelDataOperator`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from avionics.curvature import HessianOperator
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(3, 2, bias=False).double()
        >>> X, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
        >>> H = HessianOperator(model, nn.MSELoss(reduction="sum"), None, [(X, y)])
        >>> H.shape
        (6, 6)
        >>> # the Hessian of sum ||W x - y||^2 is 2 I (x) X^T X
        >>> torch.allclose(H @ torch.eye(6, dtype=torch.float64),
        ...                2 * torch.kron(torch.eye(2, dtype=torch.float64), X.T @ X))
        True
    """

    def __init__(self, model, loss_fn, params, data, *, block_sizes: Sequence[int] | None = None,
                 **kwargs):  # fmt: skip
        self._block_sizes = block_sizes
        super().__init__(model, loss_fn, params, data, **kwargs)

    def _in_shapes(self) -> list[torch.Size]:
        # the first call after the parameters are resolved: check block_sizes against them
        self._groups = _parameter_groups(self._block_sizes, len(self._params))
        return super()._in_shapes()

    def _column_product(self, X, y):
        if len(self._groups) == 1:
            _, hessian_vjp = vjp(grad(lambda params: self._loss(params, X, y)), self._params)
            return lambda v: hessian_vjp(v)[0]
        block_vjps = [self._block_vjp(group, X, y) for group in self._groups]

        def product(v: list[Tensor]) -> list[Tensor]:
            return [hv for group, block_vjp in zip(self._groups, block_vjps)
                    for hv in block_vjp([v[i] for i in group])]  # fmt: skip

        return product

    def _block_vjp(self, group: range, X, y):
        """v_g -> H_gg v_g: the vjp of the gradient of the loss as a function of group g."""

        def group_loss(group_params: list[Tensor]) -> Tensor:
            params = list(self._params)
            params[group.start : group.stop] = group_params
            return self._loss(params, X, y)

        _, hessian_vjp = vjp(grad(group_loss), self._params[group.start : group.stop])
        return lambda v_g: hessian_vjp(v_g)[0]

    def _vector_product(self, X, y, v: list[Tensor]) -> list[Tensor]:
        loss = self._loss(self._leaves, X, y)
        gradient = torch.autograd.grad(loss, self._leaves, create_graph=True)
        products = []
        for group in self._groups:  # one backward per block, through its own gradients
            leaves = self._leaves[group.start : group.stop]
            products += torch.autograd.grad(
                gradient[group.start : group.stop], leaves, v[group.start : group.stop],
                retain_graph=group.stop < len(self._leaves), materialize_grads=True,
            )  # fmt: skip
        return products


def _parameter_groups(block_sizes, num_params: int) -> list[range]:
    """The index ranges of the consecutive parameter groups of ``block_sizes``."""
    if block_sizes is None:
        return [range(num_params)]
    instead = f"pass positive group sizes that sum to the {num_params} parameter tensors"
    if isinstance(block_sizes, (str, bytes)) or not isinstance(block_sizes, Sequence):
        raise ValueError(
            f"HessianOperator: block_sizes must be a list of positive integers, got "
            f"{block_sizes!r}; {instead}, e.g. [1] * {num_params}."
        )
    sizes = [check_positive_int(s, "every entry of block_sizes", "HessianOperator", instead)
             for s in block_sizes]  # fmt: skip
    if sum(sizes) != num_params:
        raise ValueError(
            f"HessianOperator: block_sizes {sizes} sum to {sum(sizes)}, but the operator has "
            f"{num_params} parameter tensors; {instead} (e.g. [{num_params}] for the full "
            "Hessian)."
        )
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(start, start + size) for start, size in zip(starts, sizes)]
