"""The Jacobian of the model outputs w.r.t. the parameters, and its transpose."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd import forward_ad
from torch.func import jvp, vjp

from avionics.curvature._data import ModelDataOperator, accumulate, functional_pass
from avionics.curvature._distributed import refuse_distributed


class _OutputsOperator(ModelDataOperator):
    """Shared set-up: the output space is the stacked model outputs of all batches [N, *f].

    The rows follow the order of the data, so the batches must come in the same order on
    every pass (the determinism check compares the outputs batch by batch).

    The rows are the samples of ``data``, so with torch.distributed initialised a Jacobian is
    that of this process's data, its rows on this process: there is no product to sum over
    processes (J^T u of the whole data set needs the rows u of every process's samples), so
    ``distributed=True`` is refused. The curvature J^T Lambda J of a sharded data set is
    :class:`~avionics.curvature.ggn.GGNOperator` with ``distributed``.
    """

    SELF_ADJOINT = False
    FIXED_DATA_ORDER = True

    def __init__(self, model, params, data, *misplaced, distributed: bool | None = None, **kwargs):
        # The other operators take (model, loss_fn, params, data): a loss function passed the
        # same way lands in params, and data in misplaced.
        if isinstance(params, nn.Module) or misplaced or "loss_fn" in kwargs:
            name = type(self).__name__
            extra = f" and {len(misplaced)} more positional argument(s)" if misplaced else ""
            raise TypeError(
                f"{name} is of the model outputs alone and takes no loss function: call "
                f"{name}(model, params, data) with params None (all parameters that require "
                f"grad) or the parameters, and options by keyword; got params={params!r}{extra}."
            )
        refuse_distributed(
            distributed,
            type(self).__name__,
            "its rows are the samples of data, on this process; for the curvature of a data "
            "set sharded across processes use GGNOperator(model, loss_fn, params, data, "
            "distributed=True).",
        )
        self._arguments = dict(model=model, params=params, data=data, **kwargs)
        super().__init__(model, None, params, data, distributed=False, **kwargs)

    def _output_shape(self) -> torch.Size:
        X, _ = next(self._batches("output shape"))
        with functional_pass():
            sample_shape = self._output(self._params, X).shape[1:]
        return torch.Size((self.num_data, *sample_shape))

    def _adjoint_arguments(self) -> dict:
        return {**self._arguments, "num_data": self.num_data, "check_deterministic": False}


class JacobianOperator(_OutputsOperator):
    r"""The Jacobian J = d f(theta, X) / d theta of the outputs of all batches.

    Maps a parameter-space vector v to J v = [J_1 v; ...; J_B v] of shape [N, *f] (the model
    outputs stacked over the data set), each J_b v by forward-mode differentiation (jvp),
    all columns together. Unlike the curvature operators it takes no loss function.

    Args:
        model: The network (an ``nn.Module``) or a function ``model(params, X)``.
        params: The parameters; ``None`` for all that require grad.
        data: A re-iterable of (X, y) batches (y is not used).
        distributed: None or False: the Jacobian of this process's data (True is refused,
            see :class:`_OutputsOperator`).
        **kwargs: ``num_data``, ``batch_size_fn``, ``check_deterministic``, ``progressbar``,
            ``chunk_size`` (see :class:`~avionics.curvature._data.ModelDataOperator`).
    """

    def _out_shapes(self) -> list[torch.Size]:
        return [self._output_shape()]

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        (JM,) = out  # [N, *f, K]: each batch's rows written in place
        start = 0
        with functional_pass():
            for X, y in self._batches("J @ M"):
                block = self._matmat_batch(X, y, M)[0]
                JM[start : start + len(block)].copy_(block)
                start += len(block)

    def _column_product(self, X, y):
        def product(v: list[Tensor]) -> list[Tensor]:
            return [jvp(lambda params: self._output(params, X), (self._params,), (v,))[1]]

        return product

    def _vector_product(self, X, y, v: list[Tensor]) -> list[Tensor]:
        # one column by plain forward-mode autograd (dual tensors), which costs less per
        # operation than torch.func's jvp; the parameters are detached: no graph is built
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(p, t) for p, t in zip(self._params, v)]
            return [forward_ad.unpack_dual(self._output(duals, X)).tangent]

    def _adjoint(self) -> TransposedJacobianOperator:
        return TransposedJacobianOperator(**self._adjoint_arguments())


class TransposedJacobianOperator(_OutputsOperator):
    r"""The transposed Jacobian J^T, mapping output-space vectors [N, *f] to parameters.

    J^T u = sum_b J_b^T u_b with u_b the rows of batch b, each by one reverse pass (vjp)
    whose forward is shared by all columns.

    Args:
        model, params, data, **kwargs: As for :class:`JacobianOperator`.
    """

    def _in_shapes(self) -> list[torch.Size]:
        return [self._output_shape()]

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        start = 0
        with functional_pass():
            for X, y in self._batches("J^T @ M"):
                size = self._batch_size(X)
                rows = [M[0][start : start + size]]  # this batch's rows u_b, [B_b, *f, K]
                accumulate(out, self._matmat_batch(X, y, rows), 1.0, first=start == 0)
                start += size

    def _column_product(self, X, y):
        _, output_vjp = vjp(lambda params: self._output(params, X), self._params)
        return lambda u: output_vjp(u[0])[0]

    def _one_column_product(self, X, y):
        # one forward pass for all the columns, each going back through it
        return self._column_product(X, y)

    def _adjoint(self) -> JacobianOperator:
        return JacobianOperator(**self._adjoint_arguments())
