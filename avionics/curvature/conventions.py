r"""avionics' and curvlinops' conventions for the empirical Fisher and the KFAC factors.

avionics follows its definitions: a datum is a sample (all its positions together), and the
loss's own reduction is the normalisation. curvlinops flattens the model output into rows,
the class axis split off (axis 1 for CrossEntropyLoss, the last axis for MSELoss and
BCEWithLogitsLoss), and counts every row as a datum whose loss is summed over its C outputs.
For a batch of R_b rows and a loss with reduction "mean" that makes the per-datum scale

.. math:: \rho_b = \begin{cases} R_b & \text{CrossEntropyLoss} \\
          R_b C & \text{MSELoss, BCEWithLogitsLoss} \end{cases}

where avionics has the batch size B_b (``"sum"``: 1 in both). And curvlinops' KFAC with
``fisher_type="type-2"`` backpropagates one vector per column c of the rows' loss-Hessian
square roots S_r (S_r S_r^T the Hessian of row r), all rows at once,

.. math:: s_c = \big( S_r[:, c] \big)_r, \qquad c = 1, \dots, C,

where avionics backpropagates every column of every row on its own (the exact Gauss-Newton
form, no products between rows): the two differ where a layer's output rows reach several
output rows (before an attention, or an MSE output [N, V, T] whose rows are the (n, v)).
"""

from __future__ import annotations

from torch import Tensor, nn

CONVENTIONS = ("avionics", "curvlinops")
CURVLINOPS_LOSSES = (nn.MSELoss, nn.CrossEntropyLoss, nn.BCEWithLogitsLoss)


def check_convention(convention: str, loss_fn: nn.Module, owner: str) -> str:
    """``convention``, after checking it and that curvlinops' is defined for ``loss_fn``."""
    if convention not in CONVENTIONS:
        raise ValueError(f"{owner}: convention must be one of {CONVENTIONS}, got {convention!r}.")
    if convention == "curvlinops" and not isinstance(loss_fn, CURVLINOPS_LOSSES):
        raise ValueError(
            f"{owner}: convention='curvlinops' is defined for MSELoss, CrossEntropyLoss and "
            f"BCEWithLogitsLoss (those curvlinops takes), got {loss_fn!r}; use the default "
            "convention='avionics'."
        )
    return convention


def class_axis(output: Tensor, loss_fn: nn.Module, owner: str) -> int:
    """The axis curvlinops splits the output rows along: 1 for CrossEntropyLoss, else the
    last; an output without one is refused."""
    if output.ndim < 2:
        raise ValueError(
            f"{owner}: convention='curvlinops' needs model outputs with a class axis ([N, C, "
            f"...] for CrossEntropyLoss, [N, ..., C] otherwise), got shape "
            f"{list(output.shape)}; use convention='avionics'."
        )
    return 1 if isinstance(loss_fn, nn.CrossEntropyLoss) else output.ndim - 1


def datum_scale(output: Tensor, loss_fn: nn.Module, owner: str) -> float:
    """rho_b of a batch output: its rows (times C for MSE / BCE) for "mean", 1 for "sum"."""
    axis = class_axis(output, loss_fn, owner)
    if loss_fn.reduction != "mean":
        return 1.0
    rows = output.numel() // output.shape[axis]
    return float(rows if isinstance(loss_fn, nn.CrossEntropyLoss) else output.numel())


def per_column_vectors(roots: Tensor, output: Tensor, loss_fn: nn.Module) -> Tensor:
    """curvlinops' s_c [C, *f] from avionics' square-root vectors [K, *f]
    (:func:`~avionics.curvature._losses.output_hessian_square_root`: for CrossEntropyLoss
    one per (class, position), class first; for MSE / BCE one per output dimension of a
    sample, in its row-major order): each s_c the sum of the vectors of column c over the
    rows."""
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        C = output.shape[1]
        return roots.view(C, -1, *output.shape).sum(dim=1)
    C = output.shape[-1]
    return roots.view(-1, C, *output.shape).sum(dim=0)
