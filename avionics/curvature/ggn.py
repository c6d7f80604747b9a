"""The generalized Gauss-Newton matrix of the data-set loss."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.func import jvp, vjp

from avionics.curvature._data import ModelDataOperator
from avionics.curvature._losses import OutputProduct, output_hessian_product


class GGNOperator(ModelDataOperator):
    r"""The generalized Gauss-Newton matrix G = sum_b w_b J_b^T (d2 L_b / df2) J_b.

    J_b = d f(theta, X_b) / d theta is the Jacobian of the batch output and d2 L_b / df2 the
    Hessian of the batch loss w.r.t. that output (Schraudolph, "Fast curvature matrix-vector
    products for second-order gradient descent", 2002, eq. 7); w_b as in
    :mod:`avionics.curvature._data`, eq. (1). A product is

    .. math:: G v = \sum_b w_b \, J_b^\top \big( \Lambda_b (J_b v) \big),

    J_b v by forward mode (jvp) and J_b^T by a reverse pass (vjp), all columns in parallel
    with torch.func.vmap (the forward passes act on the unbatched parameters, so the columns
    share them); a single vector by plain autograd, J v carried as a forward-mode tangent
    through the forward pass that J^T goes back through. Lambda_b = d2 L_b / df2 is in
    closed form for MSELoss, CrossEntropyLoss and BCEWithLogitsLoss (by automatic
    differentiation for any other loss). Subclasses swap Lambda_b for another output-space
    matrix (:meth:`_output_space_matrix`).

    With ``data`` a shard of a data set across torch.distributed processes (``distributed``),
    G is that of the whole data set, one all_reduce per product (as for
    :class:`~avionics.curvature.hessian.HessianOperator`); so is every subclass's matrix.

    Args:
        model: The network (an ``nn.Module``) or a function ``model(params, X)``.
        loss_fn: A loss module ``loss_fn(output, y)`` with reduction "mean" or "sum".
        params: The parameters; ``None`` for all that require grad.
        data: A re-iterable of (X, y) batches.
        **kwargs: ``num_data``, ``batch_size_fn``, ``check_deterministic``, ``progressbar``,
            ``chunk_size``, ``distributed`` (see
            :class:`~avionics.curvature._data.ModelDataOperator`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from avionics.curvature import GGNOperator
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(3, 2).double()
        >>> X, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
        >>> G = GGNOperator(model, nn.CrossEntropyLoss(), None, [(X, y.argmax(1))])
        >>> dense = G @ torch.eye(G.shape[1], dtype=torch.float64)
        >>> dense.shape, bool(torch.allclose(dense, dense.T))
        (torch.Size([8, 8]), True)
        >>> # positive semi-definite, unlike the Hessian of a non-convex loss
        >>> bool(torch.linalg.eigvalsh(dense).min() > -1e-12)
        True
    """

    def __init__(self, model, loss_fn, params, data, **kwargs):
        super().__init__(model, loss_fn, params, data, **kwargs)

    def _output_space_matrix(self, output: Tensor, y: Tensor) -> OutputProduct:
        """Lambda_b: the symmetric matrix between J_b^T and J_b, as a product u -> Lambda_b u."""
        return output_hessian_product(self._loss_fn, output, y)

    def _column_product(self, X, y):
        def output_fn(params):
            return self._output(params, X)

        middle = self._output_space_matrix(output_fn(self._params), y)

        def product(v: list[Tensor]) -> list[Tensor]:
            _, Jv = jvp(output_fn, (self._params,), (v,))
            # built inside the vmap: its backward batches better than one built outside
            _, output_vjp = vjp(output_fn, self._params)
            return output_vjp(middle(Jv))[0]

        return product

    def _vector_product(self, X, y, v: list[Tensor]) -> list[Tensor]:
        # J v by forward-mode autograd in the same forward pass that J^T then goes back through
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(p, t) for p, t in zip(self._leaves, v)]
            output, Jv = forward_ad.unpack_dual(self._output(duals, X))
        middle = self._output_space_matrix(output.detach(), y)
        return list(torch.autograd.grad(output, self._leaves, middle(Jv), materialize_grads=True))
