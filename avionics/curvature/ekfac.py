"""EKFAC: KFAC with its eigenvalues corrected to the exact second moments."""

from __future__ import annotations

import torch
from torch import Tensor

from avionics.curvature.base import CurvatureLinearOperator
from avionics.curvature.kfac import KFACOperator, KroneckerBlock
from avionics.curvature.kfac_inverse import blockwise, left_product, right_product


class EKFACOperator(KFACOperator):
    r"""EKFAC: KFAC with its eigenvalues corrected to the exact second moments.

    In the eigenbasis of B (x) A (B = Q_B diag(b) Q_B^T, A = Q_A diag(a) Q_A^T) KFAC's
    eigenvalues b_i a_j are replaced by the diagonal of the curvature block in that basis
    (George et al., "Fast approximate natural gradient descent in a Kronecker-factored
    eigenbasis", 2018, eq. 7),

    .. math:: S_{ij} = \sum_b w_b \sum_{k, n} \big( Q_B^\top G_{k,n} Q_A \big)_{ij}^2,
              \qquad G_{k,n} = \sum_r g_{k,n,r} a_{n,r}^\top,

    G_{k,n} the per-sample gradients of the backpropagated vectors (see
    :class:`KFACOperator`), computed in a second pass over the data with the same draws. The
    product is Q_B ((Q_B^T V Q_A) * S) Q_A^T. For sharded data the eigenbases are those of
    the all-reduced factors, the same on every process, and one all_reduce adds the
    processes' sums S. Arguments as for :class:`KFACOperator` (but not ``"forward-only"``:
    the corrections need the backpropagated vectors). :meth:`trace`, :meth:`logdet`,
    :meth:`det` and :meth:`frobenius_norm` are those of the corrected eigenvalues S; the
    inverse has exact damping only.
    """

    FISHER_TYPES = ("mc", "type-2", "empirical")
    STATE_FACTORS = ("B", "A", "Q_B", "Q_A", "S")

    def _compute_factors(self) -> None:
        super()._compute_factors()
        eigenvectors: dict[int, Tensor] = {}  # each factor once (a weight and its bias share B)

        def eigenbasis(factor: Tensor) -> Tensor:
            if id(factor) not in eigenvectors:
                eigenvectors[id(factor)] = torch.linalg.eigh(factor)[1]
            return eigenvectors[id(factor)]

        bases = {id(block): (eigenbasis(block.B), eigenbasis(block.A)) for block in self.blocks}
        shapes = [(len(Q_B), len(Q_A)) for Q_B, Q_A in bases.values()]
        corrections = self._sum_over_processes(
            lambda: self._local_corrections(bases), shapes, "eigenvalue corrections"
        )
        self._spectra = {
            id(block): (Q_B, Q_A, None, None, S)
            for block, (Q_B, Q_A), S in zip(self.blocks, bases.values(), corrections)
        }

    def _local_corrections(self, bases: dict) -> list[Tensor]:
        """S of every block over this process's data, from the eigenbases (Q_B, Q_A)."""
        S = {
            key: torch.zeros(len(Q_B), len(Q_A), dtype=self.dtype, device=self.device)
            for key, (Q_B, Q_A) in bases.items()
        }
        for weight, layer, a, g, calls in self._backpropagated_rows("eigenvalue correction"):
            if len(calls) > 1 and self._convention == "curvlinops":
                raise ValueError(
                    f"{type(self).__name__}: a layer is called {len(calls)} times in the forward "
                    "pass; curvlinops' EKFAC pairs every call's output gradients with the last "
                    "call's inputs, which is no defined matrix; use convention='avionics' (all "
                    "calls' rows together) or KFACOperator."
                )
            for block in (b for b in self.blocks if b.layer is layer):
                Q_B, Q_A = bases[id(block)]
                rows = a if block.has_weight else torch.ones_like(a[..., :1])
                R, d_out, d_A = rows.shape[1], len(Q_B), len(Q_A)
                if R == 1:
                    # one row per sample: G_{k,n} = g_{k,n} a_n^T is of rank one, so
                    # (Q_B^T G Q_A)_ij^2 = (Q_B^T g)_i^2 (Q_A^T a)_j^2 and S a matrix product
                    squares = (g[:, :, 0] @ Q_B).square().sum(dim=0)  # [N, d_out]
                    S[id(block)].addmm_(squares.T, (rows[:, 0] @ Q_A).square(), alpha=weight)
                    continue
                # Q_B^T G_{k,n} Q_A with each rotation where it costs less: on the R rows of
                # g (R d_out^2 a sample) or on G (d_out^2 d_A), of a (R d_A^2) or G (d_out d_A^2)
                g_side = g @ Q_B if R < d_A else g  # [K, N, R, d_out]
                a_side = rows @ Q_A if R < d_out else rows  # [N, R, d_A]
                rotated = torch.einsum("knro,nri->knoi", g_side, a_side)
                if R >= d_A:
                    rotated = Q_B.T @ rotated
                if R >= d_out:
                    rotated = rotated @ Q_A
                S[id(block)].add_(rotated.square_().sum(dim=(0, 1)), alpha=weight)  # a new tensor
        return [S[id(block)] for block in self.blocks]

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        def apply(block: KroneckerBlock, V: Tensor, result: Tensor) -> None:
            Q_B, Q_A, _, _, S = self._spectra[id(block)]  # Q_B [(Q_B^T V Q_A) * S] Q_A^T
            rotated = left_product(Q_B.T, right_product(V, Q_A)).mul_(S.unsqueeze(1))
            left_product(Q_B, right_product(rotated, Q_A.T), result)

        blockwise(self.blocks, M, out, apply)

    def inverse(self, damping: float, *, mode: str = "exact",
                min_damping: float = 1e-8) -> CurvatureLinearOperator:  # fmt: skip
        """The damped inverse (EKFAC + damping I)^{-1}, block by block (KFACInverseOperator);
        only ``mode="exact"``: EKFAC is no Kronecker product whose factors could be damped."""
        if mode != "exact":
            raise ValueError(
                f"EKFACOperator.inverse supports mode='exact' only (its corrected eigenvalues "
                f"are not products of two factors' eigenvalues), got mode={mode!r}; use "
                "KFACOperator for damping per factor."
            )
        return super().inverse(damping, mode=mode, min_damping=min_damping)

    def _eigenvalues(self) -> Tensor:
        """The corrected eigenvalues S of every block, flat: EKFAC's spectrum."""
        return torch.cat([self._spectra[id(block)][4].flatten() for block in self.blocks])

    def trace(self) -> Tensor:
        """tr = sum of the corrected eigenvalues."""
        return self._eigenvalues().sum()

    def logdet(self) -> Tensor:
        """log det = sum of the logs of the corrected eigenvalues (-inf if one is 0)."""
        return self._eigenvalues().log().sum()

    def det(self) -> Tensor:
        """det = product of the corrected eigenvalues (prefer :meth:`logdet`)."""
        return self._eigenvalues().prod()

    def frobenius_norm(self) -> Tensor:
        """||EKFAC||_F = the 2-norm of the corrected eigenvalues (Q_B (x) Q_A is orthogonal)."""
        return self._eigenvalues().norm()

    def _factor_state(self) -> list[dict[str, Tensor]]:
        # the eigenbases too: eigh's eigenvectors are unique up to signs and rotations only
        return [{"B": block.B, "A": block.A, "Q_B": self._spectra[id(block)][0],
                 "Q_A": self._spectra[id(block)][1], "S": self._spectra[id(block)][4]}
                for block in self.blocks]  # fmt: skip

    def _load_factor_state(self, factors: list[dict[str, Tensor]]) -> None:
        for block, entry in zip(self.blocks, factors):
            block.B, block.A = entry["B"], entry["A"]
        self._spectra = {id(block): (entry["Q_B"], entry["Q_A"], None, None, entry["S"])
                         for block, entry in zip(self.blocks, factors)}  # fmt: skip
