"""Where forming a Linear layer's products densely beats the fused outer-product kernel (issue 25).

:meth:`avionics.quantities.binning.Tally1d.add` counts a Linear layer's per-sample gradients
delta_{n,o} x_{n,i} either with the fused kernel (``_count_outer_1d``: the N x O x I products
never written; a sample's longer factor sorted and searched for runs of equal bins where the
products span few bins) or by forming the products [N, O, I] and counting them as values
(``_count_1d``). Chunks of fewer than ``binning.DENSE_PRODUCTS`` products take the second.
This script times both paths on the same chunks (N = 32, float32, 100 bins on [-1, 1]),
forced by setting ``DENSE_PRODUCTS`` to 0 (fused) or above the chunk's size (dense), the
two alternating call by call in one process, 1 torch thread, CPU time
(``time.process_time``): the median over rounds of the mean of 5 ``add`` calls. Two spreads
of the products: 'narrow' (delta ~ 1e-3 N(0, 1), x ~ N(0, 1): a few bins, where the search
pays) and 'wide' (delta, x ~ N(0, 1): the products span the range).

Run: ``python -m benchmarks.tally_crossover`` (about a minute); ``--rounds``, ``--no-write``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from avionics.persample import OuterProducts
from avionics.quantities import binning
from benchmarks.report import machine, table, write_section

SAMPLES = 32
# (O, I): 1K to 256K products with N = 32, rows shorter and longer than binning._SEARCH_COST
# (the search pays only on longer ones); (10, 16) is the ViT's head
SHAPES = [(4, 8), (8, 8), (8, 16), (10, 16), (16, 16), (8, 64), (16, 32), (2, 256), (24, 32),
          (16, 64), (4, 256), (32, 32), (32, 48), (32, 64), (64, 64), (64, 128)]  # fmt: skip
SPREADS = {"narrow": 1e-3, "wide": 1.0}
CALLS = 5


def _time_add(chunk: OuterProducts, dense: bool) -> float:
    """Seconds of CPU per ``Tally1d.add`` of ``chunk`` on the path asked for."""
    binning.DENSE_PRODUCTS = chunk.delta.numel() * chunk.x.shape[1] + 1 if dense else 0
    tally = binning.Tally1d(100, -1.0, 1.0)
    start = time.process_time()
    for _ in range(CALLS):
        tally.add(chunk)
    elapsed = (time.process_time() - start) / CALLS
    tally.counts()
    return elapsed


def rows(rounds: int) -> list[list[str]]:
    cut = binning.DENSE_PRODUCTS
    gen = torch.Generator().manual_seed(0)
    out = []
    try:
        for o, i in SHAPES:
            for spread_name, spread in SPREADS.items():
                delta = torch.randn(SAMPLES, o, generator=gen) * spread
                chunk = OuterProducts(delta, torch.randn(SAMPLES, i, generator=gen))
                times = {True: [], False: []}
                for _ in range(rounds):
                    for dense in (False, True):
                        times[dense].append(_time_add(chunk, dense))
                fused, dense = (1e6 * statistics.median(times[d]) for d in (False, True))
                size = SAMPLES * o * i
                out.append([f"{SAMPLES} x {o} x {i}", str(size), spread_name, f"{fused:.1f}",
                            f"{dense:.1f}", f"{fused / dense:.2f}",
                            "dense" if size < cut else "fused"])  # fmt: skip
                print(" | ".join(out[-1]), flush=True)
    finally:
        binning.DENSE_PRODUCTS = cut
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    binning.load_kernels([torch.float32], dims=(1,))
    header = ["N x O x I", "products", "spread", "fused (us)", "dense (us)",
              "fused / dense", "path taken"]  # fmt: skip
    body = table(header, rows(args.rounds))
    markdown = "\n\n".join(
        [
            "### Fused outer-product kernel against forming the products (Tally1d.add)",
            machine() + f"; load average {os.getloadavg()[0]:.1f} while it ran (measured "
            f"under load: the ratios count). `python -m benchmarks.tally_crossover`: "
            f"{args.rounds} rounds, both paths alternating in one process, median CPU us "
            f"per add. Chunks below `binning.DENSE_PRODUCTS` = {binning.DENSE_PRODUCTS} "
            "products are formed densely.",
            body,
        ]
    )
    if args.no_write:
        print(markdown)
    else:
        write_section("tally-crossover", markdown)


if __name__ == "__main__":
    main()
