"""The GPU checks and rows of BENCHMARKS.md, in one prepared run (at most 8 minutes on one GPU).

1. ``pytest -m cuda``: every test parametrised over ``tests/devices.py``'s ``device``, on CUDA
   (half-precision models, host synchronisations under ``set_sync_debug_mode("error")``,
   device discipline, ...).
2. The presets against a plain step: economy, business and full on 3c3d and the GPT
   benchmark, every step tracked, the time ratio median(instrumented) / median(plain) over
   the timed steps, plain and instrumented steps alternating on two copies of the model, each
   step ended by ``torch.cuda.synchronize()``; the reference tool (cockpit-for-pytorch) the
   same way on 3c3d where installed (the paper's GPU figures: economy 1.5x, business 2.0x,
   full 21x a plain step).
3. Per-sample squared gradient norms: avionics' NormTest against BackPACK, Opacus ghost
   clipping and torch.func's vmap(grad) (:mod:`benchmarks.peers`), where installed and able
   to run the problem.

The results go to the "gpu" section of BENCHMARKS.md with the date and the GPU. Cells that
would run past the time budget are skipped and say so. On a machine without CUDA it says so
and exits 0.

Run: ``python -m benchmarks.gpu`` (``--no-write`` to print only, ``--budget`` seconds;
``--device cpu --no-write`` runs the same rows on the CPU, without the tests, to check the
script itself where there is no GPU).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time
import warnings

import torch

from avionics import configuration
from benchmarks.peers import PEERS, available, refusal
from benchmarks.problems import PROBLEMS
from benchmarks.report import machine, table, write_section
from benchmarks.tools import Avionics, Plain, Reference, reference_available, reference_refuses

PRESETS = ["economy", "business", "full"]
PROBLEMS_TIMED = ["3c3d", "gpt"]
PAPER = {"economy": 1.5, "business": 2.0, "full": 21.0}  # cockpit-for-pytorch on a GPU
TEST_SECONDS = 240
DEVICE = torch.device("cuda")  # (main() sets it from --device)


def run_cuda_tests(seconds: int) -> str:
    """``pytest -m cuda`` in a subprocess: its summary line (or why it stopped)."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
               "-W", "ignore::pytest.PytestUnknownMarkWarning", "tests"]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return f"stopped after {seconds} s"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    print(done.stdout[-4000:], flush=True)
    return lines[-1] if lines else f"no output (exit {done.returncode})"


def on_device(problem: str):
    model, X, y, loss_fn = PROBLEMS[problem]()
    return model.to(DEVICE), X.to(DEVICE), y.to(DEVICE), loss_fn


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def ratio(problem: str, make_tool, steps: int, warmup: int, budget: float):
    """(median tool step / median plain step, plain ms, timed steps), alternating, synced."""
    model, X, y, loss_fn = on_device(problem)
    plain, tool = Plain(copy.deepcopy(model), loss_fn), make_tool(model, loss_fn)
    times: dict[str, list[float]] = {"plain": [], "tool": []}
    start = time.perf_counter()
    for k in range(warmup + steps):
        for name, runner in (("plain", plain), ("tool", tool)):
            if runner is plain:
                tool.pause()
            synchronize()
            t0 = time.perf_counter()
            runner.step(k, X, y)
            synchronize()
            if runner is plain:
                tool.resume()
            if k >= warmup:
                times[name].append(time.perf_counter() - t0)
        if k >= warmup + 2 and time.perf_counter() - start > budget:
            break
    plain_s, tool_s = statistics.median(times["plain"]), statistics.median(times["tool"])
    return tool_s / plain_s, 1e3 * plain_s, len(times["tool"])


def _names(preset: str) -> list[str]:
    return [q.name for q in configuration(preset)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=470.0, help="seconds in all")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks.gpu: torch sees no CUDA device here; nothing run (the GPU rows of "
              "BENCHMARKS.md stay pending).")  # fmt: skip
        return 0
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    notes = []
    if DEVICE.type == "cuda":
        notes.append(
            f"`pytest -m cuda`: {run_cuda_tests(min(TEST_SECONDS, int(args.budget / 2)))}"
        )
    cell = (args.budget - (time.perf_counter() - started)) / 16  # seconds per cell at most

    def left() -> float:
        return args.budget - (time.perf_counter() - started)

    preset_rows, norm_rows = [], []
    why_not = reference_available()
    for problem in PROBLEMS_TIMED:
        refused = why_not or reference_refuses(problem) or (problem != "3c3d" and "3c3d only")
        for preset in PRESETS:
            if left() < cell:
                notes.append(f"{problem} {preset}: skipped (time budget)")
                continue
            names = _names(preset)
            ours, plain_ms, n = ratio(
                problem, lambda m, f, q=names: Avionics(m, f, "sgd", q),
                args.steps, args.warmup, cell,
            )  # fmt: skip
            ref = "-"
            if not refused and left() > cell:
                theirs, _, m = ratio(
                    problem, lambda md, f, q=names: Reference(md, f, "sgd", q),
                    args.steps, 1, cell,
                )  # fmt: skip
                ref = f"{theirs:.2f} ({m} steps)"
            preset_rows.append([problem, preset, f"{plain_ms:.2f}", f"{ours:.2f} ({n} steps)",
                                ref, f"{PAPER[preset]:g}"])  # fmt: skip
            print(" | ".join(preset_rows[-1]), flush=True)
        for tool in ["avionics NormTest", *PEERS]:
            model = PROBLEMS[problem]()[0]
            why = None if tool.startswith("avionics") else available(tool) or refusal(tool, model)
            if why or left() < cell:
                norm_rows.append([problem, tool, "-", why or "skipped (time budget)"])
                continue

            def make(m, f, tool=tool):
                return (
                    Avionics(m, f, "sgd", ["NormTest"])
                    if tool.startswith("av")
                    else (PEERS[tool](m, f))
                )

            value, plain_ms, n = ratio(problem, make, args.steps, args.warmup, cell)
            norm_rows.append([problem, tool, f"{value:.2f} ({n} steps)", ""])
            print(" | ".join(norm_rows[-1]), flush=True)
    if why_not:
        notes.append(f"reference tool: {why_not}")
    _report(args, preset_rows, norm_rows, notes, time.perf_counter() - started)
    return 0


def _report(args, preset_rows, norm_rows, notes, elapsed: float) -> None:
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "no GPU (--device cpu)"
    markdown = "\n\n".join(
        [
            "## GPU: the presets, per-sample norms and the CUDA tests",
            f"{machine()}; {gpu}, CUDA {torch.version.cuda}; {elapsed / 60:.1f} min for this "
            "section (`python -m benchmarks.gpu`).",
            f"Every step tracked; median of up to {args.steps} timed steps after "
            f"{args.warmup} warm-up steps, plain and instrumented steps alternating on two "
            "copies of the model, each step ended by torch.cuda.synchronize(); synthetic "
            "data, batch 128 (GPT: 32 sequences of 64 tokens), float32, plain SGD. 'paper' is "
            "cockpit-for-pytorch's own GPU figure (x a plain step).",
            table(
                [
                    "problem",
                    "preset",
                    "plain step ms",
                    "ours (x plain)",
                    "cockpit-for-pytorch (x plain)",
                    "paper",
                ],
                preset_rows,
            ),  # fmt: skip
            "Per-sample squared gradient norms of all parameters (x a plain step):",
            table(["problem", "tool", "time (x plain)", "not run because"], norm_rows),
            "\n".join(f"* {note}" for note in notes),
        ]
    )
    if args.no_write:
        print(markdown)
    else:
        write_section("gpu", markdown)


if __name__ == "__main__":
    sys.exit(main())
