"""The loss function's curvature w.r.t. the model output: products and samples.

For a batch output f (batch axis first) and labels y, the batch loss is
L(f) = kappa * sum_t l_t(f), a sum of per-term losses (one per output element for MSELoss and
BCEWithLogitsLoss, one per position of the class axis for CrossEntropyLoss) with
kappa = 1 / (number of terms) for reduction "mean" and kappa = 1 for "sum". Every l_t is a
negative log-likelihood, so its Hessian is the Fisher of the model's predictive distribution:

    d2 l_t / df2 = E_{y_hat ~ p(. | f)} [ s s^T ],   s = d l_t(f, y_hat) / df,        (1)

(Martens, "New insights and perspectives on the natural gradient method", 2020, eq. 20;
for MSELoss p(. | f) = N(f, I / 2), for cross-entropy Categorical(softmax f), for
BCEWithLogitsLoss Bernoulli(sigmoid f)). Closed-form Hessian products are used for these three
losses (CrossEntropyLoss with integer labels, no class weights, no label smoothing, no ignored
label); any other loss with a ``reduction`` gets its Hessian product by automatic
differentiation.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import grad, vjp

OutputProduct = Callable[[Tensor], Tensor]


def _is_samplable_cross_entropy(loss_fn: nn.Module) -> bool:
    """Cross-entropy whose predictive distribution is Categorical(softmax f)."""
    return (
        isinstance(loss_fn, nn.CrossEntropyLoss)
        and loss_fn.weight is None
        and loss_fn.label_smoothing == 0.0
    )


def _is_plain_cross_entropy(loss_fn: nn.Module, y: Tensor) -> bool:
    """Cross-entropy with the closed-form Hessian: also integer labels, none ignored."""
    return (
        _is_samplable_cross_entropy(loss_fn)
        and not y.is_floating_point()
        and not (y == loss_fn.ignore_index).any()
    )


def _is_plain_bce(loss_fn: nn.Module) -> bool:
    return (
        isinstance(loss_fn, nn.BCEWithLogitsLoss)
        and loss_fn.weight is None
        and loss_fn.pos_weight is None
    )


def check_samplable(loss_fn: nn.Module) -> None:
    """Refuse a loss whose predictive distribution p(. | f) of (1) is not known, so that
    :func:`sampled_output_gradients` cannot draw from it."""
    if not (
        _is_samplable_cross_entropy(loss_fn)
        or isinstance(loss_fn, nn.MSELoss)
        or _is_plain_bce(loss_fn)
    ):
        raise ValueError(
            "The Monte-Carlo Fisher samples from the model's predictive distribution, which is "
            "known for MSELoss, CrossEntropyLoss (without class weights or label smoothing) and "
            f"BCEWithLogitsLoss (without weights), not for loss_fn={loss_fn!r}; use "
            "GGNOperator for the exact Gauss-Newton matrix (KFACOperator: fisher_type='type-2')."
        )


def _kappa(loss_fn: nn.Module, num_terms: int) -> float:
    return 1.0 / num_terms if loss_fn.reduction == "mean" else 1.0


def output_hessian_product(loss_fn: nn.Module, output: Tensor, y: Tensor) -> OutputProduct:
    """The map u -> (d2 L / df2) u at the batch output ``output`` (u has the output's shape;
    for the closed forms, those of ``differentiable_output_gradient``'s losses, u may have
    column axes after it, ``[*f, K]``)."""
    output = output.detach()

    def columns(x: Tensor, u: Tensor) -> Tensor:  # x [*f] against u [*f, ...]
        return x.view(*x.shape, *(1,) * (u.ndim - x.ndim))

    if _is_plain_cross_entropy(loss_fn, y):
        # d2 L / df2 = kappa * (diag(p) - p p^T) on the class axis (axis 1), p = softmax(f).
        kappa = _kappa(loss_fn, y.numel())
        p = output.softmax(dim=1)

        def cross_entropy_product(u: Tensor) -> Tensor:
            pu = columns(p, u) * u
            return kappa * (pu - columns(p, u) * pu.sum(dim=1, keepdim=True))

        return cross_entropy_product
    if isinstance(loss_fn, nn.MSELoss):
        kappa = 2.0 * _kappa(loss_fn, output.numel())  # d2 (f - y)^2 / df2 = 2
        return lambda u: kappa * u
    if _is_plain_bce(loss_fn):
        kappa = _kappa(loss_fn, output.numel())
        sigma = output.sigmoid()
        curvature = kappa * sigma * (1 - sigma)
        return lambda u: columns(curvature, u) * u
    # Any other loss: reverse-over-reverse through d L / df, the first backward shared.
    _, hessian_product = vjp(grad(lambda f: loss_fn(f, y)), output)
    return lambda u: hessian_product(u)[0]


def differentiable_output_gradient(loss_fn, output: Tensor, y: Tensor) -> Tensor | None:
    """d L / df at the batch output f, built from elementwise ops and reductions that stay in
    the graph of f, for the losses whose gradient is known in closed form; else None.

    CrossEntropyLoss kappa (softmax(f) - onehot(y)) on the class axis (axis 1), with softmax
    written as exp(f - logsumexp(f)); MSELoss 2 kappa (f - y); BCEWithLogitsLoss
    kappa (sigmoid(f) - y). A backward through it (a Hessian product, reverse over reverse) then
    runs batched ops only, where the loss's own double backward (e.g. log_softmax's) has no
    batched rule and loops over the columns.
    """
    if not (isinstance(output, Tensor) and isinstance(y, Tensor)) or getattr(
        loss_fn, "reduction", None
    ) not in ("mean", "sum"):
        return None
    if _is_plain_cross_entropy(loss_fn, y) and output.ndim >= 2 and y.ndim == output.ndim - 1:
        probabilities = (output - output.logsumexp(dim=1, keepdim=True)).exp()
        one_hot = nn.functional.one_hot(y, output.shape[1]).movedim(-1, 1).to(output.dtype)
        return _kappa(loss_fn, y.numel()) * (probabilities - one_hot)
    same_shape = y.shape == output.shape and y.dtype == output.dtype
    if isinstance(loss_fn, nn.MSELoss) and same_shape:
        return 2.0 * _kappa(loss_fn, output.numel()) * (output - y)
    if _is_plain_bce(loss_fn) and same_shape:
        return _kappa(loss_fn, output.numel()) * (output.sigmoid() - y)
    return None


def batch_generator(seed: int, batch_index: int, device: torch.device) -> torch.Generator:
    """The generator of the draws for batch ``batch_index`` of the data set (batches counted
    in data order; for data sharded across processes, over the shards in rank order).

    Seeded from (seed, batch_index) by NumPy's ``SeedSequence``, which gives independent
    streams for distinct entropy: every batch has its own stream, the same on every pass and
    whichever process holds the batch, so the draws of a data set do not depend on how it is
    sharded.
    """
    entropy = [seed % 2**64, batch_index]  # SeedSequence takes non-negative integers
    state = np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]
    return torch.Generator(device).manual_seed(int(state))


def sampled_output_gradients(
    loss_fn: nn.Module, output: Tensor, num_samples: int, generator: torch.Generator
) -> tuple[Tensor, float]:
    """Samples S[m] = d sum_t l_t(f, y_hat_m) / df with y_hat_m ~ p(. | f), and kappa.

    By (1), kappa / M * sum_m S[m] S[m]^T (taken per sample of the batch) is an unbiased
    estimate of d2 L / df2 restricted to the per-sample blocks.
    """
    check_samplable(loss_fn)
    output = output.detach()
    shape = (num_samples, *output.shape)
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        p = output.softmax(dim=1)
        num_classes = p.shape[1]
        p_rows = p.movedim(1, -1).reshape(-1, num_classes)
        labels = torch.multinomial(p_rows, num_samples, replacement=True, generator=generator)
        one_hot = nn.functional.one_hot(labels.T, num_classes).to(p.dtype)  # [M, rows, C]
        one_hot = one_hot.reshape(num_samples, *p.movedim(1, -1).shape).movedim(-1, 2)
        return p.unsqueeze(0) - one_hot, _kappa(loss_fn, output.numel() // num_classes)
    if isinstance(loss_fn, nn.MSELoss):
        # y_hat = f + e, e ~ N(0, I / 2): d (f - y_hat)^2 / df = -2 e ~ N(0, 2 I).
        noise = torch.randn(shape, generator=generator, dtype=output.dtype, device=output.device)
        return 2.0**0.5 * noise, _kappa(loss_fn, output.numel())
    sigma = output.sigmoid().expand(shape)  # BCEWithLogitsLoss
    return sigma - torch.bernoulli(sigma, generator=generator), _kappa(loss_fn, output.numel())


def per_sample_outer_product(S: Tensor, scale: float) -> OutputProduct:
    """u -> scale * sum_m S[m] <S[m], u>_n: outer products within each sample n (axis 1 of S)."""
    inner_axes = tuple(range(2, S.ndim))

    def product(u: Tensor) -> Tensor:
        inner = (S * u).sum(dim=inner_axes, keepdim=True)  # [M, N, 1, ...]
        return scale * (S * inner).sum(dim=0)

    return product


def output_hessian_square_root(loss_fn: nn.Module, output: Tensor, y: Tensor) -> Tensor:
    """Vectors s_k, stacked [K, *output.shape], with d2 L / df2 = sum_k s_k s_k^T exactly.

    Each s_k holds one column of every sample's block of the square root, for all samples at
    once (the blocks of different samples are never mixed by the caller): MSELoss
    sqrt(2 kappa) e_d, BCEWithLogitsLoss sqrt(kappa sigma (1 - sigma)) e_d (d over the output
    dimensions of a sample), CrossEntropyLoss sqrt(kappa p_c) (e_c - p) at one position t
    (c over the classes, t over the positions; sum_c p_c (e_c - p)(e_c - p)^T =
    diag(p) - p p^T).
    """
    output = output.detach()
    if _is_plain_cross_entropy(loss_fn, y):
        p = output.softmax(dim=1)
        N, num_classes, positions = p.shape[0], p.shape[1], p[0, 0].numel()
        p = p.reshape(N, num_classes, positions)
        one_hot = torch.eye(num_classes, dtype=p.dtype, device=p.device)
        one_hot = one_hot.view(num_classes, 1, num_classes, 1)
        roots = p.movedim(1, 0).unsqueeze(2).sqrt() * (one_hot - p.unsqueeze(0))  # [C, N, C, P]
        at_position = torch.eye(positions, dtype=p.dtype, device=p.device).view(
            1, positions, 1, 1, positions
        )
        roots = (roots.unsqueeze(1) * at_position).reshape(-1, *output.shape)  # [C P, *f]
        return _kappa(loss_fn, y.numel()) ** 0.5 * roots
    if isinstance(loss_fn, nn.MSELoss) or _is_plain_bce(loss_fn):
        sample_shape = output.shape[1:]
        dims = sample_shape.numel()
        basis = torch.eye(dims, dtype=output.dtype, device=output.device)
        basis = basis.view(dims, 1, *sample_shape).expand(dims, *output.shape)
        if isinstance(loss_fn, nn.MSELoss):
            return (2.0 * _kappa(loss_fn, output.numel())) ** 0.5 * basis
        sigma = output.sigmoid()
        return (_kappa(loss_fn, output.numel()) * sigma * (1 - sigma)).sqrt() * basis
    raise ValueError(
        "The exact square root of the loss Hessian is known for MSELoss, CrossEntropyLoss "
        "(integer labels, no class weights, label smoothing or ignored labels) and "
        f"BCEWithLogitsLoss (no weights), not for {loss_fn!r}; use fisher_type='mc'."
    )
