"""The first tracked step of a fresh process against a later one (issue 25: at most 3x).

Each run is a fresh Python process (one torch thread) that builds the BasicBlock ResNet of
``tests/real_models.py`` (batch 32) under ``configuration("economy")``, as
``benchmarks/real_models.py`` does, and times the Cockpit's construction, tracked step 0 and
tracked steps 1-5 (the later step: their median); the process's first optimizer is built
before the clock starts (it imports ``torch._dynamo``: seconds that are not the cockpit's).
numba's cache is a temporary ``NUMBA_CACHE_DIR``: absent in the first process of a pair (the
kernels compile), present in the second (they load). Two modes:

* ``at construction`` (what avionics does): the Cockpit loads the histogram kernels when it is
  built (``avionics.quantities.histograms.load_histogram_kernels``);
* ``on the first step`` (before): that load is skipped, so the first tracked step's first
  count loads or compiles them.

Run: ``python -m benchmarks.first_step`` (about a minute on a quiet machine), ``--no-write``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

from benchmarks.report import machine, table, write_section

SECTION = "first-step"
TARGET = 3.0
LATER = 5  # tracked steps after step 0, their median is "a later step"


MODES = (
    "'at construction' is what avionics does (the Cockpit loads the kernels its histogram "
    "quantities use when it is built); 'on the first step (before)' skips that load, so the "
    "first count of step 0 loads or compiles them."
)
WHY = (
    "What step 0 still pays once the kernels are loaded at construction (cProfile of step 0, "
    "cache present, 2026-12-02, load average ~16): 1.03 of its 1.84 s is the per-sample "
    "engine timing its candidate plans for each convolution on their first call "
    "(`persample/rules/kernels.py` `choose` -> `_seconds`: REPEATS timed runs of each plan, "
    "kept for the run), 0.28 s the engine's first-step check (`persample/engine.py` "
    "`_mismatched`); step 1 is 0.94 s and step 2 0.42 s. Without the plan timing step 0 would "
    "be about 2x a later step; choosing by a cost model, or timing on fewer samples, would "
    "meet the 3x target (the engine's files)."
)


def _probe(lazy: bool) -> None:
    """The body of a fresh process: print (construction, step 0, later step) in seconds."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from avionics import cockpit
    from benchmarks.real_models import SIZES, Preset
    from tests.real_models import ALL_MODELS

    if lazy:
        cockpit.load_histogram_kernels = lambda quantities, params: None
    model, X, y, loss_fn = ALL_MODELS["resnet"](dtype=torch.float32, **SIZES["resnet"])
    # a process's first optimizer imports torch._dynamo (seconds): not the cockpit's to count
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    t0 = time.perf_counter()
    tool = Preset(model, loss_fn, "economy")
    seconds = [time.perf_counter() - t0]
    for k in range(1 + LATER):
        t0 = time.perf_counter()
        tool.step(k, X, y)
        seconds.append(time.perf_counter() - t0)
    print(json.dumps([seconds[0], seconds[1], statistics.median(seconds[2:])]))


def pair(lazy: bool) -> dict[str, list[float]]:
    """(construction, step 0, later) with the cache absent, then present."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        command = [sys.executable, "-m", "benchmarks.first_step", "--probe"]
        command += ["--lazy"] if lazy else []
        runs = [
            json.loads(subprocess.run(command, env=env, capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1])
            for _ in range(2)
        ]  # fmt: skip
    return {"cache absent": runs[0], "cache present": runs[1]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lazy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        return _probe(args.lazy)
    torch.set_num_threads(1)  # as the probes run (for the machine line)
    load = os.getloadavg()[0]
    rows = []
    for mode, lazy in (("on the first step (before)", True), ("at construction", False)):
        for cache, (built, first, later) in pair(lazy).items():
            ratio = first / later
            mark = "met" if ratio <= TARGET else "missed"
            rows.append([mode, cache, f"{built:.2f}", f"{first:.2f}", f"{later:.2f}",
                         f"{ratio:.1f} ({mark})"])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    header = ["kernels loaded", "numba cache", "construction s", "step 0 s", "later step s",
              f"step 0 / later (target <= {TARGET:g})"]  # fmt: skip
    markdown = "\n\n".join([
        "## First tracked step of a fresh process (issue 25)",
        machine() + f"; load average {load:.1f} when it started (shared machine).",
        __doc__.split("\n\n")[1].replace("\n", " ").replace("Two modes:", MODES),
        table(header, rows),
        WHY,
    ])  # fmt: skip
    print(markdown)
    if not args.no_write:
        write_section(SECTION, markdown)


if __name__ == "__main__":
    main()
