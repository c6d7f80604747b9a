"""The Hessian of the data-set loss w.r.t. the parameters."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import grad, vjp

from avionics.curvature._data import ModelDataOperator


class HessianOperator(ModelDataOperator):
    r"""The Hessian of the data-set loss, H = sum_b w_b d2 L_b / dtheta2.

    With L_b the loss of batch b and w_b its weight (B_b / N for reduction "mean", 1 for
    "sum"; see :mod:`avionics.curvature._data`, eq. (1)),

    .. math:: H v = \sum_b w_b \, \nabla_\theta \big( \nabla_\theta L_b(\theta)^\top v \big),

    a Hessian-vector product by reverse-over-reverse differentiation (Pearlmutter, "Fast
    exact multiplication by the Hessian", 1994): per batch one forward and one backward
    pass build the gradient, then every column costs one backward through the gradient; all
    columns go through that backward together (torch.func.vmap over the vjp of the
    gradient; a single vector by plain autograd double backward).

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
        **kwargs: ``num_data``, ``batch_size_fn``, ``check_deterministic``, ``progressbar``,
            ``chunk_size``, ``distributed`` (see
            :class:`~avionics.curvature._data.ModelDataOperator`).
    """

    def __init__(self, model, loss_fn, params, data, **kwargs):
        super().__init__(model, loss_fn, params, data, **kwargs)

    def _column_product(self, X, y):
        _, hessian_vjp = vjp(grad(lambda params: self._loss(params, X, y)), self._params)
        return lambda v: hessian_vjp(v)[0]

    def _vector_product(self, X, y, v: list[Tensor]) -> list[Tensor]:
        loss = self._loss(self._leaves, X, y)
        gradient = torch.autograd.grad(loss, self._leaves, create_graph=True)
        return list(torch.autograd.grad(gradient, self._leaves, v, materialize_grads=True))
