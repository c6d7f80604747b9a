"""Curvature of a network's loss over a data set, as matrix-free operators (docs/curvature.md).

Every operator is a :class:`CurvatureLinearOperator`: ``A @ X`` on flat vectors and matrices,
lists of per-parameter tensors and NumPy arrays; lazy ``A + B``, ``A - B``, ``c * A``,
``A @ B``, ``A.adjoint()``; ``A.to_scipy()``; ``SubmatrixOperator(A, rows, columns)`` and
``LSMRInverseOperator(A)``. The algorithms (:mod:`.algorithms`) take any operator or dense
tensor. On a data set sharded across torch.distributed processes (``distributed``) every
operator of a loss is that of the whole data set, on every process.
"""

from avionics.curvature import algorithms
from avionics.curvature.activation_hessian import ActivationHessianOperator
from avionics.curvature.algorithms import *  # noqa: F403 (re-exported: see __all__)
from avionics.curvature.base import CurvatureLinearOperator, IdentityOperator
from avionics.curvature.ef import EFOperator
from avionics.curvature.ekfac import EKFACOperator
from avionics.curvature.ggn import GGNOperator
from avionics.curvature.hessian import HessianOperator
from avionics.curvature.jacobian import JacobianOperator, TransposedJacobianOperator
from avionics.curvature.kfac import KFACOperator
from avionics.curvature.kfac_inverse import KFACInverseOperator
from avionics.curvature.lsmr_inverse import LSMRInverseOperator
from avionics.curvature.mc_fisher import MCFisherOperator
from avionics.curvature.submatrix import SubmatrixOperator

__all__ = [
    "ActivationHessianOperator",
    "CurvatureLinearOperator",
    "EFOperator",
    "EKFACOperator",
    "GGNOperator",
    "HessianOperator",
    "IdentityOperator",
    "JacobianOperator",
    "KFACInverseOperator",
    "KFACOperator",
    "LSMRInverseOperator",
    "MCFisherOperator",
    "SubmatrixOperator",
    "TransposedJacobianOperator",
    *algorithms.__all__,
]
