"""The KFAC rows of :mod:`benchmarks.curvature_operators`, medians side by side (issue 30).

On the MLP of that benchmark: KFAC's, EKFAC's and FOOF's construction, KFAC from its state
dict, the heuristic-damping inverse (construction + 16 columns, and the 16-column product
alone); then the KFAC rows of the main tables (construction with
the determinism check, the 16-column product) on the MLP, 3c3d and GPT. Each row is both
libraries' whole call on the same inputs, alternating (which goes first alternates too), CPU
time of the process (``time.process_time``, torch on one thread), the median over the
repeats (a third of them on 3c3d and GPT) after a warm-up.

Run: ``python -m benchmarks.kfac_rows [--repeats 21]`` (prints the table).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from avionics.curvature import EKFACOperator, KFACOperator
from avionics.curvature._data import MathAttention
from benchmarks.curvature_operators import (
    COLUMNS,
    cnn_3c3d_problem,
    gpt_problem,
    mlp_problem,
    operator_pairs,
)
from benchmarks.report import table


def kfac_pairs(model, loss_fn, data) -> dict:
    """(ours, curvlinops) zero-argument calls, one per KFAC row."""
    import curvlinops

    params = [p for p in model.parameters() if p.requires_grad]
    quiet = {"check_deterministic": False}
    V = torch.randn(
        sum(p.numel() for p in params), COLUMNS, generator=torch.Generator().manual_seed(0)
    )
    K_ours = KFACOperator(model, loss_fn, None, data, **quiet)
    K_theirs = curvlinops.KFACLinearOperator(model, loss_fn, params, data, **quiet)
    K_theirs.compute_kronecker_factors()
    state_ours, state_theirs = K_ours.state_dict(), K_theirs.state_dict()
    inverse_ours = K_ours.inverse(1e-3, mode="heuristic")
    inverse_theirs = curvlinops.KFACInverseLinearOperator(
        K_theirs, 1e-3, use_heuristic_damping=True
    )
    inverse_theirs @ V  # curvlinops inverts its factors on the first product

    def their_inverse():
        inverse = curvlinops.KFACInverseLinearOperator(K_theirs, 1e-3, use_heuristic_damping=True)
        return inverse @ V

    return {
        "KFAC construction": (
            lambda: KFACOperator(model, loss_fn, None, data, **quiet),
            lambda: curvlinops.KFACLinearOperator(
                model, loss_fn, params, data, **quiet
            ).compute_kronecker_factors(),
        ),
        "EKFAC construction": (
            lambda: EKFACOperator(model, loss_fn, None, data, **quiet),
            lambda: curvlinops.EKFACLinearOperator(
                model, loss_fn, params, data, **quiet
            )._maybe_compute_ekfac(),  # its factors, eigenbases and corrections
        ),
        "FOOF (forward-only) construction": (
            lambda: KFACOperator(model, loss_fn, None, data, fisher_type="forward-only", **quiet),
            lambda: curvlinops.KFACLinearOperator(
                model, loss_fn, params, data, fisher_type="forward-only", **quiet
            ).compute_kronecker_factors(),
        ),
        "KFAC from its state dict": (
            lambda: KFACOperator.from_state_dict(state_ours, model, loss_fn, None, data),
            lambda: curvlinops.KFACLinearOperator.from_state_dict(
                state_theirs, model, params, data, check_deterministic=False
            ),
        ),
        f"KFAC inverse, heuristic damping: inverted + {COLUMNS} columns": (
            lambda: K_ours.inverse(1e-3, mode="heuristic") @ V,
            their_inverse,
        ),
        f"KFAC inverse, heuristic damping: {COLUMNS} columns": (
            lambda: inverse_ours @ V,
            lambda: inverse_theirs @ V,
        ),
    }


def main_table_pairs() -> dict:
    """The KFAC rows of the main tables: construction (with the determinism check, both
    libraries' default) on the three problems, EKFAC's on the MLP (curvlinops' EKFAC takes
    [N, C] outputs only), and KFAC's 16-column product."""
    pairs = {}
    for name, (make, kinds) in {"MLP": (mlp_problem, ("KFAC", "EKFAC")),
                                "3c3d": (cnn_3c3d_problem, ("KFAC",)),
                                "GPT": (gpt_problem, ("KFAC",))}.items():  # fmt: skip
        torch.manual_seed(0)
        model, loss_fn, data, activation = make()
        factories = operator_pairs(model, loss_fn, data, activation)
        for kind in kinds:
            pairs[f"{name}: {kind} construction (determinism check)"] = factories[kind]
        with warnings.catch_warnings(), MathAttention():
            warnings.simplefilter("ignore")
            ours, theirs = (factory() for factory in factories["KFAC"])
        V = torch.randn(ours.shape[1], COLUMNS, generator=torch.Generator().manual_seed(0))
        products = (lambda A=ours, V=V: A @ V, lambda A=theirs, V=V: A @ V)
        pairs[f"{name}: KFAC product, {COLUMNS} columns"] = products
    return pairs


def median_times(ours, theirs, repeats: int) -> tuple[float, float]:
    """Median CPU times (ms) of the two calls, alternating (which goes first alternates too)."""
    times = ([], [])
    for repeat in range(repeats):
        order = (0, 1) if repeat % 2 == 0 else (1, 0)
        for side in order:
            fn = (ours, theirs)[side]
            start = time.process_time()
            fn()
            times[side].append(1e3 * (time.process_time() - start))
    return statistics.median(times[0]), statistics.median(times[1])


def run(repeats: int, only: list[str] | None = None) -> str:
    torch.manual_seed(0)
    model, loss_fn, data, _ = mlp_problem()
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pairs = {**kfac_pairs(model, loss_fn, data), **main_table_pairs()}
        for name, (ours, theirs) in pairs.items():
            if only and not any(word in name for word in only):
                continue
            slow = name.startswith(("3c3d", "GPT"))
            with MathAttention():  # curvlinops needs the math attention kernel (GPT)
                ours(), theirs()  # warm-up
                ours_ms, theirs_ms = median_times(ours, theirs, repeats // 3 if slow else repeats)
            print(f"{name}: {ours_ms:.2f} {theirs_ms:.2f} {theirs_ms / ours_ms:.2f}", flush=True)
            rows.append([name, f"{ours_ms:.2f}", f"{theirs_ms:.2f}", f"{theirs_ms / ours_ms:.2f}"])
    return table(["row (MLP)", "ours (ms)", "curvlinops (ms)", "ratio"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--only", nargs="*", help="rows whose name contains one of these words")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(run(args.repeats, args.only))


if __name__ == "__main__":
    main()
