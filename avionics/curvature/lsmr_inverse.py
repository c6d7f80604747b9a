"""The inverse of an operator as an operator, by LSMR solves."""

from __future__ import annotations

from torch import Tensor

from avionics.curvature.algorithms.lsmr import lsmr
from avionics.curvature.base import CurvatureLinearOperator, joined_columns, split_columns


class LSMRInverseOperator(CurvatureLinearOperator):
    r"""A^{-1} (for a square, non-singular A; the damped least-squares solution operator
    (A^T A + damping^2 I)^{-1} A^T in general) as an operator: X -> the LSMR solutions of
    A Y = X, all columns of X in one batched solve
    (:func:`~avionics.curvature.algorithms.lsmr`; curvlinops' LSMRInverseLinearOperator).

    It maps A's output space to its input space, so it is square only for a square A; its
    adjoint is the LSMR inverse of A's adjoint ((A^{-1})^T = (A^T)^{-1}). The result of the
    last product is kept in :attr:`last_result` (iterations, convergence, residual norms).

    Args:
        A: Any :class:`~avionics.curvature.base.CurvatureLinearOperator` (with its adjoint).
        **options: ``damping``, ``atol``, ``btol``, ``maxiter`` of
            :func:`~avionics.curvature.algorithms.lsmr`.

    Example:
        >>> import torch
        >>> from avionics.curvature import IdentityOperator, LSMRInverseOperator
        >>> A = 2.0 * IdentityOperator([(3,)], dtype=torch.float64)
        >>> LSMRInverseOperator(A) @ torch.ones(3, dtype=torch.float64)
        tensor([0.5000, 0.5000, 0.5000], dtype=torch.float64)
    """

    def __init__(self, A: CurvatureLinearOperator, **options):
        unknown = set(options) - {"damping", "atol", "btol", "maxiter"}
        if unknown:
            raise TypeError(
                f"LSMRInverseOperator got unknown options {sorted(unknown)}; it takes damping, "
                "atol, btol and maxiter (those of lsmr)."
            )
        super().__init__(A.out_shapes, A.in_shapes, A.dtype, A.device)
        self._A, self._options = A, options
        self.SELF_ADJOINT = A.SELF_ADJOINT
        self.last_result = None

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        self.last_result = lsmr(self._A, joined_columns(M), **self._options)  # [rows of A, K]
        for x, solution in zip(out, split_columns(self.last_result.solution, self.out_shapes)):
            x.copy_(solution)

    def _adjoint(self) -> LSMRInverseOperator:
        return LSMRInverseOperator(self._A.adjoint(), **self._options)
