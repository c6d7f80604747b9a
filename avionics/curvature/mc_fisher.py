"""The Monte-Carlo Fisher of the data-set loss."""

from __future__ import annotations

from torch import Tensor

from avionics.curvature._data import check_positive_int, check_seed
from avionics.curvature._losses import (
    OutputProduct,
    batch_generator,
    check_samplable,
    per_sample_outer_product,
    sampled_output_gradients,
)
from avionics.curvature.ggn import GGNOperator


class MCFisherOperator(GGNOperator):
    r"""The Monte-Carlo Fisher: the GGN with its loss Hessian replaced by sampled gradients.

    For the losses that are negative log-likelihoods (MSELoss, CrossEntropyLoss,
    BCEWithLogitsLoss), d2 L_b / df2 = kappa sum_t E[s_t s_t^T] with s_t the gradient of the
    per-term loss at a label drawn from the model's predictive distribution
    (:mod:`avionics.curvature._losses`, eq. (1)). With M draws S_m = sum_t s_t per sample,

    .. math:: F_b = J_b^\top \Big( \tfrac{\kappa}{M} \sum_m
              \operatorname{blockdiag}_n(S_{m,n} S_{m,n}^\top) \Big) J_b,
              \qquad \mathbb{E}[F_b] = G_b,

    (Martens & Grosse, "Optimizing neural networks with Kronecker-factored approximate
    curvature", 2015, section 5), weighted over batches like the GGN. The draws are seeded
    per batch, from (seed, the batch's index in the data set)
    (:func:`~avionics.curvature._losses.batch_generator`): every product uses the same sample
    (the data must come in the same order on every pass), and a data set sharded across
    torch.distributed processes (``distributed``) gets the same sample as one process with
    all its batches, the shards' in rank order.

    Args:
        model, loss_fn, params, data: As for :class:`~avionics.curvature.ggn.GGNOperator`.
        mc_samples: M, the number of labels drawn per output.
        seed: Seed of the draws.
        **kwargs: As for :class:`~avionics.curvature.ggn.GGNOperator`.
    """

    FIXED_DATA_ORDER = True

    def __init__(self, model, loss_fn, params, data, *, mc_samples: int = 1, seed: int = 0,
                 **kwargs):  # fmt: skip
        check_samplable(loss_fn)
        self._mc_samples = check_positive_int(
            mc_samples, "mc_samples", type(self).__name__, "pass the number of draws, e.g. 1"
        )
        self._seed = check_seed(seed, type(self).__name__)
        super().__init__(model, loss_fn, params, data, **kwargs)

    def _local_matmat(self, M: list[Tensor], out: list[Tensor]) -> list[Tensor]:
        # Restart at this process's first batch so that every product sees the same sample.
        self._batch_index = self._first_batch
        return super()._local_matmat(M, out)

    def _matmat_batch(self, X, y, M: list[Tensor]) -> list[Tensor]:
        # called once per batch, in data order; every column of the batch gets its sample
        product = super()._matmat_batch(X, y, M)
        self._batch_index += 1
        return product

    def _output_space_matrix(self, output: Tensor, y: Tensor) -> OutputProduct:
        generator = batch_generator(self._seed, self._batch_index, self.device)
        S, kappa = sampled_output_gradients(self._loss_fn, output, self._mc_samples, generator)
        return per_sample_outer_product(S, kappa / self._mc_samples)
