"""The first tracked step of a fresh process against a later one (issue 25: at most 3x).

Each run is a fresh Python process (one torch thread) that builds one of the seven models of
``tests/real_models.py`` (at the sizes of ``benchmarks/real_models.py``) and times, in CPU time
of the process: a plain SGD step 0 and 1 of a copy of the model (PyTorch's own first-call
costs, such as the LSTM kernel's set-up, which a user's first step pays tracked or not, paid
before the cockpit's clock, so that what follows is what avionics adds); the construction of
a Cockpit with ``configuration("economy")``, as ``benchmarks/real_models.py`` builds it (it
loads the histogram kernels its quantities use: numba); tracked step 0 and tracked steps 1-5
(the later step: their median). numba's cache is a temporary ``NUMBA_CACHE_DIR``: absent in
the first process of a pair (the kernels compile at construction), present in the second
(they load).

Run: ``python -m benchmarks.first_step`` (a few minutes on a quiet machine), ``--models``,
``--no-write``, ``--pairs 2``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

from benchmarks.real_models import TITLES
from benchmarks.report import machine, table, write_section

SECTION = "first-step"
TARGET = 3.0
LATER = 5  # tracked steps after step 0, their median is "a later step"


def _probe(name: str) -> None:
    """The body of a fresh process for model ``name``: print (plain step 0, plain step 1,
    construction, step 0, later step) in CPU s."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from benchmarks.real_models import SIZES, Preset
    from benchmarks.tools import Plain
    from tests.real_models import ALL_MODELS

    model, X, y, loss_fn = ALL_MODELS[name](dtype=torch.float32, **SIZES[name])
    plain = Plain(copy.deepcopy(model), loss_fn, "sgd")
    plain_seconds = []
    for k in range(2):
        t0 = time.process_time()
        plain.step(k, X, y)
        plain_seconds.append(time.process_time() - t0)
    t0 = time.process_time()
    tool = Preset(model, loss_fn, "economy")
    seconds = [time.process_time() - t0]
    for k in range(1 + LATER):
        t0 = time.process_time()
        tool.step(k, X, y)
        seconds.append(time.process_time() - t0)
    print(json.dumps([*plain_seconds, seconds[0], seconds[1], statistics.median(seconds[2:])]))


def pair(name: str) -> dict[str, list[float]]:
    """The probe's figures for model ``name`` with the cache absent, then present."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        command = [sys.executable, "-m", "benchmarks.first_step", "--probe", name]
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
    parser.add_argument("--why", default="", help="a paragraph after the table: the profile")
    parser.add_argument("--models", nargs="+", choices=list(TITLES), default=list(TITLES))
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        return _probe(args.probe)
    torch.set_num_threads(1)  # as the probes run (for the machine line)
    load = os.getloadavg()[0]
    rows = []
    for name in args.models:
        for _ in range(args.pairs):
            for cache, (plain0, plain1, built, first, later) in pair(name).items():
                ratio = first / later
                mark = "met" if ratio <= TARGET else "missed"
                rows.append([TITLES[name], cache, f"{plain0:.3f} / {plain1:.3f}",
                             f"{built:.2f}", f"{first:.3f}", f"{later:.3f}",
                             f"{ratio:.1f} ({mark})"])  # fmt: skip
                print(" | ".join(rows[-1]), flush=True)
    header = ["model", "numba cache", "plain steps 0 / 1 s", "construction s", "step 0 s",
              "later step s", f"step 0 / later (target <= {TARGET:g})"]  # fmt: skip
    markdown = "\n\n".join([
        "## First tracked step of a fresh process, the seven real models (issue 25)",
        machine() + f"; load average {load:.1f} when it started (shared machine: CPU time).",
        __doc__.split("\n\n")[1].replace("\n", " "),
        table(header, rows),
        *([args.why] if args.why else []),
    ])  # fmt: skip
    print(markdown)
    if not args.no_write:
        write_section(SECTION, markdown)


if __name__ == "__main__":
    main()
