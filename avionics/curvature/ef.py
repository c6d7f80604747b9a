"""The empirical Fisher of the data-set loss."""

from __future__ import annotations

from torch import Tensor
from torch.func import grad

from avionics.curvature._losses import OutputProduct
from avionics.curvature.ggn import GGNOperator


class EFOperator(GGNOperator):
    r"""The empirical Fisher F = sum_n c g_n g_n^T over the data set.

    g_n is the gradient of the loss of sample n (for a sequence: of the whole sequence, with
    the loss's own reduction over its positions) and c = 1 / N for reduction "mean", 1 for
    "sum" (Kunstner et al., "Limitations of the empirical Fisher approximation", 2019, eq. 3).
    Within a batch of size B the batch loss is L_b = c_b sum_n l_n (c_b = 1 / B or 1), so
    d L_b / df_n = c_b d l_n / df_n =: G_n and g_n = J_n^T G_n / c_b, hence

    .. math:: F_b = c_b \sum_n g_n g_n^\top = J_b^\top \Big( \tfrac{1}{c_b}
              \operatorname{blockdiag}_n(G_n G_n^\top) \Big) J_b,

    a Gauss-Newton form with the output-space matrix blockdiag(G_n G_n^T) / c_b, multiplied
    like :class:`~avionics.curvature.ggn.GGNOperator`; batches are weighted by w_b
    (B_b / N or 1). Works for any loss module with a reduction whose samples do not interact.
    """

    def _output_space_matrix(self, output: Tensor, y: Tensor) -> OutputProduct:
        G = grad(lambda f: self._loss_fn(f, y))(output)
        inverse_c = output.shape[0] if self._loss_fn.reduction == "mean" else 1.0
        inner_axes = tuple(range(1, G.ndim))

        def product(u: Tensor) -> Tensor:
            return inverse_c * G * (G * u).sum(dim=inner_axes, keepdim=True)

        return product
