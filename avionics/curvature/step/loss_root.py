"""The square root of the loss Hessian of a captured step, found from the graph of its losses.

The GGN diagonal needs, per sample n, a factor S_n with S_n S_n^T = H_n, the Hessian of the
per-sample loss l_n w.r.t. sample n's model output. The operators know ``loss_fn`` and take
its closed form (:func:`~avionics.curvature._losses.output_hessian_square_root`); a captured
step has only ``individual_losses`` and the graph that produced them, so the loss is
recognised there (:func:`loss_hessian_root`) and every closed form is verified with one random
probe v (H v from autograd against the formula, relative residual <= 10 sqrt(eps)):

* softmax cross-entropy, also token-level: l_n's graph reaches the output through one
  log-softmax, and from it through layout and selection operations only (views, transposes,
  casts, slices such as the shift ``logits[:, :-1]`` of a causal language model, indexing);
  then H_n = blockdiag_t c_t (diag p_t - p_t p_t^T) over the positions t (every axis but the
  batch and the class axis; the softmax Hessian is block-diagonal over positions), p_t the
  softmax of position t (0 where the selection leaves an output entry out), c_t >= 0 a weight
  fitted from the probe (1/T for a mean over T tokens, 1/T_n for a mean over the T_n tokens
  that ``ignore_index`` or a padding mask keeps, 0 at the others; label smoothing changes
  none of it); its factor with V - 1 columns per position is :class:`SoftmaxHessianRoot`;
* a masked scaled identity H_n = c_n diag(m_n), m_n in {0, 1} (squared error over any
  trailing axes, summed or averaged, and with a padding mask: m_{n,j} = 0 where sample n's
  loss does not reach entry j, read off the probe as H v = 0 there):
  :class:`DiagonalHessianRoot`, S z = sqrt(c_n m_n) * z;
* otherwise H_n is formed densely (M Hessian-vector products batched, M <= MAX_OUTPUT_SIZE)
  and factored by its eigendecomposition (:func:`psd_square_root`).

:func:`recognised_loss` runs the same recognition on entering a step, before the user's
backward (two products through the loss alone, none through the network), so that a variant
that cannot run is refused there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from avionics.curvature.step._autograd import batched_grad
from avionics.persample.capture import output_edge

# Most output entries per sample for the exact GGN diagonal (one column each) and the dense
# loss Hessian of an unrecognised loss.
MAX_OUTPUT_SIZE = 4096

# Autograd nodes that only rearrange or select entries of a tensor: their backward puts each
# entry back where it came from (zeros where the selection left entries out), so applied to
# the probabilities it gives them in the output's layout. (A node that repeats entries, such
# as an expand, would add them up: the probabilities would no longer sum to one, and the
# closed form is refused.)
_LAYOUT_NODES = {
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ReshapeAliasBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "CloneBackward0",
    "ToCopyBackward0",  # a cast (the float32 loss of a forward under autocast)
    "SliceBackward0",  # logits[:, :-1], the shift of a causal language model
    "SelectBackward0",  # logits[:, -1]
    "NarrowBackward0",
    "SqueezeBackward0",
    "SqueezeBackward1",
    "SqueezeBackward2",
    "UnsqueezeBackward0",
    "IndexBackward0",  # logits[mask], logits[:, positions]
}


def _probe_tolerance(dtype: torch.dtype) -> float:
    """The relative residual of a closed form's probe: 10 sqrt(eps), or, for 16-bit floats
    (a forward under autocast, whose H v is rounded to them once), 4 eps."""
    eps = torch.finfo(dtype).eps
    return 4 * eps if dtype in (torch.float16, torch.bfloat16) else 10 * eps**0.5


class HessianRoot:
    """z -> S z ([N, M] -> [N, M], the batch first and each sample's output flattened) for a
    per-sample square-root factor S_n S_n^T = H_n, and the columns of S for the exact GGN
    diagonal: by default S e_j for every output entry j (M columns). ``kind`` names the loss
    recognised."""

    kind = "a dense loss Hessian"

    def __init__(self, apply: Callable[[Tensor], Tensor], n: int, m: int, like: Tensor):
        self.apply, self.n, self.m, self.like = apply, n, m, like

    def __call__(self, z: Tensor) -> Tensor:
        return self.apply(z)

    def columns(self):
        eye = torch.eye(self.m, dtype=self.like.dtype, device=self.like.device)
        return (self.apply(eye[j].expand(self.n, self.m)) for j in range(self.m))


class SoftmaxHessianRoot(HessianRoot):
    """Softmax cross-entropy, per position t (p_t, weight c_t; the class axis moved last):
    S z = sqrt(c_t) A_t z_t with A = diag(s) - p s^T, s = sqrt(p).

    H_t = c_t A A^T has rank V - 1 (A s = 0), so the exact diagonal needs only V - 1 columns per
    position: with the Householder reflection R = I - w w^T / (1 + s_V), w = s + e_V (R s = -e_V,
    w^T w = 2 + 2 s_V >= 2, stable for every p), the first V - 1 columns of R span s^perp, and
    A R[:, :V-1] is a factor of H: A R[:, :V-1] R[:, :V-1]^T A^T = A (I - s s^T) A^T = A A^T.
    Since A e_j = s_j (e_j - p) and A w = A e_V, its column j (< V) is
    sqrt(c_t) s_j (e_j - s_V / (1 + s_V) e_V - p / (1 + s_V)). One backward fewer per position
    than the V columns of A (10 % of the work for 10 classes).

    The operators' :func:`~avionics.curvature._losses.output_hessian_square_root` keeps the
    V columns A e_c = s_c (e_c - p) of every position: K-FAC's type-2 factors take all columns
    at once in one stacked tensor, where one column fewer saves little, and the reflected
    columns would change its numbers (the same factor S S^T, rounded differently).
    """

    kind = "softmax cross-entropy"

    def __init__(self, p: Tensor, c: Tensor, axis: int, n: int):
        self.p = p.movedim(axis, -1)  # [N, ..., V]
        self.s = self.p.sqrt()
        self.root_c = c.movedim(axis, -1).sqrt()  # [N, ..., 1]
        self.axis, self.shape = axis, p.shape
        super().__init__(self._apply, n, p[0].numel(), p)

    def _apply(self, z: Tensor) -> Tensor:
        z = z.reshape(self.shape).movedim(self.axis, -1)
        s = self.root_c * (self.s * z - self.p * (self.s * z).sum(-1, keepdim=True))
        return s.movedim(-1, self.axis).reshape(self.n, -1)

    def columns(self):
        v = self.p.shape[-1]
        p = self.p.reshape(self.n, -1, v)  # [N, T, V]
        s = self.s.reshape(self.n, -1, v)
        s_last = s[:, :, -1:]
        inv = 1.0 / (1.0 + s_last)
        base = -(p * inv)  # [N, T, V]: the part common to every column of a position
        base[:, :, -1:] -= s_last * inv
        scale = self.root_c.reshape(self.n, -1, 1) * s[:, :, : v - 1]  # [N, T, V-1]
        eye = torch.eye(v - 1, v, dtype=p.dtype, device=p.device)
        # positions whose block is zero for every sample (c_t = 0: ignore_index or padding;
        # p_t = 0: left out by the loss's selection) have only zero columns
        live = ((self.root_c.reshape(self.n, -1) > 0) & (p.sum(-1) > 0)).any(0)
        for t in live.nonzero().flatten().tolist():
            # the V - 1 columns of position t: [N, V - 1, V]
            block = (base[:, t, None, :] + eye).mul_(scale[:, t, :, None])
            for j in range(v - 1):
                if p.shape[1] == 1:
                    col = block[:, j].reshape(self.p.shape)
                else:
                    col = torch.zeros_like(p)
                    col[:, t] = block[:, j]
                    col = col.reshape(self.p.shape)
                yield col.movedim(-1, self.axis).reshape(self.n, -1)


class DiagonalHessianRoot(HessianRoot):
    """H_n = diag(d_n), d_n = c_n m_n >= 0 (squared error, masked or not): S z = sqrt(d_n) * z;
    the exact diagonal's columns are sqrt(d) e_j for the entries j where some d_{n,j} > 0."""

    kind = "squared error"

    def __init__(self, d: Tensor, n: int, m: int):
        self.root_d = d.sqrt()  # [N, M]
        super().__init__(lambda z: self.root_d * z, n, m, d)

    def columns(self):
        for j in (self.root_d > 0).any(0).nonzero().flatten().tolist():
            col = torch.zeros_like(self.root_d)
            col[:, j] = self.root_d[:, j]
            yield col


def psd_square_root(hess: Tensor) -> Tensor:
    """S [N, M, M] with S_n S_n^T = H_n for symmetric positive semi-definite H [N, M, M]:
    S_n = Q Lambda^{1/2} from the eigendecomposition of (H_n + H_n^T) / 2. Eigenvalues below
    eps^(2/3) * max |lambda| are dropped; negative ones beyond that are an error (a GGN built
    on H would not be positive semi-definite)."""
    hess = 0.5 * (hess + hess.transpose(1, 2))
    lam, Q = torch.linalg.eigh(hess)
    top = lam.abs().amax(1, keepdim=True).clamp_min(torch.finfo(lam.dtype).tiny)
    cut = torch.finfo(lam.dtype).eps ** (2 / 3) * top
    if bool((lam < -cut).any()):
        raise ValueError(
            "The loss Hessian w.r.t. the model output has negative eigenvalues, so the GGN is "
            "not positive semi-definite and has no square-root factor; use curvature='diag_h'."
        )
    return Q * torch.where(lam > cut, lam, torch.zeros_like(lam)).sqrt().unsqueeze(1)


def check_exact_columns(out_shape, m: int) -> None:
    """The exact diagonal backpropagates one column per output entry of a sample (m of them)."""
    if m > MAX_OUTPUT_SIZE:
        raise ValueError(
            f"The exact GGN diagonal backpropagates one column per output entry of a sample: "
            f"the model output has shape {tuple(out_shape)}, {m} entries per sample (limit "
            f"{MAX_OUTPUT_SIZE}). Use curvature='diag_ggn_mc'."
        )


def loss_hessian_root(individual_losses: Tensor, root, u: Tensor) -> HessianRoot:
    """A map z -> S_n z with S_n S_n^T = H_n, the Hessian of l_n w.r.t. sample n's output
    (z and the result: [N, M], batch first, the sample's output flattened).

    ``root`` is the captured call of the model, ``u`` = d sum_n l_n / d output with its graph.
    Closed forms where the loss graph establishes them (see the module's docstring), else the
    dense factor; eigenvalues below eps^(2/3) * max are dropped, negative ones beyond that are
    an error (the GGN would not be positive semi-definite).
    """
    closed = closed_form_root(individual_losses, root, u)
    if closed is not None:
        return closed
    n = u.shape[root.batch_axis]
    return _dense_root(u, root, n, u.numel() // n)


def loss_gradient(individual_losses: Tensor, root) -> Tensor:
    """u = d sum_n l_n / d output, with its graph (through the loss alone)."""
    (u,) = torch.autograd.grad(
        individual_losses.sum(), [output_edge(root.nodes[0])], retain_graph=True, create_graph=True
    )
    return u


def recognised_loss(individual_losses: Tensor, root) -> str | None:
    """The closed form :func:`closed_form_root` finds for this step's loss (its ``kind``), or
    None when only the dense loss Hessian would do; on entering a step, before its backward
    (the products run through the loss's graph only and leave the model's graph as it is)."""
    if individual_losses.grad_fn is None:
        return None
    closed = closed_form_root(individual_losses, root, loss_gradient(individual_losses, root))
    return closed.kind if closed is not None else None


def closed_form_root(individual_losses: Tensor, root, u: Tensor) -> HessianRoot | None:
    """The closed-form factor of the module's docstring that one random probe v confirms
    (H v from autograd against the formula), or None."""
    out_edge = output_edge(root.nodes[0])
    n = u.shape[root.batch_axis]
    moved = u.movedim(root.batch_axis, 0)
    m = moved[0].numel()
    probe_gen = torch.Generator(device="cpu").manual_seed(0)
    v = torch.randn(moved.shape, generator=probe_gen, dtype=u.dtype).to(u.device)
    (hv,) = torch.autograd.grad(
        [u], [out_edge], [v.movedim(0, root.batch_axis)], retain_graph=True
    )
    hv = hv.movedim(root.batch_axis, 0)

    probs = _softmax_probabilities(individual_losses, root)
    if probs is not None:
        p, softmax_dtype = probs
        p = p.movedim(root.batch_axis, 0)
        # (the softmax's own precision where it is less than the output's)
        tol = _probe_tolerance(_least_precise(softmax_dtype, u.dtype)) * float(hv.norm())
        for axis in _probability_axes(p, softmax_dtype):
            q = p * v - p * (p * v).sum(axis, keepdim=True)
            qq = q.pow(2).sum(axis, keepdim=True)
            c = torch.where(qq > 0, (hv * q).sum(axis, keepdim=True) / qq, 0.0)
            if float((hv - c * q).norm()) <= tol and bool((c >= -tol).all()):
                return SoftmaxHessianRoot(p, c.clamp_min(0), axis, n)
    tol = _probe_tolerance(u.dtype) * float(hv.norm())
    flat_v, flat_hv = v.reshape(n, m), hv.reshape(n, m)
    reached = flat_hv != 0  # the entries sample n's loss depends on (exact zeros elsewhere)
    vv = (flat_v.pow(2) * reached).sum(1, keepdim=True)
    c = torch.where(vv > 0, (flat_hv * flat_v).sum(1, keepdim=True) / vv, 0.0)
    if float((flat_hv - c * reached * flat_v).norm()) <= tol and bool((c >= -tol).all()):
        return DiagonalHessianRoot(c.clamp_min(0) * reached, n, m)
    return None


def _least_precise(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).eps > torch.finfo(b).eps else b


def _softmax_probabilities(individual_losses: Tensor, root) -> tuple[Tensor, torch.dtype] | None:
    """exp of the one log-softmax between the model output and the losses, in the output's
    layout and dtype, and the log-softmax's own dtype; None if there is not exactly one, or it
    is not reached by layout operations."""
    out_node, out_nr = root.nodes[0] if not isinstance(root.nodes[0], Tensor) else (None, 0)
    found, seen, queue = [], set(), [individual_losses.grad_fn]
    while queue and len(seen) < 64:  # the loss's own graph only: stop at the model output
        node = queue.pop()
        if node is None or node is out_node or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "LogSoftmaxBackward0":
            found.append(node)
        queue.extend(f for f, _ in node.next_functions)
    if len(found) != 1 or out_node is None:
        return None
    log_p, (node, nr) = found[0]._saved_result, found[0].next_functions[0]
    chain = []
    while node is not out_node:
        if node is None or type(node).__name__ not in _LAYOUT_NODES:
            return None
        chain.append(node)
        node, nr = node.next_functions[0]
    if nr != out_nr:
        return None
    # each node's backward takes the probabilities back to its input's layout (0 where a
    # selection left entries out); applied to p, not log p, so that those entries have p = 0
    p = log_p.detach().exp()
    with torch.no_grad():
        for layout in chain:
            p = layout(p)
    return p, log_p.dtype


def _probability_axes(p: Tensor, dtype: torch.dtype) -> list[int]:
    """The axes (not the batch axis 0) along which p (computed in ``dtype``) sums to one, or
    is zero (entries the loss's selection left out), everywhere."""
    tol = 10 * torch.finfo(_least_precise(p.dtype, dtype)).eps ** 0.5
    axes = []
    for a in range(1, p.dim()):
        total = p.sum(a)
        if bool((((total - 1).abs() <= tol) | (total == 0)).all()) and bool((total > 0).any()):
            axes.append(a)
    return axes


def _dense_root(u: Tensor, root, n: int, m: int) -> HessianRoot:
    """H_n from M batched Hessian-vector products e_j -> d (u . e_j) / d output, factored."""
    if m > MAX_OUTPUT_SIZE:
        raise ValueError(
            f"The GGN diagonal forms the loss Hessian w.r.t. each sample's output densely when "
            f"the loss is not recognised (softmax cross-entropy or squared error, per sample "
            f"or per token); the model output has {m} entries per sample (limit "
            f"{MAX_OUTPUT_SIZE}). Use curvature='diag_h' on a small model."
        )
    out_edge = output_edge(root.nodes[0])
    moved_shape = u.movedim(root.batch_axis, 0).shape
    eye = torch.eye(m, dtype=u.dtype, device=u.device)
    probes = eye.reshape(m, 1, *moved_shape[1:]).expand(m, *moved_shape)
    probes = probes.movedim(1, root.batch_axis + 1)
    (hess,) = batched_grad([u], [out_edge], [probes])  # [m, *out_shape]
    hess = hess.movedim(root.batch_axis + 1, 1).reshape(m, n, m).transpose(0, 1)  # [N, m, m]
    S = psd_square_root(hess)
    return HessianRoot(lambda z: torch.einsum("nij,nj->ni", S, z), n, m, u)
