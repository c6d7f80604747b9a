"""Importing avionics where numba can cache its kernels nowhere: they still work, compiled
in the process; where it can, they are cached on disk, without a warning either way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Counts per-sample gradient elements with the numba kernels and compares the counts with
# the bins b(x) = floor((x - lo) * bins / (hi - lo)), clamped to [0, bins - 1], in float64.
COUNT_AND_CHECK = """
import sys

import numpy as np
import torch

import avionics
from avionics.quantities import binning

assert avionics.__file__.startswith(sys.argv[1]), avionics.__file__
values = torch.randn(50, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
counts = torch.zeros(16, dtype=torch.int64)
binning.count_1d(values, -1.5, 1.5, counts)
index = np.clip(np.floor((values.numpy().ravel() + 1.5) * 16 / 3.0), 0, 15).astype(int)
assert counts.tolist() == np.bincount(index, minlength=16).tolist(), counts
print(binning.CACHE)
"""


def count_in_subprocess(package_root: Path, env: dict) -> subprocess.CompletedProcess:
    """Run :data:`COUNT_AND_CHECK` with avionics imported from ``package_root`` (also the
    working directory, which ``python -c`` puts first on the path), warnings turned into
    errors."""
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", COUNT_AND_CHECK, str(package_root)],
        capture_output=True,
        text=True,
        cwd=package_root,
        env={**os.environ, "PYTHONPATH": str(package_root), **env},
        timeout=600,
    )


def test_kernels_work_where_no_cache_folder_can_be_written(tmp_path):
    """A copy of the package whose ``__pycache__`` (where the kernels live) cannot be
    created, with NUMBA_CACHE_DIR and the home's cache under a file as well: numba's cache
    locators all fail to create their folder (the OSError a read-only folder gives; a file
    in the way binds root too, so the test runs for every user) and ``cache=True`` would
    raise "no locator available" at import."""
    root = tmp_path / "site"
    shutil.copytree(
        REPO / "avionics", root / "avionics", ignore=shutil.ignore_patterns("__pycache__")
    )
    (root / "avionics" / "quantities" / "__pycache__").write_text("not a folder")
    blocked = tmp_path / "blocked"
    blocked.write_text("not a folder")
    env = {
        "HOME": str(blocked / "home"),
        "XDG_CACHE_HOME": str(blocked / "cache"),
        "NUMBA_CACHE_DIR": str(blocked / "numba"),
    }
    result = count_in_subprocess(root, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]
    assert (root / "avionics" / "quantities" / "__pycache__").read_text() == "not a folder"


def test_kernels_are_cached_where_numba_can_write(tmp_path):
    cache = tmp_path / "numba-cache"
    result = count_in_subprocess(REPO, {"NUMBA_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"]
    assert any(cache.rglob("binning._count_1d-*.nbi")), sorted(cache.rglob("*"))
