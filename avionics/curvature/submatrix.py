"""A submatrix of an operator: chosen rows and columns."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from avionics.curvature._data import _is_integer
from avionics.curvature.base import CurvatureLinearOperator


class SubmatrixOperator(CurvatureLinearOperator):
    r"""The submatrix A[rows][:, columns] of an operator A, for flat row and column indices.

    A product embeds the columns: S x = (A P_c^T x)[rows], with P_c^T x the vector of A's
    input size that holds x at ``columns`` and 0 elsewhere; one product with A per product
    (curvlinops' SubmatrixLinearOperator). Its adjoint is the submatrix of A's adjoint with
    rows and columns swapped; it is self-adjoint when A is and rows = columns.
    :meth:`of_parameters` takes the rows and columns of named parameters.

    Args:
        A: Any :class:`~avionics.curvature.base.CurvatureLinearOperator`.
        rows: Distinct indices into A's flat output (rows), in the order wanted.
        columns: Distinct indices into A's flat input (columns), in the order wanted.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from avionics.curvature import HessianOperator, SubmatrixOperator
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        >>> data = [(torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,)))]
        >>> H = HessianOperator(model, nn.CrossEntropyLoss(), None, data)
        >>> S = SubmatrixOperator.of_parameters(H, ["2.bias"], ["0.bias"])
        >>> S.shape
        (2, 4)
    """

    def __init__(self, A: CurvatureLinearOperator, rows: Sequence[int], columns: Sequence[int]):
        rows = _check_indices(rows, A.shape[0], "rows")
        columns = _check_indices(columns, A.shape[1], "columns")
        super().__init__([(len(columns),)], [(len(rows),)], A.dtype, A.device)
        self._A, self._rows, self._columns = A, rows, columns
        self.SELF_ADJOINT = A.SELF_ADJOINT and rows == columns
        self._row_index = torch.tensor(rows, dtype=torch.long, device=A.device)
        self._column_index = torch.tensor(columns, dtype=torch.long, device=A.device)

    @classmethod
    def of_parameters(cls, A: CurvatureLinearOperator, row_parameters: Sequence[str],
                      column_parameters: Sequence[str]) -> SubmatrixOperator:  # fmt: skip
        """The rows of ``row_parameters`` and the columns of ``column_parameters`` (names of
        the parameters of a curvature operator A, whose rows and columns are its parameters),
        each parameter's entries in flat order, the parameters in the order given."""
        names = list(getattr(A, "param_names", []))
        if not names or A.in_shapes != A.out_shapes:
            raise ValueError(
                f"SubmatrixOperator.of_parameters needs an operator on the parameters (rows and "
                f"columns), got {type(A).__name__}; pass flat indices to SubmatrixOperator."
            )
        sizes = [s.numel() for s in A.in_shapes]
        offsets = {name: sum(sizes[:i]) for i, name in enumerate(names)}

        def indices(chosen: Sequence[str]) -> list[int]:
            unknown = [name for name in chosen if name not in offsets]
            if unknown:
                raise ValueError(
                    f"SubmatrixOperator.of_parameters: the operator has no parameter "
                    f"{unknown[0]!r}; its parameters are {names}."
                )
            return [offsets[name] + j for name in chosen
                    for j in range(sizes[names.index(name)])]  # fmt: skip

        return cls(A, indices(row_parameters), indices(column_parameters))

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        (X,) = M  # [len(columns), K]
        embedded = X.new_zeros(self._A.shape[1], X.shape[-1])
        embedded[self._column_index] = X
        torch.index_select(self._A @ embedded, 0, self._row_index, out=out[0])

    def _adjoint(self) -> SubmatrixOperator:
        return SubmatrixOperator(self._A.adjoint(), self._columns, self._rows)


def _check_indices(indices, size: int, what: str) -> list[int]:
    valid = (
        isinstance(indices, Sequence)
        and len(indices) > 0
        and all(_is_integer(i) and 0 <= i < size for i in indices)
        and len(set(indices)) == len(indices)
    )
    if not valid:
        raise ValueError(
            f"SubmatrixOperator: {what} must be distinct integers in [0, {size}) (a non-empty "
            f"list), got {indices!r}."
        )
    return [int(i) for i in indices]
