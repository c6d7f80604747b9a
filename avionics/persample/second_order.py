"""Curvature diagonals of the mini-batch mean loss from one captured, graph-keeping step.

Three diagonals h of the Hessian of L = mean_n l_n (SPEC section 2, TIC and HessTrace):

* ``"diag_ggn_exact"``: the diagonal of the generalized Gauss-Newton G = (1/N) sum_n
  J_n^T H_n J_n, with J_n the Jacobian of the model output for sample n and H_n the Hessian of
  l_n w.r.t. that output. Write H_n = S_n S_n^T; then G_dd = (1/N) sum_n sum_j (J_n^T S_n
  e_j)_d^2: the per-sample "gradients" obtained by backpropagating the columns S_n e_j instead
  of dl_n/dout, squared and summed. S_n has closed forms for softmax cross-entropy (also per
  token of a sequence: the loss Hessian is block-diagonal over positions) and squared error,
  recognised from the loss's graph and verified numerically (:func:`loss_hessian_root`); any
  other loss gets a dense eigendecomposition of H_n. Softmax cross-entropy's H_n has rank
  V - 1 per position (V classes), and a factor with V - 1 columns is used (:class:`_SoftmaxRoot`:
  9 backwards instead of 10 for 10 classes). Each column goes back from the model output to
  every captured module output in one backward (none when that output is the model output
  itself); the squared per-sample gradients are summed over columns by :class:`_ColumnSums` (a
  closed form for Linear layers without shared axes, all columns in one product per sample for
  convolutions, the per-sample engine's rules for everything else).

  Cost, with K columns (V - 1 = 9 for 10 classes): K backwards from the output to the layer
  outputs (no weight gradients), each roughly the input-gradient half of a backward; for each
  convolution, K times the multiply-adds of its forward (the per-sample, per-column weight
  gradients have no cheaper exact form); for Linear layers, one product the size of the
  layer's forward in all. So on 10 classes the exact diagonal costs several plain steps on
  any network whose backward is not negligible; the MC diagonal costs one column.
* ``"diag_ggn_mc"``: the same with S_n z_n, z_n ~ N(0, I) from a seeded generator
  (E[S z z^T S^T] = H_n), averaged over ``mc_samples`` draws: an unbiased estimate, one
  backward per draw whatever the output size.
* ``"diag_h"``: the exact Hessian diagonal. For networks that are piecewise linear in each
  single weight (Sequential stacks of Linear/Conv/ReLU/pooling/Flatten/Dropout/Identity), the
  second derivative of the output w.r.t. a single weight vanishes, so diag(H) = diag(G) and the
  GGN path is used. Otherwise it is computed exactly by Hessian-vector products with one-hot
  probes through the gradient graph that ``create_graph=True`` kept, batched with
  ``is_grads_batched``: D products, affordable for small networks; above ``max_probes``
  parameters an error names the modules that are not piecewise linear and the variants that
  do work.

The exact GGN diagonal backpropagates up to M columns (M = number of output entries of one
sample), so it needs M <= ``MAX_OUTPUT_SIZE`` (so does the dense loss Hessian of an
unrecognised loss).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from avionics.persample.request import Request
from avionics.persample.rules.conv import unfold

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


def _batched_grad(
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


# ------------------------------------------------------------------------------ GGN diagonals
def ggn_diagonal(
    model: nn.Module,
    engine,
    calls: dict,
    individual_losses: Tensor,
    params: list[Tensor],
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    traces: bool = False,
) -> list[Tensor]:
    """Exact (``mc_samples=None``) or Monte-Carlo diagonal of the GGN of the mean loss, or with
    ``traces`` only its sum per parameter, sum_d G_dd (0-dim tensors).

    With a square root S_n of the loss Hessian H_n w.r.t. sample n's output (S_n S_n^T = H_n,
    see :func:`loss_hessian_root`), G_dd = (1/N) sum_n sum_j (J_n^T S_n e_j)_d^2 (exact: every
    unit vector e_j of the output of one sample) or (1/(N K)) sum_n sum_k (J_n^T S_n z_{n,k})_d^2
    (Monte Carlo: z ~ N(0, I) from ``generator``, K = ``mc_samples``). Each column S e_j (or
    S z) is backpropagated from the model output to every captured module output, one backward
    per column; the squared per-sample gradients are summed over columns by
    :class:`_ColumnSums`. The traces need only the per-sample squared norms ||J_n^T S_n e_j||^2,
    which Linear layers without shared axes have in closed form, ||delta||^2 ||x||^2 (N (I + O)
    per column instead of N I O in all).
    """
    root = _root_call(model, calls, len(individual_losses))
    n = len(individual_losses)
    out_edge = _edge(root.nodes[0])
    out_shape = root.outputs[root.node_outputs[0]].shape
    m = out_shape.numel() // n
    if mc_samples is None and m > MAX_OUTPUT_SIZE:
        raise ValueError(
            f"The exact GGN diagonal backpropagates one column per output entry of a sample: "
            f"the model output has shape {tuple(out_shape)}, {m} entries per sample (limit "
            f"{MAX_OUTPUT_SIZE}). Use curvature='diag_ggn_mc'."
        )
    (u,) = torch.autograd.grad(
        individual_losses.sum(), [out_edge], retain_graph=True, create_graph=True
    )
    root_of = loss_hessian_root(individual_losses, root, u)
    if mc_samples is None:
        columns = root_of.columns()
    else:
        z = torch.randn(mc_samples, n, m, generator=generator, dtype=u.dtype, device="cpu")
        columns = (root_of(zk) for zk in z.to(u.device))
    sums = _ColumnSums(engine, calls, params, n, traces)
    moved_shape = (n, *(s for a, s in enumerate(out_shape) if a != root.batch_axis))
    # the model output is often a captured output too (a final Linear): its column is given
    inner = [i for i, key in enumerate(sums.keys) if key != _key(root.nodes[0])]
    edges = [sums.edges[i] for i in inner]
    for column in columns:
        column = column.reshape(moved_shape).movedim(0, root.batch_axis)
        grads = [column] * len(sums.edges)
        if edges:
            found = torch.autograd.grad(
                [out_edge], edges, [column], retain_graph=True, allow_unused=True
            )
            for i, g in zip(inner, found, strict=True):
                grads[i] = g
        sums.add(grads)
    return sums.result(1.0 / (n if mc_samples is None else n * mc_samples))


def _root_call(model: nn.Module, calls: dict, n: int):
    roots = calls.get(model, [])
    if len(roots) != 1 or len(roots[0].nodes) != 1:
        raise RuntimeError(
            "The GGN diagonal needs exactly one forward of the model with one tensor output per "
            f"step; this step has {len(roots)} calls of the model. Use curvature='diag_h'."
        )
    root = roots[0]
    shape = root.outputs[root.node_outputs[0]].shape
    if shape[root.batch_axis] != n:
        raise ValueError(
            f"The GGN diagonal needs the batch ({n} samples) on axis {root.batch_axis} of the "
            f"model output; it has shape {tuple(shape)}."
        )
    return root


# Autograd nodes that only rearrange a tensor (their backward is the inverse rearrangement).
_LAYOUT_NODES = {
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ReshapeAliasBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "CloneBackward0",
}


def loss_hessian_root(individual_losses: Tensor, root, u: Tensor):
    """A map z -> S_n z with S_n S_n^T = H_n, the Hessian of l_n w.r.t. sample n's output
    (z and the result: [N, M], batch first, the sample's output flattened).

    Closed forms where the loss graph establishes them, each verified with one random probe
    (H v from autograd against the formula, relative residual <= 10 sqrt(eps)):

    * softmax cross-entropy: l_n's graph reaches the output through one log-softmax (and
      layout operations only), and H_n = blockdiag_t c_t (diag p_t - p_t p_t^T) over the
      positions t (every axis but the batch and the class axis), p_t the softmax of position
      t, c_t >= 0 a weight (1/T for a mean over T tokens). Then
      S z = sqrt(c_t) (sqrt(p_t) * z_t - p_t (sqrt(p_t) . z_t)) per position, since
      (diag(sqrt p) - p sqrt(p)^T)(diag(sqrt p) - sqrt(p) p^T) = diag p - p p^T (1^T p = 1).
    * a scaled identity H_n = c_n I (squared error): S z = sqrt(c_n) z.

    Otherwise H_n is formed densely (M Hessian-vector products batched, M <= MAX_OUTPUT_SIZE)
    and S_n = Q Lambda^{1/2} from its eigendecomposition; eigenvalues below eps^(2/3) * max are
    dropped, negative ones beyond that are an error (the GGN would not be positive
    semi-definite).
    """
    out_edge = _edge(root.nodes[0])
    n = u.shape[root.batch_axis]
    moved = u.movedim(root.batch_axis, 0)
    m = moved[0].numel()
    probe_gen = torch.Generator(device="cpu").manual_seed(0)
    v = torch.randn(moved.shape, generator=probe_gen, dtype=u.dtype).to(u.device)
    (hv,) = torch.autograd.grad(
        [u], [out_edge], [v.movedim(0, root.batch_axis)], retain_graph=True
    )
    hv = hv.movedim(root.batch_axis, 0)
    tol = 10 * torch.finfo(u.dtype).eps ** 0.5 * float(hv.norm())

    probs = _softmax_probabilities(individual_losses, root)
    if probs is not None:
        p = probs.movedim(root.batch_axis, 0)
        for axis in _probability_axes(p):
            q = p * v - p * (p * v).sum(axis, keepdim=True)
            qq = q.pow(2).sum(axis, keepdim=True)
            c = torch.where(qq > 0, (hv * q).sum(axis, keepdim=True) / qq, 0.0)
            if float((hv - c * q).norm()) <= tol and bool((c >= -tol).all()):
                return _SoftmaxRoot(p, c.clamp_min(0), axis, n)
    flat_v, flat_hv = v.reshape(n, m), hv.reshape(n, m)
    c = (flat_hv * flat_v).sum(1, keepdim=True) / flat_v.pow(2).sum(1, keepdim=True)
    if float((flat_hv - c * flat_v).norm()) <= tol and bool((c >= -tol).all()):
        root_c = c.clamp_min(0).sqrt()
        return _Root(lambda z: root_c * z, n, m, u)
    return _dense_root(u, root, n, m)


def _softmax_probabilities(individual_losses: Tensor, root) -> Tensor | None:
    """exp of the one log-softmax between the model output and the losses, in the output's
    layout; None if there is not exactly one, or it is not reached by layout operations."""
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
    for layout in chain:
        log_p = layout(log_p)
    return log_p.detach().exp()


def _probability_axes(p: Tensor) -> list[int]:
    """The axes (not the batch axis 0) along which p sums to one everywhere."""
    tol = 10 * torch.finfo(p.dtype).eps ** 0.5
    return [a for a in range(1, p.dim()) if bool(((p.sum(a) - 1).abs() <= tol).all())]


class _Root:
    """z -> S z ([N, M] -> [N, M]), and the columns of a square-root factor of H_n for the
    exact diagonal: by default S e_j for every output entry j (M columns)."""

    def __init__(self, apply, n: int, m: int, like: Tensor):
        self.apply, self.n, self.m, self.like = apply, n, m, like

    def __call__(self, z: Tensor) -> Tensor:
        return self.apply(z)

    def columns(self):
        eye = torch.eye(self.m, dtype=self.like.dtype, device=self.like.device)
        return (self.apply(eye[j].expand(self.n, self.m)) for j in range(self.m))


class _SoftmaxRoot(_Root):
    """Softmax cross-entropy, per position t (p_t, weight c_t; the class axis moved last):
    S z = sqrt(c_t) A_t z_t with A = diag(s) - p s^T, s = sqrt(p).

    H_t = c_t A A^T has rank V - 1 (A s = 0), so the exact diagonal needs only V - 1 columns per
    position: with the Householder reflection R = I - w w^T / (1 + s_V), w = s + e_V (R s = -e_V,
    w^T w = 2 + 2 s_V >= 2, stable for every p), the first V - 1 columns of R span s^perp, and
    A R[:, :V-1] is a factor of H: A R[:, :V-1] R[:, :V-1]^T A^T = A (I - s s^T) A^T = A A^T.
    Since A e_j = s_j (e_j - p) and A w = A e_V, its column j (< V) is
    sqrt(c_t) s_j (e_j - s_V / (1 + s_V) e_V - p / (1 + s_V)). One backward fewer per position
    than the V columns of A (10 % of the work for 10 classes).
    """

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
        for t in range(p.shape[1]):
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


def _dense_root(u: Tensor, root, n: int, m: int):
    if m > MAX_OUTPUT_SIZE:
        raise ValueError(
            f"The GGN diagonal forms the loss Hessian w.r.t. each sample's output densely when "
            f"the loss is not recognised (softmax cross-entropy, squared error); the model "
            f"output has {m} entries per sample (limit {MAX_OUTPUT_SIZE}). Use "
            "curvature='diag_h' on a small model."
        )
    out_edge = _edge(root.nodes[0])
    moved_shape = u.movedim(root.batch_axis, 0).shape
    eye = torch.eye(m, dtype=u.dtype, device=u.device)
    probes = eye.reshape(m, 1, *moved_shape[1:]).expand(m, *moved_shape)
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
    S = Q * torch.where(lam > cut, lam, torch.zeros_like(lam)).sqrt().unsqueeze(1)
    return _Root(lambda z: torch.einsum("nij,nj->ni", S, z), n, m, u)


# Bytes of pending column gradients a convolution may hold before they are reduced, and of
# one chunk of per-sample, per-column convolution gradients (kept small: it stays in cache).
CONV_PENDING_BYTES = 64 * 2**20
CONV_CHUNK_BYTES = 2 * 2**20


class _ColumnSums:
    """sum over columns of sum_n g_{n,d}^2, g_n the per-sample gradient of one backpropagated
    column, from the columns' gradients w.r.t. the captured module outputs.

    * A Linear layer called once per forward without shared axes (input [N, I]) has
      g_n = delta_n x_n^T, so sum_j sum_n (delta_{j,n}^2)(x_n^2)^T = sum_n (sum_j
      delta_{j,n}^2) (x_n^2)^T: only sum_j delta_j^2 is accumulated, and one product per step
      forms the weight's sum (sum_n sum_j delta_{j,n}^2 for the bias).
    * A convolution called once per forward (:class:`_ConvSums`) has no such closed form (its
      output locations are shared axes): its per-sample, per-column gradients are formed, but
      for many columns at once, sample by sample from one unfolding of the input, as one
      product [columns x out channels, locations] @ [locations, in channels x kernel] per
      sample and group, squared and summed while the chunk is in cache.
    * Every other parameter (shared axes of a Linear, tied or adopted weights, other layers)
      goes through the per-sample engine's rules once per column, restricted to those
      parameters.

    With ``traces``, only sum_d of each parameter's sums is kept: for a Linear layer
    sum_n (sum_j ||delta_{j,n}||^2) ||x_n||^2, for the engine's rules their per-sample squared
    norms (closed forms) instead of squares; a convolution's sums are formed and summed.
    """

    def __init__(self, engine, calls: dict, params: list[Tensor], n: int, traces: bool = False):
        self.calls, self.params, self.n, self.traces = calls, params, n, traces
        keyed: dict = {}
        for module_calls in calls.values():
            for call in module_calls:
                for node in call.nodes:
                    keyed.setdefault(_key(node), _edge(node))
        self.keys = list(keyed)
        self.edges = [keyed[key] for key in self.keys]
        self.linear: dict = {}  # module -> [call, {param index: name}, running sum_j delta^2]
        self.conv: dict = {}  # module -> _ConvSums
        rest = []
        for k, owners in enumerate(engine.owners):
            module, name = owners[0] if len(owners) == 1 else (None, None)
            if engine.rerouted(k):
                rest.append(k)
            elif _separable_linear(module, name, calls, n):
                entry = self.linear.setdefault(module, [calls[module][0], {}, None])
                entry[1][k] = name
            elif _single_conv(module, name, calls, n):
                if module not in self.conv:
                    self.conv[module] = _ConvSums(module, calls[module][0], n)
                self.conv[module].indices[k] = name
            else:
                rest.append(k)
        self.rest = rest
        self.engine = _restricted_engine(engine, rest) if rest else None
        self.totals: list[Tensor | None] = [None] * len(params)

    def add(self, grads) -> None:
        by_key = dict(zip(self.keys, grads, strict=True))
        with torch.no_grad():
            for entry in self.linear.values():
                call = entry[0]
                d = by_key[_key(call.nodes[0])]
                if d is not None:
                    d = d.movedim(call.batch_axis, 0).reshape(self.n, -1)
                    entry[2] = d * d if entry[2] is None else entry[2].addcmul_(d, d)
            for sums in self.conv.values():
                sums.add(by_key[_key(sums.call.nodes[0])])
        if self.engine is None:
            return
        column_calls = {}
        for module, module_calls in self.calls.items():
            replaced = []
            for call in module_calls:
                outs = [None] * len(call.outputs)
                for i, node in zip(call.node_outputs, call.nodes, strict=True):
                    outs[i] = by_key[_key(node)]
                copy = dataclasses.replace(call)  # (__post_init__ resets grad_outputs)
                copy.grad_outputs = outs
                replaced.append(copy)
            column_calls[module] = replaced
        request = Request(sq_norms=True) if self.traces else Request(sum_sq=True)
        stats = self.engine.statistics(column_calls, request, {}, self.n, 1.0)
        for k, s in zip(self.rest, stats.sq_norms if self.traces else stats.sum_sq, strict=True):
            s = s.sum() if self.traces else s
            self.totals[k] = s if self.totals[k] is None else self.totals[k].add_(s)

    def result(self, scale: float = 1.0) -> list[Tensor]:
        """``scale`` times the sums (or their traces), one tensor per parameter (owned by the
        caller)."""
        with torch.no_grad():
            for call, names, sq in self.linear.values():
                if sq is None:
                    continue
                sq.mul_(scale)
                x = call.args[0].movedim(call.batch_axis, 0).reshape(self.n, -1)
                for k, name in names.items():
                    if name == "bias":
                        self.totals[k] = sq.sum() if self.traces else sq.sum(0)
                    elif self.traces:  # sum_n ||sq_n||_1 ||x_n||^2
                        self.totals[k] = torch.dot(sq.sum(1), x.square().sum(1))
                    else:
                        self.totals[k] = torch.mm(sq.t(), x * x)
            for sums in self.conv.values():
                for k, total in sums.result(scale).items():
                    self.totals[k] = total.sum() if self.traces else total
            for k in self.rest:
                if self.totals[k] is not None:
                    self.totals[k].mul_(scale)
        return [
            t if t is not None else (p.new_zeros(()) if self.traces else torch.zeros_like(p))
            for t, p in zip(self.totals, self.params, strict=True)
        ]


class _ConvSums:
    """sum_j sum_n g_{n,j}^2 of a convolution's weight and bias (module called once), g_{n,j}
    the gradient of sample n for column j: G_{n,j,g} = delta_{n,j,g} X_{n,g}^T with the
    unfolded input X_{n,g} [locations, (in channels / groups) x kernel].

    The columns' output gradients are kept (up to :data:`CONV_PENDING_BYTES`) and reduced
    together, a few samples at a time so that everything stays in cache: per sample and group
    one product [k columns x out channels / groups, locations] @ [locations, in / groups x
    kernel], squared in place and summed. The input is unfolded once per k columns (not once per
    column), each product is k times larger than one column's, and no [N, k, ...] copy of the
    columns is made.
    """

    def __init__(self, module, call, n: int):
        self.module, self.call, self.n = module, call, n
        self.indices: dict[int, str] = {}
        self.groups = module.groups
        self.pending: list[Tensor] = []
        self.weight_sum: Tensor | None = None
        self.bias_sum: Tensor | None = None

    def add(self, d: Tensor | None) -> None:
        if d is None:
            return
        d = d.movedim(self.call.batch_axis, 0)
        d = d.reshape(self.n, self.groups, d.shape[1] // self.groups, -1)  # [N, G, O/G, T]
        if "bias" in self.indices.values():
            b = d.sum(-1).reshape(self.n, -1)
            self.bias_sum = b * b if self.bias_sum is None else self.bias_sum.addcmul_(b, b)
            # (summed over samples in result(): sum_n of [N, O] rows, cheap)
        if "weight" in self.indices.values():
            self.pending.append(d)
            if len(self.pending) * d.numel() * d.element_size() >= CONV_PENDING_BYTES:
                self._reduce()

    def _reduce(self) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        n, groups, k = self.n, self.groups, len(pending)
        x = self.call.args[0].movedim(self.call.batch_axis, 0)
        o, t = pending[0].shape[2], pending[0].shape[3]
        i = (x.shape[1] // groups) * math.prod(self.module.kernel_size)
        per_sample = groups * (k * o * (t + i) + t * i) * pending[0].element_size()
        step = max(1, min(n, CONV_CHUNK_BYTES // max(1, per_sample)))
        total = self.weight_sum
        for start in range(0, n, step):
            stop = min(n, start + step)
            # the chunk's columns side by side, [c, G, k O/G, T], and its unfolded input
            d = torch.cat([p[start:stop] for p in pending], 2) if k > 1 else pending[0][start:stop]
            cols = unfold(self.module, x[start:stop])  # [c, C K, T]
            cols = cols.reshape(stop - start, groups, i, t)
            g = torch.matmul(d, cols.transpose(-1, -2))  # [c, G, k O/G, I/G]
            g = g.mul_(g).reshape(stop - start, groups, k, o, i)
            part = g.sum((0, 2))  # [G, O/G, I/G]
            total = part if total is None else total.add_(part)
        self.weight_sum = total

    def result(self, scale: float) -> dict[int, Tensor]:
        self._reduce()
        out = {}
        for k, name in self.indices.items():
            p = self.module.get_parameter(name)
            s = self.weight_sum if name == "weight" else self.bias_sum
            if s is None:
                continue
            s = s.sum(0) if name == "bias" else s
            out[k] = s.reshape(p.shape).mul_(scale)
        return out


def _key(node) -> tuple:
    return (id(node),) if isinstance(node, Tensor) else (id(node[0]), node[1])


def _separable_linear(module, name, calls, n: int) -> bool:
    """An nn.Linear (its own forward) called once, on an input [N, I] (no shared axes)."""
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        return False
    if name not in ("weight", "bias") or len(calls.get(module, [])) != 1:
        return False
    call = calls[module][0]
    x = call.args[0] if call.args else None
    return (
        isinstance(x, Tensor)
        and len(call.nodes) == 1
        and x.dim() > call.batch_axis
        and x.shape[call.batch_axis] == n
        and x.numel() == n * module.in_features
    )


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _single_conv(module, name, calls, n: int) -> bool:
    """An nn.Conv1d/2d/3d (its own forward) called once on an input [N, C, *spatial]."""
    if not isinstance(module, _CONVS) or type(module).forward not in {c.forward for c in _CONVS}:
        return False
    if name not in ("weight", "bias") or len(calls.get(module, [])) != 1:
        return False
    call = calls[module][0]
    x = call.args[0] if len(call.args) == 1 and not call.kwargs else None
    return (
        isinstance(x, Tensor)
        and len(call.nodes) == 1
        and call.node_outputs == [0]
        and x.dim() == len(module.kernel_size) + 2
        and x.shape[call.batch_axis] == n
        and x._version == call.input_versions[0]
    )


_RESTRICTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _restricted_engine(engine, indices: list[int]):
    """``engine.restricted(indices)``, cached per engine and routing."""
    cache = _RESTRICTED.setdefault(engine, {})
    key = (tuple(indices), tuple(engine.rerouted(k) for k in indices))
    if key not in cache:
        cache[key] = engine.restricted(indices)
    return cache[key]


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
