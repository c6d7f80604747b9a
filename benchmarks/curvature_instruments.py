"""Cost of the curvature instruments, ours and the reference tool's, side by side.

    python -m benchmarks.curvature_instruments                  # the default run (10-15 min)
    python -m benchmarks.curvature_instruments --quick          # a few steps each (~2 min)
    python -m benchmarks.curvature_instruments --problems mlp --configs HessMaxEV --no-write

Each measurement is a steady training run (SGD, lr 0.01, the problem's fixed batch) that tracks
every step, next to an identical plain run (no instruments) of a copy of the model; plain and
instrumented steps alternate, so that the load of a shared machine drifts over both alike. The
ratio of each instrumented step to the plain step just before it is recorded; the table gives
their median. A measurement runs ``--steps`` tracked steps after ``WARMUP`` untimed ones
(HessMaxEV's first step starts Lanczos from a random vector; later ones warm-start), or stops
early after ``--seconds`` (at least ``MIN_STEPS``): the table says how many steps it measured.

Configurations (the same for both tools): HessMaxEV; HessTrace + TICDiag with the exact GGN
diagonal; with the Monte-Carlo GGN diagonal (one sample); HessTrace alone with each (it needs
only the diagonal's sums); the "full" preset. The reference is
cockpit-for-pytorch (``import cockpit``) on a BackPACK-extended model and loss. Tracked steps
of the GPT run PyTorch's math attention kernel (curvature differentiates the gradient again;
the fused kernels have no second derivative); its plain steps use the default kernel.
Writes the section "curvature-instruments" of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from avionics import Cockpit, configuration
from avionics.quantities import HessMaxEV, HessTrace, TICDiag
from benchmarks.problems import PROBLEMS, cross_entropy
from benchmarks.report import machine, table, write_section

WARMUP = 1
MIN_STEPS = 2
LR = 0.01

OURS = {
    "HessMaxEV": lambda: [HessMaxEV()],
    "GGN exact": lambda: [
        HessTrace(curvature="diag_ggn_exact"),
        TICDiag(curvature="diag_ggn_exact"),
    ],
    "GGN MC": lambda: [HessTrace(curvature="diag_ggn_mc"), TICDiag(curvature="diag_ggn_mc")],
    "HessTrace exact": lambda: [HessTrace(curvature="diag_ggn_exact")],
    "HessTrace MC": lambda: [HessTrace(curvature="diag_ggn_mc")],
    "full": lambda: configuration("full"),
}
TARGETS = {
    "HessMaxEV": 4.0,
    "GGN exact": 3.0,
    "GGN MC": 1.5,
    "HessTrace exact": 3.0,
    "HessTrace MC": 1.5,
    "full": 6.0,
}
NOTES = (
    "Where the time goes (ours, CPU, measured on mlp and 3c3d in multiples of a plain step). "
    "Every instrument here needs the create_graph backward (1.1-1.45x with an empty quantity; "
    "the GGN diagonals backpropagate through the forward graph of the per-sample losses, which "
    "a backward without create_graph frees). HessMaxEV: one Hessian-vector product costs "
    "1.3-1.5x a plain step on the MLP and 1.6-1.7x on 3c3d (PyTorch's double backward of a "
    "convolution alone is about a third of it); warm-started Lanczos needs 2 products per step "
    "when the top eigenvector moves little (MLP, logreg) and 3-5 on the CNNs early in "
    "training, where lambda_2 / lambda_1 is about 0.85 (the eigenvalue error bound needs them "
    "for tol 1e-3), so create_graph + products alone are about 3.8-4.3x on the MLP and 4.4-6x "
    "on 3c3d before any Lanczos vector work. GGN exact: one backward per column of the loss "
    "Hessian's root from the model output to the layer outputs (9 for 10 classes: the softmax "
    "root has rank C - 1); Linear layers without shared axes then take one product in all, a "
    "convolution's per-sample, per-column gradients are formed once per step for all columns "
    "(one unfolding and one product per sample), C - 1 times its weight gradient's "
    "multiply-adds. On the MLP, the step without any diagonal is 2.2x (cockpit, create_graph, "
    "TICDiag's sum_n g_n^2), the 9 column backwards 1.5x, the column sums 0.4x; on 2c2d the "
    "same accounting gives a floor of 7.1x. GGN MC: one backward and one sum of squares on top "
    "of that 1.9-2.6x base. HessTrace alone needs only the sums of the diagonal per parameter, "
    "which Linear layers have from per-sample squared norms (||delta||^2 ||x||^2, no product "
    "the size of the layer): the column backwards and create_graph remain. 'full' on the CNNs "
    "adds GradHist1d/GradHist2d (histograms of all "
    "N x D per-sample gradient elements, whose convolution gradients must be formed) and "
    "HessMaxEV to the exact GGN diagonal that HessTrace/TICDiag use by default (diag_h equals "
    "it for these piecewise-linear networks). logreg's plain step is 0.4 ms: there, Python "
    "overhead per tracked step dominates every ratio. The GPT's tracked steps run PyTorch's "
    "math attention kernel (curvature needs its second derivative), its plain steps the "
    "default kernel; its exact GGN diagonal would need 64 x 511 backwards per step and says so "
    "(use the MC one), and diag_h (HessTrace's default, used by 'full') would need D probes "
    "and says so too. The reference is not run on the GPT (BackPACK's second-order extensions "
    "need a model built from the modules they support and one of BackPACK's losses; the GPT "
    "has functional attention, LayerNorm and a per-sequence mean token loss), nor on 3c3d by "
    "default (minutes per step)."
)


def _reference_quantities(config: str):
    from cockpit import quantities as q
    from cockpit.utils.configuration import configuration as reference_configuration
    from cockpit.utils.schedules import linear

    every = linear(1)
    return {
        "HessMaxEV": lambda: [q.HessMaxEV(every)],
        "GGN exact": lambda: [
            q.HessTrace(every, curvature="diag_ggn_exact"),
            q.TICDiag(every, curvature="diag_ggn_exact"),
        ],
        "GGN MC": lambda: [
            q.HessTrace(every, curvature="diag_ggn_mc"),
            q.TICDiag(every, curvature="diag_ggn_mc"),
        ],
        "HessTrace exact": lambda: [q.HessTrace(every, curvature="diag_ggn_exact")],
        "HessTrace MC": lambda: [q.HessTrace(every, curvature="diag_ggn_mc")],
        "full": lambda: reference_configuration("full", every),
    }[config]()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _plain_stepper(model, X, y, loss_fn):
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(k):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(X), y).mean().backward()
        opt.step()

    return step


def _our_stepper(config, model, X, y, loss_fn, attention):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cockpit = Cockpit(model, OURS[config]())

    def step(k):
        opt.zero_grad(set_to_none=True)
        with attention():
            losses = loss_fn(model(X), y)
            loss = losses.mean()
            info = {"loss": loss, "individual_losses": losses, "batch_size": len(X),
                    "optimizer": opt}  # fmt: skip
            with cockpit(k, info):
                loss.backward(create_graph=cockpit.create_graph(k))
        opt.step()
        for p in model.parameters():  # break the grad <-> graph cycle of create_graph
            p.grad = None

    return step, cockpit


def _reference_stepper(config, model, X, y, loss_fn, attention):
    import cockpit as reference
    from backpack import extend

    if loss_fn is not cross_entropy:
        raise NotImplementedError("BackPACK's losses have no per-sequence token cross-entropy")
    model = extend(model)
    mean_loss = extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ck = reference.Cockpit(model.parameters(), quantities=_reference_quantities(config))

    def step(k):
        opt.zero_grad(set_to_none=True)
        out = model(X)
        loss, losses = mean_loss(out, y), loss_fn(out, y)
        info = {"loss": loss, "individual_losses": losses, "batch_size": len(X),
                "optimizer": opt}  # fmt: skip
        with ck(k, info=info):
            loss.backward(create_graph=ck.create_graph(k))
        opt.step()
        for p in model.parameters():
            p.grad = None

    return step, ck


def measure(problem, tool, config, steps, seconds, device):
    """(median instrumented/plain ratio, median plain step [s], steps measured, our quantities'
    cockpit or None)."""
    model, X, y, loss_fn = PROBLEMS[problem]()
    model, X, y = model.to(device), X.to(device), y.to(device)
    plain = _plain_stepper(copy.deepcopy(model), X, y, loss_fn)
    attention = (lambda: sdpa_kernel(SDPBackend.MATH)) if problem == "gpt" else nullcontext
    make = _our_stepper if tool == "ours" else _reference_stepper
    tracked, cockpit = make(config, model, X, y, loss_fn, attention)
    ratios, plain_times = [], []
    start = time.perf_counter()
    for k in range(WARMUP + steps):
        times = []
        for run in (plain, tracked):
            _sync(device)
            t0 = time.perf_counter()
            run(k)
            _sync(device)
            times.append(time.perf_counter() - t0)
        if k >= WARMUP:
            plain_times.append(times[0])
            ratios.append(times[1] / times[0])
            if len(ratios) >= MIN_STEPS and time.perf_counter() - start > seconds:
                break
    return statistics.median(ratios), statistics.median(plain_times), len(ratios), cockpit


def _products(cockpit) -> str:
    """Median Hessian-vector products per warm-started step of our HessMaxEV."""
    for q in getattr(cockpit, "quantities", []):
        if isinstance(q, HessMaxEV):
            counts = [c for s, c in sorted(q.num_products.items()) if s >= WARMUP]
            return f", {statistics.median(counts):g} HVP/step" if counts else ""
    return ""


def _cell(problem, tool, config, args, device, plain_times) -> str:
    try:
        ratio, plain, n, cockpit = measure(problem, tool, config, args.steps, args.seconds, device)
    except Exception as error:  # noqa: BLE001 (a tool that cannot run a problem: say why)
        reason = str(error).strip().split("\n")[0].split(". ")[0]
        return f"n/a ({type(error).__name__}: {reason[:200]})"
    plain_times.append(plain)
    return f"{ratio:.1f}x ({n} steps{_products(cockpit) if tool == 'ours' else ''})"


def section(rows, configs, args, device) -> str:
    """The markdown of the section "curvature-instruments" for the measured ``rows``."""
    return (
        f"Machine: {machine()}; device {device}, {args.threads} torch thread(s). The machine "
        "is shared with other jobs (2 cores, load far above 2): step times are noisy, so "
        "plain and instrumented steps alternate (each instrumented step "
        "is divided by the plain step just before it) and the median ratio is reported. "
        f"Per cell: median instrumented / plain step time over the tracked steps measured "
        f"(up to {args.steps}, capped at {args.seconds:g} s per cell, at least {MIN_STEPS}; "
        f"after {WARMUP} untimed warm-up step), every step tracked, steady SGD run (lr {LR}). "
        "'ours' = avionics, 'reference' = cockpit-for-pytorch on a BackPACK-extended model "
        "and loss (run on the problems listed in --reference-problems; '-' = not run). "
        "HVP/step: Hessian-vector products per tracked step of our HessMaxEV (median).\n\n"
        + table(["problem", "tool", "plain step", *configs], rows)
        + "\n\nTargets (ours): "
        + ", ".join(f"{c} <= {TARGETS[c]:g}x" for c in configs)
        + " ('GGN exact'/'GGN MC' = HessTrace + TICDiag with that curvature, 'HessTrace "
        "exact'/'HessTrace MC' = HessTrace alone; 'full' on the CNNs); HessMaxEV at least 10x "
        "faster than the reference.\n\n" + NOTES
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50, help="tracked steps per measurement")
    parser.add_argument("--seconds", type=float, default=10.0, help="time cap per measurement")
    parser.add_argument("--problems", default=",".join(PROBLEMS))
    parser.add_argument("--configs", default=",".join(OURS))
    parser.add_argument("--full-problems", default="2c2d,3c3d", help="where to run 'full'")
    parser.add_argument(
        "--reference-problems", default="logreg,mlp,2c2d", help="where to run the reference"
    )
    parser.add_argument("--tools", default="ours,reference")
    parser.add_argument(
        "--reference-configs",
        default="HessMaxEV,GGN exact,GGN MC,HessTrace exact,HessTrace MC",
        help="opt-in 'full': minutes per step and many GB on the CNNs",
    )
    parser.add_argument("--quick", action="store_true", help="--steps 5 --seconds 5")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: the 2 shared cores are busy)"
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.seconds = 5, 5.0
    device = torch.device(args.device)
    configs = [c for c in args.configs.split(",") if c]
    warnings.filterwarnings("ignore")  # create_graph's reference-cycle note, deprecations
    rows = []
    for problem in args.problems.split(","):
        for tool in args.tools.split(","):
            if tool == "reference" and problem not in args.reference_problems.split(","):
                continue
            cells, plain_times = [], []
            for config in configs:
                skipped = tool == "reference" and config not in args.reference_configs.split(",")
                if skipped or config == "full" and problem not in args.full_problems.split(","):
                    cells.append("-")
                else:
                    cells.append(_cell(problem, tool, config, args, device, plain_times))
            plain = f"{statistics.median(plain_times) * 1e3:.1f} ms" if plain_times else "-"
            rows.append([problem, tool, plain, *cells])
            print(" | ".join(rows[-1]), flush=True)
    text = section(rows, configs, args, device)
    if not args.no_write:
        write_section("curvature-instruments", text)
    print(text)


if __name__ == "__main__":
    main()
