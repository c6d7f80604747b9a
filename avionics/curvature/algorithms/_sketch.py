"""The first stage XTrace and XDiag share (Epperly, Tropp, Webber 2024, Sec. 2).

A randomized range finder Q R = A Omega with m test vectors, Z = A Q (XTrace) or Z = A^T Q
(XDiag: diag(Q Q^T A) needs the rows Q^T A; 2m products in all), and
S = the column-normalised R^{-T}: Q S e_i is the direction that leaving out test vector w_i
removes from range(Q), which makes the exchangeable (leave-one-out) estimators cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from ._matmul import _adjoint_matmul, _as_matmul, _generator, _random
from ._progress import check_progress, progress_bar


@dataclass
class ExchangeableSketch:
    omega: Tensor  # the test vectors, [D, m]
    Y: Tensor  # A Omega
    Q: Tensor
    R: Tensor
    Z: Tensor  # A Q, or A^T Q

    @property
    def m(self) -> int:
        return self.omega.shape[1]

    @property
    def rank_deficient(self) -> bool:
        """A Omega has lower rank than m: range(Q) contains range(A), the sketch is exact."""
        rdiag = torch.diagonal(self.R).abs()
        return bool(rdiag.min() <= 100 * torch.finfo(self.R.dtype).eps * rdiag.max())

    @cached_property
    def S(self) -> Tensor:
        eye = torch.eye(self.m, dtype=self.R.dtype, device=self.R.device)
        S = torch.linalg.solve_triangular(self.R.T, eye, upper=False)
        return S / S.norm(dim=0, keepdim=True)


def exchangeable_sketch(A, num_products: int, kind: str, name: str, seed, generator, progress,
                        transpose: bool = False):  # fmt: skip
    """The sketch of ``A`` with m = num_products // 2 test vectors of ``kind`` (m <= D), its
    2m products behind a progress bar (see :mod:`._progress`) named ``name``; Z = A^T Q
    (by ``A.adjoint()``) if ``transpose``, else A Q."""
    mm = _as_matmul(A)
    second = _adjoint_matmul(A, name) if transpose else mm
    m = num_products // 2
    if m < 2:
        raise ValueError(f"{name} needs num_products >= 4, got {num_products}")
    check_progress(name, progress)
    m = min(m, mm.dim)
    omega = _random((mm.dim, m), kind, _generator(seed, generator, mm.device), mm.dtype, mm.device)
    with progress_bar(progress, 2 * m, name) as bar:
        Y = mm(omega)
        bar.update(m)
        Q, R = torch.linalg.qr(Y)
        Z = second(Q)
        bar.update(m)
    return ExchangeableSketch(omega, Y, Q, R, Z)
