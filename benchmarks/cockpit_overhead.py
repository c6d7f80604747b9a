"""Overhead of the cockpit: an instrumented training step divided by a plain one.

For every problem of :mod:`benchmarks.problems` and every configuration (each quantity alone,
and all of them together), two identical copies of the model train side by side with plain
SGD: one plainly, one inside ``with cockpit(step, info)`` with every step tracked. Steps
alternate (plain, instrumented, plain, ...) so that machine noise hits both alike; the time
ratio is median(instrumented) / median(plain) over the timed steps after a warm-up. While a
plain step runs, the cockpit's capture hook is disarmed, so the plain step runs with no hook at
all. The reference tool (cockpit-for-pytorch, on a BackPACK-extended copy) is timed the same
way against its own plain copy, where it is installed and can run the problem.

Peak memory: the growth of the RSS high-water of a fresh process per configuration over three
steps (see the section text in BENCHMARKS.md).

Run: ``python -m benchmarks.cockpit_overhead`` (all; about ten minutes on two cores), or e.g.
``python -m benchmarks.cockpit_overhead --problems mlp --quantities NormTest --no-write``.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from benchmarks.memory import probe_growth, probe_steps
from benchmarks.problems import PROBLEMS
from benchmarks.report import machine, table, write_section
from benchmarks.tools import (
    Avionics,
    Plain,
    Reference,
    reference_available,
    reference_refuses,
    time_steps,
)

QUANTITIES = [
    "Loss", "GradNorm", "Distance", "UpdateSize", "Time", "Parameters",
    "NormTest", "InnerTest", "OrthoTest", "MeanGSNR", "CABS", "EarlyStopping",
]  # fmt: skip
GRADIENT_TESTS = ["NormTest", "InnerTest", "OrthoTest"]
ALL = "all together"
# All but Parameters, whose copy of every parameter is converted to Python lists each step.
ALL_BUT_PARAMETERS = "all but Parameters"
TIME_TARGET = {**{q: 1.3 for q in GRADIENT_TESTS}, ALL: 1.6, ALL_BUT_PARAMETERS: 1.6}
MEMORY_TARGET = 1.5
# Configurations whose peak memory is measured (the ones with per-sample statistics).
MEMORY_CONFIGS = ["NormTest", ALL]


def time_ratio(problem, tool_cls, names, steps, warmup, budget_s):
    """(median instrumented / median plain step time, timed steps)."""
    tool, plain, count = time_steps(
        problem, lambda model, loss_fn: tool_cls(model, loss_fn, "sgd", names), "sgd", steps,
        warmup, budget_s,
    )  # fmt: skip
    return tool / plain, count


def _probe(problem: str, tool: str, config: str, steps: int, threads: int) -> None:
    """In a fresh process: print the RSS high-water of imports alone and after ``steps``."""
    tool_cls = {"plain": None, "avionics": Avionics, "reference": Reference}[tool]
    if tool_cls is Reference:
        reference_available()  # import it before the baseline is taken

    def runner(model, loss_fn):
        if tool_cls is None:
            return Plain(model, loss_fn, "sgd")
        return tool_cls(model, loss_fn, "sgd", _names(config))

    probe_steps(problem, runner, steps, threads)


def peak_memory(problem: str, tool: str, config: str, threads: int, steps: int = 3) -> int:
    """Bytes the process's RSS high-water grows by over ``steps`` steps (fresh process)."""
    args = [problem, tool, config, "--steps", str(steps), "--threads", str(threads)]
    return probe_growth("benchmarks.cockpit_overhead", args)


# --------------------------------------------------------------------------------- report
def _names(config: str) -> list[str]:
    if config == ALL:
        return QUANTITIES
    if config == ALL_BUT_PARAMETERS:
        return [q for q in QUANTITIES if q != "Parameters"]
    return [config]


def _mark(value: float, target: float | None) -> str:
    if target is None:
        return f"{value:.2f}"
    return f"{value:.2f}" + ("" if value <= target else " (over)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--quantities", nargs="+", default=QUANTITIES + [ALL, ALL_BUT_PARAMETERS],
                        help=f"names from {QUANTITIES}, or 'all' for all together")  # fmt: skip
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--reference-budget",
        type=float,
        default=3.0,
        help="seconds of timed steps per reference configuration (min 5 steps)",
    )
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--probe", nargs=3, metavar=("PROBLEM", "TOOL", "CONFIG"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args(argv)
    if args.probe:
        return _probe(*args.probe, steps=args.steps, threads=args.threads)
    configs = [ALL if q in ("all", ALL) else q for q in args.quantities]
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    why_not = "switched off" if args.no_reference else reference_available()

    rows, notes = [], []
    started = time.perf_counter()
    for problem in args.problems:
        refused = why_not or reference_refuses(problem)
        if refused and not why_not:
            notes.append(f"reference tool on {problem}: cannot run ({refused})")
        plain_memory = None if args.no_memory else peak_memory(problem, "plain", ALL, args.threads)
        for config in configs:
            names = _names(config)
            measure_memory = plain_memory is not None and config in MEMORY_CONFIGS
            ours, _ = time_ratio(problem, Avionics, names, args.steps, args.warmup, 1e9)
            mem = ref = ref_mem = "-"
            if measure_memory:
                ratio = peak_memory(problem, "avionics", config, args.threads) / plain_memory
                mem = _mark(ratio, MEMORY_TARGET)
            if not refused:
                r, n_ref = time_ratio(problem, Reference, names, args.steps, args.warmup,
                                      args.reference_budget)  # fmt: skip
                ref = f"{r:.2f}" + ("" if n_ref >= args.steps else f" ({n_ref} steps)")
                if measure_memory:
                    ratio = peak_memory(problem, "reference", config, args.threads)
                    ref_mem = f"{ratio / plain_memory:.2f}"
            row = [problem, config, _mark(ours, TIME_TARGET.get(config)), ref, mem, ref_mem]
            rows.append(row)
            print(" | ".join(str(c) for c in row), flush=True)
    elapsed = time.perf_counter() - started

    header = ["problem", "quantities", "time ours", "time reference", "memory ours",
              "memory reference"]  # fmt: skip
    markdown = "\n\n".join(
        [
            "## Cockpit overhead (instrumented step / plain step)",
            machine() + f"; {elapsed / 60:.1f} min for this table.",
            f"Every step tracked; median of {args.steps} timed steps after {args.warmup} "
            "warm-up steps, plain and instrumented steps alternating on two copies of the "
            "model (SGD, lr 1e-3), synthetic data, batch 128 (GPT: 32 sequences of 64 "
            "tokens). Targets: each gradient test <= 1.3x, all together <= 1.6x, peak "
            "memory <= 1.5x; '(over)' marks a miss. The reference tool is timed with at most "
            f"{args.reference_budget:g} s of steps per cell (at least 5; fewer than "
            f"{args.steps} are noted).",
            "Peak memory: each configuration runs three steps in a fresh process; its memory is "
            "the growth of the process's resident high-water (`VmHWM`, large buffers mmapped) "
            "from just before the model is built, i.e. model, data, activations, gradients and "
            "the tool's own tensors at their peak, without the interpreter and libraries "
            "(benchmarks/memory.py); the ratio divides by the same for plain steps. Measured "
            f"for the configurations that compute per-sample statistics "
            f"({', '.join(MEMORY_CONFIGS)}); the others keep at most a copy or two of the "
            "parameters.",
            table(header, rows),
            "\n".join(f"* {note}" for note in notes),
        ]
    )
    if args.no_write:
        print(markdown)
    else:
        write_section("cockpit-overhead", markdown)


if __name__ == "__main__":
    main()
