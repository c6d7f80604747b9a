"""Cost of the instruments for modern training (issue 15): an instrumented Adam step divided by
a plain one.

For every problem of :mod:`benchmarks.problems` and every configuration (each new quantity
alone, HessMaxEV for comparison, and the new ones all together), two identical copies of the
model train side by side with Adam (lr 1e-3): one plainly, one inside ``with cockpit(step,
info)`` with every step tracked. Steps alternate (plain, instrumented, plain, ...) so that
machine noise hits both alike (:func:`benchmarks.tools.time_steps`); the ratio is
median(instrumented) / median(plain) over the timed steps after a warm-up (PreconditionedSharpness
and HessMaxEV start Lanczos from a random vector on the first step and warm-start afterwards).
Tracked steps that differentiate the gradient again run PyTorch's math attention kernel on the
GPT (the fused kernels have no second derivative); plain steps use the default kernel.

Run: ``python -m benchmarks.modern_instruments`` (all), or e.g.
``python -m benchmarks.modern_instruments --problems mlp --quantities LossOutliers --no-write``.
Writes the section "modern-instruments" of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time
import warnings
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from avionics import quantities
from benchmarks.problems import PROBLEMS
from benchmarks.report import machine, table, write_section
from benchmarks.tools import Avionics, time_steps

# The issue-15 quantities, those of them that this tree has (UpdateRatio and ActivationHealth
# are another module's), and HessMaxEV, the curvature instrument they are compared with.
NEW = [
    q
    for q in ("PreconditionedSharpness", "LossOutliers", "UpdateRatio", "ActivationHealth")
    if hasattr(quantities, q)
]
COMPARED = ["HessMaxEV"]
ALL = "all new together"


class _AdamCockpit(Avionics):
    """An Adam step watched by a cockpit; steps that differentiate the gradient again run the
    math attention kernel (``math_attention``)."""

    def __init__(self, model, loss_fn, names: list[str], math_attention: bool):
        super().__init__(model, loss_fn, "adam", names)
        self.math_attention = math_attention

    def step(self, k, X, y) -> None:
        second_order = self.math_attention and self.cockpit.create_graph(k)
        with sdpa_kernel(SDPBackend.MATH) if second_order else nullcontext():
            super().step(k, X, y)


def time_ratio(problem: str, names: list[str], steps: int, warmup: int) -> float:
    """Median instrumented / median plain Adam step time."""
    tool, plain, _ = time_steps(
        problem,
        lambda model, loss_fn: _AdamCockpit(model, loss_fn, names, problem == "gpt"),
        "adam",
        steps,
        warmup,
        budget_s=1e9,
    )
    return tool / plain


def _names(config: str) -> list[str]:
    return NEW if config == ALL else [config]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument(
        "--quantities",
        nargs="+",
        default=NEW + COMPARED + [ALL],
        help=f"names from {NEW + COMPARED}, or 'all' for the new ones together",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    configs = [ALL if q in ("all", ALL) else q for q in args.quantities]
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    rows = []
    started = time.perf_counter()
    for problem in args.problems:
        for config in configs:
            ratio = time_ratio(problem, _names(config), args.steps, args.warmup)
            rows.append([problem, config, f"{ratio:.2f}"])
            print(" | ".join(rows[-1]), flush=True)
    elapsed = time.perf_counter() - started

    markdown = "\n\n".join(
        [
            "## Instruments for modern training (instrumented Adam step / plain Adam step)",
            machine() + f"; {elapsed / 60:.1f} min for this table.",
            f"Every step tracked; median of {args.steps} timed steps after {args.warmup} "
            "warm-up steps, plain and instrumented steps alternating on two copies of the "
            "model (Adam, lr 1e-3), synthetic data, batch 128 (GPT: 32 sequences of 64 "
            f"tokens). '{ALL}' is {', '.join(NEW)}. PreconditionedSharpness and HessMaxEV "
            "use their defaults (tol 1e-3, warm-started Lanczos); their tracked GPT steps run "
            "the math attention kernel, the plain ones the default kernel.",
            table(["problem", "quantities", "time ratio"], rows),
        ]
    )
    if args.no_write:
        print(markdown)
    else:
        write_section("modern-instruments", markdown)


if __name__ == "__main__":
    main()
