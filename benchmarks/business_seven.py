"""The business preset over a plain step on the seven real models (issue 25), CPU time.

For each model of ``tests/real_models.py`` (float32, the sizes of ``benchmarks/real_models``),
a plain SGD step and a step under ``configuration("business")`` run interleaved, one of each
per round, each timed by ``time.process_time()`` (CPU time: on a loaded machine wall-clock
time counts other processes' work), on one torch thread; the figure is the median tracked
step over the median plain step. Target (issue 25): at most 6x.

Run: ``python -m benchmarks.business_seven`` (a few minutes); ``--models``, ``--rounds``,
``--json PATH`` to keep the ratios (e.g. to compare two checkouts).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch

from benchmarks.real_models import SIZES, TITLES, Preset
from benchmarks.tools import Plain
from tests.real_models import ALL_MODELS as MODELS

TARGET = 6.0


def _cpu_seconds(run) -> float:
    began = time.process_time()
    run()
    return time.process_time() - began


def business_over_plain(name: str, rounds: int, warmup: int) -> tuple[float, float]:
    """(median plain step in ms, median business step over median plain step)."""
    model, X, y, loss_fn = MODELS[name](dtype=torch.float32, **SIZES[name])
    plain = Plain(copy.deepcopy(model), loss_fn, "sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        business = Preset(model, loss_fn, "business")
        times = {"plain": [], "business": []}
        for k in range(warmup + rounds):
            for kind, tool in (("plain", plain), ("business", business)):
                seconds = _cpu_seconds(lambda tool=tool, k=k: tool.step(k, X, y))
                if k >= warmup:
                    times[kind].append(seconds)
    plain_s = statistics.median(times["plain"])
    return 1e3 * plain_s, statistics.median(times["business"]) / plain_s


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write {model: [plain ms, ratio]} to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    found = {}
    for name in args.models:
        found[name] = business_over_plain(name, args.rounds, args.warmup)
        plain_ms, ratio = found[name]
        met = "met" if ratio <= TARGET else "missed"
        print(f"{TITLES[name]} | {plain_ms:.1f} | {ratio:.1f} | {met}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f)


if __name__ == "__main__":
    main()
