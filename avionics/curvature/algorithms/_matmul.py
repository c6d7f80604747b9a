"""The one thing every algorithm needs from an operator: ``A @ X`` on torch tensors.

Any object with a ``.shape`` (M, D) (square, M = D, for most algorithms) and ``@`` on a flat
vector [D] or a matrix [D, k] (columns multiplied together) is accepted, as is a dense tensor.
``dtype`` and ``device`` are read when present. The algorithms that need products with the
transpose A^T (XDiag of a non-symmetric operator, the Frobenius norm of a wide one) take it
from ``A.adjoint()`` (every :class:`~avionics.curvature.base.CurvatureLinearOperator` has
one, free for the self-adjoint ones; so do torch tensors and SciPy operators). Nothing here
imports the operator classes: duck typing only. Products are detached from autograd (an
operator built on a graph, e.g. Hessian-vector products through ``create_graph=True``
gradients, keeps no graph alive in the algorithms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MatMul:
    """A linear map ``X -> A @ X`` from R^dim to R^rows, with its dtype and device."""

    apply: Callable[[Tensor], Tensor]
    dim: int
    dtype: torch.dtype
    device: torch.device
    rows: int | None = None  # None: square, rows = dim

    @property
    def out_dim(self) -> int:
        return self.dim if self.rows is None else self.rows

    def __call__(self, X: Tensor) -> Tensor:
        return self.apply(X)


def _as_matmul(A, *, square: bool = True) -> MatMul:
    """Wrap a dense tensor or any operator with ``.shape`` and ``@`` into a :class:`MatMul`.

    Raises a ``TypeError``/``ValueError`` that says what is wrong when ``A`` is not a (square,
    unless ``square`` is False) linear operator.
    """
    if isinstance(A, MatMul):
        if square and A.rows not in (None, A.dim):
            raise ValueError(f"expected a square operator, got shape ({A.rows}, {A.dim})")
        return A
    shape = getattr(A, "shape", None)
    if shape is None or not hasattr(A, "__matmul__"):
        raise TypeError(
            f"expected a square operator (anything with .shape and @) or a dense tensor, got "
            f"{type(A).__name__}"
        )
    shape = tuple(shape)
    if len(shape) != 2 or (square and shape[0] != shape[1]):
        what = "a square operator of shape (D, D)" if square else "an operator of shape (M, D)"
        raise ValueError(f"expected {what}, got shape {shape}")
    dtype = getattr(A, "dtype", None) or torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype):  # e.g. a numpy dtype on a foreign operator
        dtype = torch.get_default_dtype()
    device = torch.device(getattr(A, "device", None) or "cpu")

    def apply(X: Tensor) -> Tensor:
        out = A @ X
        if not isinstance(out, Tensor):
            raise TypeError(
                f"{type(A).__name__} @ tensor returned {type(out).__name__}, not a torch tensor"
            )
        return out.detach()  # the algorithms are not differentiable; keep no graph alive

    rows = None if shape[0] == shape[1] else int(shape[0])
    return MatMul(apply, int(shape[1]), dtype, device, rows)


def _adjoint_matmul(A, name: str) -> MatMul:
    """The transpose A^T as a :class:`MatMul`, from ``A.adjoint()`` (a tensor's transpose).

    Raises a ``TypeError`` naming ``name`` (the algorithm that needs it) and the remedy when
    ``A`` offers no adjoint: assuming A^T = A would silently give a wrong result for a
    non-symmetric A.
    """
    if isinstance(A, Tensor):
        return _as_matmul(A.mT, square=False)
    adjoint = getattr(A, "adjoint", None)
    if isinstance(A, MatMul) or not callable(adjoint):
        raise TypeError(
            f"{name} needs products with the transpose A^T, but {type(A).__name__} has no "
            "adjoint() method: pass a CurvatureLinearOperator or a dense tensor, or give the "
            "operator an adjoint() that returns A^T (A itself when A is symmetric)."
        )
    return _as_matmul(adjoint(), square=False)


def _apply_preconditioner(M, X: Tensor) -> Tensor:
    """``M @ X`` for a tensor or an operator, ``M(X)`` for a plain callable."""
    if isinstance(M, Tensor) or (hasattr(M, "__matmul__") and hasattr(M, "shape")):
        return M @ X
    if callable(M):
        return M(X)
    raise TypeError(
        f"a preconditioner must be a tensor, an operator with @, or a callable; got "
        f"{type(M).__name__}"
    )


def _generator(seed: int | None, generator: torch.Generator | None, device) -> torch.Generator:
    """The random generator a stochastic function uses: ``generator`` if given, else one seeded
    with ``seed`` (0 when both are None, so results are reproducible by default)."""
    if generator is not None:
        if seed is not None:
            raise ValueError("pass either seed or generator, not both")
        return generator
    device = torch.device(device)
    gen = torch.Generator(device=device if device.type != "meta" else "cpu")
    gen.manual_seed(0 if seed is None else int(seed))
    return gen


def _random(shape, kind: str, gen: torch.Generator, dtype: torch.dtype, device) -> Tensor:
    """Random test vectors: ``"rademacher"`` (+-1), ``"gaussian"`` (standard normal)."""
    if kind == "rademacher":
        Z = torch.randint(0, 2, shape, generator=gen, device=device).to(dtype)
        return 2 * Z - 1
    if kind in ("gaussian", "normal"):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)
    raise ValueError(f"unknown distribution {kind!r}; use 'rademacher' or 'gaussian'")


def _probe_blocks(
    D: int, m: int, chunk_size: int | None, kind: str, gen: torch.Generator, dtype, device
):
    """m random probe vectors of size D in blocks [D, c] of at most ``chunk_size`` columns.

    The probes are drawn one after the other (as the rows of an [m, D] array), so the same
    seed gives the same probes whatever ``chunk_size`` is, and only one block is in memory.
    """
    step = m if chunk_size is None else max(1, int(chunk_size))
    for i in range(0, m, step):
        c = min(step, m - i)
        yield _random((c, D), kind, gen, dtype, device).T.contiguous()
