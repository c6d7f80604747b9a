"""Warm-started Lanczos during real training (issue 25): HessMaxEV's products per step, the
least any stopping rule could use, and the true error of what it reports.

For each model of ``tests/real_models.py`` (float32, the sizes of ``benchmarks/real_models``,
train mode: dropout and batch-statistics BatchNorm on, as a training loop holds them), 10 plain
SGD steps (lr 1e-3, one fixed batch) under a cockpit tracking HessMaxEV (tol 1e-3) at every
step. At each step, on the same Hessian (the step's gradient graph), a float64 Lanczos with
full reorthogonalisation runs from the vector HessMaxEV started from (the previous step's
eigenvector; step 0 from HessMaxEV's seeded vector) until its Ritz residual is below 1e-7
|theta|: its last Ritz value is the reference lambda_1, and its Ritz values after m products
are what any Lanczos from that start could report after m products. From these:

* used: the products HessMaxEV used (the shipped stopping rule, ``criterion="eigenvalue"``);
* oracle: the fewest products after which the Ritz value is within tol of lambda_1 (what a
  rule that knew lambda_1 would stop at: no stopping rule can use fewer);
* error: |reported - lambda_1| / lambda_1 of the value HessMaxEV stored (<= tol: honest);
* each stopping rule replayed on the reference's Ritz values (same start, nested Krylov
  spaces, restarts aside): the products it would stop at and the largest error there, for
  the residual rule r <= tol theta, the shipped Kato-Temple estimate with the Ritz gap
  (min(r, 10 r^2 / (theta_1 - theta_2))) and a candidate without the factor whose gap takes
  the next Ritz value's residual out (min(r, r^2 / (theta_1 - theta_2 - r_2))); the
  one-product check (which needs the previous calls' gap) is not replayed, so these start at
  2 products.

Step 0 (a cold start) is left out of the medians. Run: ``python -m benchmarks.lanczos_training``
(``--models``, ``--steps``, ``--no-write``).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import warnings

import torch

from avionics import Cockpit
from avionics.quantities import HessMaxEV
from benchmarks.real_models import SIZES, TITLES
from benchmarks.report import machine, table, write_section
from tests.real_models import ALL_MODELS as MODELS

TOL = 1e-3
REFERENCE_TOL = 1e-7
MOST = 80
PREVIOUS_SAFETY = 10.0  # the shipped rule's factor on r^2 / (theta_1 - theta_2) (GAP_SAFETY)


def ritz_values(apply, v0: torch.Tensor) -> list[tuple[float, float, float, float]]:
    """(theta_1, theta_2, r_1, r_2) after each product of float64 Lanczos (full
    reorthogonalisation, twice) from v0, until r_1 <= REFERENCE_TOL |theta_1| or MOST."""
    D = v0.numel()
    V = torch.zeros(MOST + 1, D, dtype=torch.float64)
    V[0] = v0.double() / v0.double().norm()
    T = torch.zeros(MOST, MOST, dtype=torch.float64)
    out = []
    for j in range(MOST):
        w = apply(V[j])
        h = torch.zeros(j + 1, dtype=torch.float64)
        for _ in range(2):
            c = V[: j + 1] @ w
            w = w - V[: j + 1].T @ c
            h += c
        T[: j + 1, j] = T[j, : j + 1] = h
        beta = float(w.norm())
        theta, Y = torch.linalg.eigh(T[: j + 1, : j + 1])
        r = beta * Y[-1].abs()
        second = (float(theta[-2]), float(r[-2])) if j else (math.nan, math.nan)
        out.append((float(theta[-1]), second[0], float(r[-1]), second[1]))
        if out[-1][2] <= REFERENCE_TOL * abs(out[-1][0]) or beta == 0:
            break
        V[j + 1] = w / beta
    return out


def replay(trajectory, estimate) -> tuple[int, float]:
    """(products, relative error) where the rule ``estimate(t1, t2, r1, r2)`` <= TOL |t1|
    first holds on the trajectory (nb >= 2; its end if never)."""
    lam = trajectory[-1][0]
    for m, (t1, t2, r1, r2) in enumerate(trajectory[1:], start=2):
        if estimate(t1, t2, r1, r2) <= TOL * abs(t1):
            return m, abs(t1 - lam) / abs(lam)
    return len(trajectory), 0.0


RULES = {
    "residual": lambda t1, t2, r1, r2: r1,
    "shipped: min(r, 10 r^2 / Ritz gap)": lambda t1, t2, r1, r2: min(
        r1, PREVIOUS_SAFETY * r1 * r1 / (t1 - t2)
    ),
    "candidate: min(r, r^2 / (Ritz gap - r_2))": lambda t1, t2, r1, r2: (
        min(r1, r1 * r1 / (t1 - t2 - r2)) if t1 - t2 > r2 else r1
    ),
}


class Watched(HessMaxEV):
    """HessMaxEV that also runs the float64 reference from its own start vector."""

    def __init__(self):
        super().__init__(tol=TOL)
        self.records: dict[int, dict] = {}

    def compute(self, data):
        op = self.operator(data)
        start = self._lanczos.eigenvector
        if start is None:
            start = torch.randn(op.dim, generator=torch.Generator().manual_seed(self.seed))
        start = start.detach().clone()
        result = super().compute(data)

        def apply(v):
            parts = op(v.to(op.dtype))
            return torch.cat(
                [
                    torch.zeros(s.stop - s.start) if p is None else p.reshape(-1)
                    for p, s in zip(parts, op.slices, strict=True)
                ]
            ).double()

        trajectory = ritz_values(apply, start)
        lam = trajectory[-1][0]
        errors = [abs(t[0] - lam) / abs(lam) for t in trajectory]
        self.records[data.step] = {
            "used": self.num_products[data.step],
            "error": abs(result[data.step] - lam) / abs(lam),
            "oracle": next(m for m, e in enumerate(errors, start=1) if e <= TOL),
            "rules": {name: replay(trajectory, rule) for name, rule in RULES.items()},
            "lambda": lam,
        }
        return result


def measure(name: str, steps: int) -> dict[int, dict]:
    model, X, y, loss_fn = MODELS[name](dtype=torch.float32, **SIZES[name])
    model = copy.deepcopy(model)
    quantity = Watched()
    cockpit = Cockpit(model, [quantity])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            opt.zero_grad()
            losses = loss_fn(model(X), y)
            loss = losses.mean()
            info = {"loss": loss, "individual_losses": losses, "batch_size": len(X)}
            info["optimizer"] = opt
            with cockpit(step, info):
                loss.backward(create_graph=cockpit.create_graph(step))
            opt.step()
    for p in model.parameters():
        p.grad = None
    return quantity.records


def row(name: str, records: dict[int, dict]) -> list[str]:
    later = [records[s] for s in sorted(records) if s > 0]

    def median(values):
        return f"{statistics.median(values):g}"

    used = [r["used"] for r in later]
    cells = [
        TITLES[name],
        f"{median(used)} ({', '.join(map(str, used))})",
        f"{median([r['oracle'] for r in later])} ({', '.join(str(r['oracle']) for r in later)})",
        f"{max(r['error'] for r in later):.1e}",
    ]
    for rule in RULES:
        stops = [r["rules"][rule] for r in later]
        cells.append(f"{median([m for m, _ in stops])} / {max(e for _, e in stops):.1e}")
    return cells


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        rows.append(row(name, measure(name, args.steps)))
        print(" | ".join(rows[-1]), flush=True)
    header = ["model", "HessMaxEV products per step, median (steps 1..)",
              "oracle: fewest products within tol", "largest error of the stored value",
              *(f"{rule}: median products / largest error" for rule in RULES)]  # fmt: skip
    markdown = (
        "## Warm-started Lanczos during training: products, the oracle, the error (issue 25)\n\n"
        f"{machine()}; `python -m benchmarks.lanczos_training` (the module docstring says what "
        f"each column is): {args.steps} SGD steps in train mode, HessMaxEV at tol {TOL} at "
        "every step; the float64 reference from the same start vector on the same Hessian.\n\n"
        + table(header, rows)
    )
    print(markdown)
    if not args.no_write:
        write_section("lanczos-training", markdown)


if __name__ == "__main__":
    main()
