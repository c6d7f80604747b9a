"""Presets against their floors on the real models (issue 25), in one run per model.

For each model of ``tests/real_models.py`` (float32, the sizes of ``benchmarks/real_models``),
these run side by side, one step of each per round, so that a shared machine's noise hits all
alike: a plain SGD step, a plain Adam step, the economy, business and full presets (SGD), the
transformer preset (Adam; two steps a round, numbered from 8 so that its sparse schedule tracks
steps 10, 12 and 15 and not 9, 11, 13, 14), the economy floor of :mod:`benchmarks.floors`
(where it has a kernel for every parameter), and the floor's curvature work timed by hand on
another copy: one backward with ``create_graph=True`` (what the curvature quantities need of
the user's backward), K loss-Hessian-root columns backpropagated to the parameters in one
batched product (K = C - 1 for the exact GGN diagonal of a softmax cross-entropy over C
classes, its rank; 1 for the Monte-Carlo one), and one Hessian-vector product.

Floors (a preset's extra over the plain step, in ms):

* economy: the economy floor's step minus the plain step (:mod:`benchmarks.floors`: per-sample
  norms and projections by the cheapest per-layer kernel, the histogram's N x D values
  written once, Alpha's projections, GradNorm, Distance, UpdateSize);
* business: economy's + the create-graph backward's extra + the K columns (a lower bound: the
  columns' per-sample squares and TICDiag's mean_n g_n^2 are left out);
* full: business's + k Hessian-vector products, k the products HessMaxEV used at the step
  (its median), the GradHist2d values left out (one more write of N x D values);
* the transformer preset's ordinary step has no floor here (its target is a ratio to a plain
  Adam step: <= 1.5x).

Targets (issue 25): economy extra <= 1.25x its floor's and economy <= 3x a plain step;
business <= 6x; full <= 21x; the transformer preset's ordinary step <= 1.5x a plain Adam step;
HessMaxEV's median products per step during training (warm-started Lanczos) <= 2; the first
tracked step of a fresh process <= 3x a later one (ResNet, economy, numba's cache filled).

Run: ``python -m benchmarks.preset_floors`` (minutes on two cores); ``--models``,
``--rounds``, ``--no-write``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

from avionics import configuration
from benchmarks.floors import Floor
from benchmarks.real_models import SIZES, TITLES, first_steps
from benchmarks.report import machine, table, write_section
from benchmarks.tools import Avionics, Plain
from tests.real_models import ALL_MODELS as MODELS

TRANSFORMER_FIRST_STEP = 8
TARGETS = {"economy": 3.0, "business": 6.0, "full": 21.0, "transformer": 1.5}
ECONOMY_TO_FLOOR = 1.25
LANCZOS_PRODUCTS = 2.0
FIRST_STEP = 3.0


def _seconds(run) -> float:
    began = time.perf_counter()
    run()
    return time.perf_counter() - began


class CurvatureWork:
    """The floor's curvature work on its own copy of the model, timed by hand: (create-graph
    step, K batched columns to the parameters, one Hessian-vector product), seconds."""

    def __init__(self, model, loss_fn, columns: int):
        self.model, self.loss_fn, self.columns = model, loss_fn, columns
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, X, y) -> tuple[float, float, float]:
        began = time.perf_counter()
        out = self.model(X)
        losses = self.loss_fn(out, y)
        grads = torch.autograd.grad(losses.mean(), self.params, create_graph=True)
        graph = time.perf_counter() - began
        logits = out if isinstance(out, torch.Tensor) else out.logits
        probes = torch.randn(self.columns, *logits.shape)
        columns = _seconds(
            lambda: torch.autograd.grad(logits, self.params, probes, retain_graph=True,
                                        allow_unused=True, is_grads_batched=True)
        )  # fmt: skip
        v = [torch.randn_like(p) for p in self.params]
        product = _seconds(
            lambda: torch.autograd.grad(grads, self.params, v, retain_graph=True,
                                        allow_unused=True)
        )  # fmt: skip
        return graph, columns, product


def _products(tool: Avionics, name: str, steps) -> list[int]:
    for q in tool.cockpit.quantities:
        if type(q).__name__ == name:
            return [q.num_products[s] for s in steps if s in q.num_products]
    return []


def _variant(tool: Avionics) -> str:
    chosen = {
        getattr(q, "_chosen", None) for q in tool.cockpit.quantities if hasattr(q, "_chosen")
    }
    return ", ".join(sorted(c for c in chosen if c)) or "-"


def measure(name: str, rounds: int, warmup: int) -> dict:
    """One model's run: median seconds of every step kind, and what the floors need."""
    built = MODELS[name](dtype=torch.float32, **SIZES[name])
    model, X, y, loss_fn = built
    out = model(X)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    classes = logits[0].numel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tools = {
            "plain": Plain(copy.deepcopy(model), loss_fn, "sgd"),
            "plain adam": Plain(copy.deepcopy(model), loss_fn, "adam"),
            **{p: Avionics(copy.deepcopy(model), loss_fn, "sgd", configuration(p))
               for p in ("economy", "business", "full")},
            "transformer": Avionics(copy.deepcopy(model), loss_fn, "adam",
                                    configuration("transformer"),
                                    first_step=TRANSFORMER_FIRST_STEP),
        }  # fmt: skip
        try:
            tools["economy floor"] = Floor(copy.deepcopy(model), loss_fn, "sgd", "economy")
            no_floor = None
        except ValueError as error:
            no_floor = str(error).split(":")[0].replace("The floor has no kernel for ", "")
        times = {k: [] for k in tools if k != "transformer"}
        ordinary, sparse, work = [], [], []
        transformer_steps = []
        curvature = None
        for r in range(warmup + rounds):
            for kind, tool in tools.items():
                if kind == "transformer":
                    for j in range(2):
                        k = 2 * r + j
                        t = _seconds(lambda tool=tool, k=k: tool.step(k, X, y))
                        step = TRANSFORMER_FIRST_STEP + k
                        if r >= warmup:
                            transformer_steps.append(step)
                            sparse_step = any(
                                q.is_active(step) for q in tool.cockpit.quantities
                                if type(q).__name__ == "PreconditionedSharpness"
                            )  # fmt: skip
                            (sparse if sparse_step else ordinary).append(t)
                    continue
                t = _seconds(lambda tool=tool, r=r: tool.step(r, X, y))
                if r >= warmup:
                    times[kind].append(t)
            if curvature is None:  # the variant "auto" chose, known after the first step
                variant = _variant(tools["business"])
                columns = classes - 1 if variant == "diag_ggn_exact" else 1
                curvature = CurvatureWork(copy.deepcopy(model), loss_fn, columns)
            if r >= warmup:
                work.append(curvature.step(X, y))
    timed = range(warmup, warmup + rounds)
    median = {k: statistics.median(v) for k, v in times.items()}
    graph, columns, product = (statistics.median(w[i] for w in work) for i in range(3))
    return {
        "median": median,
        "ordinary": statistics.median(ordinary) if ordinary else float("nan"),
        "sparse": statistics.median(sparse) if sparse else float("nan"),
        "graph": graph, "columns": columns, "product": product,
        "k_columns": curvature.columns, "variant": _variant(tools["business"]),
        "hess_products": _products(tools["full"], "HessMaxEV", timed),
        "sharpness_products": _products(tools["transformer"], "PreconditionedSharpness",
                                        transformer_steps),
        "no_floor": no_floor,
    }  # fmt: skip


def lanczos_products(name: str, steps: int) -> dict[str, list[int]]:
    """The products per step of HessMaxEV (SGD) and of PreconditionedSharpness (Adam), each
    tracked at every step of ``steps`` training steps of its own copy, alone in its cockpit;
    step 0 (a cold start) left out."""
    from avionics.quantities import HessMaxEV, PreconditionedSharpness

    model, X, y, loss_fn = MODELS[name](dtype=torch.float32, **SIZES[name])
    out = {}
    for quantity, kind in ((HessMaxEV, "sgd"), (PreconditionedSharpness, "adam")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tool = Avionics(copy.deepcopy(model), loss_fn, kind, [quantity()])
            for k in range(steps):
                tool.step(k, X, y)
        out[quantity.__name__] = _products(tool, quantity.__name__, range(1, steps))
    return out


def _verdict(value: float, target: float) -> str:
    return f"{value:.2f} ({'met' if value <= target else 'missed'})"


def rows_of(name: str, m: dict) -> list[list[str]]:
    """The table's rows of one model: one per preset."""
    med = m["median"]
    plain = med["plain"]
    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    products = statistics.median(m["hess_products"]) if m["hess_products"] else 0
    economy_floor = med["economy floor"] - plain if "economy floor" in med else None
    # (the create-graph backward costs at least the plain one: noise clamped)
    curvature_floor = max(0.0, m["graph"] - plain) + m["columns"]
    floors = {
        "economy": economy_floor,
        "business": None if economy_floor is None else economy_floor + curvature_floor,
        "full": None if economy_floor is None
        else economy_floor + curvature_floor + products * m["product"],
    }  # fmt: skip
    rows = []
    for preset in ("economy", "business", "full"):
        extra = med[preset] - plain
        floor = floors[preset]
        ratio = "-" if floor is None or floor <= 0 else f"{extra / floor:.2f}"
        if preset == "economy" and floor is not None and floor > 0:
            ratio = _verdict(extra / floor, ECONOMY_TO_FLOOR)
        floor_text = ms(floor) if floor is not None else f"none ({m['no_floor']})"
        rows.append([TITLES[name], preset, ms(plain), ms(extra), floor_text, ratio,
                     _verdict(med[preset] / plain, TARGETS[preset])])  # fmt: skip
    adam = med["plain adam"]
    rows.append([TITLES[name], "transformer (ordinary / sparse step)", ms(adam),
                 f"{ms(m['ordinary'] - adam)} / {ms(m['sparse'] - adam)}", "-", "-",
                 f"{_verdict(m['ordinary'] / adam, TARGETS['transformer'])} / "
                 f"{m['sparse'] / adam:.1f}"])  # fmt: skip
    return rows


def curvature_row(name: str, m: dict, products: dict[str, list[int]]) -> list[str]:
    """What the curvature floors are made of, and the Lanczos products during training."""
    plain = m["median"]["plain"]
    cells = []
    for counts in (products["HessMaxEV"], products["PreconditionedSharpness"]):
        median = statistics.median(counts)
        cells += [f"{median:g} ({', '.join(map(str, counts))})",
                  _verdict(median, LANCZOS_PRODUCTS)]  # fmt: skip
    return [TITLES[name], m["variant"], str(m["k_columns"]), f"{1e3 * (m['graph'] - plain):.1f}",
            f"{1e3 * m['columns']:.1f}", f"{1e3 * m['product']:.2f}",
            ", ".join(map(str, m["hess_products"])), *cells]  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per model")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lanczos-steps", type=int, default=10)
    parser.add_argument("--no-first-step", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows, curvature_rows = [], []
    for name in args.models:
        m = measure(name, args.rounds, args.warmup)
        rows += rows_of(name, m)
        products = lanczos_products(name, args.lanczos_steps)
        curvature_rows.append(curvature_row(name, m, products))
        for row in rows[-4:] + curvature_rows[-1:]:
            print(" | ".join(row), flush=True)
    first = None if args.no_first_step else first_steps()
    header = ["model", "preset", "plain step (ms)", "preset extra (ms)", "floor extra (ms)",
              "extra / floor's (economy <= 1.25)", "step / plain step (target)"]  # fmt: skip
    curvature_header = [
        "model", "curvature variant (auto)", "K columns", "create-graph extra (ms)",
        "K columns (ms)", "one HVP (ms)", "HessMaxEV products in full's timed steps",
        "HessMaxEV products per training step, median (steps 1..)", "<= 2",
        "PreconditionedSharpness products per training step", "<= 2",
    ]  # fmt: skip
    sections = [
        "## Presets against their floors (issue 25)",
        machine() + f"; {(time.perf_counter() - started) / 60:.1f} min; "
        f"`python -m benchmarks.preset_floors`: {args.warmup} warm-up and {args.rounds} timed "
        "rounds per model, every step kind once a round side by side (the transformer preset "
        "twice), medians. 'extra': a step minus the plain step of the same round kind (plain "
        "SGD; plain Adam for the transformer preset). The floors are defined in the script's "
        "docstring: economy's is benchmarks/floors.py's hand-written step; business adds "
        "the create-graph backward's extra and the K loss-Hessian-root columns batched to "
        "the parameters (a lower bound), full the HVPs HessMaxEV used. 'none': the floor "
        "has no kernel for some layer (parameters used directly in a root forward; "
        "recurrent layers and attention's packed in-projection have kernels, "
        "benchmarks/recurrent_floor.py and benchmarks/floors.py).",
        table(header, rows),
        "What the curvature floors are made of, and warm-started Lanczos during training: "
        f"HessMaxEV (SGD) and PreconditionedSharpness (Adam), each alone in a cockpit tracking "
        f"every one of {args.lanczos_steps} steps (lr 1e-3, tol 1e-3), the products of steps "
        "1.. (step 0 starts cold):",
        table(curvature_header, curvature_rows),
    ]
    if first is not None:
        ratio = first["cached"] / first["later"]
        sections.append(
            f"First tracked step of a fresh process (ResNet, economy): {first['compiling']:.2f} s "
            f"while numba compiles the histogram kernels, {first['cached']:.2f} s with them "
            f"cached, {first['later']:.3f} s for the next step: cached / later "
            f"{_verdict(ratio, FIRST_STEP)}, compiling / later "
            f"{first['compiling'] / first['later']:.0f}."
        )
    markdown = "\n\n".join(sections)
    if args.no_write:
        print(markdown)
    else:
        write_section("preset-floors", markdown)


if __name__ == "__main__":
    main()
