"""Curvature diagonals of the mini-batch mean loss from one captured, graph-keeping step.

Three diagonals h of the Hessian of L = mean_n l_n (SPEC section 2, TIC and HessTrace):

* ``"diag_ggn_exact"``: the diagonal of the generalized Gauss-Newton G = (1/N) sum_n
  J_n^T H_n J_n, with J_n the Jacobian of the model output for sample n and H_n the Hessian of
  l_n w.r.t. that output. Write H_n = S_n S_n^T (S_n = Q_n Lambda_n^{1/2} from its
  eigendecomposition, M columns for M output entries); then
  G_dd = (1/N) sum_n sum_c (J_n^T s_{n,c})_d^2: the per-sample "gradients" obtained by
  backpropagating the columns s_{n,c} instead of dl_n/dout, squared and summed. All M columns
  go back through the network in ONE batched backward (``is_grads_batched``), which yields the
  gradient w.r.t. every captured module output for every column; the per-sample engine then
  turns each column's output gradients into sum_n g_{n,d}^2 with its closed-form rules (tied
  weights, adopted parameters, custom modules included).

  The model output itself is not kept by the capture, only its autograd edge; the columns are
  therefore injected through the loss: with u_n = dl_n/dout (differentiable, taken w.r.t. the
  output's edge), backpropagating <u_n, v_n> gives J_n^T H_n v_n at every module output, and
  v = Q Lambda^{-1/2} gives H v = S. Eigenvalues below eps^(2/3) * max are dropped (their
  contribution is below that relative size; dividing by their root would amplify round-off).
* ``"diag_ggn_mc"``: the same with s_n = S_n z_n, z_n ~ N(0, I) from a seeded generator
  (E[s s^T] = H_n), averaged over ``mc_samples`` draws: an unbiased estimate.
* ``"diag_h"``: the exact Hessian diagonal. For networks that are piecewise linear in each
  single weight (Sequential stacks of Linear/Conv/ReLU/pooling/Flatten/Dropout/Identity), the
  second derivative of the output w.r.t. a single weight vanishes, so diag(H) = diag(G) and the
  GGN path is used. Otherwise it is computed exactly by Hessian-vector products with one-hot
  probes through the gradient graph that ``create_graph=True`` kept, batched with
  ``is_grads_batched``: D products, affordable for small networks; above ``max_probes``
  parameters an error names the modules that are not piecewise linear and the variants that
  do work.

The loss Hessian w.r.t. the output is formed densely per sample (M x M, M = number of output
entries of one sample), so the GGN variants need M <= ``MAX_OUTPUT_SIZE``.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from avionics.persample.request import Request

VARIANTS = ("diag_h", "diag_ggn_exact", "diag_ggn_mc")
MAX_OUTPUT_SIZE = 4096
MAX_PROBES = 50_000

# Modules through which the output is piecewise linear in each single weight.
PIECEWISE_LINEAR = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ReLU,
    nn.LeakyReLU,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Flatten,
    nn.Identity,
    nn.Dropout,
    nn.ZeroPad2d,
)


def not_piecewise_linear(model: nn.Module) -> list[str]:
    """Names of the modules that keep ``model`` from being piecewise linear in each weight."""
    bad = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
            continue
        if isinstance(m, PIECEWISE_LINEAR) and type(m).forward in {
            c.forward for c in PIECEWISE_LINEAR
        }:
            continue
        bad.append(f"'{name or 'the model'}' ({type(m).__name__})")
    return bad


def _edge(node) -> Tensor | GradientEdge:
    if isinstance(node, Tensor):
        return node
    grad_fn, output_nr = node
    return GradientEdge(grad_fn, output_nr)


NO_SECOND_DERIVATIVE = (
    "PyTorch has no second derivative for an operation in this model's backward ({error}). "
    "Curvature instruments differentiate the gradient again: for attention, run the forward of "
    "tracked steps under torch.nn.attention.sdpa_kernel(SDPBackend.MATH)."
)


def _batched_grad(outputs, inputs, grad_outputs, retain_graph=True, create_graph=False):
    """torch.autograd.grad with a leading batch axis on grad_outputs (loop if vmap fails)."""
    try:
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


# ------------------------------------------------------------------------------ GGN diagonals
def ggn_diagonal(
    model: nn.Module,
    engine,
    calls: dict,
    individual_losses: Tensor,
    params: list[Tensor],
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> list[Tensor]:
    """Exact (``mc_samples=None``) or Monte-Carlo diagonal of the GGN of the mean loss."""
    roots = calls.get(model, [])
    if len(roots) != 1 or len(roots[0].nodes) != 1:
        raise RuntimeError(
            "The GGN diagonal needs exactly one forward of the model with one tensor output per "
            f"step; this step has {len(roots)} calls of the model. Use curvature='diag_h'."
        )
    root = roots[0]
    n = len(individual_losses)
    out_shape = root.outputs[root.node_outputs[0]].shape
    m = out_shape.numel() // n
    if out_shape[root.batch_axis] != n or m > MAX_OUTPUT_SIZE:
        raise ValueError(
            f"The GGN diagonal forms the loss Hessian w.r.t. each sample's output densely; the "
            f"model output has shape {tuple(out_shape)} ({m} entries per sample, limit "
            f"{MAX_OUTPUT_SIZE}) for a batch of {n}. Use curvature='diag_h' on a small model."
        )
    out_edge = _edge(root.nodes[0])
    (u,) = torch.autograd.grad(
        individual_losses.sum(), [out_edge], retain_graph=True, create_graph=True
    )
    moved = u.movedim(root.batch_axis, 0)  # [N, ...]
    eye = torch.eye(m, dtype=u.dtype, device=u.device)
    probes = eye.reshape(m, 1, *moved.shape[1:]).expand(m, *moved.shape)
    probes = probes.movedim(1, root.batch_axis + 1)
    (hess,) = _batched_grad([u], [out_edge], [probes])  # [m, *out_shape]
    hess = hess.movedim(root.batch_axis + 1, 1).reshape(m, n, m).transpose(0, 1)  # [N, m, m]
    hess = 0.5 * (hess + hess.transpose(1, 2))
    lam, Q = torch.linalg.eigh(hess)
    top = lam.abs().amax(1, keepdim=True).clamp_min(torch.finfo(lam.dtype).tiny)
    cut = torch.finfo(lam.dtype).eps ** (2 / 3) * top
    if bool((lam < -cut).any()):
        raise ValueError(
            "The loss Hessian w.r.t. the model output has negative eigenvalues, so the GGN is "
            "not positive semi-definite and has no square-root factor; use curvature='diag_h'."
        )
    inv_root = torch.where(lam > cut, lam.clamp_min(cut).rsqrt(), torch.zeros_like(lam))
    V = Q * inv_root.unsqueeze(1)  # [N, m, m]: column c is v_{n,c}, H_n v_{n,c} = s_{n,c}
    if mc_samples is None:
        columns = V.permute(2, 0, 1)  # [m, N, m]
    else:
        z = torch.randn(mc_samples, n, m, generator=generator, dtype=V.dtype, device="cpu").to(
            V.device
        )
        columns = torch.einsum("nij,knj->kni", V, z)
    k = columns.shape[0]
    columns = columns.reshape(k, *moved.shape).movedim(1, root.batch_axis + 1)

    # One batched backward: every captured module output, for every column.
    keyed: dict = {}
    for module_calls in calls.values():
        for call in module_calls:
            for node in call.nodes:
                key = (id(node),) if isinstance(node, Tensor) else (id(node[0]), node[1])
                keyed.setdefault(key, _edge(node))
    keys = list(keyed)
    grads = _batched_grad([u], [keyed[key] for key in keys], [columns])
    by_key = dict(zip(keys, grads, strict=True))

    total = [torch.zeros_like(p) for p in params]
    request = Request(sum_sq=True)
    for c in range(k):
        column_calls = {}
        for module, module_calls in calls.items():
            replaced = []
            for call in module_calls:
                outs = [None] * len(call.outputs)
                for i, node in zip(call.node_outputs, call.nodes, strict=True):
                    key = (id(node),) if isinstance(node, Tensor) else (id(node[0]), node[1])
                    g = by_key[key]
                    outs[i] = None if g is None else g[c]
                copy = dataclasses.replace(call)  # (__post_init__ resets grad_outputs)
                copy.grad_outputs = outs
                replaced.append(copy)
            column_calls[module] = replaced
        stats = engine.statistics(column_calls, request, {}, n, 1.0)
        for t, s in zip(total, stats.sum_sq, strict=True):
            t.add_(s)
    scale = 1.0 / n if mc_samples is None else 1.0 / (n * mc_samples)
    return [t * scale for t in total]


# ------------------------------------------------------------------------------ Hessian diagonal
def hessian_diagonal_by_probes(
    graph_grads: list[Tensor], params: list[Tensor], scale: float, chunk: int | None = None
) -> list[Tensor]:
    """diag of the Hessian of scale * (the loss whose graph-carrying gradients are given), by
    one-hot Hessian-vector products batched in chunks."""
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    ref = params[0]
    chunk = chunk or max(1, min(total, 2**23 // max(total, 1), 1024))
    diag = torch.empty(total, dtype=ref.dtype, device=ref.device)
    for start in range(0, total, chunk):
        stop = min(total, start + chunk)
        k = stop - start
        E = torch.zeros(k, total, dtype=ref.dtype, device=ref.device)
        E[torch.arange(k), torch.arange(start, stop)] = 1
        parts = [
            e.reshape(k, *p.shape) for e, p in zip(E.split(sizes, dim=1), params, strict=True)
        ]
        hv = _batched_grad(graph_grads, params, parts)
        flat = torch.cat(
            [
                (h if h is not None else torch.zeros_like(e)).reshape(k, -1)
                for h, e in zip(hv, parts, strict=True)
            ],
            dim=1,
        )
        diag[start:stop] = flat[torch.arange(k), torch.arange(start, stop)]
    diag = diag.detach() * scale
    return [d.reshape(p.shape) for d, p in zip(diag.split(sizes), params, strict=True)]
