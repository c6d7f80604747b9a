"""Per-layer kernels chosen by a measured cost model (issue 17).

A layer with several exact ways to answer a request (a convolution's per-sample gradients G_n
by unfolding, by windows of its flat input or by one grouped convolution; its squared norms
from the materialised G_n or by the Gram form; its projections G_n . V by its own convolution
or the unfolded closed form) offers them as *plans*. At the first step that asks a request of
a layer, :func:`choose` runs each plan on the step's own tensors, restricted to a few samples,
keeps the fastest for the rest of the run (the layer's prior plan, its FLOPs-based choice,
unless another is :data:`PRIOR_MARGIN` times faster; one choice per layer shape, dtype, device
and kind of request, in :data:`CHOICES`) and logs it once at INFO on the ``"avionics"``
logger.

The cost of a plan on the whole batch of N samples is taken as N / c times that of one run on
c samples: c is :func:`timing_samples` (about :data:`TIMING_FLOPS` multiply-adds of
materialised gradients, so that a run's fixed costs, kernel launches and Python, weigh little
against its work, as they do at the chunk sizes of the whole batch). The measurement is
bounded: the plans take :data:`REPEATS` turns (the fastest run counts, the first includes
any warm-up; clearly slower plans sit the last out), and nothing runs where the FLOPs alone
decide (every other plan :data:`FLOPS_MARGIN` times the cheapest) or on layers whose
per-sample gradients of the whole batch take fewer than :data:`MEASURED_FLOPS` multiply-adds
(there the timing would cost more than it can save: the layer's prior decides). On the 3c3d
CNN the first step's timing took 57-65 ms for its three convolutions (one loaded CPU core).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

logger = logging.getLogger("avionics")

# A plan at least this many times the FLOPs of the cheapest is not timed.
FLOPS_MARGIN = 3.0
# Rounds of runs of the timed plans; the fastest run of each counts. From the third round on,
# a plan this many times slower than the fastest sits out (after two rounds a burst of load
# elsewhere during one run no longer decides).
REPEATS = 3
DROP_SLOWER = 2.0
# Multiply-adds of materialised per-sample gradients a timing run aims at (~1.5 ms on one
# core: on 4x fewer samples the estimates of the 3c3d layers were up to 2x high, on 4x more
# within 20% of the whole batch's times).
TIMING_FLOPS = 2**24
# A measured plan replaces the layer's prior only when it is estimated this much faster: the
# estimates from a few samples misranked close plans of the 3c3d CNN on one CPU core (the
# Gram form and the layer's own convolution of the whole batch differ most: its conv 1
# projected by its convolution in 22 ms estimated from 4 samples against 32 ms unfolded, in 52
# against 35 ms on the whole batch of 128).
PRIOR_MARGIN = 1.5
# Layers with fewer multiply-adds of per-sample gradients per step take their prior plan.
MEASURED_FLOPS = 2**22
# Choices kept at most: beyond, new keys take their prior plan unmeasured (inputs whose
# shapes change from step to step would otherwise be timed at every new shape).
MAX_CHOICES = 256


@dataclass(frozen=True)
class Plan:
    """One way to answer a request: ``flops`` (multiply-adds per sample) and ``run(start,
    stop)``, which computes the request's statistics of samples start..stop-1."""

    flops: float
    run: Callable[[int, int], object]


@dataclass(frozen=True)
class LayerKernels:
    """A layer's own kernels besides the unfolded forms of
    :class:`~avionics.persample.rules.bilinear.Bilinear`, by name: ``gradients[name](start,
    stop)`` is G_n of samples start..stop-1 shaped like the weight, ``projections[name](V,
    start, stop)`` G_n . V of those samples (of all without a range) for V shaped like the
    weight. ``prior_gradients`` and ``prior_projections`` name the kernels taken unmeasured
    (any of these or the unfolded ones); ``key`` identifies the layer's shapes, dtype and
    device (the measured choices are kept under it) and ``describe()`` names it in the log."""

    gradients: dict[str, Callable[[int, int], Tensor]]
    projections: dict[str, Callable[..., Tensor]]
    prior_gradients: str
    prior_projections: str
    key: tuple
    describe: Callable[[], str]


@dataclass(frozen=True)
class Choice:
    """The plan kept for a layer and kind of request, and what decided it: ``seconds`` per
    plan timed (for the whole batch, extrapolated from the timing samples), ``skipped`` the
    plans the FLOPs ruled out (name -> FLOPs ratio to the cheapest), ``prior`` the layer's
    prior plan (kept unless another is :data:`PRIOR_MARGIN` times faster)."""

    name: str
    seconds: dict[str, float]
    skipped: dict[str, float]
    prior: str


# (layer key, request kind) -> the choice measured at its first step; kept for the run.
CHOICES: dict[tuple, Choice] = {}
# Plan names tried first by :func:`choose`, for tests: the first one that is a candidate wins.
_FORCED: list[str] = []


@contextlib.contextmanager
def forcing(*names: str):
    """Within the block, :func:`choose` takes the first of ``names`` that is a candidate and
    raises if none is (nothing is measured, cached or logged): to test every path."""
    _FORCED[:0] = names
    try:
        yield
    finally:
        del _FORCED[: len(names)]


def timing_samples(n: int, flops_per_sample: float) -> int:
    """Samples a timing run takes: about :data:`TIMING_FLOPS` multiply-adds, 1 to ``n``."""
    return max(1, min(n, int(TIMING_FLOPS // max(1.0, flops_per_sample))))


def choose(
    key: tuple,
    plans: dict[str, Plan],
    n: int,
    samples: int,
    prior: str,
    describe: Callable[[], str],
    device: torch.device,
) -> str:
    """The name of the plan to run for ``key`` (a layer's shapes, dtype, device and the kind
    of request), chosen once per run.

    ``plans`` are the candidates, in the layer's prior order; ``prior`` is taken unmeasured
    when the batch's work is below :data:`MEASURED_FLOPS` (or :data:`MAX_CHOICES` are kept
    already); ``samples`` is how many samples a
    timing run takes of the ``n``; ``describe()`` names the layer and request in the log line;
    ``device`` is where the plans run.
    """
    if _FORCED:
        for name in _FORCED:
            if name in plans:
                return name
        raise ValueError(
            f"forcing({', '.join(map(repr, _FORCED))}): none is a plan for {describe()}; "
            f"its plans are {sorted(plans)}. Force one of them."
        )
    if key in CHOICES:
        return CHOICES[key].name
    cheapest = min(p.flops for p in plans.values())
    if len(plans) == 1 or n * cheapest < MEASURED_FLOPS or len(CHOICES) >= MAX_CHOICES:
        return prior
    skipped = {
        name: p.flops / cheapest for name, p in plans.items() if p.flops > FLOPS_MARGIN * cheapest
    }
    timed = [name for name in plans if name not in skipped]
    seconds = _seconds({name: plans[name] for name in timed}, n, samples, device)
    name = min(seconds, key=seconds.get) if seconds else timed[0]
    if prior in seconds and seconds[name] * PRIOR_MARGIN > seconds[prior]:
        name = prior
    CHOICES[key] = choice = Choice(name, seconds, skipped, prior)
    logger.info("%s: %s", describe(), _explain(choice))
    return name


def _seconds(plans: dict[str, Plan], n: int, samples: int, device) -> dict[str, float]:
    """Each plan's seconds on all ``n`` samples (none where only one plan is left): n /
    ``samples`` times its fastest of :data:`REPEATS` runs on ``samples`` samples, the plans
    taking turns (a burst of load elsewhere slows all alike; from the third round on, one
    :data:`DROP_SLOWER` times slower than the fastest sits out), in seconds of CPU time of this
    process on the CPU (the machine may be shared: other processes' load does not count, this
    process's other threads do), of wall time after synchronising on a GPU."""
    if len(plans) < 2:
        return {}
    best = dict.fromkeys(plans, float("inf"))
    for round_ in range(REPEATS):
        fastest = min(best.values())
        for name, plan in plans.items():
            if round_ >= 2 and best[name] > DROP_SLOWER * fastest:
                continue
            start = _clock(device)
            plan.run(0, samples)
            best[name] = min(best[name], _clock(device) - start)
    return {name: t * n / samples for name, t in best.items()}


def _clock(device: torch.device) -> float:
    """Seconds: of this process's CPU time, or of wall time once ``device`` (a GPU) is idle."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def _explain(choice: Choice) -> str:
    """'G_n by grouped convolution (6.60 ms vs G_n by unfold + bmm 10.30 ms; not timed, FLOPs
    over the cheapest: Gram form 22.7x)'."""
    parts = []
    if choice.seconds:
        others = [f"{n} {1e3 * s:.2f} ms" for n, s in choice.seconds.items() if n != choice.name]
        parts.append(f"{1e3 * choice.seconds[choice.name]:.2f} ms vs " + ", ".join(others))
    else:
        parts.append("by FLOPs")
    if choice.seconds and choice.name == choice.prior != min(
        choice.seconds, key=choice.seconds.get
    ):
        parts.append(f"the prior plan, kept: none is {PRIOR_MARGIN:g}x faster")
    if choice.skipped:
        skipped = ", ".join(f"{n} {r:.1f}x" for n, r in choice.skipped.items())
        parts.append(f"not timed, FLOPs over the cheapest: {skipped}")
    return f"{choice.name} ({'; '.join(parts)})"
