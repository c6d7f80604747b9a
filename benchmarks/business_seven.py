"""The business preset over a plain step on the seven real models (issue 25), CPU time.

For each model of ``tests/real_models.py`` (float32, the sizes of ``benchmarks/real_models``),
a plain SGD step and a step under ``configuration("business")`` run interleaved, one of each
per round, each timed by ``time.process_time()`` (CPU time: on a loaded machine wall-clock
time counts other processes' work), on one torch thread; the figure is the median tracked
step over the median plain step. Target (issue 25): at most 6x.

With ``--floor`` (the ResNet), the hand-written floor of :mod:`benchmarks.ggn_floor` and an
economy step join the rounds: the curvature quantities' extra (business step minus economy
step) over the floor's (its step minus the plain step), target (issue 25) at most 1.25x, and
avionics' GGN diagonal alone (``ggn_diagonal``'s CPU time inside the business step) beside the
floor's columns and squares.

Run: ``python -m benchmarks.business_seven`` (a few minutes); ``--models``, ``--rounds``,
``--json PATH`` to keep the ratios (e.g. to compare two checkouts), ``--floor``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch

import avionics.quantities.curvature as curvature_quantities
from benchmarks.ggn_floor import GGNFloor
from benchmarks.real_models import SIZES, TITLES, Preset
from benchmarks.tools import Plain
from tests.real_models import ALL_MODELS as MODELS

TARGET = 6.0
FLOOR_TARGET = 1.25


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


class _TimedDiagonal:
    """``ggn_diagonal`` as the curvature quantities call it, its CPU seconds kept per call."""

    def __init__(self):
        self.seconds: list[float] = []
        self.inner = curvature_quantities.ggn_diagonal

    def __call__(self, *args, **kwargs):
        began = time.process_time()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds.append(time.process_time() - began)


def against_floor(name: str, rounds: int, warmup: int) -> dict[str, float]:
    """Median CPU ms of a plain, an economy, a business and a floor step (interleaved), and of
    avionics' GGN diagonal inside the business step."""
    model, X, y, loss_fn = MODELS[name](dtype=torch.float32, **SIZES[name])
    timed = _TimedDiagonal()
    curvature_quantities.ggn_diagonal = timed
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tools = {
                "plain": Plain(copy.deepcopy(model), loss_fn, "sgd"),
                "economy": Preset(copy.deepcopy(model), loss_fn, "economy"),
                "business": Preset(copy.deepcopy(model), loss_fn, "business"),
                "floor": GGNFloor(copy.deepcopy(model), loss_fn, "sgd"),
            }
            times = {kind: [] for kind in tools}
            for k in range(warmup + rounds):
                for kind, tool in tools.items():
                    seconds = _cpu_seconds(lambda tool=tool, k=k: tool.step(k, X, y))
                    if k >= warmup:
                        times[kind].append(seconds)
    finally:
        curvature_quantities.ggn_diagonal = timed.inner
    found = {kind: 1e3 * statistics.median(t) for kind, t in times.items()}
    found["ggn_diagonal"] = 1e3 * statistics.median(timed.seconds[warmup:])
    return found


def _print_floor(name: str, m: dict[str, float]) -> None:
    ours, floor = m["business"] - m["economy"], m["floor"] - m["plain"]
    met = "met" if ours <= FLOOR_TARGET * floor else "missed"
    print(
        f"{TITLES[name]} | plain {m['plain']:.1f} | economy {m['economy'] / m['plain']:.2f}x | "
        f"business {m['business'] / m['plain']:.2f}x | floor step {m['floor'] / m['plain']:.2f}x"
        f" | curvature extra {ours:.1f} ms, floor's {floor:.1f} ms: {ours / floor:.2f}x {met} | "
        f"ggn_diagonal {m['ggn_diagonal']:.1f} ms",
        flush=True,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write {model: [plain ms, ratio]} to this file")
    parser.add_argument("--floor", action="store_true", help="against the GGN floor (ResNet)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.floor:
        models = args.models if args.models != list(MODELS) else ["resnet"]
        found = {name: against_floor(name, args.rounds, args.warmup) for name in models}
        for name, m in found.items():
            _print_floor(name, m)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(found, f)
        return
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
