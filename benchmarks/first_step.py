"""The first tracked step of a fresh process against a later one (issue 25: at most 3x).

Each run is a fresh Python process (one torch thread) that builds the BasicBlock ResNet of
``tests/real_models.py`` (batch 32) under ``configuration("economy")``, as
``benchmarks/real_models.py`` does, and times, in CPU time of the process, the Cockpit's
construction (it loads the histogram kernels its quantities use: numba), tracked step 0 and
tracked steps 1-5 (the later step: their median); the process's first optimizer is built
before the clock starts (it imports ``torch._dynamo``: seconds that are not the cockpit's).
numba's cache is a temporary ``NUMBA_CACHE_DIR``: absent in the first process of a pair (the
kernels compile at construction), present in the second (they load).

Run: ``python -m benchmarks.first_step`` (about a minute on a quiet machine), ``--no-write``,
``--pairs 2``.
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


WHY = (
    "Before (2026-12-02, helper first; the same script on 5dbbb2d, where the per-sample "
    "engine timed its candidate plans for each convolution at its first step, "
    "`persample/rules/kernels.py` `choose` -> `_seconds`): {before}. Now each layer's plan is "
    "fixed by its shape (BENCHMARKS.md, 'Measurements behind the engine's choices'): nothing "
    "is timed, and step 0 / later is what the table gives. What step 0 still pays over a "
    "later step: {why}"
)


def _probe() -> None:
    """The body of a fresh process: print (construction, step 0, later step) in CPU s."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from benchmarks.real_models import SIZES, Preset
    from tests.real_models import ALL_MODELS

    model, X, y, loss_fn = ALL_MODELS["resnet"](dtype=torch.float32, **SIZES["resnet"])
    # a process's first optimizer imports torch._dynamo (seconds): not the cockpit's to count
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    t0 = time.process_time()
    tool = Preset(model, loss_fn, "economy")
    seconds = [time.process_time() - t0]
    for k in range(1 + LATER):
        t0 = time.process_time()
        tool.step(k, X, y)
        seconds.append(time.process_time() - t0)
    print(json.dumps([seconds[0], seconds[1], statistics.median(seconds[2:])]))


def pair() -> dict[str, list[float]]:
    """(construction, step 0, later) with the cache absent, then present."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        command = [sys.executable, "-m", "benchmarks.first_step", "--probe"]
        runs = [
            json.loads(subprocess.run(command, env=env, capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1])
            for _ in range(2)
        ]  # fmt: skip
    return {"cache absent": runs[0], "cache present": runs[1]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--pairs", type=int, default=2, help="pairs of fresh processes")
    parser.add_argument("--before", default="not measured", help="the text of 'before'")
    parser.add_argument("--why", default="not profiled", help="the profile of step 0")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        return _probe()
    torch.set_num_threads(1)  # as the probes run (for the machine line)
    load = os.getloadavg()[0]
    rows = []
    for _ in range(args.pairs):
        for cache, (built, first, later) in pair().items():
            ratio = first / later
            mark = "met" if ratio <= TARGET else "missed"
            rows.append([cache, f"{built:.2f}", f"{first:.3f}", f"{later:.3f}",
                         f"{ratio:.1f} ({mark})"])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    header = ["numba cache", "construction s", "step 0 s", "later step s",
              f"step 0 / later (target <= {TARGET:g})"]  # fmt: skip
    markdown = "\n\n".join([
        "## First tracked step of a fresh process (issue 25, helper first, 2026-12-02)",
        machine() + f"; load average {load:.1f} when it started (shared machine: CPU time).",
        __doc__.split("\n\n")[1].replace("\n", " "),
        table(header, rows),
        WHY.format(before=args.before, why=args.why),
    ])  # fmt: skip
    print(markdown)
    if not args.no_write:
        write_section(SECTION, markdown)


if __name__ == "__main__":
    main()
