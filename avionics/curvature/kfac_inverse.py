"""The damped inverse of a Kronecker-factored operator (KFAC, EKFAC), block by block."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
from torch import Tensor

from avionics.curvature.base import CurvatureLinearOperator

DAMPING_MODES = ("exact", "factors", "heuristic")


class KFACInverseOperator(CurvatureLinearOperator):
    r"""The damped inverse of a Kronecker-factored operator, block by block, exactly.

    With exact damping every block is inverted in the eigenbasis Q_B (x) Q_A of its factors
    (B = Q_B diag(b) Q_B^T, A = Q_A diag(a) Q_A^T), where the damped block is diagonal with
    entries D_ij; the inverse is

    .. math:: V \mapsto Q_B \big[ (Q_B^\top V Q_A) \oslash D \big] Q_A^\top;

    with damping per factor, (B + lambda_B I)^{-1} (x) (A + lambda_A I)^{-1} is V -> B_inv V
    A_inv with the two inverses by Cholesky factorisations (no eigendecomposition).

    The damping (``mode`` of :meth:`~avionics.curvature.kfac.KFACOperator.inverse`):

    * ``"exact"``: (B (x) A + lambda I)^{-1}, D = b a^T + lambda (S + lambda for EKFAC, S its
      corrected eigenvalues; Grosse et al., "Studying large language model generalization
      with influence functions", 2023, eq. 21);
    * ``"factors"``: (B + lambda_B I)^{-1} (x) (A + lambda_A I)^{-1}, D = (b + lambda_B)
      (a + lambda_A)^T, with ``damping`` one lambda for both factors or the pair
      (lambda_A, lambda_B);
    * ``"heuristic"``: the factored damping with Martens & Grosse's pi ("Optimizing neural
      networks with Kronecker-factored approximate curvature", 2015, section 6.3):
      pi = sqrt((tr A / d_A) / (tr B / d_B)), lambda_A = max(pi sqrt(lambda), min_damping),
      lambda_B = max(sqrt(lambda) / pi, min_damping).

    A bias in its own block has no input factor (its A is the number 1): it gets
    (B + lambda_B I)^{-1}, with lambda_B = lambda for the heuristic (curvlinops'
    KFACInverseLinearOperator does so for a layer whose weight is not among the parameters,
    and otherwise damps the bias's B with the weight's lambda_B). The eigendecompositions
    are those of the operator; the inverse is computed once, at construction, each damped
    factor once (a weight and its bias share B).
    """

    SELF_ADJOINT = True

    def __init__(self, kfac, inverses: dict[int, tuple[Tensor, Tensor, Tensor | None]]):
        """``inverses``: per block (Q_B, Q_A, D) in the eigenbasis, or (B_inv, A_inv, None)."""
        super().__init__(kfac.in_shapes, kfac.out_shapes, kfac.dtype, kfac.device)
        self._blocks, self._inverses = kfac.blocks, inverses

    def _matmat(self, M: list[Tensor]) -> list[Tensor]:
        def apply(block, V: Tensor) -> Tensor:
            left, right, D = self._inverses[id(block)]
            if D is None:
                return left @ (V @ right)
            return left @ (((left.T @ (V @ right)) / D) @ right.T)

        return blockwise(self._blocks, M, apply)


def check_damping(damping, mode: str, min_damping: float, owner: str):
    """The damping as a number (``"exact"``, ``"heuristic"``) or a pair (lambda_A, lambda_B)
    (``"factors"``), after checking the arguments."""
    if mode not in DAMPING_MODES:
        raise ValueError(f"{owner}.inverse: mode must be one of {DAMPING_MODES}, got {mode!r}.")
    _check_damping(min_damping, owner, allow_zero=True, name="min_damping")
    if mode != "factors":
        return _check_damping(damping, owner, allow_zero=False)
    pair = damping if isinstance(damping, (tuple, list)) else (damping, damping)
    if len(pair) != 2:
        raise ValueError(
            f"{owner}.inverse: damping for mode='factors' is one number or a pair "
            f"(damping of A, damping of B), got {damping!r}."
        )
    return tuple(_check_damping(value, owner, allow_zero=True) for value in pair)


def exact_inverse(block, Q_B: Tensor, Q_A: Tensor, S: Tensor, damping: float, owner: str):
    """(Q_B, Q_A, S + damping) of a block, after checking that S + damping > 0."""
    D = S + damping
    # eigenvalues of a PSD factor come out of eigh as small as -eps * its norm
    if not bool((D > torch.finfo(D.dtype).eps * max(D.shape) * D.abs().max()).all()):
        _singular(block, owner)
    return Q_B, Q_A, D


def factored_inverse(block, damping, mode: str, min_damping: float, owner: str,
                     inverted: dict) -> tuple[Tensor, Tensor, None]:  # fmt: skip
    """((B + lambda_B I)^{-1}, (A + lambda_A I)^{-1}, None) of a block by Cholesky; a lone
    bias has no input factor to damp (its A is the number 1, its own inverse).
    ``inverted``: the damped inverses already computed, by (id(factor), lambda), which
    blocks sharing a factor (a weight and its bias) with the same damping share."""
    if mode == "heuristic":
        lambda_A, lambda_B = _heuristic_damping(block, damping, min_damping)
    else:
        lambda_A, lambda_B = damping
    A_inverse = block.A
    if block.has_weight:
        A_inverse = _damped_inverse(block, block.A, lambda_A, owner, inverted)
    return _damped_inverse(block, block.B, lambda_B, owner, inverted), A_inverse, None


def _damped_inverse(block, factor: Tensor, damping: float, owner: str, inverted: dict):
    """(factor + damping I)^{-1} by Cholesky (cached in ``inverted``)."""
    key = (id(factor), damping)
    if key not in inverted:
        damped = factor.clone()
        damped.diagonal().add_(damping)
        L, info = torch.linalg.cholesky_ex(damped)
        # singular to working precision: no factorisation, or a pivot L_ii^2 (>= the least
        # eigenvalue) at rounding level, where an exactly singular factor may land
        pivots = torch.diagonal(L).square()
        tiny = torch.finfo(L.dtype).eps * len(L) * torch.diagonal(damped).abs().max()
        if int(info) != 0 or not bool((pivots > tiny).all()):
            _singular(block, owner)
        inverted[key] = torch.cholesky_inverse(L)
    return inverted[key]


def _singular(block, owner: str):
    raise ValueError(
        f"{owner}.inverse: the damped block of {block.describe()} is singular (not positive "
        "definite); increase the damping."
    )


def _heuristic_damping(block, damping: float, min_damping: float) -> tuple[float, float]:
    """(lambda_A, lambda_B) by Martens & Grosse's pi (section 6.3): the damping of the two
    factors in the ratio of their mean eigenvalues."""
    if not block.has_weight:
        return 0.0, damping
    mean_A = float(torch.trace(block.A)) / len(block.A)
    mean_B = float(torch.trace(block.B)) / len(block.B)
    if mean_A < 0 or mean_B <= 0:  # no ratio: damp both factors alike
        return damping, damping
    pi = math.sqrt(mean_A / mean_B)
    root = math.sqrt(damping)
    return max(pi * root, min_damping), max(root / pi, min_damping)


def _check_damping(value, owner: str, *, allow_zero: bool, name: str = "damping") -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value < math.inf:
        if value > 0 or (allow_zero and value == 0):
            return float(value)
    kind = "non-negative" if allow_zero else "positive"
    raise ValueError(
        f"{owner}.inverse: {name} must be {kind} and finite, got {value!r}; pass e.g. {name}=1e-3."
    )


def blockwise(
    blocks: list,
    M: list[Tensor],
    apply: Callable[..., Tensor],
) -> list[Tensor]:
    """Apply each block's map to its parameters' columns, as matrices V [K, d_out, d_in].

    The maps multiply V by the input-side matrix first, (V @ A): one matrix product of
    [K d_out, d_in] by [d_in, d_in], the larger of the two, faster than K batched ones."""
    result = [None] * len(M)
    for block in blocks:
        # weights [K, d_out, C_in (kh kw)], biases [K, d_out, 1]
        parts = [M[i].reshape(M[i].shape[0], M[i].shape[1], -1) for i in block.param_indices]
        AV = apply(block, parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
        widths = [p.shape[-1] for p in parts]
        for i, part in zip(block.param_indices, AV.split(widths, dim=2)):
            result[i] = part.reshape(M[i].shape)
    return result
