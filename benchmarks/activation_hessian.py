"""The activation Hessian: avionics vs curvlinops vs a hand-written floor, in one run.

The product of d2 L / dZ2 (Z an intermediate tensor with its batch axis, L the batch loss) with
16 columns, on the problems of :mod:`benchmarks.curvature_operators` (MLP 784-256-256-10 at two
activations, the 3c3d CNN, the GPT; batch 128, 128, 32). Three implementations of the same
exact product, V [D, K] -> H V [D, K]:

* avionics: ``ActivationHessianOperator(...) @ V``;
* curvlinops: ``ActivationHessianLinearOperator(...) @ V``;
* the floor, by hand: the network split at Z into ``below`` and ``above``, Z = below(X)
  computed without a graph, the rest run once from the leaf Z, f = above(Z), g = d L / dZ
  with its graph as the backward from f of the closed-form d L / df (as avionics does, so
  that the second backward needs no loop over the columns through log_softmax), and per
  product one batched backward through g (reverse-over-reverse, Pearlmutter 1994):
  H V = d (g . V) / dZ for all columns at once (``is_grads_batched``).

Beside the floor, forward-over-reverse by torch.func (``vmap(jvp(grad(f)))`` with f the loss
as a function of Z), the other exact way, measured to show which of the two is the floor.

Times are the CPU time of the computing thread (``time.thread_time``, torch on one thread),
the median over repeats with the implementations alternating. Before timing, the three are
checked to agree (relative difference at most 1e-6 in float64) on one case.

Run: ``python -m benchmarks.activation_hessian`` (writes its section of BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from importlib.metadata import version

import torch
from torch import Tensor
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
    """The four products of one case ({label: V -> HV}) and their dimension D."""
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
    return {
        "floor": double_backward_floor(below, above, loss_fn, X, y),
        "avionics": lambda V: ours @ V,
        "curvlinops": lambda V: reference @ V,
        "forward-over-reverse": forward_over_reverse(below, above, loss_fn, X, y),
    }, ours.shape[1]


def check_agreement(name: str) -> float:
    """The largest relative difference to the floor of the other products, in float64;
    an AssertionError if it exceeds :data:`AGREEMENT_RTOL`."""
    with MathAttention():
        fns, D = products(name, torch.float64)
        generator = torch.Generator().manual_seed(0)
        V = torch.randn(D, COLUMNS, dtype=torch.float64, generator=generator)
        floor = fns.pop("floor")(V)
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
    header = [
        "case", "D", "floor (ms)", "avionics (ms)", "curvlinops (ms)",
        "forward-over-reverse (ms)", "avionics / floor", "curvlinops / avionics",
    ]  # fmt: skip
    rows = []
    for name in cases:
        print(name, flush=True)
        repeats = max(2, round(CASES[name][3] * repeat_scale))
        D, ms = measure(name, repeats)
        rows.append(
            [name, D]
            + [f"{ms[key]:.1f}" for key in ("floor", "avionics", "curvlinops")]
            + [f"{ms['forward-over-reverse']:.1f}"]
            + [f"{ms['avionics'] / ms['floor']:.2f}", f"{ms['curvlinops'] / ms['avionics']:.1f}"]
        )
    return (
        f"## Activation Hessian: avionics, curvlinops and the floor\n\n{machine()}; "
        f"curvlinops {version('curvlinops-for-pytorch')}. CPU time in ms of one thread of a "
        f"product with {COLUMNS} columns, on a shared machine under load (median over "
        "alternating repeats). The floor is one "
        "batched double backward through d L / dZ, built once by hand from the network cut "
        "at Z as the backward of the closed-form d L / df (`benchmarks/activation_hessian.py`); "
        "forward-over-reverse is the other exact "
        f"way (torch.func). The products agree to {worst:.0e} (relative, float64, on "
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
