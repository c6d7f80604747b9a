"""The economy preset against its floor on the real models (issue 25), in one run per model.

For each model of ``tests/real_models.py`` (float32, the sizes of ``benchmarks/real_models``)
three steps run side by side, one of each per round, so that a shared machine's noise hits
all alike: a plain SGD step, the economy preset's step (SGD), and the economy floor of
:mod:`benchmarks.floors` (where it has a kernel for every parameter). 'extra': a step minus
the plain step. Targets (issue 25): economy's extra at most 1.25x the floor's, and economy at
most 3x a plain step. A narrower, faster run than :mod:`benchmarks.preset_floors` (which
times every preset and the curvature floors), for the engine's per-layer-call overhead.

Steps are timed by the process's CPU time (``time.process_time``; ``--clock wall`` for wall
time): with one torch thread every kernel runs in the calling thread, and on a machine shared
with other processes a step is not charged the time it waited for a core.

Run: ``python -m benchmarks.economy_floor`` (a few minutes on two cores); ``--models``,
``--rounds``, ``--clock``, ``--no-write``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings

import torch

from avionics import configuration
from benchmarks.floors import Floor
from benchmarks.preset_floors import ECONOMY_TO_FLOOR, TARGETS, _verdict
from benchmarks.real_models import SIZES, TITLES
from benchmarks.report import machine, table, write_section
from benchmarks.tools import Avionics, Plain
from tests.real_models import ALL_MODELS as MODELS

ECONOMY_TO_PLAIN = TARGETS["economy"]


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def measure(name: str, rounds: int, warmup: int, clock=time.process_time) -> dict[str, float]:
    """Median seconds of the plain, economy and floor steps of one model, side by side."""
    model, X, y, loss_fn = MODELS[name](dtype=torch.float32, **SIZES[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tools = {
            "plain": Plain(copy.deepcopy(model), loss_fn, "sgd"),
            "economy": Avionics(copy.deepcopy(model), loss_fn, "sgd", configuration("economy")),
        }
        try:
            tools["floor"] = Floor(copy.deepcopy(model), loss_fn, "sgd", "economy")
        except ValueError:
            pass
        times: dict[str, list[float]] = {k: [] for k in tools}
        for r in range(warmup + rounds):
            for kind, tool in tools.items():
                began = clock()
                tool.step(r, X, y)
                if r >= warmup:
                    times[kind].append(clock() - began)
    return {k: statistics.median(v) for k, v in times.items()}


def row_of(name: str, m: dict[str, float]) -> list[str]:
    plain, extra = m["plain"], m["economy"] - m["plain"]
    floor = m["floor"] - plain if "floor" in m else None
    ratio = "-" if floor is None or floor <= 0 else _verdict(extra / floor, ECONOMY_TO_FLOOR)
    return [TITLES[name], f"{1e3 * plain:.1f}", f"{1e3 * extra:.1f}",
            "none" if floor is None else f"{1e3 * floor:.1f}", ratio,
            _verdict(m["economy"] / plain, ECONOMY_TO_PLAIN)]  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per model")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started, load = time.perf_counter(), os.getloadavg()[0]
    rows = []
    for name in args.models:
        rows.append(row_of(name, measure(name, args.rounds, args.warmup, CLOCKS[args.clock])))
        print(" | ".join(rows[-1]), flush=True)
    load = f"{min(load, os.getloadavg()[0]):.1f}-{max(load, os.getloadavg()[0]):.1f}"
    header = ["model", "plain step (ms)", "economy extra (ms)", "floor extra (ms)",
              "extra / floor's (<= 1.25)", "economy / plain step (<= 3)"]  # fmt: skip
    markdown = "\n\n".join([
        "## Economy against its floor (issue 25)",
        machine() + f"; {(time.perf_counter() - started) / 60:.1f} min; load average {load} "
        f"(1 min, at the start and the end); `python -m benchmarks.economy_floor`: "
        f"{args.warmup} warm-up and {args.rounds} timed rounds per model ({args.clock} time), a "
        "plain SGD step, "
        "economy's step and benchmarks/floors.py's hand-written economy step side by side in "
        "each round, medians. 'none': the floor has no kernel for some parameter.",
        table(header, rows),
    ])  # fmt: skip
    if args.no_write:
        print(markdown)
    else:
        write_section("economy-floor", markdown)


if __name__ == "__main__":
    main()
