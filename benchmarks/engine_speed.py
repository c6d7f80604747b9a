"""Engine speed (issue 17): avionics' gradient tests and economy preset against their floors and
against the per-sample peers, in one run.

Per problem and thread count, every row is timed as in :func:`benchmarks.tools.time_steps`:
its steps alternate with a plain SGD step on a copy of the model, the ratio is median(row
step) / median(plain step) over ``--steps`` timed steps after ``--warmup``, ``--repeats``
times (the table gives the range). Rows:

* avionics (:class:`benchmarks.tools.Avionics`): NormTest, InnerTest, OrthoTest, the three
  together, ``configuration("economy")``;
* their floors (:mod:`benchmarks.floors`): the least exact work each adds, hand-written;
  before timing, each floor's values are checked to equal avionics' (float64, N = 4, two
  steps, relative 1e-8; the run stops if not);
* the peers (:mod:`benchmarks.peers`): BackPACK BatchL2Grad, Opacus ghost clipping,
  torch.func vmap(grad), each computing the per-sample squared gradient norms, checked
  against a loop over samples the same way.

For avionics rows, extra / floor's = (ratio - 1) / (floor's ratio - 1), the means over the
repeats. Targets (issue 17): ratio at most that of the fastest peer that runs the model, and
extra at most 1.25x the floor's; aten ops per tracked step at most 2x a plain step's.

aten ops: one step after two warm-up steps under ``torch.profiler`` (CPU), counting the events
named ``aten::*`` that no other ``aten::`` event encloses (the ops dispatched by Python and by
the autograd engine, not the ones they call inside); all ``aten::`` events in brackets.

Peak memory (``--memory-problems``): the growth of a fresh process's RSS high-water over three
steps (:mod:`benchmarks.memory`), each tool over a plain step.

Results are kept inside the section of BENCHMARKS.md (a JSON comment), so a run with
``--problems`` replaces only those problems' rows (at the thread counts it runs), and
``--problems --memory-problems`` (none) redraws the section only. Run:
``python -m benchmarks.engine_speed`` (all; ``--threads 1,2``), ``--problems mlp 3c3d-n32
--threads 1``, ``--quick`` (tiny models, nothing written).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import time
import warnings
from functools import partial

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from avionics import configuration
from benchmarks import memory
from benchmarks.floors import KINDS, Floor
from benchmarks.peers import PEERS, available, check, refusal
from benchmarks.problems import GPT, c3d3, cross_entropy, gpt, logreg, mlp, sequence_cross_entropy
from benchmarks.report import BENCHMARKS_MD, machine, table, write_section
from benchmarks.tools import Avionics, Plain, time_steps

SECTION = "engine-speed"
TESTS = ["NormTest", "InnerTest", "OrthoTest"]
# avionics row -> its quantities (None: the economy preset)
AVIONICS = {"NormTest": ["NormTest"], "InnerTest": ["InnerTest"], "OrthoTest": ["OrthoTest"],
            "three tests": TESTS, "economy": None}  # fmt: skip
FLOOR_SLACK = 1.25  # extra time at most this times the floor's
ATEN_TARGET = 2.0
ATEN_ROWS = ["plain", "floor NormTest", "floor three tests", "floor economy",
             "avionics NormTest", "avionics three tests", "avionics economy"]  # fmt: skip
MEMORY_TOOLS = ["avionics NormTest", "avionics economy", *PEERS]
ROWS = [*(f"avionics {r}" for r in AVIONICS), *(f"floor {r}" for r in KINDS), *PEERS]


def _tiny_cnn(batch: int = 6):
    """Strides, dilation, padding; the last convolution takes the Gram form, the first Linear
    layer's projections the Gram form too (N (I + O) < I O at N = 4)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(4, 5, 3, dilation=2, padding=2), nn.ReLU(),
        nn.Conv2d(5, 8, 3, stride=2), nn.Flatten(),
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3),
    )  # fmt: skip
    return model, torch.randn(batch, 2, 8, 8), torch.randint(0, 3, (batch,)), cross_entropy


def _tiny_gpt(batch: int = 4):
    torch.manual_seed(0)
    model = GPT(vocab=11, width=8, heads=2, blocks=1, context=5)
    tokens = torch.randint(0, 11, (batch, 6))
    return model, tokens[:, :-1], tokens[:, 1:], sequence_cross_entropy


PROBLEMS = {
    "logreg": (logreg, 128, "logistic regression 784-10, N=128"),
    "mlp": (mlp, 128, "MLP 784-1000-500-100-10, N=128"),
    "mlp-n512": (mlp, 512, "MLP 784-1000-500-100-10, N=512"),
    "3c3d-n32": (c3d3, 32, "3c3d CNN, N=32"),
    "3c3d-n128": (c3d3, 128, "3c3d CNN, N=128"),
    "gpt": (gpt, 32, "GPT (2 blocks, width 128, ctx 64, vocab 512), N=32"),
}
QUICK = {
    "tiny-gpt": (_tiny_gpt, 4, "tiny GPT (1 block, width 8, ctx 5, vocab 11), N=4"),
    "tiny-cnn": (_tiny_cnn, 6, "tiny CNN, 3 convolutions and 2 Linear layers, N=6"),
}
TIMED = ["logreg", "mlp", "3c3d-n32", "3c3d-n128", "gpt"]
MEMORY = ["mlp", "mlp-n512", "3c3d-n32"]


def builder(problem: str, batch: int | None = None):
    """The problem's builder at its batch (or at ``batch``)."""
    build, default, _ = {**PROBLEMS, **QUICK}[problem]
    return partial(build, batch=batch or default)


def make(row: str):
    """make_tool(model, loss_fn) of a row named 'avionics X', 'floor X' or a peer's name."""
    if row == "plain":
        return lambda model, loss_fn: Plain(model, loss_fn)
    if row.startswith("avionics "):
        names = AVIONICS[row.removeprefix("avionics ")]
        return lambda model, loss_fn: Avionics(
            model, loss_fn, "sgd", names or configuration("economy")
        )
    if row.startswith("floor "):
        return lambda model, loss_fn: Floor(model, loss_fn, "sgd", row.removeprefix("floor "))
    return PEERS[row]


def exactness(build) -> float:
    """Largest relative difference between each floor's values (the gradient tests; for
    economy also Loss, GradNorm and Distance) and avionics' for the same quantities, over two
    steps in float64 from one initial model."""
    model, X, y, loss_fn = build()
    model = model.double()
    X = X.double() if X.is_floating_point() else X
    worst = 0.0
    for row in AVIONICS:
        floor = make(f"floor {row}")(copy.deepcopy(model), loss_fn)
        ours = make(f"avionics {row}")(copy.deepcopy(model), loss_fn)
        for k in range(2):
            floor.step(k, X, y)
            ours.step(k, X, y)
        output = ours.cockpit.get_output()
        for k in range(2):
            # (the histograms' counts are checked by tests/test_floors_layers.py)
            shared = [
                q for q in floor.values[k] if q in output[k] and not isinstance(output[k][q], dict)
            ]
            if not set(TESTS) & set(shared):
                raise AssertionError(f"floor {row} and avionics share no test at step {k}")
            for q in shared:
                a = torch.tensor(floor.values[k][q], dtype=torch.float64)
                b = torch.tensor(output[k][q], dtype=torch.float64)
                relative = torch.where(a == b, 0.0, (a - b).abs() / b.abs())  # (0 = 0)
                worst = max(worst, float(relative.nan_to_num(nan=math.inf).max()))
    return worst


def aten_ops(build, row: str) -> tuple[int, int]:
    """(top-level aten ops, all aten ops) of one step of ``row`` after two warm-up steps."""
    model, X, y, loss_fn = build()
    tool = make(row)(model, loss_fn)
    for k in range(2):
        tool.step(k, X, y)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tool.step(2, X, y)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(1 for e in events if not _inside_aten(e)), len(events)


def _inside_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def timing(build, problem: str, rows: list[str], args) -> dict:
    """{"plain_ms": [...], "steps": requested, "rows": {row: {"ratios": [...], "steps":
    [timed, ...]} or {"refused": why}}} at the current thread count."""
    threads = torch.get_num_threads()
    # one thread: this process's CPU time (comparable on a loaded machine); more: wall time
    clock = time.process_time if threads == 1 else time.perf_counter
    out = {"plain_ms": [], "rows": {}, "steps": args.steps, "load": os.getloadavg()[0],
           "clock": "CPU" if threads == 1 else "wall"}  # fmt: skip
    for row in rows:
        why = _refused(row, problem)
        if why:
            out["rows"][row] = {"refused": why}
            continue
        ratios, timed = [], []
        budget = args.peer_budget if row in PEERS else math.inf
        try:
            for _ in range(args.repeats):
                tool, plain, count = time_steps(
                    build, make(row), "sgd", args.steps, args.warmup, budget, clock=clock
                )
                ratios.append(tool / plain)
                timed.append(count)
                out["plain_ms"].append(plain * 1e3)
        except Exception as error:  # a peer that fails on the model: say why
            if row not in PEERS:
                raise
            out["rows"][row] = {"refused": f"{type(error).__name__}: {str(error)[:120]}"}
            continue
        out["rows"][row] = {"ratios": ratios, "steps": timed}
        print(f"  {problem} {threads}t {row}: {_range(ratios)}", flush=True)
    return out


def _refused(row: str, problem: str) -> str | None:
    """Why a peer cannot run the problem (None for avionics rows and floors)."""
    if row not in PEERS:
        return None
    return available(row) or refusal(row, builder(problem)()[0])


def conv_kernels(build) -> dict[str, dict[str, str]]:
    """{"norms": {conv: kernel}, "projections": {conv: kernel}}: what the NormTest floor and
    the three tests' floor chose for each convolution (after one step)."""
    out = {}
    for key, floor in (("norms", "NormTest"), ("projections", "three tests")):
        model, X, y, loss_fn = build()
        tool = Floor(model, loss_fn, "sgd", floor)
        tool.step(0, X, y)
        out[key] = tool.kernels()
    return out


def peak_growth(problem: str, row: str, threads: int) -> int:
    """Bytes the RSS high-water of a fresh process grows by over three steps of ``row``."""
    args = [problem, row, "--threads", str(threads)]
    return memory.probe_growth("benchmarks.engine_speed", args)


def _probe(problem: str, row: str, threads: int, steps: int = 3) -> None:
    """The body of a memory probe (as :func:`benchmarks.memory.probe_steps`, at the batch of
    ``problem``)."""
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    memory.load_kernels()
    for peer in PEERS:  # every probe imports the same libraries before its baseline
        available(peer)
    baseline = memory.resident_kib()
    model, X, y, loss_fn = builder(problem)()
    tool = make(row)(model, loss_fn)
    for k in range(steps):
        tool.step(k, X, y)
    print(baseline, memory.high_water_kib())


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"got {text!r}; give positive integers separated by commas, e.g. 1,2"
        )
    return values


def _positive_int(text: str) -> int:
    values = _positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; give one positive integer, e.g. 15")
    return values[0]


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--problems",
        nargs="*",
        choices=[*PROBLEMS, *QUICK],
        help=f"default: {' '.join(TIMED)} ({' '.join(QUICK)} with --quick)",
    )
    parser.add_argument(
        "--threads", type=_positive_ints, help="thread counts, e.g. 1,2 (default; 1 with --quick)"
    )
    parser.add_argument("--steps", type=_positive_int, default=15, help="timed steps")
    parser.add_argument("--warmup", type=_positive_int, default=3)
    parser.add_argument("--repeats", type=_positive_int, default=2)
    parser.add_argument("--peer-budget", type=float, default=20.0,
                        help="seconds of timed steps per peer cell (at least 5)")  # fmt: skip
    parser.add_argument("--memory-problems", nargs="*", default=MEMORY, choices=list(PROBLEMS))
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny models, 3 steps, aten ops of the first only, no memory probes, nothing written",
    )
    parser.add_argument("--probe", nargs=2, metavar=("PROBLEM", "ROW"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    allowed = QUICK if args.quick else PROBLEMS
    if args.problems is None:
        args.problems = list(allowed if args.quick else TIMED)
    wrong = [p for p in args.problems if p not in allowed]
    if wrong:
        parser.error(
            f"argument --problems: {', '.join(map(repr, wrong))} "
            + ("is not a --quick problem" if args.quick else "is a --quick problem")
            + f"; choose from {', '.join(allowed)}"
        )
    args.threads = args.threads or ([1] if args.quick else [1, 2])
    if args.quick:
        args.memory_problems, args.no_write = [], True
        args.steps, args.warmup, args.repeats = 3, 1, 1
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.probe:
        return _probe(*args.probe, threads=args.threads[0])
    warnings.filterwarnings("ignore")
    data = {} if args.no_write else _stored()
    minutes = data.setdefault("minutes", {})
    for problem in args.problems:
        started = time.perf_counter()
        build = builder(problem)
        exact = exactness(builder(problem, 4))
        if exact > 1e-8:
            raise AssertionError(f"{problem}: a floor differs from avionics by {exact:.1e}")
        peers = {p: _refused(p, problem) or check(p, builder(problem, 4)) for p in PEERS}
        data.setdefault("checks", {})[problem] = {"floor": exact, "peers": peers}
        torch.set_num_threads(1)
        if not args.quick or problem == args.problems[0]:  # (the profiler is slow to read)
            data.setdefault("aten", {})[problem] = {r: aten_ops(build, r) for r in ATEN_ROWS}
        for threads in args.threads:
            torch.set_num_threads(threads)
            data.setdefault("timing", {})[f"{problem}|{threads}"] = timing(
                build, problem, ROWS, args
            )
        data.setdefault("conv", {})[problem] = conv_kernels(build)
        minutes[problem] = (time.perf_counter() - started) / 60
        _report(args, data)
    for problem in args.memory_problems:
        started = time.perf_counter()
        plain = peak_growth(problem, "plain", 1)
        cells = {"plain": plain}
        for row in MEMORY_TOOLS:
            cells[row] = _refused(row, problem) or peak_growth(problem, row, 1) / plain
        data.setdefault("memory", {})[problem] = cells
        minutes[f"memory {problem}"] = (time.perf_counter() - started) / 60
        _report(args, data)
    _report(args, data)


def _machine() -> str:
    """:func:`benchmarks.report.machine` without its thread count (the tables give it)."""
    parts = machine().split(", ")
    return ", ".join(parts[:2] + parts[3:])


def _clocks(data: dict) -> str:
    """What timed each thread count, and the machine's load when its problems started."""
    said = []
    for threads in sorted({int(k.split("|")[1]) for k in data.get("timing", {})}):
        cells = [v for k, v in data["timing"].items() if int(k.split("|")[1]) == threads]
        clock = {c.get("clock", "wall") for c in cells}
        loads = [c["load"] for c in cells if "load" in c]
        text = f"{threads} thread{'s' * (threads > 1)}: " + "/".join(
            "CPU time of the process" if c == "CPU" else "wall time" for c in sorted(clock)
        )
        if threads > 1:
            text += f" (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')})"
        if loads:
            text += f", load average {min(loads):.1f}-{max(loads):.1f} (shared machine)"
        said.append(text)
    return "Clocks: " + "; ".join(said) + "." if said else ""


def _stored() -> dict:
    """The data kept in this section of BENCHMARKS.md by the last run (empty if none)."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else ""
    found = re.search(r"<!-- engine-speed-data (.*?) -->", text, re.S)
    return json.loads(found.group(1)) if found else {}


def _range(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}"


def _mean(values):
    return sum(values) / len(values)


def _in_order(stored: dict) -> list[str]:
    """The problems of ``stored`` (keys 'problem' or 'problem|threads') in table order."""
    order = list({**PROBLEMS, **QUICK})
    return sorted(stored, key=lambda key: order.index(key.split("|")[0]))


def _timing_rows(data: dict, threads: int) -> list[list[str]]:
    out = []
    for key in _in_order(data.get("timing", {})):
        cell = data["timing"][key]
        problem, t = key.split("|")
        if int(t) != threads:
            continue
        rows, aten = cell["rows"], data.get("aten", {}).get(problem, {})
        title = {**PROBLEMS, **QUICK}[problem][2]
        ran = {r: _mean(v["ratios"]) for r, v in rows.items() if r in PEERS and "ratios" in v}
        fastest = min(ran, key=ran.get) if ran else None
        plain_ms = f"{_range(cell['plain_ms'])}"
        plain_ops = aten.get("plain", [0, 0])[0]
        ops = f"1x ({aten['plain'][0]} [{aten['plain'][1]}])" if "plain" in aten else "-"
        out.append([title, plain_ms, "plain", "1", "-", "-", "-", ops])
        for row in (r for r in ROWS if r in rows):
            value = rows[row]
            if "refused" in value:
                out.append([title, plain_ms, row, f"- ({value['refused']})", "-", "-", "-", "-"])
                continue
            ratio = _mean(value["ratios"])
            extra = per_floor = peer = targets = "-"
            if row.startswith("avionics "):
                floor = rows.get("floor " + row.removeprefix("avionics "), {}).get("ratios")
                marks = []
                if fastest:
                    peer = f"{ran[fastest]:.2f} ({fastest})"
                    marks.append("peer " + ("met" if ratio <= ran[fastest] else "missed"))
                if floor and ratio <= 1 < _mean(floor):
                    extra = "0 (within noise)"
                    marks.append("floor met")
                elif floor and _mean(floor) > 1:
                    per_floor = (ratio - 1) / (_mean(floor) - 1)
                    extra = f"{per_floor:.2f}"
                    marks.append("floor " + ("met" if per_floor <= FLOOR_SLACK else "missed"))
                elif floor:
                    extra = "- (floor's extra within noise)"
                targets = ", ".join(marks) or "-"
            ops = "-"
            if row in aten and plain_ops:
                top, every = aten[row]
                ops = f"{top / plain_ops:.1f}x ({top} [{every}])"
                if row.startswith("avionics "):
                    met = top / plain_ops <= ATEN_TARGET
                    targets += ", ops " + ("met" if met else "missed")
            ratio_text = _range(value["ratios"])
            if min(value["steps"]) < cell["steps"]:
                ratio_text += f" ({min(value['steps'])} steps)"
            out.append([title, plain_ms, row, ratio_text, extra, peer, targets, ops])
    return out


def _memory_rows(data: dict) -> list[list[str]]:
    out = []
    for problem in _in_order(data.get("memory", {})):
        cells = data["memory"][problem]
        row = [{**PROBLEMS, **QUICK}[problem][2], f"{cells['plain'] / 2**20:.0f}"]
        peers = [cells[p] for p in PEERS if isinstance(cells.get(p), float)]
        best = min(peers) if peers else math.inf
        for tool in MEMORY_TOOLS:
            value = cells.get(tool, "-")
            if isinstance(value, str):
                row.append(f"- ({value})" if value != "-" else "-")
                continue
            text = f"{value:.2f}"
            if tool.startswith("avionics") and best < math.inf:
                text += " (met)" if value <= best + 0.10 else " (missed)"
            row.append(text)
        out.append(row)
    return out


def _report(args, data: dict) -> None:
    checks = data.get("checks", {})
    sections = [
        "## Engine speed: the gradient tests and economy against their floors and the peers "
        "(issues 17 and 25; regenerated by helper first)",
        _machine()
        + "; minutes per problem (its last run, every thread count): "
        + ", ".join(f"{p} {m:.1f}" for p, m in data.get("minutes", {}).items())
        + ". "
        f"Every step tracked; median of {args.steps} timed steps after {args.warmup} warm-up "
        f"steps, {args.repeats} repeats (the range), each row's steps alternating with a plain "
        "SGD step (lr 1e-3) on a copy of the model, synthetic data. " + _clocks(data),
        "Rows: avionics with the quantities named; 'floor X', the least exact work X adds, "
        "hand-written; the peers computing the per-sample squared gradient norms of all "
        "parameters (what NormTest needs). 'x plain' = row step / plain step; 'extra / "
        "floor's' = (x plain - 1) / (the floor's x plain - 1). Targets (issue 17): x plain at "
        "most the fastest peer's that runs the model, extra at most 1.25x the floor's, aten "
        "ops at most 2x a plain step's; peak memory at most the best peer's ratio + 0.10.",
    ]
    for threads in sorted({int(k.split("|")[1]) for k in data.get("timing", {})}):
        header = [
            "problem",
            "plain ms",
            "row",
            "x plain",
            "extra / floor's",
            "fastest peer (x plain)",
            "targets",
            "aten ops (x plain; top-level [all])",
        ]
        sections.append(f"### {threads} thread{'s' if threads > 1 else ''}")
        sections.append(table(header, _timing_rows(data, threads)))
    if data.get("memory"):
        sections.append("### Peak memory (x plain, 1 thread)")
        header = ["problem", "plain growth MiB", *MEMORY_TOOLS]
        sections.append(table(header, _memory_rows(data)))
    sections.append(FLOORS_NOTE)
    notes = []
    for problem, c in checks.items():
        peers = ", ".join(
            f"{p} {v:.0e}" if isinstance(v, float) else f"{p} -" for p, v in c["peers"].items()
        )
        conv = data.get("conv", {}).get(problem, {})
        kernels = "; ".join(
            f"{key}: " + ", ".join(f"{name} {kernel}" for name, kernel in chosen.items())
            for key, chosen in conv.items()
            if chosen
        )
        notes.append(
            f"{problem}: floors = avionics within {c['floor']:.0e} (float64, N=4, 2 steps); "
            f"peers' norms against a loop over samples: {peers}"
            + (f"; the floors' convolution kernels ({kernels})" if kernels else "")
        )
    sections.append("\n".join(f"* {note}" for note in notes))
    markdown = "\n\n".join(sections)
    if args.no_write:
        print(markdown)
        return
    blob = json.dumps(data, sort_keys=True).replace("--", "-\\u002d")
    write_section(SECTION, markdown + f"\n\n<!-- engine-speed-data {blob} -->")


FLOORS_NOTE = (
    "How the floors work (`benchmarks/floors.py`): plain forward hooks keep each Linear, "
    "Conv2d, Embedding and LayerNorm call's input, a tensor hook on its output keeps the "
    "output gradient, and after the backward each parameter's per-sample statistics come "
    "from the cheapest exact kernel by FLOPs. Linear without shared axes: ||g_n||^2 = "
    "||delta_n||^2 ||x_n||^2, projections g_n . g by the Gram form (x x^T)(d d^T) or by "
    "d_n^T G x_n; Linear with shared axes (the GPT): the Gram form sum_{t,s} (d_t . "
    "d_s)(x_t . x_s) for norms alone where cheaper, sum_t d_t^T G x_t for projections "
    "alone, else the per-sample gradient materialised; Conv2d: per-sample weight gradients "
    "by one grouped convolution (groups = N) or by unfold + bmm, whichever a measurement at"
    " the first call finds faster, or, where cheaper, norms by the Gram form over output "
    "positions and projections by one ordinary convolution of the input with g as its "
    "weight (also for projections alone); Embedding: index_add, projections by gathering "
    "rows of g; LayerNorm and biases materialised ([N, W]); the GPT's tied embedding/head "
    "weight: the summed per-sample gradient of both uses materialised in chunks of samples."
    " NormTest's floor computes the norms only, InnerTest's the projections only, "
    "OrthoTest's and the three tests' both. Economy's floor adds GradNorm (one "
    "_foreach_norm), UpdateSize (lr ||g|| under plain SGD), Distance (one _foreach_sub and "
    "_foreach_norm from theta_0), Loss, Alpha's means and variances of the losses and of "
    "the projections onto the update at both of its steps (onto the previous mean gradient:"
    " its factors kept for Linear layers without shared axes, a copy otherwise; the fit's "
    "3x3 solve is left out) and GradHist1d's floor of the alpha-histograms section, writing"
    " N * D float32 values once. All values are read with one host transfer per step. That "
    "last term is not a lower bound where Linear layers hold most of D: avionics counts "
    "their products delta_{n,o} x_{n,i} in sorted runs without writing them, so there "
    "economy can come out below its floor (the MLP, logistic regression)."
)


if __name__ == "__main__":
    main()
