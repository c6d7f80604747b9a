"""The "transformer" preset's ordinary step against a plain Adam step (issue 25: <= 1.5x).

An ordinary step is one where the preset's sparse-schedule quantities (GradHist1d,
PreconditionedSharpness) are off: ActivationHealth, GradNorm, GradientNoiseScale, Loss,
LossOutliers, UpdateRatio and UpdateSize run. For each model of ``tests/real_models.py``
(float32, the sizes of ``benchmarks/real_models``, one torch thread or ``--threads``) a
plain Adam step and a tracked ordinary step alternate, one of each per round, after warm-up
rounds; the ratio is of the medians, of the process's CPU time per step (on a shared machine
the wall time also counts the other processes' turns) and of the wall time. Steps are
numbered from 1001, and those the sparse schedule tracks are left out (never run).

``--compare DIR`` measures, model by model in turn, the avionics under DIR (another checkout,
e.g. the commit before a change) and this one, each model in a fresh process per tree, and
writes both columns; ``--profile`` prints the avionics modules' inclusive time of the
ordinary steps under cProfile instead (:mod:`benchmarks.profile_presets`).

Run: ``python -m benchmarks.transformer_ordinary [--compare DIR] [--models ...]``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

FIRST_STEP = 1001
SPARSE = ("GradHist1d", "PreconditionedSharpness")


def ordinary_steps(cockpit, count: int) -> list[int]:
    """The first ``count`` steps from :data:`FIRST_STEP` that no sparse quantity tracks."""
    sparse = [q for q in cockpit.quantities if type(q).__name__ in SPARSE]
    steps, step = [], FIRST_STEP
    while len(steps) < count:
        if not any(q.is_active(step) for q in sparse):
            steps.append(step)
        step += 1
    return steps


def measure(name: str, rounds: int, warmup: int, profile: bool) -> dict:
    """{'plain': median s, 'ordinary': median s, and both in the process's CPU seconds
    ('plain cpu', 'ordinary cpu'); with ``profile``, also the profile's modules}."""
    from avionics import configuration
    from benchmarks.real_models import SIZES
    from benchmarks.tools import Avionics, Plain
    from tests.real_models import ALL_MODELS as MODELS

    model, X, y, loss_fn = MODELS[name](dtype=torch.float32, **SIZES[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = Plain(copy.deepcopy(model), loss_fn, "adam")
        tool = Avionics(copy.deepcopy(model), loss_fn, "adam", configuration("transformer"))
        steps = ordinary_steps(tool.cockpit, warmup + rounds)
        times = {"plain": [], "ordinary": [], "plain cpu": [], "ordinary cpu": []}
        profiler = cProfile.Profile(time.process_time)  # (CPU time: the machine is shared)
        for r, step in enumerate(steps):
            timed = r >= warmup
            for kind, run in (("plain", plain), ("ordinary", tool)):
                if profile and timed and kind == "ordinary":
                    profiler.enable()
                began, cpu = time.perf_counter(), time.process_time()
                run.step(step, X, y)
                seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
                profiler.disable()
                if timed:
                    times[kind].append(seconds)
                    times[kind + " cpu"].append(cpu)
    result = {k: statistics.median(v) for k, v in times.items()}
    if profile:
        from benchmarks.profile_presets import inclusive_by_module

        modules = inclusive_by_module(pstats.Stats(profiler))
        result["modules"] = {m: s / rounds for m, s in modules.items()}
    return result


def _in_tree(tree: Path, name: str, args) -> dict:
    """:func:`measure` of one model in a fresh process importing avionics from ``tree``."""
    command = [sys.executable, __file__, "--one", name, "--rounds", str(args.rounds),
               "--warmup", str(args.warmup), "--threads", str(args.threads)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> None:
    from tests.real_models import ALL_MODELS as MODELS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--compare", type=Path, help="another tree: its column beside this")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (a --compare child: one model)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure(args.one, args.rounds, args.warmup, False)))
        return
    if args.profile:
        for name in args.models:
            m = measure(name, args.rounds, args.warmup, True)
            top = sorted(m["modules"].items(), key=lambda item: -item[1])[:10]
            print(f"{name}: plain {1e3 * m['plain']:.1f} ms, ordinary "
                  f"{1e3 * m['ordinary']:.1f} ms ({m['ordinary'] / m['plain']:.2f}x): "
                  + "; ".join(f"{k} {1e3 * s:.1f}" for k, s in top), flush=True)  # fmt: skip
        return
    _compare(args)


def _compare(args) -> None:
    from benchmarks.real_models import TITLES
    from benchmarks.report import machine, table, write_section

    here = Path(__file__).resolve().parent.parent
    trees = ([("before", args.compare)] if args.compare else []) + [("after", here)]
    rows, loads = [], [os.getloadavg()[0]]
    started = time.perf_counter()
    for name in args.models:
        got = {label: _in_tree(tree, name, args) for label, tree in trees}
        loads.append(os.getloadavg()[0])
        row = [TITLES[name]]
        for label, _ in trees:
            m = got[label]
            row += [f"{1e3 * m['plain cpu']:.1f}", f"{1e3 * m['ordinary cpu']:.1f}",
                    f"{m['ordinary cpu'] / m['plain cpu']:.2f}",
                    f"{m['ordinary'] / m['plain']:.2f}"]  # fmt: skip
        rows.append(row + [_verdict(got["after"])])
        print(" | ".join(rows[-1]), flush=True)
    header = ["model"]
    for label, _ in trees:
        header += [f"{label}: plain Adam (CPU ms)", f"{label}: ordinary step (CPU ms)",
                   f"{label}: ratio (CPU)", f"{label}: ratio (wall)"]  # fmt: skip
    header.append("after <= 1.5x (CPU)")
    markdown = "\n\n".join([
        "## The transformer preset's ordinary step against plain Adam (issue 25)",
        machine() + f"; {(time.perf_counter() - started) / 60:.1f} min; load average "
        f"{min(loads):.1f}-{max(loads):.1f} (the machine is shared). `python -m "
        f"benchmarks.transformer_ordinary`: {args.warmup} warm-up and {args.rounds} timed "
        "rounds per model, a plain Adam step and an ordinary tracked step (no sparse-schedule "
        "quantity) in turn, medians of each step's CPU time (the process's: on a shared "
        "machine the wall time counts the other processes' turns) and, beside it, the ratio "
        "of the wall-time medians; 'before' is the tree given by `--compare`, each model "
        "measured in a fresh process of each tree, one after the other.",
        table(header, rows),
    ])  # fmt: skip
    if args.no_write:
        print(markdown)
    else:
        write_section("transformer-ordinary", markdown)


def _verdict(m: dict) -> str:
    ratio = m["ordinary cpu"] / m["plain cpu"]
    return "met" if ratio <= 1.5 else "missed"


if __name__ == "__main__":
    main()
