"""The empirical Fisher of the data-set loss."""

from __future__ import annotations

from torch import Tensor, nn
from torch.func import grad

from avionics.curvature._losses import OutputProduct
from avionics.curvature.conventions import check_convention, class_axis, datum_scale
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

    The two conventions, side by side (``convention``):

    * ``"avionics"`` (default, the definition above): a datum is a sample n, all its
      positions together (cross-position terms included), and c_b = 1 / B for "mean" (any
      reduction over outputs inside the loss stays in l_n).
    * ``"curvlinops"`` (curvlinops' EFLinearOperator): a datum is every row r of the output
      with its class axis (axis 1 for CrossEntropyLoss, the last axis for MSELoss and
      BCEWithLogitsLoss) split off, i.e. every position of a sequence or image, and the loss
      of a datum is the sum over its C outputs (MSE, BCE):

      .. math:: F_b = \rho_b \sum_r J_r^\top G_r G_r^\top J_r, \qquad
                \rho_b = \begin{cases} R_b & \text{CrossEntropyLoss, "mean"} \\
                R_b C & \text{MSELoss, BCEWithLogitsLoss, "mean"} \\
                1 & \text{"sum"} \end{cases}

      with R_b the rows of batch b and G_r = d L_b / d f_r; batches weighted by w_b. Without
      positions this is avionics' matrix for CrossEntropyLoss and C times it for MSELoss and
      BCEWithLogitsLoss with reduction "mean"; with positions the cross-position terms are
      left out. Only these three losses (the ones curvlinops takes).

    Args:
        model, loss_fn, params, data: As for :class:`~avionics.curvature.ggn.GGNOperator`.
        convention: ``"avionics"`` or ``"curvlinops"`` (see above).
        **kwargs: As for :class:`~avionics.curvature.ggn.GGNOperator`.
    """

    def __init__(self, model, loss_fn, params, data, *, convention: str = "avionics", **kwargs):
        self._convention = check_convention(convention, loss_fn, "EFOperator")
        super().__init__(model, loss_fn, params, data, **kwargs)

    def _output_space_matrix(self, output: Tensor, y: Tensor) -> OutputProduct:
        G = grad(lambda f: self._loss_fn(f, y))(output)
        if self._convention == "curvlinops":
            return _per_row_outer_product(G, self._loss_fn)
        inverse_c = output.shape[0] if self._loss_fn.reduction == "mean" else 1.0
        inner_axes = tuple(range(1, G.ndim))

        def product(u: Tensor) -> Tensor:
            return inverse_c * G * (G * u).sum(dim=inner_axes, keepdim=True)

        return product


def _per_row_outer_product(G: Tensor, loss_fn: nn.Module) -> OutputProduct:
    """u -> rho_b blockdiag_r(G_r G_r^T) u, the rows r split along the class axis."""
    axis = class_axis(G, loss_fn, "EFOperator")
    rho = datum_scale(G, loss_fn, "EFOperator")

    def product(u: Tensor) -> Tensor:
        return rho * G * (G * u).sum(dim=axis, keepdim=True)

    return product
