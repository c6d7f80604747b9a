"""Autograd helpers shared by the curvature diagonals of a captured step.

* :func:`batched_grad`: K vector-Jacobian products J^T v_k at once, ``torch.autograd.grad`` with
  ``is_grads_batched`` (a leading axis of K on the vectors), falling back to K plain products
  where vmap cannot batch an operation. Differentiating a gradient (Hessian-vector products
  H v = d (g . v) / d theta) needs the second derivative of every operation of the forward;
  where PyTorch has none, the error says so (:data:`NO_SECOND_DERIVATIVE`).
"""

from __future__ import annotations

import warnings

import torch

NO_SECOND_DERIVATIVE = (
    "PyTorch has no second derivative for an operation in this model's backward ({error}). "
    "Curvature instruments differentiate the gradient again: for attention, run the forward of "
    "tracked steps under torch.nn.attention.sdpa_kernel(SDPBackend.MATH)."
)


def batched_grad(
    outputs, inputs, grad_outputs, retain_graph=True, create_graph=False, batched=True
):
    """torch.autograd.grad with a leading batch axis on grad_outputs (loop if vmap fails);
    ``batched=False``: one plain product. Clear error where a second derivative is missing."""
    try:
        if not batched:
            return torch.autograd.grad(
                outputs, inputs, grad_outputs, retain_graph=True, allow_unused=True
            )
        return _batched_grad_unchecked(outputs, inputs, grad_outputs, retain_graph, create_graph)
    except RuntimeError as error:
        if "is not implemented" in str(error) and "derivative for" in str(error):
            raise RuntimeError(NO_SECOND_DERIVATIVE.format(error=error)) from error
        raise


def _batched_grad_unchecked(outputs, inputs, grad_outputs, retain_graph, create_graph):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.autograd.grad(
                outputs,
                inputs,
                grad_outputs,
                retain_graph=retain_graph,
                create_graph=create_graph,
                allow_unused=True,
                is_grads_batched=True,
            )
    except RuntimeError:
        k = grad_outputs[0].shape[0]
        rows = [
            torch.autograd.grad(
                outputs,
                inputs,
                [g[j] for g in grad_outputs],
                retain_graph=True,
                create_graph=create_graph,
                allow_unused=True,
            )
            for j in range(k)
        ]
        return tuple(
            None if rows[0][i] is None else torch.stack([r[i] for r in rows])
            for i in range(len(inputs))
        )
