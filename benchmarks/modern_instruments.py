"""Cost of the instruments for modern training (issue 15): an instrumented Adam step divided by
a plain one.

For every problem of :mod:`benchmarks.problems` and every configuration (each new quantity
alone, HessMaxEV for comparison, the new ones all together, and the "transformer" preset on
one of its ordinary steps and on a step of its sparse schedule), two identical copies of the
model train side by side with Adam (lr 1e-3): one plainly, one inside ``with cockpit(step,
info)`` with every step tracked. Steps alternate (plain, instrumented, plain, ...) so that
machine noise hits both alike (:func:`benchmarks.tools.time_steps`); the ratio is
median(instrumented) / median(plain) over the timed steps after a warm-up (PreconditionedSharpness
and HessMaxEV start Lanczos from a random vector on the first step and warm-start afterwards).
Tracked steps that differentiate the gradient again run PyTorch's math attention kernel on the
GPT (the cockpit selects it: the fused kernels have no second derivative); plain steps use the
default kernel.

Run: ``python -m benchmarks.modern_instruments`` (all), or e.g.
``python -m benchmarks.modern_instruments --problems mlp --quantities LossOutliers --no-write``.
Writes the section "modern-instruments" of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from avionics import configuration, quantities
from avionics.schedules import linear
from benchmarks.problems import PROBLEMS
from benchmarks.report import machine, table, write_section
from benchmarks.tools import Avionics, time_steps

NEW = ["PreconditionedSharpness", "LossOutliers", "UpdateRatio", "ActivationHealth"]
COMPARED = ["HessMaxEV"]
ALL = "all new together"
# The preset's ordinary steps are timed from step 10001, where its logarithmic schedule has no
# step for a while; its sparse steps with every quantity on every step.
PRESET_ORDINARY = 'configuration("transformer"), an ordinary step'
PRESET_SPARSE = 'configuration("transformer"), a step of its sparse schedule'
CONFIGS = {
    **{name: (lambda name=name: [getattr(quantities, name)()], 0) for name in NEW + COMPARED},
    ALL: (lambda: [getattr(quantities, name)() for name in NEW], 0),
    PRESET_ORDINARY: (lambda: configuration("transformer"), 10_001),
    PRESET_SPARSE: (lambda: configuration("transformer", schedule=linear(1)), 0),
}


def time_ratio(problem: str, config: str, steps: int, warmup: int) -> float:
    """Median instrumented / median plain Adam step time."""
    make_quantities, offset = CONFIGS[config]
    tool, plain, _ = time_steps(
        problem,
        lambda model, loss_fn: Avionics(model, loss_fn, "adam", make_quantities(), offset),
        "adam",
        steps,
        warmup,
        budget_s=1e9,
    )
    return tool / plain


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    rows = []
    started = time.perf_counter()
    for problem in args.problems:
        for config in args.configs:
            ratio = time_ratio(problem, config, args.steps, args.warmup)
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
            "use their defaults (tol 1e-3, warm-started Lanczos). The transformer preset runs "
            "GradHist1d and PreconditionedSharpness on a logarithmic schedule (about 10 steps "
            "a decade) and the rest at every step: its ordinary steps are timed from step "
            "10001 (none of the sparse steps among them), its sparse steps with all its "
            "quantities at every step.",
            table(["problem", "quantities", "time ratio"], rows),
        ]
    )
    if args.no_write:
        print(markdown)
    else:
        write_section("modern-instruments", markdown)


if __name__ == "__main__":
    main()
