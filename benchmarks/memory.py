"""Peak memory of a few training steps, each configuration in a fresh process.

A probe prints the resident memory before the model is built and the high-water after its
steps; the difference is the model, data, optimizer state and the steps' peak, without the
interpreter and libraries. The high-water is ``VmHWM``, not ``ru_maxrss``: a child's
``ru_maxrss`` starts at its parent's high-water (Linux copies it on fork), which would hide the
child's own peak. Large buffers are always mmapped (``MALLOC_MMAP_THRESHOLD_``), so that freed
ones go back to the OS at once and the high-water follows live memory, not glibc's arenas.
The histogram kernels are loaded before the baseline too (:func:`load_kernels`): numba's
runtime is a one-time cost of the process, about 70 MiB, reported beside the tables.
tracemalloc does not see torch's CPU allocations, and this torch build's profiler records no
memory events, so neither is used.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys


def load_kernels() -> None:
    """Load avionics' compiled histogram kernels (numba's runtime and code: about 70 MiB, once
    per process), so that, like the libraries, they are not part of a probe's growth."""
    import torch

    from avionics.persample import OuterProducts
    from avionics.quantities import binning

    counts = torch.zeros(4, dtype=torch.int64)
    binning.count_1d(torch.zeros(3), -1.0, 1.0, counts)
    binning.count_1d(OuterProducts(torch.zeros(1, 2), torch.zeros(1, 2)), -1.0, 1.0, counts)
    binning.count_2d(torch.zeros(1, 4), torch.zeros(4, dtype=torch.int64), 1, -1.0, 1.0, counts)
    outer = OuterProducts(torch.zeros(1, 2), torch.zeros(1, 2))
    binning.count_2d(outer, torch.zeros(4, dtype=torch.int64), 1, -1.0, 1.0, counts)


def probe_steps(problem: str, make_runner, steps: int, threads: int) -> None:
    """The body of a probe (a fresh process): print the resident KiB before the model is
    built and the high-water after ``steps`` steps of ``make_runner(model, loss_fn)``, for
    :func:`probe_growth`. Import what the runner needs before calling it."""
    import warnings

    import torch

    from benchmarks.problems import PROBLEMS

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    load_kernels()
    baseline = resident_kib()
    model, X, y, loss_fn = PROBLEMS[problem]()
    runner = make_runner(model, loss_fn)
    for k in range(steps):
        runner.step(k, X, y)
    print(baseline, high_water_kib())


def resident_kib() -> int:
    """Resident memory of this process now, in KiB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() // 1024


def high_water_kib() -> int:
    """The resident high-water of this process, in KiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def probe_growth(module: str, args: list[str]) -> int:
    """Run ``python -m MODULE --probe ARGS`` (which prints resident and high-water KiB, the
    last two numbers of its output) and return the growth in bytes."""
    command = [sys.executable, "-m", module, "--probe", *args]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(2**20))
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    baseline, peak = map(int, out.split()[-2:])
    return max(1, peak - baseline) * 1024
