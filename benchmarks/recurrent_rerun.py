"""The recurrent rules with a tree's re-run of the recurrence against this tree's, side by side
in one process (issue 25, helper rnn), CPU time.

For the LSTM LM and the packed GRU of ``tests/real_models.py`` (float32, the sizes of
``benchmarks/real_models``), one torch thread, each round runs a plain SGD step and, for each
of economy and business, a step with the recurrent rule of a given tree (``--before``: the
path of a checkout's ``avionics/persample/rules/recurrent.py``, whose ``ReRun`` is patched in
for its steps, by the rule and by the GGN columns) and a step with this tree's; each
timed by ``time.process_time()``; the figures are the medians over the median plain step.

Run: ``python -m benchmarks.recurrent_rerun --before OLD/avionics/persample/rules/recurrent.py``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time
import warnings

import torch

from avionics.persample.rules import recurrent
from benchmarks.real_models import SIZES, TITLES, Preset
from benchmarks.tools import Plain
from tests.real_models import ALL_MODELS as MODELS


def _load(path: str):
    spec = importlib.util.spec_from_file_location("recurrent_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Patched:
    """While entered: the recurrent rule and its GGN columns re-run the recurrence by
    ``before``'s :class:`ReRun` (same interface: ``ReRun(module, call, n, copies)``,
    ``factors(columns)``)."""

    def __init__(self, before):
        self.before, self.saved = before.ReRun, recurrent.ReRun

    def __enter__(self):
        recurrent.ReRun = self.before

    def __exit__(self, *exc):
        recurrent.ReRun = self.saved


def _cpu_seconds(run) -> float:
    began = time.process_time()
    run()
    return time.process_time() - began


def compare(name: str, before, rounds: int, warmup: int) -> dict[str, float]:
    model, X, y, loss_fn = MODELS[name](dtype=torch.float32, **SIZES[name])
    tools = {"plain": Plain(copy.deepcopy(model), loss_fn, "sgd")}
    for preset in ("economy", "business"):
        for tree in ("before", "after"):
            tools[f"{preset} {tree}"] = Preset(copy.deepcopy(model), loss_fn, preset)
    times = {key: [] for key in tools}
    patched = _Patched(before)
    for k in range(warmup + rounds):
        for key, tool in tools.items():
            if key.endswith("before"):
                with patched:
                    seconds = _cpu_seconds(lambda tool=tool, k=k: tool.step(k, X, y))
            else:
                seconds = _cpu_seconds(lambda tool=tool, k=k: tool.step(k, X, y))
            if k >= warmup:
                times[key].append(seconds)
    plain = statistics.median(times["plain"])
    found = {"plain ms": 1e3 * plain}
    found.update({key: statistics.median(t) / plain for key, t in times.items() if key != "plain"})
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="a tree's rules/recurrent.py")
    parser.add_argument("--models", nargs="+", default=["lstm_lm", "packed_gru"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    before = _load(args.before)
    print("| model | plain step (CPU ms) | economy before | after | business before | after |")
    print("|---|---|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in args.models:
            r = compare(name, before, args.rounds, args.warmup)
            print(
                f"| {TITLES[name]} | {r['plain ms']:.1f} | {r['economy before']:.2f} | "
                f"{r['economy after']:.2f} | {r['business before']:.2f} | "
                f"{r['business after']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
