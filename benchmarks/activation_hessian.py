"""The activation Hessian: avionics vs curvlinops vs hand-written floors, in one run.

The product of d2 L / dZ2 (Z an intermediate tensor with its batch axis, L the batch loss) with
16 columns, on the problems of :mod:`benchmarks.curvature_operators` (MLP 784-256-256-10 at two
activations, the 3c3d CNN, the GPT; batch 128, 128, 32). The same exact product,
V [D, K] -> H V [D, K], five ways:

* avionics: ``ActivationHessianOperator(...) @ V``;
* curvlinops: ``ActivationHessianLinearOperator(...) @ V``;
* double backward, by hand: the network split at Z into ``below`` and ``above``, Z = below(X)
  computed without a graph, the rest run once from the leaf Z, f = above(Z), g = d L / dZ
  with its graph as the backward from f of the closed-form d L / df (as avionics does, so
  that the second backward needs no loop over the columns through log_softmax), and per
  product one batched backward through g (reverse-over-reverse, Pearlmutter 1994):
  H V = d (g . V) / dZ for all columns at once (``is_grads_batched``);
* columns last, by hand, where ``above`` is a chain of Linear layers and elementwise
  activations (both MLP cases, 3c3d): Hessian backpropagation (Dangel et al. 2020; for
  out = f(in), H_in V = J^T H_out J V + sum_i (d2 out_i / d in2) (d L / d out_i) V) with V
  kept as [N, D_l, K]: J V forward through each layer (for a Linear one ``bmm`` of a small
  matrix product per sample, W broadcast by stride 0; a scaling for an activation), the loss
  Hessian of the mean cross-entropy in closed form, (diag(p_n) - p_n p_n^T) / N, and J^T
  back, plus at each activation a = sigma(h) its own term diag(sigma''(h) * d L / da) V
  (:func:`columns_last_floor`);
* forward-over-reverse by torch.func (``vmap(jvp(grad(f)))`` with f the loss as a function of
  Z), the other automatic way.

The floor of a case is the fastest of the three hand-written ways.

Times are the CPU time of the computing thread (``time.thread_time``, torch on one thread),
the median over repeats with the implementations alternating. Before timing, all are
checked to agree (relative difference at most 1e-6 in float64) on one case.

Run: ``python -m benchmarks.activation_hessian`` (writes its section of BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from importlib.metadata import version

import torch
from torch import Tensor, nn
from torch.func import grad, jvp, vmap

from avionics.curvature import ActivationHessianOperator
from avionics.curvature._data import MathAttention
from benchmarks.curvature_operators import (
    COLUMNS,
    alternating_median_times,
    cnn_3c3d_problem,
    gpt_problem,
    mlp_problem,
)
from benchmarks.report import machine, table, write_section

AGREEMENT_RTOL = 1e-6
CHECKED_CASE = "MLP, ('2', 'input', 0)"

Split = Callable[[torch.nn.Module], tuple[Callable, Callable]]


def _sequential_split(position: int) -> Split:
    """A Sequential cut before its module ``position`` (Z is that module's input)."""
    return lambda model: (model[:position], model[position:])


def _gpt_split(model) -> tuple[Callable, Callable]:
    """The GPT cut at the output of its final LayerNorm (as in ``GPT.forward``)."""

    def below(idx: Tensor) -> Tensor:
        return model.ln_f(model.blocks(model.tokens(idx) + model.positions[: idx.shape[1]]))

    return below, lambda z: model.head(z).transpose(1, 2)


# name -> (problem, activation, the network split at that activation, timed repeats)
CASES = {
    "MLP, ('4', 'input', 0)": (mlp_problem, ("4", "input", 0), _sequential_split(4), 100),
    "MLP, ('2', 'input', 0)": (mlp_problem, ("2", "input", 0), _sequential_split(2), 60),
    "3c3d, ('10', 'input', 0)": (cnn_3c3d_problem, ("10", "input", 0), _sequential_split(10), 4),
    "GPT, ('ln_f', 'output', 0)": (gpt_problem, ("ln_f", "output", 0), _gpt_split, 2),
}


# ------------------------------------------------------------------------------------------
# The hand-written products
# ------------------------------------------------------------------------------------------


def cross_entropy_gradient(f: Tensor, y: Tensor) -> Tensor:
    """d L / df of the mean cross-entropy (class axis 1), (softmax(f) - onehot(y)) / y.numel(),
    with softmax as exp(f - logsumexp f): elementwise ops and reductions, each batched in a
    backward through it (log_softmax's own double backward loops over the columns)."""
    one_hot = torch.nn.functional.one_hot(y, f.shape[1]).movedim(-1, 1).to(f.dtype)
    return ((f - f.logsumexp(dim=1, keepdim=True)).exp() - one_hot) / y.numel()


def double_backward_floor(below, above, loss_fn, X, y) -> Callable[[Tensor], Tensor]:
    """V [D, K] -> H V by one batched backward through d L / dZ, built once here as the
    backward of the closed-form d L / df (every problem's loss is the mean cross-entropy)."""
    assert isinstance(loss_fn, torch.nn.CrossEntropyLoss) and loss_fn.reduction == "mean"
    with torch.no_grad():
        Z = below(X)
    Z.requires_grad_()
    f = above(Z)
    (gradient,) = torch.autograd.grad(f, Z, cross_entropy_gradient(f, y), create_graph=True)

    def product(V: Tensor) -> Tensor:
        K = V.shape[1]
        (HV,) = torch.autograd.grad(
            gradient, Z, V.T.reshape(K, *Z.shape), retain_graph=True, is_grads_batched=True
        )
        return HV.reshape(K, -1).T

    return product


def _activation_derivatives(module: nn.Module, h: Tensor) -> tuple[Tensor, Tensor | None]:
    """sigma'(h) and sigma''(h) (None where it is zero) of an elementwise activation."""
    if isinstance(module, nn.ReLU):
        return (h > 0).to(h.dtype), None
    if isinstance(module, nn.Tanh):
        first = 1 - h.tanh() ** 2  # tanh' = 1 - tanh^2, tanh'' = -2 tanh tanh'
        return first, -2 * h.tanh() * first
    if isinstance(module, nn.Sigmoid):
        first = h.sigmoid() * (1 - h.sigmoid())  # s' = s (1 - s), s'' = s' (1 - 2 s)
        return first, first * (1 - 2 * h.sigmoid())
    raise TypeError(f"the columns-last floor has no rule for {type(module).__name__}")


def columns_last_applies(above) -> bool:
    """Whether :func:`columns_last_floor` covers the network above Z."""
    covered = (nn.Linear, nn.ReLU, nn.Tanh, nn.Sigmoid)
    return isinstance(above, nn.Sequential) and all(isinstance(m, covered) for m in above)


def columns_last_floor(above: nn.Sequential, loss_fn, Z: Tensor, y: Tensor):
    """V [N D, K] -> H V by Hessian backpropagation with the columns last, V as [N, D_l, K].

    Built once: each layer's Jacobian products on [N, D_l, K] (W V and W^T U per sample for a
    Linear, sigma'(h) V for an activation a = sigma(h)) and, at a smooth activation, the
    curvature sigma''(h) * d L / da, the gradients back by hand from the closed-form
    d L / df = (softmax(f) - onehot(y)) / N. Per product: V_l = J_l V_{l-1} forward,
    U = (diag(p) - p p^T) V_L / N per sample, then U_{l-1} = J_l^T U_l back, plus
    sigma''(h) (d L / da) V_{l-1} at a smooth activation.
    """
    assert isinstance(loss_fn, nn.CrossEntropyLoss) and loss_fn.reduction == "mean"
    assert columns_last_applies(above) and Z.dim() == 2 and y.dim() == 1
    N = Z.shape[0]
    jacobians = []  # per layer: (V -> J V, U -> J^T U, U -> J^T g of the gradient g)
    curvatures = []  # per layer: sigma''(h) d L / da as [N, D_l, 1], None where zero
    with torch.no_grad():
        h = Z
        for module in above:
            if isinstance(module, nn.Linear):  # W broadcast by stride 0: no copy of V or W
                weight = module.weight.detach()  # (a view made under no_grad keeps its grad)
                W = weight.expand(N, *weight.shape)
                W_T = weight.T.contiguous().expand(N, *weight.T.shape)
                jacobians.append((W.bmm, W_T.bmm, weight.__rmatmul__))
                curvatures.append(None)
            else:
                first, second = _activation_derivatives(module, h)
                columns = first.unsqueeze(-1)
                jacobians.append((columns.mul, columns.mul, first.mul))
                curvatures.append(second)
            h = module(h)
        p = h.softmax(dim=1)
        g = (p - nn.functional.one_hot(y, p.shape[1]).to(p.dtype)) / N
        for index in reversed(range(len(above))):  # g = d L / d (layer index's output)
            if curvatures[index] is not None:
                curvatures[index] = (curvatures[index] * g).unsqueeze(-1)
            g = jacobians[index][2](g)
        p = p.unsqueeze(-1)

    def product(V: Tensor) -> Tensor:
        K = V.shape[1]
        V = V.view(N, -1, K)
        inputs = []  # V_{l-1} where layer l has a curvature term
        for (forward, _, _), curvature in zip(jacobians, curvatures):
            inputs.append(None if curvature is None else V)
            V = forward(V)
        pV = p * V
        U = (pV - p * pV.sum(dim=1, keepdim=True)) / N
        for index in reversed(range(len(jacobians))):
            U = jacobians[index][1](U)
            if curvatures[index] is not None:
                U = U + curvatures[index] * inputs[index]
        return U.view(-1, K)

    return product


def forward_over_reverse(below, above, loss_fn, X, y) -> Callable[[Tensor], Tensor]:
    """V [D, K] -> H V as the directional derivative of d L / dZ along each column (jvp)."""
    with torch.no_grad():
        Z = below(X)
    loss_gradient = grad(lambda z: loss_fn(above(z), y))

    def product(V: Tensor) -> Tensor:
        def column(v: Tensor) -> Tensor:
            return jvp(loss_gradient, (Z,), (v,))[1]

        with torch.no_grad():
            HV = vmap(column, in_dims=-1, out_dims=-1)(V.view(*Z.shape, V.shape[1]))
        return HV.reshape(-1, V.shape[1])

    return product


def products(name: str, dtype: torch.dtype = torch.float32) -> tuple[dict, int]:
    """The products of one case ({label: V -> HV}; columns last only where it applies) and
    their dimension D."""
    from curvlinops.experimental.activation_hessian import ActivationHessianLinearOperator

    problem, activation, split, _ = CASES[name]
    model, loss_fn, data, _ = problem()
    model = model.to(dtype)
    X, y = data[0]
    X = X.to(dtype) if X.is_floating_point() else X
    data = [(X, y)]
    below, above = split(model)
    ours = ActivationHessianOperator(model, loss_fn, activation, data)
    reference = ActivationHessianLinearOperator(model, loss_fn, activation, data)
    fns = {
        "double backward": double_backward_floor(below, above, loss_fn, X, y),
        "avionics": lambda V: ours @ V,
        "curvlinops": lambda V: reference @ V,
        "forward-over-reverse": forward_over_reverse(below, above, loss_fn, X, y),
    }
    if columns_last_applies(above):
        with torch.no_grad():
            Z = below(X)
        fns["columns last"] = columns_last_floor(above, loss_fn, Z, y)
    return fns, ours.shape[1]


def check_agreement(name: str) -> float:
    """The largest relative difference to the double backward of the other products, in
    float64; an AssertionError if it exceeds :data:`AGREEMENT_RTOL`."""
    with MathAttention():
        fns, D = products(name, torch.float64)
        generator = torch.Generator().manual_seed(0)
        V = torch.randn(D, COLUMNS, dtype=torch.float64, generator=generator)
        floor = fns.pop("double backward")(V)
        worst = max(float((fn(V) - floor).abs().max() / floor.abs().max()) for fn in fns.values())
    assert worst <= AGREEMENT_RTOL, f"{name}: the products differ by {worst:.1e} (relative)"
    return worst


# ------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------


def measure(name: str, repeats: int) -> tuple[int, dict[str, float]]:
    """D and the median CPU time (ms) of each product with 16 columns."""
    with MathAttention():  # curvlinops cannot differentiate through the fused attention
        fns, D = products(name)
        V = torch.randn(D, COLUMNS, generator=torch.Generator().manual_seed(0))
        times = alternating_median_times([lambda fn=fn: fn(V) for fn in fns.values()], repeats)
    return D, dict(zip(fns, times))


def run(cases: list[str], repeat_scale: float) -> str:
    torch.manual_seed(0)
    worst = check_agreement(CHECKED_CASE)
    hand_written = ("double backward", "columns last", "forward-over-reverse")
    header = [
        "case", "D", *(f"{key} (ms)" for key in hand_written), "avionics (ms)",
        "curvlinops (ms)", "avionics / floor", "curvlinops / avionics",
    ]  # fmt: skip
    rows = []
    for name in cases:
        print(name, flush=True)
        repeats = max(2, round(CASES[name][3] * repeat_scale))
        D, ms = measure(name, repeats)
        floor = min(ms[key] for key in hand_written if key in ms)
        rows.append(
            [name, D]
            + [f"{ms[key]:.1f}" if key in ms else "-" for key in hand_written]
            + [f"{ms['avionics']:.1f}", f"{ms['curvlinops']:.1f}"]
            + [f"{ms['avionics'] / floor:.2f}", f"{ms['curvlinops'] / ms['avionics']:.1f}"]
        )
    return (
        f"## Activation Hessian: avionics, curvlinops and the floor\n\n{machine()}; "
        f"curvlinops {version('curvlinops-for-pytorch')}. CPU time in ms of one thread of a "
        f"product with {COLUMNS} columns, on a shared machine under load (median over "
        "alternating repeats). Three hand-written exact ways (`benchmarks/activation_hessian.py`):"
        " double backward, one batched backward through d L / dZ, built once from the network "
        "cut at Z as the backward of the closed-form d L / df; columns last, Hessian "
        "backpropagation by hand with V as [N, D, K] through a chain of Linear layers and "
        "activations (J V forward, the cross-entropy's Hessian in closed form, J^T back plus "
        "sigma''(h) (d L / da) V at each activation; '-' where the network above Z is not such "
        "a chain); forward-over-reverse (torch.func). The floor is the fastest of the three. "
        f"The products agree to {worst:.0e} (relative, float64, on "
        f"{CHECKED_CASE}). Targets: avionics / floor at most 1.25; curvlinops / avionics at "
        f"least 5 on the MLP at ('4', 'input', 0).\n\n{table(header, rows)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--repeat-scale", type=float, default=1.0,
                        help="multiplies each case's timed repeats")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--no-write", action="store_true", help="print, don't write the file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    markdown = run(args.cases, args.repeat_scale)
    print(markdown)
    if not args.no_write:
        write_section("activation-hessian", markdown)


if __name__ == "__main__":
    main()
