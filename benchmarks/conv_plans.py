"""Every exact plan of a convolution's per-sample statistics, timed on the whole batch (issue 25).

The measurements behind the fixed per-shape rule that chooses a convolution's plan
(:mod:`avionics.persample.rules.kernels`, BENCHMARKS.md "Measurements behind the engine's
choices"). Each layer of the 3c3d CNN (batch 32 and 128), of the BasicBlock ResNet of
``tests/real_models.py`` (batch 32) and a few others (a 1d, a depthwise and a strided
convolution) is run inside a float32 model ``layer -> flatten -> linear``; for each request
(the squared norms of NormTest; the norms and one projection of InnerTest; the projection of
OrthoTest; the materialised gradients of economy's histograms) every plan the layer offers runs
on the whole batch, the plans taking turns, ``--repeats`` rounds, the median of each plan's CPU
time (one thread) counts. The row gives the plan the rule takes, the fastest, and the rule's
time over the fastest's.

The table is written into BENCHMARKS.md, inside "Measurements behind the engine's choices".
Run: ``python -m benchmarks.conv_plans`` (a few minutes), ``--repeats 3``, ``--no-write``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from avionics.persample import Request
from avionics.persample.rules import bilinear
from benchmarks.report import machine, table, write_section
from tests.models import captured_engine_step

SECTION = "conv-plans"
# name -> (layer, per-sample input shape, batch)
LAYERS = {
    "3c3d conv1 3->64 5x5, 32x32": (lambda: nn.Conv2d(3, 64, 5), (3, 32, 32), 32),
    "3c3d conv2 64->96 3x3, 14x14": (lambda: nn.Conv2d(64, 96, 3), (64, 14, 14), 32),
    "3c3d conv3 96->128 3x3 pad 1, 6x6": (
        lambda: nn.Conv2d(96, 128, 3, padding=1),
        (96, 6, 6),
        32,
    ),
    "3c3d conv1, N=128": (lambda: nn.Conv2d(3, 64, 5), (3, 32, 32), 128),
    "3c3d conv2, N=128": (lambda: nn.Conv2d(64, 96, 3), (64, 14, 14), 128),
    "3c3d conv3, N=128": (lambda: nn.Conv2d(96, 128, 3, padding=1), (96, 6, 6), 128),
    "ResNet stem 3->16 3x3, 16x16": (
        lambda: nn.Conv2d(3, 16, 3, 1, 1, bias=False),
        (3, 16, 16),
        32,
    ),
    "ResNet 16->16 3x3, 16x16": (lambda: nn.Conv2d(16, 16, 3, 1, 1, bias=False), (16, 16, 16), 32),
    "ResNet 16->32 3x3 stride 2, 16x16": (
        lambda: nn.Conv2d(16, 32, 3, 2, 1, bias=False),
        (16, 16, 16),
        32,
    ),
    "ResNet 32->32 3x3, 8x8": (lambda: nn.Conv2d(32, 32, 3, 1, 1, bias=False), (32, 8, 8), 32),
    "ResNet 32->36 3x3 stride 2, 8x8": (
        lambda: nn.Conv2d(32, 36, 3, 2, 1, bias=False),
        (32, 8, 8),
        32,
    ),
    "ResNet 36->36 3x3, 4x4": (lambda: nn.Conv2d(36, 36, 3, 1, 1, bias=False), (36, 4, 4), 32),
    "ResNet shortcut 16->32 1x1 stride 2": (
        lambda: nn.Conv2d(16, 32, 1, 2, bias=False),
        (16, 16, 16),
        32,
    ),
    "1d 64->64 k3, length 128": (lambda: nn.Conv1d(64, 64, 3, padding=1), (64, 128), 32),
    "depthwise 32 3x3, 16x16": (
        lambda: nn.Conv2d(32, 32, 3, padding=1, groups=32),
        (32, 16, 16),
        32,
    ),
    "2 groups 64->64 3x3, 16x16": (
        lambda: nn.Conv2d(64, 64, 3, padding=1, groups=2),
        (64, 16, 16),
        32,
    ),
    "64->64 3x3 stride 2, 32x32": (lambda: nn.Conv2d(64, 64, 3, 2, 1), (64, 32, 32), 32),
}
REQUESTS = {
    "norms": Request(sq_norms=True),
    "norms + 1 projection": Request(sq_norms=True, directions=frozenset({"grad"})),
    "1 projection": Request(directions=frozenset({"grad"})),
    "materialised": Request(sq_norms=True, visitors=(lambda index, chunk: None,)),
}


def _ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def measure(layer: str, request: str, repeats: int) -> tuple[str, dict[str, float]] | None:
    """(the plan the rule takes, {plan: median CPU seconds on the whole batch}), or None where
    the layer has one plan for the request."""
    make, shape, n = LAYERS[layer]
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Flatten(), nn.LazyLinear(10))
    model(torch.randn(1, *shape))
    X, y = torch.randn(n, *shape), torch.randint(0, 10, (n,))
    _, step, mean_grad, _ = captured_engine_step(model, X, y, _ce)
    seen = []

    def record(key, plans, prior, describe):
        seen.append((prior, plans))
        return prior

    original, bilinear.choose = bilinear.choose, record
    try:
        directions = {d: mean_grad for d in REQUESTS[request].directions}
        step.statistics(REQUESTS[request], directions)
    finally:
        bilinear.choose = original
    if not seen or len(seen[0][1]) < 2:
        return None
    rule, plans = seen[0]
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(repeats):
        for name, plan in plans.items():
            form = plan.run.func.__self__  # the Bilinear: no unfolded input kept from a run
            form._x = form._gram_matrix = None
            start = time.process_time()
            plan.run(0, n)
            times[name].append(time.process_time() - start)
    return rule, {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", nargs="*", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rows = []
    for layer in args.layers:
        for request in REQUESTS:
            result = measure(layer, request, args.repeats)
            if result is None:
                continue
            rule, seconds = result
            best = min(seconds, key=seconds.get)
            others = ", ".join(f"{k} {1e3 * s:.2f}" for k, s in seconds.items())
            rows.append([layer, request, rule, best, f"{seconds[rule] / seconds[best]:.2f}",
                         others])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    header = ["layer", "request", "the rule's plan", "fastest", "rule / fastest", "ms per plan"]
    markdown = "\n\n".join([
        "### Convolution plans timed on the whole batch (issue 25, helper first)",
        machine() + f"; load average {load:.1f} when it started (shared machine: CPU time).",
        " ".join(__doc__.split("\n\n")[1].split()),
        table(header, rows),
    ])  # fmt: skip
    print(markdown)
    if not args.no_write:
        write_section(SECTION, markdown)


if __name__ == "__main__":
    main()
