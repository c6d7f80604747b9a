"""Where a preset's step goes on the real models (issue 25): cProfile by avionics module.

For each model of ``tests/real_models.py`` and each preset, a cockpit with
``configuration(preset)`` runs warm-up steps, then a few tracked steps under cProfile. The time
of each avionics module is its inclusive time: the cumulative time of the calls that enter the
module from outside it (so a module's figure contains what it calls: the per-sample rules
contain their torch kernels, the engine's statistics contain the rules, a curvature
quantity contains its backward passes). The figures overlap along a call chain and are shown
in ms per step beside the plain step (forward, mean loss, backward, update) of the same
model, timed without the profiler.

Run: ``python -m benchmarks.profile_presets`` (a few minutes on two cores); ``--models``,
``--presets`` to choose, ``--no-write`` to print only.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.real_models import PRESETS, SIZES, TITLES, Preset
from benchmarks.report import machine, table, write_section
from benchmarks.tools import Plain
from tests.real_models import ALL_MODELS as MODELS

ROOT = str(Path(__file__).resolve().parent.parent / "avionics") + "/"
# the modules shown per row, the largest first
TOP = 6


def _module(filename: str) -> str | None:
    """The avionics module of a code object's file ("persample/rules/recurrent"), else None."""
    if not filename.startswith(ROOT):
        return None
    return filename[len(ROOT) : -3]


# a quantity's own work: these methods of the classes in avionics/quantities/*.py
QUANTITY_METHODS = ("prepare", "sums", "compute")


def inclusive_by_module(profile: pstats.Stats) -> dict[str, float]:
    """{avionics module: seconds spent inside it, callees included}. For a module of
    avionics/quantities, the cumulative time of its quantities' prepare, sums and compute
    (the quantity's own work; a Lanczos product re-enters the module from outside it); for
    any other module, the sum over the edges caller -> f with f in the module and the caller
    outside it of the edge's cumulative time."""
    seconds: dict[str, float] = defaultdict(float)
    for (filename, _, function), (_, _, _, cumulative, callers) in profile.stats.items():
        module = _module(filename)
        if module is None:
            continue
        if module.startswith("quantities/"):
            if function in QUANTITY_METHODS:
                seconds[module] += cumulative
            continue
        for (caller_file, _, _), (_, _, _, edge_cumulative) in callers.items():
            if _module(caller_file) != module:
                seconds[module] += edge_cumulative
    return seconds


def plain_seconds(name: str, steps: int) -> float:
    """The median plain step of model ``name`` (SGD), unprofiled."""
    model, X, y, loss_fn = MODELS[name](dtype=torch.float32, **SIZES[name])
    plain = Plain(copy.deepcopy(model), loss_fn, "sgd")
    times = []
    for k in range(steps + 2):
        t0 = time.perf_counter()
        plain.step(k, X, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def profile_preset(name: str, preset: str, steps: int, warmup: int):
    """(tracked step seconds unprofiled, {module: seconds per profiled step}) of one model
    under one preset. With the defaults the transformer preset's sparse schedule (0, 1, 2,
    3, 5, 6, 7, 10, ...) tracks timed steps 2 and 3 and profiled step 5, not step 4."""
    model, X, y, loss_fn = MODELS[name](dtype=torch.float32, **SIZES[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tool = Preset(model, loss_fn, preset)
        for k in range(warmup):
            tool.step(k, X, y)
        times = []
        for k in range(warmup, warmup + steps):
            t0 = time.perf_counter()
            tool.step(k, X, y)
            times.append(time.perf_counter() - t0)
        profiler = cProfile.Profile()
        profiler.enable()
        for k in range(warmup + steps, warmup + 2 * steps):
            tool.step(k, X, y)
        profiler.disable()
    stats = pstats.Stats(profiler)
    modules = {m: s / steps for m, s in inclusive_by_module(stats).items()}
    return statistics.median(times), modules


def _row(name, preset, step_s, plain_s, modules) -> list[str]:
    top = sorted(
        ((m, s) for m, s in modules.items() if m not in ("cockpit", "step/compute")),
        key=lambda item: -item[1],
    )[:TOP]
    where = "; ".join(f"{m} {1e3 * s:.0f}" for m, s in top)
    exit_s = modules.get("step/compute", 0.0)
    return [TITLES[name], preset, f"{1e3 * plain_s:.1f}", f"{step_s / plain_s:.1f}",
            f"{1e3 * exit_s:.0f}", where]  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--presets", nargs="+", default=PRESETS, choices=PRESETS)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    started = time.perf_counter()
    for name in args.models:
        plain_s = plain_seconds(name, 5)
        for preset in args.presets:
            step_s, modules = profile_preset(name, preset, args.steps, args.warmup)
            rows.append(_row(name, preset, step_s, plain_s, modules))
            print(" | ".join(rows[-1]), flush=True)
    header = ["model", "preset", "plain step (ms)", "tracked / plain", "values after the "
              "backward (ms)", "largest avionics modules, inclusive (ms per step)"]  # fmt: skip
    markdown = "\n\n".join([
        "## Where the presets' time goes on the real models (issue 25)",
        machine() + f"; {(time.perf_counter() - started) / 60:.1f} min. "
        f"`python -m benchmarks.profile_presets`: {args.warmup} warm-up steps, {args.steps} "
        f"timed steps (median), {args.steps} more under cProfile. A module's time includes "
        "what it calls (its torch kernels, the rules it runs), so the figures overlap along "
        "a call chain: persample/step contains persample/rules/*, quantities/curvature "
        "contains curvature/step/*; a quantities/ module counts its quantities' prepare, "
        "sums and compute (quantities/hess_max_ev also PreconditionedSharpness's Lanczos, "
        "which it shares). 'values after the backward': step/compute, everything the "
        "cockpit does on leaving the step. The transformer preset's timed and profiled steps "
        "are sparse-schedule steps (2, 3, 5) but for step 4.",
        table(header, rows),
    ])  # fmt: skip
    if args.no_write:
        print(markdown)
    else:
        write_section("preset-profiles", markdown)


if __name__ == "__main__":
    main()
