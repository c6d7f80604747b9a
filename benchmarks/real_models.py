"""The presets on real models (issues 18 and 24): an instrumented step divided by a plain one.

The models of ``tests/real_models.py`` as a new user brings them, in float32: a BasicBlock
ResNet with train-mode BatchNorm and dropout, the real Hugging Face GPT-2 built from a tiny
config (position table looked up by ``arange(T)``, tied head) trained as a causal language
model on padded sequences (shifted loss, ignore_index), a BERT-style classifier with padding
masks, an ``nn.TransformerEncoder`` classifier with key padding masks, an LSTM language
model, a packed GRU and a ViT with a class token and a position table. Each runs
``configuration("economy")``, ``"business"``, ``"full"`` (HessTrace and TICDiag with
``curvature="auto"``: the variant it chooses is printed) and ``"transformer"`` (with Adam,
which its PreconditionedSharpness reads; the others with SGD), every step tracked. Two copies
of the model train side by side with the same optimiser, steps alternating (plain,
instrumented, plain, ...) so that the noise of a shared machine hits both alike; the ratio
is median(instrumented) / median(plain) over the timed steps after a warm-up. Targets (issue
25; issue 18 asked economy <= 2x, full <= 6x): economy <= 3x, business <= 6x, full <= 21x
(the cockpit paper's figure); the transformer preset's ordinary step <= 1.5x is measured in
``benchmarks/preset_floors`` (here most timed steps are its sparse schedule's, 0, 1, 2, 3, 5,
6, 7, so the median is a sparse step).

Also the first tracked step in a fresh process (the ResNet under economy), with numba's cache
of the histogram kernels empty (they compile) and filled (they load), beside a later step.

Run: ``python -m benchmarks.real_models`` (a few minutes on two cores), ``--quick`` for a smoke
run (small batches, one timed step, no first-step processes, nothing written).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings

import torch

from avionics import configuration
from benchmarks.report import machine, table, write_section
from benchmarks.tools import Avionics, time_steps
from tests.real_models import ALL_MODELS as MODELS

PRESETS = ["economy", "business", "full", "transformer"]
TARGET = {"economy": 3.0, "business": 6.0, "full": 21.0}
# The builders' arguments for the timed runs and for --quick.
SIZES = {
    "resnet": {"n": 32},
    "gpt2": {"n": 16, "t": 16},
    "bert": {"n": 32, "t": 10},
    "encoder": {"n": 32, "t": 10},
    "lstm_lm": {"n": 32, "t": 12},
    "packed_gru": {"n": 32, "t": 8},
    "vit": {"n": 32},
}
QUICK_SIZES = {
    "resnet": {"n": 4},
    "gpt2": {"n": 2, "t": 8},
    "bert": {"n": 4, "t": 6},
    "encoder": {"n": 4, "t": 6},
    "lstm_lm": {"n": 4, "t": 4},
    "packed_gru": {"n": 4, "t": 4},
    "vit": {"n": 4},
}
TITLES = {
    "resnet": "BasicBlock ResNet",
    "gpt2": "HF GPT-2 tiny (causal LM, padded)",
    "bert": "BERT-style classifier (padding mask)",
    "encoder": "TransformerEncoder",
    "lstm_lm": "LSTM language model",
    "packed_gru": "packed GRU",
    "vit": "ViT (class token, position table)",
}
# the optimiser of each preset's runs
OPTIMIZER = {"transformer": "adam"}


class Preset(Avionics):
    """A step watched by a cockpit with ``configuration(preset)``."""

    def __init__(self, model, loss_fn, preset: str):
        super().__init__(model, loss_fn, OPTIMIZER.get(preset, "sgd"), configuration(preset))

    def variants(self) -> str:
        """The curvature variant of each curvature-diagonal quantity, once chosen (``"-"``
        without one)."""
        chosen = {
            q.name: getattr(q, "_chosen", None) or q.curvature
            for q in self.cockpit.quantities
            if hasattr(q, "curvature")
        }
        return ", ".join(sorted(set(chosen.values()))) or "-"


def time_preset(name: str, sizes: dict, preset: str, steps: int, warmup: int):
    """(median instrumented / median plain step time, the curvature variant, why "auto" chose
    it, parameters, batch description) for one model and preset."""
    built = MODELS[name](dtype=torch.float32, **sizes)
    model, X = built[0], built[1]
    tools = []

    def make_tool(model, loss_fn):
        tools.append(Preset(model, loss_fn, preset))
        return tools[-1]

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        t_tool, t_plain, _ = time_steps(
            lambda: built, make_tool, OPTIMIZER.get(preset, "sgd"), steps, warmup, math.inf
        )
    tool = tools[0]
    ratio = t_tool / t_plain
    # what curvature="auto" chose and why (said once by each quantity, alike)
    messages = sorted(
        {
            str(w.message).split(") computes ", 1)[1].split(". Pass")[0]
            for w in said
            if "(curvature='auto') computes" in str(w.message)
        }
    )
    parameters = sum(p.numel() for p in model.parameters())
    batch = "x".join(str(s) for s in X.shape) if X.dtype == torch.int64 else str(len(X))
    return ratio, tool.variants(), messages, parameters, batch


def _probe_first_step() -> None:
    """The body of a fresh process: print the seconds of tracked steps 0 and 1 (ResNet,
    economy) as JSON."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    model, X, y, loss_fn = MODELS["resnet"](dtype=torch.float32, **SIZES["resnet"])
    tool = Preset(model, loss_fn, "economy")
    seconds = []
    for k in range(2):
        t0 = time.perf_counter()
        tool.step(k, X, y)
        seconds.append(time.perf_counter() - t0)
    print(json.dumps(seconds))


def first_steps() -> dict[str, float]:
    """Tracked step 0 with the kernels compiled, step 0 with them loaded from the cache, and
    step 1, in seconds, each step 0 in a fresh process with its own NUMBA_CACHE_DIR."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        command = [sys.executable, "-m", "benchmarks.real_models", "--probe-first-step"]
        runs = [
            json.loads(subprocess.run(command, env=env, capture_output=True, text=True,
                                      check=True).stdout)
            for _ in range(2)
        ]  # fmt: skip
    return {"compiling": runs[0][0], "cached": runs[1][0], "later": runs[1][1]}


def _mark(ratio: float, target: float | None) -> str:
    return f"{ratio:.1f}" + ("" if target is None or ratio <= target else " (over)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--presets", nargs="+", default=PRESETS, choices=PRESETS)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke run: small, nothing written")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--probe-first-step", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_first_step:
        return _probe_first_step()
    torch.set_num_threads(args.threads)
    sizes, steps, warmup = SIZES, args.steps, args.warmup
    if args.quick:
        sizes, steps, warmup = QUICK_SIZES, 1, 0

    rows, notes = [], []
    started = time.perf_counter()
    for name in args.models:
        for preset in args.presets:
            ratio, variant, messages, parameters, batch = time_preset(
                name, sizes[name], preset, steps, warmup
            )
            target = TARGET.get(preset)
            row = [TITLES[name], f"{parameters:,}", batch, preset, variant, _mark(ratio, target),
                   "-" if target is None else f"<= {target:g}"]  # fmt: skip
            rows.append(row)
            if preset == "full":  # business says the same
                notes += [f"{TITLES[name]}, {preset}: {m}" for m in messages]
            print(" | ".join(row), flush=True)
    first = None if args.quick else first_steps()
    elapsed = time.perf_counter() - started

    header = ["model", "parameters", "batch", "preset", "curvature variant (auto)",
              "step / plain step", "target"]  # fmt: skip
    sections = [
        "## Real models (issues 18, 24 and 25): a preset's step / a plain step",
        machine() + f"; {elapsed / 60:.1f} min for this section.",
        f"Every step tracked; median of {steps} timed steps after {warmup} warm-up steps, "
        "plain and instrumented steps alternating on two copies of the model (SGD, Adam for "
        "the transformer preset, lr 1e-3), "
        "float32, synthetic data (tests/real_models.py; batch: images, or sequences x tokens). "
        "'(over)' marks a miss of the target.",
        table(header, rows),
    ]
    if first is not None:
        sections.append(
            "First tracked step in a fresh process (ResNet, economy): "
            f"{first['compiling']:.1f} s while numba compiles the histogram kernels (first "
            f"use; it says so on stderr), {first['cached']:.1f} s with them in numba's cache, "
            f"{first['later']:.2f} s for the next step."
        )
    sections.append("\n".join(f"* {note}" for note in notes))
    markdown = "\n\n".join(sections)
    if args.no_write or args.quick:
        print(markdown)
    else:
        write_section("real-models", markdown)


if __name__ == "__main__":
    main()
