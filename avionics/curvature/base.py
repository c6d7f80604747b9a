"""The linear-operator interface every curvature operator shares.

An operator A of shape (M, D) acts on a space that is a product of tensor shapes (for the
curvature of a network: the parameter shapes). ``A @ X`` accepts

* a flat vector ``[D]`` or a flat matrix ``[D, K]`` (columns on the last axis),
* a list of tensors with the in-shapes ``[*s_i]`` (vector) or ``[*s_i, K]`` (matrix),
* a NumPy array ``[D]`` or ``[D, K]``,
* another operator (giving the lazy product),

and returns the result in the format it was given. ``A + B``, ``A - B``, ``c * A``, ``A @ B``
and ``A.adjoint()`` are lazy operators; ``A.to_scipy()`` is a
``scipy.sparse.linalg.LinearOperator``. Subclasses implement :meth:`_matmat` on the list format
with the columns on a leading axis, ``[K, *s_i]`` (contiguous per column, the layout batched
kernels are fastest on); they multiply all columns together, never one at a time.
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

    def _matmat(self, M: list[Tensor]) -> list[Tensor]:
        """Multiply onto K columns in list format: tensors ``[K, *in_i]`` -> ``[K, *out_i]``."""
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
            M, is_vector = self._flat_to_list(X)
            return self._list_to_flat(self._matmat(M), is_vector)
        if isinstance(X, (list, tuple)) and all(isinstance(x, Tensor) for x in X):
            M, is_vector = self._check_list(X)
            AM = self._matmat(M)
            return [am.squeeze(0) if is_vector else am.movedim(0, -1) for am in AM]
        raise TypeError(
            f"{type(self).__name__} @ X needs X to be a tensor, a list of tensors, a NumPy array"
            f" or an operator; got {type(X).__name__}."
        )

    def _check_dtype_device(self, X: Tensor) -> None:
        if X.dtype != self.dtype or X.device != self.device:
            raise ValueError(
                f"{type(self).__name__} computes in {self.dtype} on {self.device}, but X is "
                f"{X.dtype} on {X.device}; convert it with X.to({self.dtype}, {self.device})."
            )

    def _flat_to_list(self, X: Tensor) -> tuple[list[Tensor], bool]:
        """Split a flat ``[D]`` or ``[D, K]`` tensor into the list format ``[K, *s_i]``."""
        self._check_dtype_device(X)
        if X.ndim not in (1, 2) or X.shape[0] != self.shape[1]:
            raise ValueError(
                f"{type(self).__name__} has shape {self.shape}: a flat X must be [{self.shape[1]}]"
                f" or [{self.shape[1]}, K], got {list(X.shape)}."
            )
        is_vector = X.ndim == 1
        columns = X.unsqueeze(0) if is_vector else X.T.contiguous()  # [K, D]
        sizes = [s.numel() for s in self.in_shapes]
        M = [x.view(len(columns), *s) for x, s in zip(columns.split(sizes, dim=1), self.in_shapes)]
        return M, is_vector

    def _list_to_flat(self, AM: list[Tensor], is_vector: bool) -> Tensor:
        flat = [am.reshape(am.shape[0], -1) for am in AM]
        columns = flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)  # [K, D]
        return columns.squeeze(0) if is_vector else columns.T

    def _check_list(self, X: Sequence[Tensor]) -> tuple[list[Tensor], bool]:
        """Check a list of per-shape tensors and bring it to the list format ``[K, *s_i]``."""
        if len(X) != len(self.in_shapes):
            raise ValueError(
                f"{type(self).__name__} acts on {len(self.in_shapes)} tensors of shapes "
                f"{[list(s) for s in self.in_shapes]}, got a list of {len(X)}."
            )
        for x in X:
            self._check_dtype_device(x)
        is_vector = all(x.shape == s for x, s in zip(X, self.in_shapes))
        if is_vector:
            return [x.unsqueeze(0) for x in X], True
        columns = {x.shape[-1] for x in X}
        if len(columns) != 1 or any(x.shape[:-1] != s for x, s in zip(X, self.in_shapes)):
            raise ValueError(
                f"{type(self).__name__} needs a list of tensors with shapes "
                f"{[list(s) for s in self.in_shapes]} (a vector) or the same shapes with one "
                f"trailing axis of K columns (a matrix), got {[list(x.shape) for x in X]}."
            )
        return [x.movedim(-1, 0).contiguous() for x in X], False

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

    def _matmat(self, M: list[Tensor]) -> list[Tensor]:
        AM, BM = self._A._matmat(M), self._B._matmat(M)
        return [a.add(b, alpha=self._sign) for a, b in zip(AM, BM)]

    def _adjoint(self) -> CurvatureLinearOperator:
        return _SumOperator(self._A.adjoint(), self._B.adjoint(), self._sign)


class _ScaledOperator(CurvatureLinearOperator):
    """scalar * A."""

    def __init__(self, A: CurvatureLinearOperator, scalar: float):
        super().__init__(A.in_shapes, A.out_shapes, A.dtype, A.device)
        self._A, self._scalar = A, scalar
        self.SELF_ADJOINT = A.SELF_ADJOINT

    def _matmat(self, M: list[Tensor]) -> list[Tensor]:
        return [self._scalar * am for am in self._A._matmat(M)]

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

    def _matmat(self, M: list[Tensor]) -> list[Tensor]:
        return self._A._matmat(self._B._matmat(M))

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

    def _matmat(self, M: list[Tensor]) -> list[Tensor]:
        return [m.clone() for m in M]
