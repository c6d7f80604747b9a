"""Cost of Alpha, GradHist1d, GradHist2d and the economy preset.

Same problems and method as :mod:`benchmarks.cockpit_overhead`: two identical copies of the
model train side by side, one plainly and one inside ``with cockpit(step, info)`` with every
step tracked; steps alternate; the time ratio is median(instrumented) / median(plain) over the
timed steps after a warm-up. Alpha is timed with plain SGD (its start projections come free
with the gradient) and with Adam (the update is only known after ``optimizer.step()``: the
start step's captured layer inputs and output gradients are kept until the next step and
projected then); every other configuration uses plain SGD.

Histograms are also reported against the cost of touching all N * D per-sample gradient
elements, measured in the same run: the time to write N * D float32 values once (``fill_`` of
one preallocated buffer, median of 5). A histogram's cost is its instrumented step minus the
plain step, divided by that floor. GradHist1d goes below it where Linear layers dominate D:
their products delta_{n,o} x_{n,i} are counted in runs along a sorted factor, a handful of
them per (n, o) (see :mod:`avionics.quantities.binning`).

Peak memory of the economy preset, as in :mod:`benchmarks.cockpit_overhead`: the growth of
the RSS high-water of a fresh process over three steps, instrumented / plain. The reference
tool (cockpit-for-pytorch) is timed the same way where installed and able to run the
problem, with at most ``--reference-budget`` seconds of steps per cell.

The kernels alone (``--kernels``, its own section): the numba kernels of
:mod:`avionics.quantities.binning` against its torch operations (the path of tensors on an
accelerator, run here on the CPU) on the same chunks, with 1 and 2 torch threads (numba's
kernels run on one), nanoseconds per counted element, the fastest of 5 runs each.

Run: ``python -m benchmarks.alpha_histograms`` (all), or e.g.
``python -m benchmarks.alpha_histograms --problems mlp --configs GradHist1d --no-write``;
``python -m benchmarks.alpha_histograms --kernels``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

from avionics import configuration
from avionics.persample import OuterProducts
from avionics.quantities import binning
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

ECONOMY = "economy"
# configuration -> (avionics quantities, optimizer, reference tool's quantity names)
CONFIGS = {
    "Alpha (SGD)": (["Alpha"], "sgd"),
    "Alpha (Adam)": (["Alpha"], "adam"),
    "GradHist1d": (["GradHist1d"], "sgd"),
    "GradHist2d": (["GradHist2d"], "sgd"),
    ECONOMY: (ECONOMY, "sgd"),
    # with any optimizer but plain SGD, Alpha's start projections are one more pass
    f"{ECONOMY} (Adam)": (ECONOMY, "adam"),
}
STEP_TARGET = {"Alpha (SGD)": 1.3, "Alpha (Adam)": 1.3, ECONOMY: 2.0, f"{ECONOMY} (Adam)": 2.0}
FLOOR_TARGET = {"GradHist1d": 2.0, "GradHist2d": 3.0}
MEMORY_TARGET = 1.5
# the problems on which the reference tool runs by default (it is slow: see --reference-on)
REFERENCE_ON = ["2c2d"]


def _names(config: str) -> list[str]:
    names = CONFIGS[config][0]
    return [q.name for q in configuration(ECONOMY)] if names == ECONOMY else names


def write_floor(problem) -> float:
    """Seconds to write N * D float32 values once."""
    model, X, _, _ = PROBLEMS[problem]()
    count = len(X) * sum(p.numel() for p in model.parameters() if p.requires_grad)
    buffer = torch.empty(count, dtype=torch.float32)
    buffer.fill_(0.0)  # first touch: page faults are not part of the floor
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        buffer.fill_(1.0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _probe(problem: str, config: str, plain: bool, steps: int, threads: int) -> None:
    """In a fresh process: print the resident KiB before the model exists and the high-water
    after ``steps`` steps (plain steps, or instrumented with ``config``)."""
    names, kind = _names(config), CONFIGS[config][1]

    def runner(model, loss_fn):
        return Plain(model, loss_fn, kind) if plain else Avionics(model, loss_fn, kind, names)

    probe_steps(problem, runner, steps, threads)


def peak_memory(problem: str, config: str, plain: bool, threads: int, steps: int = 3) -> int:
    """Bytes the RSS high-water of a fresh process grows by over ``steps`` steps."""
    args = [problem, config, "plain" if plain else "avionics", "--steps", str(steps)]
    return probe_growth("benchmarks.alpha_histograms", args + ["--threads", str(threads)])


def memory_ratio(problem: str, config: str, threads: int) -> float:
    return peak_memory(problem, config, False, threads) / peak_memory(
        problem, config, True, threads
    )


def _fastest(run, repeats: int = 5) -> float:
    run()  # (compiles or loads the numba kernel; warms torch's allocator)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def kernel_rows(threads: int) -> list[list[str]]:
    """numba against torch on the CPU, one row per kind of chunk (module docstring): a
    materialised chunk [128, 20000] (a convolution's G_n) and a Linear layer's outer
    products of delta [128, 256] and x [128, 512], counted in 1d (100 bins) and 2d (40 x 50
    bins)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(128, 20000, generator=gen) * 0.3
    outer = OuterProducts(torch.randn(128, 256, generator=gen) * 0.1, torch.randn(128, 512))
    counts, joint = torch.zeros(100, dtype=torch.int64), torch.zeros(2000, dtype=torch.int64)

    def offsets(d: int) -> torch.Tensor:
        theta = torch.randn(d, generator=gen)
        return binning.bin_index(theta, 50, -2.0, 2.0).mul_(40).to(torch.int32)

    cases = [
        ("1d, materialised", g, g.numel(), None),
        ("1d, outer products", outer, 128 * 256 * 512, None),
        ("2d, materialised", g, g.numel(), offsets(20000)),
        ("2d, outer products", outer, 128 * 256 * 512, offsets(256 * 512)),
    ]
    rows = []
    for name, chunk, elements, offset in cases:
        if offset is None:
            ours = _fastest(lambda c=chunk: binning.count_1d(c, -2.0, 2.0, counts))
            theirs = _fastest(lambda c=chunk: binning.torch_count_1d(c, -2.0, 2.0, counts))
        else:
            ours = _fastest(lambda c=chunk, o=offset: binning.count_2d(c, o, 40, -1, 1, joint))
            theirs = _fastest(
                lambda c=chunk, o=offset: binning.torch_count_2d(c, o, 40, -1, 1, joint)
            )
        rows.append([name, str(threads), f"{1e9 * ours / elements:.2f}",
                     f"{1e9 * theirs / elements:.2f}", f"{theirs / ours:.1f}"])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    return rows


def kernels_section(write: bool) -> None:
    rows = [row for threads in (1, 2) for row in kernel_rows(threads)]
    header = ["chunk", "torch threads", "numba ns/element", "torch ns/element",
              "torch (x numba)"]  # fmt: skip
    markdown = "\n\n".join(
        [
            "## Histogram kernels: numba against torch operations on the CPU",
            machine() + f"; load average {os.getloadavg()[0]:.1f} while it ran (a shared "
            "machine: the rows of 2 torch threads suffer most from other processes' load).",
            "The same chunks counted by the numba kernels and by the torch operations "
            "(`bin_index` in float64, then `scatter_add_`, in parts of 2^20 values; a Linear "
            "layer's products formed a part at a time) that count tensors on an accelerator; "
            "the counts are the same (tests/quantities/test_binning.py). Fastest of 5 runs. "
            "With 2 torch threads the numba kernels count a chunk's rows in 2 parts at once "
            "(`binning.PER_THREAD`: at least 2^18 values a part), the torch operations use "
            "torch's threads. "
            "The torch operations are slower on the CPU, so CPU tensors keep the numba "
            "kernels and every other device takes the torch operations (no copy to the host, "
            "no compilation).",
            table(header, rows),
        ]
    )
    if write:
        write_section("histogram-kernels", markdown)
    else:
        print(markdown)


def _maker(cls, kind, names):
    return lambda model, loss_fn: cls(model, loss_fn, kind, names)


def _mark(value: float, target: float | None) -> str:
    text = f"{value:.2f}"
    return text if target is None or value <= target else text + " (over)"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reference-on", nargs="*", default=REFERENCE_ON,
                        choices=list(PROBLEMS))  # fmt: skip
    parser.add_argument("--reference-budget", type=float, default=8.0,
                        help="seconds of timed steps per reference cell")  # fmt: skip
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--kernels", action="store_true",
                        help="only the numba against torch kernel section")  # fmt: skip
    parser.add_argument("--probe", nargs=3, metavar=("PROBLEM", "CONFIG", "plain|avionics"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args(argv)
    if args.probe:
        problem, config, tool = args.probe
        return _probe(problem, config, tool == "plain", args.steps, args.threads)
    if args.kernels:
        return kernels_section(not args.no_write)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    why_not = reference_available()

    rows, notes = [], []
    started = time.perf_counter()
    for problem in args.problems:
        floor = write_floor(problem)
        refused = why_not or reference_refuses(problem)
        if problem not in args.reference_on:
            refused = refused or "not run on this problem (slow; see --reference-on)"
        for config in args.configs:
            names, kind = _names(config), CONFIGS[config][1]
            ours, plain, _ = time_steps(
                problem, _maker(Avionics, kind, names), kind, args.steps, args.warmup, 1e9
            )
            ratio = ours / plain
            per_floor = "-"
            if config in FLOOR_TARGET:
                per_floor = _mark(max(0.0, ours - plain) / floor, FLOOR_TARGET[config])
            mem = "-"
            if CONFIGS[config][0] == ECONOMY and not args.no_memory:
                mem = _mark(memory_ratio(problem, config, args.threads), MEMORY_TARGET)
            ref = speedup = "-"
            if not refused:
                r_tool, r_plain, n_ref = time_steps(
                    problem, _maker(Reference, kind, names), kind, args.steps, 1,
                    args.reference_budget, min_steps=3,
                )  # fmt: skip
                r = r_tool / r_plain
                ref = f"{r:.1f}" + ("" if n_ref >= args.steps else f" ({n_ref} steps)")
                speedup = f"{r / ratio:.0f}x"
            row = [problem, config, f"{plain * 1e3:.1f}", _mark(ratio, STEP_TARGET.get(config)),
                   per_floor, f"{floor * 1e3:.1f}", mem, ref, speedup]  # fmt: skip
            rows.append(row)
            print(" | ".join(str(c) for c in row), flush=True)
        if refused and refused != why_not:
            notes.append(f"reference tool on {problem}: {refused}")
        if not args.no_write:
            _report(args, rows, notes, time.perf_counter() - started, final=False)
    if why_not:
        notes.append(f"reference tool: {why_not}")
    _report(args, rows, notes, time.perf_counter() - started, final=True)


def _report(args, rows, notes, elapsed, final: bool) -> None:
    header = ["problem", "quantities", "plain step ms", "time ours (x plain)",
              "hist cost (x floor)", "floor ms", "memory ours", "time reference (x plain)",
              "ours faster by"]  # fmt: skip
    markdown = "\n\n".join(
        [
            "## Alpha, gradient histograms and the economy preset",
            machine()
            + f"; {elapsed / 60:.1f} min for this table"
            + ("." if final else " (partial: still running)."),
            f"Every step tracked; median of {args.steps} timed steps after {args.warmup} "
            "warm-up steps, plain and instrumented steps alternating on two copies of the "
            "model (lr 1e-3; SGD, or Adam where the row says so, the plain copy using the "
            "same optimizer), synthetic data, batch 128 (GPT: 32 sequences of 64 tokens). "
            "Targets: Alpha <= 1.3x a plain step, economy <= 2x on the CNNs and the GPT, "
            "economy peak memory <= 1.5x; '(over)' marks a miss.",
            "Histogram cost = (instrumented step - plain step) / floor, where the floor is "
            "the time to write N * D float32 values once (one `fill_` of a preallocated "
            "buffer, same run). Targets: GradHist1d <= 2x, GradHist2d <= 3x the floor. "
            "GradHist1d goes below the floor where Linear layers hold most of D: it counts "
            "their products delta_{n,o} x_{n,i} in runs along a sorted factor, without "
            "forming each one.",
            "Peak memory (economy rows only), as in the cockpit-overhead section: three steps "
            "in a fresh process; the growth of its RSS high-water from before the model is built "
            "(model, data, optimizer state and the steps' peak), instrumented / plain; glibc's "
            "mmap threshold is fixed at 1 MiB there so that freed buffers leave the high-water. "
            "Like the libraries, the histogram kernels are loaded before the baseline: numba's "
            "runtime and their code take about 70 MiB once per process (127 MiB with numba's "
            "import), measured separately.",
            f"The reference tool is timed after one warm-up step with at most "
            f"{args.reference_budget:g} s of steps per cell (at least 3; fewer than the full "
            "count are noted), by default on 2c2d only: on the MLP one of its steps takes "
            "minutes (the issue quotes 250x a plain step for GradHist1d, 650x for GradHist2d, "
            "260x for economy there). 'ours faster by' = its ratio / ours.",
            table(header, rows),
            "\n".join(f"* {note}" for note in notes),
        ]
    )
    if args.no_write:
        print(markdown)
    else:
        write_section("alpha-histograms", markdown)


if __name__ == "__main__":
    main()
