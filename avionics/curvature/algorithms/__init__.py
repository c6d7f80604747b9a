"""Algorithms on any curvature operator (or dense tensor): eigenpairs, trace, diagonal,
squared Frobenius norm, spectral density (and an interval that holds the spectrum) and
inverses.

Every function takes any object with ``.shape`` (D, D) and ``@`` on torch vectors [D] and
matrices [D, k], or a dense tensor (the squared Frobenius norm and LSMR any shape (M, D));
XDiag, LSMR and the Frobenius norm of a wide operator also multiply by the transpose,
``A.adjoint()``.
Stochastic functions take ``seed`` or ``generator`` and are reproducible (seed 0 when neither
is given). The eigenpairs, spectral density, trace and diagonal estimators take ``progress``
(default ``"auto"``: a progress bar over the operator products on stderr once a call has run
a few seconds; True: at once; False: never).

On an operator of data sharded across torch.distributed processes (``distributed``), call the
function on every process with the same ``seed`` (or generators seeded alike): the products
are the same on every process, so are the random test vectors, and so every decision and
result is the same on every process.
"""

from .diagonal import hutchinson_diagonal, xdiag
from .frobenius import frobenius_norm_squared
from .inverse import CGResult, conjugate_gradient, neumann_inverse
from .lanczos import EigenResult, bottom_eigenpairs, top_eigenpairs
from .lsmr import LSMRResult, lsmr
from .spectral_density import SpectralDensity, approximate_boundaries, spectral_density
from .trace import hutchinson_trace, hutchpp_trace, xtrace

__all__ = [
    "CGResult",
    "EigenResult",
    "LSMRResult",
    "SpectralDensity",
    "approximate_boundaries",
    "bottom_eigenpairs",
    "conjugate_gradient",
    "frobenius_norm_squared",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "hutchpp_trace",
    "lsmr",
    "neumann_inverse",
    "spectral_density",
    "top_eigenpairs",
    "xdiag",
    "xtrace",
]
