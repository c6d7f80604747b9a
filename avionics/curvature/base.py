"""The linear-operator interface every curvature operator shares.

An operator A of shape (M, D) acts on a space that is a product of tensor shapes (for the
curvature of a network: the parameter shapes). ``A @ X`` accepts

* a flat vector ``[D]`` or a flat matrix ``[D, K]`` (columns on the last axis),
* a list of tensors with the in-shapes ``[*s_i]`` (vector) or ``[*s_i, K]`` (matrix),
* a NumPy array ``[D]`` or ``[D, K]``,
* another operator (giving the lazy product),

and returns the result in the format it was given. ``A + B``, ``A - B``, ``c * A``, ``A @ B``
and ``A.adjoint()`` are lazy operators; ``A.to_scipy()`` is a
``scipy.sparse.linalg.LinearOperator``.

Subclasses implement :meth:`_matmat` with the columns last, as curvlinops does: the input is
the list of views ``[*in_i, K]`` into the flat ``[D, K]`` block (row ranges of it, no copy),
and the product is written into the views ``[*out_i, K]`` of one result block allocated
before the call (no concatenation after it). All columns are multiplied together, never one
at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.sparse.linalg
import torch
from torch import Tensor


class CurvatureLinearOperator:
    """A linear map between products of tensor spaces, with lazy algebra and SciPy export.

    Args:
        in_shapes: The shapes whose product is the input space (columns of the matrix).
        out_shapes: The shapes whose product is the output space (rows of the matrix).
        dtype: The dtype the operator computes in.
        device: The device the operator computes on.

    Attributes:
        SELF_ADJOINT: Whether the operator equals its adjoint (then :meth:`adjoint` is free).
    """

    SELF_ADJOINT: bool = False

    def __init__(
        self,
        in_shapes: Sequence[Sequence[int]],
        out_shapes: Sequence[Sequence[int]],
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.in_shapes = [torch.Size(s) for s in in_shapes]
        self.out_shapes = [torch.Size(s) for s in out_shapes]
        self.dtype = dtype
        self.device = torch.device(device)
        self.shape = (
            sum(s.numel() for s in self.out_shapes),
            sum(s.numel() for s in self.in_shapes),
        )

    # ---------------------------------------------------------------------------------------
    # What a subclass implements
    # ---------------------------------------------------------------------------------------

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        """Write the product with K columns, ``out[i] = (A M)_i``.

        ``M[i]`` is ``[*in_shapes[i], K]`` and must not be written to (it may be the caller's
        memory); ``out[i]`` is ``[*out_shapes[i], K]``, views into one ``[rows, K]`` block,
        uninitialised on entry.
        """
        raise NotImplementedError

    def _adjoint(self) -> CurvatureLinearOperator:
        """The adjoint operator (only needed when the operator is not self-adjoint)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement its adjoint.")

    # ---------------------------------------------------------------------------------------
    # Multiplication in every input format
    # ---------------------------------------------------------------------------------------

    def __matmul__(self, X):
        """``A @ X`` for a tensor, a list of tensors, a NumPy array, or another operator."""
        if isinstance(X, CurvatureLinearOperator):
            return _ProductOperator(self, X)
        if isinstance(X, np.ndarray):
            AX = self @ torch.as_tensor(X, dtype=self.dtype, device=self.device)
            return AX.cpu().numpy().astype(X.dtype, copy=False)
        if isinstance(X, Tensor):
            self._check_flat(X)
            columns = X.unsqueeze(-1) if X.ndim == 1 else X
            AX = self._new_result(columns.shape[1])
            self._matmat(
                split_columns(columns, self.in_shapes), split_columns(AX, self.out_shapes)
            )
            return AX.squeeze(-1) if X.ndim == 1 else AX
        if isinstance(X, (list, tuple)) and all(isinstance(x, Tensor) for x in X):
            M, is_vector = self._check_list(X)
            AM = self._empty_columns(M[0].shape[-1])
            self._matmat(M, AM)
            return [am.squeeze(-1) for am in AM] if is_vector else AM
        raise TypeError(
            f"{type(self).__name__} @ X needs X to be a tensor, a list of tensors, a NumPy array"
            f" or an operator; got {type(X).__name__}."
        )

    def _new_result(self, K: int) -> Tensor:
        """The uninitialised ``[rows, K]`` block a product is written into: row-major, the
        columns last (an operator whose kernel gives the columns on a leading axis may
        allocate it as ``[K, rows]`` transposed, so that writing into it is a plain copy)."""
        return torch.empty(self.shape[0], K, dtype=self.dtype, device=self.device)

    def _empty_columns(self, K: int) -> list[Tensor]:
        """Views ``[*out_i, K]`` into a new :meth:`_new_result` block."""
        return split_columns(self._new_result(K), self.out_shapes)

    def _check_dtype_device(self, X: Tensor) -> None:
        if X.dtype != self.dtype or X.device != self.device:
            raise ValueError(
                f"{type(self).__name__} computes in {self.dtype} on {self.device}, but X is "
                f"{X.dtype} on {X.device}; convert it with X.to({self.dtype}, {self.device})."
            )

    def _check_flat(self, X: Tensor) -> None:
        """Refuse a flat X that is not ``[D]`` or ``[D, K]`` in the operator's dtype and device."""
        self._check_dtype_device(X)
        if X.ndim not in (1, 2) or X.shape[0] != self.shape[1]:
            raise ValueError(
                f"{type(self).__name__} has shape {self.shape}: a flat X must be [{self.shape[1]}]"
                f" or [{self.shape[1]}, K], got {list(X.shape)}."
            )

    def _check_list(self, X: Sequence[Tensor]) -> tuple[list[Tensor], bool]:
        """Check a list of per-shape tensors and bring it to the list format ``[*s_i, K]``
        (views of the tensors given)."""
        if len(X) != len(self.in_shapes):
            raise ValueError(
                f"{type(self).__name__} acts on {len(self.in_shapes)} tensors of shapes "
                f"{[list(s) for s in self.in_shapes]}, got a list of {len(X)}."
            )
        for x in X:
            self._check_dtype_device(x)
        if all(x.shape == s for x, s in zip(X, self.in_shapes)):
            return [x.unsqueeze(-1) for x in X], True
        columns = {x.shape[-1] for x in X}
        if len(columns) != 1 or any(x.shape[:-1] != s for x, s in zip(X, self.in_shapes)):
            raise ValueError(
                f"{type(self).__name__} needs a list of tensors with shapes "
                f"{[list(s) for s in self.in_shapes]} (a vector) or the same shapes with one "
                f"trailing axis of K columns (a matrix), got {[list(x.shape) for x in X]}."
            )
        return list(X), False

    # ---------------------------------------------------------------------------------------
    # Lazy algebra
    # ---------------------------------------------------------------------------------------

    def adjoint(self) -> CurvatureLinearOperator:
        """The adjoint A^T (A itself when the operator is self-adjoint)."""
        return self if self.SELF_ADJOINT else self._adjoint()

    def __add__(self, other: CurvatureLinearOperator) -> CurvatureLinearOperator:
        return _SumOperator(self, other, 1.0)

    def __sub__(self, other: CurvatureLinearOperator) -> CurvatureLinearOperator:
        return _SumOperator(self, other, -1.0)

    def __mul__(self, scalar: float) -> CurvatureLinearOperator:
        if not isinstance(scalar, (int, float)) or isinstance(scalar, bool):
            return NotImplemented
        return _ScaledOperator(self, float(scalar))

    __rmul__ = __mul__

    def __neg__(self) -> CurvatureLinearOperator:
        return _ScaledOperator(self, -1.0)

    # ---------------------------------------------------------------------------------------
    # SciPy export
    # ---------------------------------------------------------------------------------------

    def to_scipy(self, dtype: np.dtype | None = None) -> scipy.sparse.linalg.LinearOperator:
        """This operator as a ``scipy.sparse.linalg.LinearOperator`` on NumPy arrays.

        Args:
            dtype: The NumPy dtype SciPy sees; default: the operator's own dtype.
        """
        dtype = torch.empty(0, dtype=self.dtype).numpy().dtype if dtype is None else dtype
        adjoint = self.adjoint()

        def matmat(X: np.ndarray) -> np.ndarray:
            return (self @ np.asarray(X)).astype(dtype, copy=False)

        def rmatmat(X: np.ndarray) -> np.ndarray:
            return (adjoint @ np.asarray(X)).astype(dtype, copy=False)

        return scipy.sparse.linalg.LinearOperator(
            self.shape, matvec=matmat, rmatvec=rmatmat, matmat=matmat, rmatmat=rmatmat,
            dtype=dtype,
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"


def _check_same_space(A: CurvatureLinearOperator, B: CurvatureLinearOperator, what: str) -> None:
    if A.dtype != B.dtype or A.device != B.device:
        raise ValueError(
            f"{what} needs operators with one dtype and device, got {A.dtype} on {A.device} "
            f"and {B.dtype} on {B.device}."
        )


class _SumOperator(CurvatureLinearOperator):
    """A + sign * B."""

    def __init__(self, A: CurvatureLinearOperator, B: CurvatureLinearOperator, sign: float):
        if not isinstance(B, CurvatureLinearOperator):
            raise TypeError(f"Only an operator can be added to an operator, got {type(B)}.")
        if A.in_shapes != B.in_shapes or A.out_shapes != B.out_shapes:
            raise ValueError(
                f"A + B needs operators on the same spaces: A maps {A.in_shapes} -> "
                f"{A.out_shapes}, B maps {B.in_shapes} -> {B.out_shapes}."
            )
        _check_same_space(A, B, "A + B")
        super().__init__(A.in_shapes, A.out_shapes, A.dtype, A.device)
        self._A, self._B, self._sign = A, B, sign
        self.SELF_ADJOINT = A.SELF_ADJOINT and B.SELF_ADJOINT

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        self._A._matmat(M, out)
        BM = self._B._empty_columns(M[0].shape[-1])
        self._B._matmat(M, BM)
        for a, b in zip(out, BM):
            a.add_(b, alpha=self._sign)

    def _adjoint(self) -> CurvatureLinearOperator:
        return _SumOperator(self._A.adjoint(), self._B.adjoint(), self._sign)


class _ScaledOperator(CurvatureLinearOperator):
    """scalar * A."""

    def __init__(self, A: CurvatureLinearOperator, scalar: float):
        super().__init__(A.in_shapes, A.out_shapes, A.dtype, A.device)
        self._A, self._scalar = A, scalar
        self.SELF_ADJOINT = A.SELF_ADJOINT

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        self._A._matmat(M, out)
        for am in out:
            am.mul_(self._scalar)

    def _adjoint(self) -> CurvatureLinearOperator:
        return _ScaledOperator(self._A.adjoint(), self._scalar)


class _ProductOperator(CurvatureLinearOperator):
    """A @ B, applied as A (B X)."""

    def __init__(self, A: CurvatureLinearOperator, B: CurvatureLinearOperator):
        if A.in_shapes != B.out_shapes:
            raise ValueError(
                f"A @ B needs A's input space to be B's output space, got {A.in_shapes} and "
                f"{B.out_shapes}."
            )
        _check_same_space(A, B, "A @ B")
        super().__init__(B.in_shapes, A.out_shapes, A.dtype, A.device)
        self._A, self._B = A, B

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        BM = self._B._empty_columns(M[0].shape[-1])
        self._B._matmat(M, BM)
        self._A._matmat(BM, out)

    def _adjoint(self) -> CurvatureLinearOperator:
        return _ProductOperator(self._B.adjoint(), self._A.adjoint())


class IdentityOperator(CurvatureLinearOperator):
    """The identity on a product of tensor spaces, e.g. for damping: ``A + damping * I``.

    Args:
        shapes: The shapes of the space, or an operator whose input space to take (with its
            dtype and device).
        dtype: The dtype (ignored when ``shapes`` is an operator).
        device: The device (ignored when ``shapes`` is an operator).
    """

    SELF_ADJOINT = True

    def __init__(
        self,
        shapes: Sequence[Sequence[int]] | CurvatureLinearOperator,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if isinstance(shapes, CurvatureLinearOperator):
            shapes, dtype, device = shapes.in_shapes, shapes.dtype, shapes.device
        super().__init__(shapes, shapes, dtype, device)

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        for m, am in zip(M, out):
            am.copy_(m)


def split_columns(columns: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    """The row ranges of a ``[sum_i |s_i|, K]`` block as tensors ``[*s_i, K]``, in the order
    of ``shapes``: views for any strides (they only split the row axis)."""
    K = columns.shape[-1]
    rows = columns.split([s.numel() for s in shapes])
    return [part.view(*s, K) for part, s in zip(rows, shapes)]


def joined_columns(M: Sequence[Tensor]) -> Tensor:
    """The list format ``[*s_i, K]`` as one ``[sum_i |s_i|, K]`` block (a copy)."""
    return torch.cat([m.reshape(-1, m.shape[-1]) for m in M])
