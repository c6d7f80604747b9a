"""The binning kernels against numpy.histogram / numpy.histogram2d."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from avionics.persample import OuterProducts
from avionics.quantities import binning


def numpy_1d(values: np.ndarray, bins: int, lo: float, hi: float) -> np.ndarray:
    """numpy's counts with our conventions: clamped into the range, NaN in the last bin."""
    values = values.astype(np.float64).reshape(-1)
    nan = np.isnan(values)
    counts = np.histogram(np.clip(values[~nan], lo, hi), bins=bins, range=(lo, hi))[0]
    counts[-1] += nan.sum()
    return counts


def random_values(n: int, dtype, seed: int = 0) -> torch.Tensor:
    """Spread over and beyond [-1, 1], with zeros, infinities, NaN and the range ends."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen, dtype=torch.float64) * 0.7
    special = torch.tensor([0.0, -1.0, 1.0, float("inf"), -float("inf"), float("nan"), 3.0])
    values[: min(n, len(special))] = special[: min(n, len(special))].double()
    return values.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bins", [1, 31, 100, binning.PAIR_BINS, binning.PAIR_BINS + 1, 300])
@pytest.mark.parametrize("n", [1, 3, 1025, 5001])
def test_count_1d_matches_numpy(dtype, bins, n):
    values = random_values(n, dtype)
    counts = torch.zeros(bins, dtype=torch.int64)
    binning.count_1d(values, -1.0, 1.0, counts)
    binning.count_1d(values[: n // 2], -1.0, 1.0, counts)  # counts accumulate
    expected = numpy_1d(values.float().numpy(), bins, -1, 1)
    expected += numpy_1d(values[: n // 2].float().numpy(), bins, -1, 1)
    np.testing.assert_array_equal(counts.numpy(), expected)


def test_count_1d_of_a_strided_multidimensional_tensor():
    values = random_values(6 * 7 * 5, torch.float64).reshape(6, 7, 5).transpose(0, 2)
    counts = torch.zeros(17, dtype=torch.int64)
    binning.count_1d(values, -0.5, 1.5, counts)
    np.testing.assert_array_equal(counts.numpy(), numpy_1d(values.numpy(), 17, -0.5, 1.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 1030), (17, 5)])
def test_count_2d_matches_numpy(dtype, shape):
    xbins, ybins = 13, 9
    g = random_values(shape[0] * shape[1], dtype, seed=1).reshape(shape)
    theta = random_values(shape[1], dtype, seed=2) * 2
    offsets = binning.bin_index(theta, ybins, -2.0, 2.0) * xbins
    counts = torch.zeros(xbins * ybins, dtype=torch.int64)
    binning.count_2d(g, offsets, xbins, -1.0, 1.0, counts)

    x = g.double().numpy().reshape(-1)
    y = np.broadcast_to(theta.double().numpy(), shape).reshape(-1)
    x_bin = np.argmax(numpy_onehot(x, xbins, -1, 1), axis=1)
    y_bin = np.argmax(numpy_onehot(y, ybins, -2, 2), axis=1)
    expected = np.zeros((ybins, xbins), dtype=np.int64)
    np.add.at(expected, (y_bin, x_bin), 1)
    np.testing.assert_array_equal(counts.numpy().reshape(ybins, xbins), expected)


def numpy_onehot(values: np.ndarray, bins: int, lo: float, hi: float) -> np.ndarray:
    """[n, bins]: each value's numpy bin (clamped; NaN in the last bin), one-hot."""
    return np.stack([numpy_1d(v[None], bins, lo, hi) for v in values])


def test_bin_index_agrees_with_the_kernel():
    values = random_values(2000, torch.float64, seed=3)
    index = binning.bin_index(values, 23, -1.0, 1.0)
    counts = torch.zeros(23, dtype=torch.int64)
    binning.count_1d(values, -1.0, 1.0, counts)
    np.testing.assert_array_equal(np.bincount(index.numpy(), minlength=23), counts.numpy())


def test_torch_fallbacks_match_the_kernels():
    """The accelerator path, run on the CPU, on finite values (NaN and the edges: below)."""
    values = random_values(3000, torch.float64, seed=4)
    values = values[values.isfinite()]
    ours, theirs = (torch.zeros(31, dtype=torch.int64) for _ in range(2))
    binning.count_1d(values, -1.0, 1.0, ours)
    binning.torch_count_1d(values, -1.0, 1.0, theirs)
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())

    g = values[:2900].reshape(29, 100)
    offsets = binning.bin_index(torch.linspace(-3, 3, 100), 7, -2.0, 2.0) * 11
    ours, theirs = (torch.zeros(77, dtype=torch.int64) for _ in range(2))
    binning.count_2d(g, offsets, 11, -1.0, 1.0, ours)
    binning.torch_count_2d(g, offsets, 11, -1.0, 1.0, theirs)
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def edge_values(bins: int, lo: float, hi: float, dtype) -> torch.Tensor:
    """Every edge of the bins and its neighbours one rounding below and above (in ``dtype``),
    values beyond the range, +-inf and NaN: where two ways of binning could disagree."""
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64).to(dtype)
    up = torch.nextafter(edges, torch.full_like(edges, math.inf))
    down = torch.nextafter(edges, torch.full_like(edges, -math.inf))
    special = torch.tensor([2 * lo, 2 * hi, 0.0, math.inf, -math.inf, math.nan], dtype=dtype)
    return torch.cat([edges, up, down, special])


def brute_force_1d(chunk, bins: int, lo: float, hi: float) -> np.ndarray:
    """A loop over samples: each sample's values (its products formed in the factors' dtype,
    float32 at least), binned one by one as floor((x - lo) bins / (hi - lo)) in float64,
    clamped, NaN in the last bin."""
    counts = np.zeros(bins, np.int64)
    scale = bins / (hi - lo)
    for values in _per_sample(chunk):
        for v in values.double().reshape(-1).tolist():
            b = bins - 1 if math.isnan(v) else min(max((v - lo) * scale, 0.0), bins - 1)
            counts[int(b)] += 1
    return counts


def _per_sample(chunk):
    if isinstance(chunk, OuterProducts):
        dtype = torch.promote_types(chunk.delta.dtype, chunk.x.dtype)
        dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        for d, x in zip(chunk.delta.to(dtype), chunk.x.to(dtype), strict=True):
            yield d[:, None] * x[None, :]
    else:
        yield from chunk


def brute_force_2d(chunk, offsets: torch.Tensor, bins, lo, hi, size: int) -> np.ndarray:
    counts = np.zeros(size, np.int64)
    for values in _per_sample(chunk):
        index = binning.bin_index(values.reshape(-1), bins, lo, hi) + offsets.reshape(-1)
        for b in index.tolist():
            counts[b] += 1
    return counts


@pytest.fixture(params=["fused", "dense"])
def products_path(request, monkeypatch):
    """How Tally1d counts a Linear layer's products in this test, whatever their number: by
    the fused outer-product kernel (DENSE_PRODUCTS = 0) or formed [N, O, I] and counted as
    values (DENSE_PRODUCTS above any test's size)."""
    monkeypatch.setattr(binning, "DENSE_PRODUCTS", 0 if request.param == "fused" else 2**62)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bins", [7, 100, binning.PAIR_BINS + 1])
def test_the_torch_kernels_count_as_the_numba_kernels_and_a_loop_over_samples(
    dtype, bins, monkeypatch, products_path
):
    """Values at and one rounding beside every bin edge, outside the range, infinite and NaN;
    parts of a few values each (TORCH_PART small), so that a sample spans several parts; the
    products of a Linear layer by both paths of Tally1d (``products_path``)."""
    monkeypatch.setattr(binning, "TORCH_PART", 37)
    lo, hi = -0.75, 1.25
    edges = edge_values(bins, lo, hi, dtype)
    g = torch.cat([edges, random_values(6 * 64 - len(edges) % 64, dtype, seed=9)])
    g = g[: len(g) - len(g) % 6].reshape(6, -1)
    expected = brute_force_1d(g, bins, lo, hi)
    for count in (binning.count_1d, binning.torch_count_1d):
        counts = torch.zeros(bins, dtype=torch.int64)
        count(g, lo, hi, counts)
        np.testing.assert_array_equal(counts.numpy(), expected, err_msg=count.__name__)

    # a Linear layer's products delta_{n,o} x_{n,i}, counted without the [N, O, I] tensor
    delta = torch.cat([edges[:5], torch.tensor([1.0, -1.0, 0.5], dtype=dtype)])
    delta = torch.stack([delta, delta.flip(0), delta * 0.5])
    x = torch.stack([edges, edges.flip(0), random_values(len(edges), dtype, seed=10)])
    outer = OuterProducts(delta, x)
    expected = brute_force_1d(outer, bins, lo, hi)
    assert expected.sum() == delta.numel() * x.shape[1]
    for count in (binning.count_1d, binning.torch_count_1d):
        counts = torch.zeros(bins, dtype=torch.int64)
        count(outer, lo, hi, counts)
        np.testing.assert_array_equal(counts.numpy(), expected, err_msg=count.__name__)

    # 2d: the joint bins with the offsets of each element's parameter bin
    for chunk, width in ((g, g.shape[1]), (outer, delta.shape[1] * x.shape[1])):
        theta = torch.linspace(-3, 3, width, dtype=torch.float64)
        offsets = (binning.bin_index(theta, 5, -2.0, 2.0) * bins).to(torch.int32)
        expected = brute_force_2d(chunk, offsets, bins, lo, hi, 5 * bins)
        for count in (binning.count_2d, binning.torch_count_2d):
            counts = torch.zeros(5 * bins, dtype=torch.int64)
            count(chunk, offsets, bins, lo, hi, counts)
            np.testing.assert_array_equal(counts.numpy(), expected, err_msg=count.__name__)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bins", [31, binning.PAIR_BINS + 1])
def test_outer_products_count_as_their_materialised_values(dtype, bins, products_path):
    """The fused kernels bin delta_{n,o} x_{n,i} exactly as the materialised products."""
    delta = random_values(3 * 5, dtype, seed=5).reshape(3, 5)
    x = random_values(3 * 1500, dtype, seed=6).reshape(3, 1500)  # rows longer than a batch
    outer = OuterProducts(delta, x)
    g = outer.materialize()
    torch.testing.assert_close(g, torch.einsum("no,ni->noi", delta, x), rtol=0, atol=0,
                               equal_nan=True)  # fmt: skip
    finite = OuterProducts(delta.nan_to_num(0, 0, 0), x.nan_to_num(0, 0, 0))
    assert finite.abs_max().item() == finite.materialize().abs().max().item()

    fused, materialised = (torch.zeros(bins, dtype=torch.int64) for _ in range(2))
    binning.count_1d(outer, -1.0, 1.0, fused)
    binning.count_1d(g, -1.0, 1.0, materialised)
    np.testing.assert_array_equal(fused.numpy(), materialised.numpy())
    assert fused.sum() == g.numel()

    offsets = binning.bin_index(torch.linspace(-3, 3, 5 * 1500, dtype=dtype), 7, -2.0, 2.0)
    offsets = offsets * bins
    fused, materialised = (torch.zeros(7 * bins, dtype=torch.int64) for _ in range(2))
    binning.count_2d(outer, offsets, bins, -1.0, 1.0, fused)
    binning.count_2d(g, offsets, bins, -1.0, 1.0, materialised)
    np.testing.assert_array_equal(fused.numpy(), materialised.numpy())
    assert fused.sum() == g.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("size", ["below", "at"])
def test_products_below_the_cut_are_formed_and_from_it_on_fused(monkeypatch, dtype, size):
    """With the default DENSE_PRODUCTS (2^15 products), 7 x 31 x 151 = 2^15 - 1 products are
    formed and counted as values, 8 x 32 x 128 = 2^15 by the fused kernel; both count as a
    float64 loop over the products (every bin edge and its neighbours, beyond the range, +-inf,
    NaN, zero factors) and, on finite random values, as numpy.histogram."""
    assert binning.DENSE_PRODUCTS == 2**15
    n, o, i = (7, 31, 151) if size == "below" else (8, 32, 128)
    fused = []
    kernel = binning._count_outer_1d
    monkeypatch.setattr(binning, "_count_outer_1d", lambda *a: fused.append(1) or kernel(*a))
    lo, hi, bins = -0.75, 1.25, 100
    edges = edge_values(bins, lo, hi, dtype)
    x = torch.cat([edges, random_values(n * i - len(edges), dtype, seed=31)]).reshape(n, i)
    delta = random_values(n * o, dtype, seed=32).reshape(n, o)
    delta[:, :4] = torch.tensor([1.0, -1.0, 0.0, 0.5], dtype=dtype)  # the edges, exactly
    outer = OuterProducts(delta, x)
    counts = torch.zeros(bins, dtype=torch.int64)
    binning.count_1d(outer, lo, hi, counts)
    np.testing.assert_array_equal(counts.numpy(), brute_force_1d(outer, bins, lo, hi))
    assert counts.sum() == n * o * i and bool(fused) == (size == "at")

    gen = torch.Generator().manual_seed(33)
    delta, x = torch.randn(n, o, generator=gen), torch.randn(n, i, generator=gen)
    outer = OuterProducts(delta.to(dtype), x.to(dtype))
    counts = torch.zeros(bins, dtype=torch.int64)
    binning.count_1d(outer, lo, hi, counts)
    values = torch.stack(list(_per_sample(outer)))  # rounded as the kernels round them
    np.testing.assert_array_equal(counts.numpy(), numpy_1d(values.numpy(), bins, lo, hi))


@pytest.mark.parametrize("bins", [100, binning.PAIR_BINS + 1])
@pytest.mark.parametrize("spread", [0.0, 1e-3, 3e-2, 0.2])
def test_batches_spanning_few_bins_count_exactly(bins, spread, products_path):
    """Batches of values spanning fewer than FEW_BINS bins are counted from their moments:
    the counts must equal those of the materialised products (edges at 0 included)."""
    gen = torch.Generator().manual_seed(7)
    delta = torch.randn(4, 9, generator=gen) * spread
    delta[0, :3] = torch.tensor([0.0, -0.0, 1e-30])
    x = torch.randn(4, 700, generator=gen)
    x[1] = x[1].abs()  # one-signed rows
    outer = OuterProducts(delta, x)
    fused, materialised = (torch.zeros(bins, dtype=torch.int64) for _ in range(2))
    binning.count_1d(outer, -2.0, 2.0, fused)
    binning.count_1d(outer.materialize(), -2.0, 2.0, materialised)
    np.testing.assert_array_equal(fused.numpy(), materialised.numpy())
    assert fused.sum() == delta.numel() * x.shape[1]
    # and against the bins computed elementwise by torch (the same formula, no shortcut)
    index = binning.bin_index(outer.materialize().reshape(-1), bins, -2.0, 2.0)
    np.testing.assert_array_equal(fused.numpy(), np.bincount(index.numpy(), minlength=bins))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(6, 40, 3000), (6, 3000, 40), (2, 1, 1), (3, 7, 7)])
@pytest.mark.parametrize("limits", [(-2.0, 2.0), (-0.5, 0.3), (-1e-3, 1e-3)])
@pytest.mark.parametrize("products_path", ["fused"], indirect=True)
def test_outer_products_counted_by_runs_of_a_sorted_factor(dtype, shape, limits, products_path):
    """The 1d kernel sorts a sample's longer factor and searches where the bins of its
    products change: runs of one bin, of a few and of many (counted one by one), factors of
    either sign, zeros and ties must all count exactly as the products binned one by one."""
    n, o, i = shape
    gen = torch.Generator().manual_seed(11)
    delta = (torch.randn(n, o, generator=gen, dtype=torch.float64) * 0.3).to(dtype)
    x = torch.randn(n, i, generator=gen, dtype=torch.float64).relu().to(dtype)  # many zeros
    x[0, : i // 2] = x[0, -1]  # ties
    delta[-1, : o // 2] = 0.0
    for special in (None, float("nan"), float("inf")):  # in one sample's factors
        if special is not None:
            x[1, 0] = delta[1, 0] = special
        outer = OuterProducts(delta, x)
        counts = torch.zeros(100, dtype=torch.int64)
        binning.count_1d(outer, *limits, counts)
        index = binning.bin_index(outer.materialize().reshape(-1), 100, *limits)
        np.testing.assert_array_equal(counts.numpy(), np.bincount(index.numpy(), minlength=100))


@pytest.mark.parametrize("products_path", ["fused"], indirect=True)
def test_runs_are_searched_only_where_sorting_pays(monkeypatch, products_path):
    """Sorting a sample's factor pays when enough of its products span few bins."""
    gen = torch.Generator().manual_seed(3)
    delta, x = torch.randn(8, 50, generator=gen), torch.randn(8, 400, generator=gen)
    searched = []
    kernel = binning._count_outer_1d
    monkeypatch.setattr(
        binning, "_count_outer_1d", lambda *args: searched.append(args[3]) or kernel(*args)
    )
    for limits in [(-100.0, 100.0), (-1e-3, 1e-3)]:  # products within a few bins / across all
        counts = torch.zeros(100, dtype=torch.int64)
        binning.count_1d(OuterProducts(delta * 1e-3, x), *limits, counts)
        index = binning.bin_index(
            (delta[:, :, None] * 1e-3 * x[:, None]).reshape(-1), 100, *limits
        )
        np.testing.assert_array_equal(counts.numpy(), np.bincount(index.numpy(), minlength=100))
    assert searched == [True, False]


@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("products_path", ["fused"], indirect=True)
def test_runs_are_not_searched_in_rows_with_nan_or_inf(special, products_path):
    """NaN sorts last and counts in the last bin: with negative factors the bins along such a
    sorted row are not monotone, so that sample is counted one by one."""
    gen = torch.Generator().manual_seed(4)
    delta = -0.01 - torch.rand(4, 30, generator=gen) * 0.01  # products within a few bins
    x = torch.randn(4, 20000, generator=gen)  # halves longer than 64 x the bins they span
    x[1, 7] = special
    outer = OuterProducts(delta, x)
    counts = torch.zeros(100, dtype=torch.int64)
    binning.count_1d(outer, -2.0, 2.0, counts)
    index = binning.bin_index(outer.materialize().reshape(-1), 100, -2.0, 2.0)
    np.testing.assert_array_equal(counts.numpy(), np.bincount(index.numpy(), minlength=100))


# In a fresh process: an unrelated numba function compiles (no notice), a mark goes to
# stderr, then a binning kernel and its helpers compile (or load from the cache) and count.
COMPILE_THEN_COUNT = """
import sys

import numba
import torch

from avionics.quantities import binning

numba.njit(lambda x: x + 1)(1)
sys.stderr.write("MARK\\n")
values = torch.arange(15, dtype=torch.float64).reshape(5, 3) / 7 - 1
counts = torch.zeros(8, dtype=torch.int64)
binning.count_1d(values, -1.0, 1.0, counts)
print(counts.tolist())
"""


def test_compiling_the_kernels_is_said_once_and_loading_them_from_the_cache_is_not(tmp_path):
    def run() -> subprocess.CompletedProcess:
        env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
        command = [sys.executable, "-c", COMPILE_THEN_COUNT]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)

    compiled, loaded = run(), run()
    # the bins of k / 7 - 1, k = 0..14, on [-1, 1] with 8 bins
    expected = np.bincount(np.clip((np.arange(15) / 7) * 4, 0, 7).astype(int), minlength=8)
    for result in (compiled, loaded):
        assert result.returncode == 0, result.stderr
        assert result.stdout.split("\n")[0] == str(expected.tolist())
    notice = "avionics: compiling the gradient-histogram kernels (first use, ~10-60 s); they are"
    assert compiled.stderr.count(notice) == 1, compiled.stderr
    assert compiled.stderr.index("MARK") < compiled.stderr.index(notice)
    assert loaded.stderr == "MARK\n"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spread", [0.01, 1.0])  # narrow: the sorted-runs search pays
def test_counts_split_over_threads_equal_the_torch_operations(
    monkeypatch, dtype, spread, products_path
):
    """With 3 torch threads and parts of at least 8 values, every kernel's rows are split
    over 3 threads; the counts are those of the torch operations (and of one thread)."""
    monkeypatch.setattr(binning, "PER_THREAD", 8)
    threads = torch.get_num_threads()
    delta = random_values(7 * 5, dtype, seed=11).reshape(7, 5) * spread
    x = random_values(7 * 300, dtype, seed=12).reshape(7, 300)
    outer = OuterProducts(delta, x)
    g = outer.materialize()
    offsets = binning.bin_index(torch.linspace(-3, 3, 5 * 300, dtype=dtype), 6, -2.0, 2.0) * 31
    chunks = [(outer, binning.count_1d, binning.torch_count_1d), (g, binning.count_1d,
              binning.torch_count_1d), (outer, binning.count_2d, binning.torch_count_2d),
              (g.reshape(7, -1), binning.count_2d, binning.torch_count_2d)]  # fmt: skip
    try:
        for chunk, count, torch_count in chunks:
            is_1d = count is binning.count_1d
            args = () if is_1d else (offsets, 31)
            size = 31 if is_1d else 31 * 6
            counted = []
            for n_threads, kernel in ((3, count), (1, count), (3, torch_count)):
                torch.set_num_threads(n_threads)
                counts = torch.zeros(size, dtype=torch.int64)
                kernel(chunk, *args, -1.0, 1.0, counts)
                counted.append(counts)
            assert binning._pools[os.getpid()][0] == 2  # the pool's workers: it did split
            assert counted[0].sum() == g.numel()
            for other in counted[1:]:
                np.testing.assert_array_equal(counted[0].numpy(), other.numpy())
    finally:
        torch.set_num_threads(threads)


COCKPIT_THEN_STEP = """
import torch
from avionics import Cockpit
from avionics.quantities import GradHist1d, GradHist2d, binning

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
cockpit = Cockpit(model, [GradHist1d(), GradHist2d()])
loaded = [list(kernel.signatures) for kernel in binning.KERNELS]
X, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
losses = torch.nn.functional.cross_entropy(model(X), y, reduction="none")
with cockpit(0, {"loss": losses.mean(), "individual_losses": losses, "batch_size": 8}):
    losses.mean().backward()
counts = cockpit.get_output()[0]["GradHist1d"]["hist"]
print(all(loaded), [list(kernel.signatures) for kernel in binning.KERNELS] == loaded,
      sum(counts) == 8 * sum(p.numel() for p in model.parameters()))
"""


def test_a_cockpit_with_a_histogram_loads_the_kernels_its_first_step_uses():
    """Built in a fresh process, the Cockpit has loaded a signature of every kernel, and its
    first tracked step (Linear layers' outer products, biases materialised; 1d and 2d) adds
    none: it dispatches to what construction loaded."""
    command = [sys.executable, "-c", COCKPIT_THEN_STEP]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "True"], result.stdout


@pytest.mark.parametrize("bins", [100, binning.PAIR_BINS + 1])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_tally_of_many_chunks_counts_as_all_their_values_at_once(
    monkeypatch, bins, threads, products_path
):
    """One Tally1d over a step's chunks (dense tensors, outer products, empty ones, NaN and
    inf, split over threads or not) counts what numpy counts of all their values."""
    monkeypatch.setattr(binning, "PER_THREAD", 8)
    previous = torch.get_num_threads()
    delta, x = (
        random_values(6 * 4, torch.float32, seed=21).reshape(6, 4),
        random_values(6 * 90, torch.float32, seed=22).reshape(6, 90),
    )
    dense = random_values(6 * 50, torch.float32, seed=23).reshape(6, 5, 10) * 3
    dense[2, 1, 3], dense[4, 0, 0], dense[5, 4, 9] = float("nan"), float("inf"), -float("inf")
    chunks = [dense, OuterProducts(delta, x), torch.zeros(6, 0), OuterProducts(delta * 1e-3, x)]
    try:
        torch.set_num_threads(threads)
        tally = binning.Tally1d(bins, -2.0, 2.0)
        for chunk in chunks:
            tally.add(chunk)
        counts = tally.counts()
    finally:
        torch.set_num_threads(previous)
    values = [c.materialize() if isinstance(c, OuterProducts) else c for c in chunks]
    index = binning.bin_index(torch.cat([v.reshape(-1) for v in values]), bins, -2.0, 2.0)
    expected = np.bincount(index.numpy(), minlength=bins)
    assert counts.dtype == torch.int64 and counts.sum() == index.numel()
    np.testing.assert_array_equal(counts.numpy(), expected)
