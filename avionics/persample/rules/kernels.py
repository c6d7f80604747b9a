"""Per-layer kernels chosen by a fixed per-shape rule (issues 17 and 25).

A layer with several exact ways to answer a request (a convolution's per-sample gradients G_n
by unfolding, by one grouped convolution or by the weight gradient of the samples as groups;
its squared norms from the materialised G_n or by the Gram form; its projections G_n . V by
its own convolution or the unfolded closed form) offers them as *plans*. :func:`choose` takes
the plan the layer's rule names: by FLOPs between materialising G_n and the Gram form with
projections (:meth:`~avionics.persample.rules.bilinear.Bilinear._prior`), by the layer's shape
between its own kernels and the unfolded ones
(:meth:`~avionics.persample.rules.conv.ConvRule.kernels`).

The rule is fixed, the same for every run, dtype and load of the machine. It replaced timing
the plans at a layer's first step, which cost a fresh process's first tracked step 4-9x a later
one and chose by the noise between close plans; the rule comes from timing every plan on the
whole batch across layer shapes (``benchmarks/conv_plans.py``; BENCHMARKS.md, "Measurements
behind the engine's choices"). The choice is logged once per layer shape and kind of request,
at INFO on the ``"avionics"`` logger.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("avionics")

# Choices logged at most (inputs whose shapes change from step to step would log each new
# shape): beyond, nothing more is logged.
MAX_LOGGED = 256


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
    weight. ``prior_gradients`` and ``prior_projections`` name the kernels the rule takes (any
    of these or the unfolded ones); ``key`` identifies the layer's shapes, dtype and device
    (a choice is logged once under it) and ``describe()`` names it in the log."""

    gradients: dict[str, Callable[[int, int], object]]
    projections: dict[str, Callable[..., object]]
    prior_gradients: str
    prior_projections: str
    key: tuple
    describe: Callable[[], str]


# (layer key, request kind) of the choices logged in this run.
LOGGED: set[tuple] = set()
# Plan names tried first by :func:`choose`, for tests: the first one that is a candidate wins.
_FORCED: list[str] = []


@contextlib.contextmanager
def forcing(*names: str):
    """Within the block, :func:`choose` takes the first of ``names`` that is a candidate and
    raises if none is (nothing is logged): to test every path."""
    _FORCED[:0] = names
    try:
        yield
    finally:
        del _FORCED[: len(names)]


def choose(key: tuple, plans: dict[str, Plan], prior: str, describe: Callable[[], str]) -> str:
    """The name of the plan to run for ``key`` (a layer's shapes, dtype, device and the kind
    of request): ``prior``, the plan of the layer's rule among ``plans``, logged the first
    time ``key`` asks (``describe()`` names the layer and request)."""
    if _FORCED:
        for name in _FORCED:
            if name in plans:
                return name
        raise ValueError(
            f"forcing({', '.join(map(repr, _FORCED))}): none is a plan for {describe()}; "
            f"its plans are {sorted(plans)}. Force one of them."
        )
    if key not in LOGGED and len(LOGGED) < MAX_LOGGED:
        LOGGED.add(key)
        logger.info("%s: %s", describe(), _explain(plans, prior))
    return prior


def _explain(plans: dict[str, Plan], name: str) -> str:
    """'G_n by grouped convolution (by the layer's rule; FLOPs over its: G_n by unfold + bmm
    1.0x, Gram form 22.7x)'."""
    flops = plans[name].flops
    others = ", ".join(f"{n} {p.flops / flops:.1f}x" for n, p in plans.items() if n != name)
    return f"{name} (by the layer's rule" + (f"; FLOPs over its: {others})" if others else ")")
