"""Counting per-sample gradient elements into equal-width bins in one pass (CPU kernels, numba).

A value x falls into bin

    b(x) = floor((x - lo) * bins / (hi - lo)),  clamped to [0, bins - 1],

computed in float64 whatever the values' dtype (``numpy.histogram`` also compares in float64;
only a value within rounding of an inner edge can land in the neighbouring bin). Values below
``lo`` count in the first bin, values above ``hi`` and NaN in the last, so the counts always
add up to the number of values. ``GradHist2d``'s joint bin adds a per-column offset:
b(x) + offsets[column].

The values come as a tensor [rows, ...] or, for a Linear layer's weight without shared axes,
as the factors of g_n = delta_n x_n^T (:class:`avionics.persample.OuterProducts`): the kernels
then form each product delta_{n,o} x_{n,i} (one rounding in the values' dtype, exactly as
materialising it would) and bin it at once, so the N x O x I gradients are never written.
In 1d they need not even be formed one by one: with a sample's longer factor sorted, the bin
of a product is monotone along it, so the products with one element of the other factor fall
into a few runs of equal bins whose ends a search finds (a handful of products each).
A batch of values that spans at most three bins (most batches, when the range is wide next
to the values' spread) is counted from the sums of its bins and of their squares, which
vectorise, instead of with increments. In 1d a chunk of fewer than :data:`DENSE_PRODUCTS` (2^15)
products is formed instead ([N, O, I], the same rounding) and counted as values: there the
fused kernel's fixed costs (the sort, the search's estimate, a tally per row) make it 2-4x
slower than forming them (BENCHMARKS.md, "tally-crossover").

Why kernels: a histogram of N * D elements costs one read of each at best. ``torch.histc`` and
``torch.bincount`` take 3-8 ns per element on a CPU core, several times the cost of writing
the element once; these loops take about 0.5 ns (1d) and 1 ns (2d). The increments are the
bottleneck (a run of equal bins serialises on one counter), so counts go to several private
counters, and in 1d with ``bins <= PAIR_BINS`` two values are counted with one increment of
their joint bin b(x_1) * bins + b(x_2), marginalised at the end.

A step's chunks (one per parameter) are counted into one :class:`Tally1d`: the private
counters are zeroed and added into the counts once a step, not once a chunk (with 100 bins,
3 x 100^2 counters: about 25 us a chunk, which was most of the counting on the real models'
small layers).

With several torch threads (``torch.get_num_threads()``), a large chunk's rows are split into
one part per thread, counted in parallel into private counts (the kernels release the GIL)
and added up: the same integers.

Tensors on any other device (a GPU) are counted where they are, by torch operations that give
the same counts (:func:`torch_count_1d`, :func:`torch_count_2d`: the bins of
:func:`bin_index`, in float64, added by ``scatter_add_``, which needs no host synchronisation;
a Linear layer's products formed a part at a time): no copy to the host and no compilation.
On the CPU they are 5-60x slower than these kernels (BENCHMARKS.md, "Histogram kernels"),
so CPU tensors keep the kernels.

The kernels are compiled on first use and cached on disk where numba finds a writable folder
(``NUMBA_CACHE_DIR``, this package's ``__pycache__``, or the user-wide cache under
``~/.cache``); where it finds none (a read-only installation used by a user without a writable
home), they are compiled anew in each process (:data:`CACHE` is False). A Cockpit with a
histogram quantity loads them when it is built (:func:`load_kernels`), so that its first
tracked step costs about what a later one does. Compiling takes seconds per kernel and value
dtype (5-60 s in all), so the first compilation in a process says so once on stderr
(:data:`COMPILE_NOTICE`); loading them from
the cache takes under a second and says nothing.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch
from numba.core import event
from torch import Tensor

from avionics.persample import OuterProducts

# Values binned per pass of the index loop (its buffer stays in L1).
_BATCH = 1024
# Largest bin count for which the 1d kernels count pairs of values (3 * bins^2 counters).
PAIR_BINS = 128
# A batch of values spanning fewer bins than this is counted from its moments (see _tally).
FEW_BINS = 3
# Products of one factor with a sorted row are counted one by one when they span more than
# row length / _SEARCH_COST bins (a run's search costs about that many one-by-one bins).
_SEARCH_COST = 64
# Sorting a row costs about as much as counting its products with this many factors one by
# one (numpy's sort: about 4 ns per element; the one-by-one kernel: about 1 ns per product).
_SORT_ROWS = 4
# A Linear layer's products are formed (a tensor [N, O, I]) and counted as values when there
# are fewer than this many: below it the fused kernel's per-row work and Python (the sort, the
# search's estimate) cost more than forming them; 1 thread, benchmarks/tally_crossover.py.
DENSE_PRODUCTS = 2**15


def _cache_probe():
    """Never called: decorated once to learn whether numba can cache this file's kernels."""


def _numba_can_cache() -> bool:
    """Whether numba finds a writable cache folder for this file. ``njit(cache=True)`` looks
    for one when it decorates and raises ``RuntimeError`` ("cannot cache function ...: no
    locator available") when every candidate is missing or read-only; the answer is the same
    for every function of one source file, so one probe decides for all kernels."""
    try:
        numba.njit(cache=True)(_cache_probe)
    except RuntimeError:
        return False
    return True


CACHE = _numba_can_cache()
_jit = numba.njit(cache=CACHE, nogil=True, boundscheck=False)

COMPILE_NOTICE = "avionics: compiling the gradient-histogram kernels (first use, ~10-60 s)" + (
    "; they are cached on disk for later runs."
    if CACHE
    else "; no writable cache folder, so every process compiles them: set NUMBA_CACHE_DIR to "
    "a writable folder to keep them."
)


class _CompileNotice(event.Listener):
    """Prints :data:`COMPILE_NOTICE` to stderr when numba starts compiling a kernel of this
    module for the first time in the process. numba's "numba:compile" event starts only on
    a real compilation, after the on-disk cache missed."""

    def __init__(self):
        self.said = False

    def on_start(self, compile_event: event.Event) -> None:
        dispatcher = (compile_event.data or {}).get("dispatcher")
        if self.said or getattr(dispatcher, "py_func", None) is None:
            return
        if dispatcher.py_func.__module__ == __name__:
            self.said = True
            print(COMPILE_NOTICE, file=sys.stderr, flush=True)

    def on_end(self, compile_event: event.Event) -> None:
        pass


event.register("numba:compile", _CompileNotice())


@_jit
def _bin(b, top):
    """The clamped bin of a scaled value b = (x - lo) * scale. Selects rather than branches,
    so that the loops around it vectorise; the comparisons are False for NaN (last bin)."""
    b = b if b < top else top
    return np.int32(b if b > 0.0 else 0.0)


@_jit
def _bin_values(values, start, stop, lo, scale, top, out):
    for e in range(stop - start):
        out[e] = _bin((np.float64(values[start + e]) - lo) * scale, top)


@_jit
def _bin_products(a, values, start, stop, lo, scale, top, out):
    """Bins of the products a * values[e] (rounded in the values' dtype)."""
    for e in range(stop - start):
        out[e] = _bin((np.float64(a * values[start + e]) - lo) * scale, top)


def _counters(bins: int) -> np.ndarray:
    """The private counters the 1d kernels increment (:func:`_tally`), zeroed; added into
    the counts once, by :func:`_collect`."""
    if bins <= PAIR_BINS:
        return np.zeros((3, bins * bins), np.int64)  # two of pairs, one of single values
    return np.zeros((8, bins), np.int64)


@_jit
def _tally(index, m, counters, bins):
    """Count the bins index[:m] into the private counters."""
    if m == 0:
        return
    # one vectorised pass: extent and the first two moments of the bins
    first, last, s1, s2 = index[0], index[0], 0, 0
    for e in range(m):
        b = np.int64(index[e])
        first = min(first, index[e])
        last = max(last, index[e])
        s1 += b
        s2 += b * b
    if last - first < FEW_BINS:
        # bins first + {0, 1, 2} with counts c0, c1, c2: d = b - first has
        # sum d = c1 + 2 c2 and sum d^2 = c1 + 4 c2 (exact integers)
        f = np.int64(first)
        d1 = s1 - m * f
        d2 = s2 - 2 * f * s1 + m * f * f
        c2 = (d2 - d1) // 2
        c1 = d1 - 2 * c2
        for k, count in ((0, m - c1 - c2), (1, c1), (2, c2)):
            if count:
                _tally_bulk(counters, bins, first + k, count)
    elif bins <= PAIR_BINS:
        even = m - m % 4
        for e in range(0, even, 4):
            counters[0, index[e] * bins + index[e + 1]] += 1
            counters[1, index[e + 2] * bins + index[e + 3]] += 1
        for e in range(even, m):
            counters[2, index[e]] += 1
    else:
        even = m - m % 8
        for e in range(0, even, 8):
            for j in range(8):
                counters[j, index[e + j]] += 1
        for e in range(even, m):
            counters[0, index[e]] += 1


@_jit
def _collect(counters, bins, counts):
    if bins <= PAIR_BINS:
        for j in range(2):
            for a in range(bins):
                for c in range(bins):
                    k = counters[j, a * bins + c]
                    counts[a] += k
                    counts[c] += k
        for a in range(bins):
            counts[a] += counters[2, a]
    else:
        for j in range(8):
            for a in range(bins):
                counts[a] += counters[j, a]


@_jit
def _count_1d(values, lo, scale, bins, counters):
    """Tally the bins of ``values`` into ``counters`` (collected later: :func:`_collect`)."""
    top = np.float64(bins - 1)
    index = np.empty(_BATCH, np.int32)
    for start in range(0, values.size, _BATCH):
        stop = min(values.size, start + _BATCH)
        _bin_values(values, start, stop, lo, scale, top, index)
        _tally(index, stop - start, counters, bins)


@_jit
def _tally_bulk(counters, bins, b, count):
    """Count ``count`` values of bin b."""
    counters[2 if bins <= PAIR_BINS else 0, b] += count


@_jit
def _product_bin(a, row, k, lo, scale, top):
    return _bin((np.float64(a * row[k]) - lo) * scale, top)


@_jit
def _count_products(a, row, lo, scale, top, index, counters, bins):
    """Count the bins of a * row[k] for every k, one by one."""
    for start in range(0, row.size, _BATCH):
        stop = min(row.size, start + _BATCH)
        _bin_products(a, row, start, stop, lo, scale, top, index)
        _tally(index, stop - start, counters, bins)


@_jit
def _count_sorted_products(a, row, start, stop, lo, scale, top, counts):
    """Count the bins of a * row[k], start <= k < stop, for a finite a and a finite ``row``
    sorted ascending by searching where the bin changes; False (nothing counted) if the
    products span too many bins for that to pay.

    b(a * row[k]) is monotone in k (rising for a > 0, falling for a < 0): rounding the product
    and every step of b are monotone. So the bins form runs, and a run's end is found by
    galloping then bisecting, about 2 log2(run length) evaluations per run."""
    if start == stop:
        return True
    last = stop - 1
    b, b_last = (
        _product_bin(a, row, start, lo, scale, top),
        _product_bin(a, row, last, lo, scale, top),
    )
    if abs(b_last - b) * _SEARCH_COST > stop - start:
        return False
    step = 1 if b_last >= b else -1
    k = start
    while b != b_last:
        gap = 1  # the run ends in (k + gap / 2, k + gap]
        while k + gap < last and (_product_bin(a, row, k + gap, lo, scale, top) - b) * step <= 0:
            gap *= 2
        left, right = k + gap // 2 + 1, min(k + gap, last)
        while left < right:
            mid = (left + right) >> 1
            if (_product_bin(a, row, mid, lo, scale, top) - b) * step > 0:
                right = mid
            else:
                left = mid + 1
        counts[b] += left - k
        k, b = left, _product_bin(a, row, left, lo, scale, top)
    counts[b] += stop - k
    return True


@_jit
def _count_outer_1d(rows, factors, sorted_rows, search, lo, scale, bins, counters, counts):
    """Bins of rows[n, k] * factors[n, j], tallied into ``counters`` (collected later) or,
    for the runs found by search, added to ``counts``. With ``search``, ``sorted_rows``
    holds the rows sorted ascending, and the products with one factor are counted run by run
    (:func:`_count_sorted_products`) on the row's negative, zero and positive parts (0 is
    often an edge: one run each then); otherwise, and where the products are not finite or
    span many bins, one by one (from the rows in their own order: runs of equal bins would
    serialise the increments)."""
    top = np.float64(bins - 1)
    index = np.empty(_BATCH, np.int32)
    for n in range(rows.shape[0]):
        if not search:
            for a in factors[n]:
                _count_products(a, rows[n], lo, scale, top, index, counters, bins)
            continue
        row = sorted_rows[n]
        if row.size == 0:
            continue
        finite = np.isfinite(row[0]) and np.isfinite(row[-1])  # NaN sorts last
        parts = (
            0,
            np.searchsorted(row, 0.0, "left"),
            np.searchsorted(row, 0.0, "right"),
            row.size,
        )
        for a in factors[n]:
            wide = not (finite and np.isfinite(a))
            if not wide:  # the products' span over the whole row decides first
                first = _product_bin(a, row, 0, lo, scale, top)
                last = _product_bin(a, row, row.size - 1, lo, scale, top)
                wide = abs(last - first) * _SEARCH_COST > row.size
            if wide:
                _count_products(a, rows[n], lo, scale, top, index, counters, bins)
                continue
            for p in range(3):
                start, stop = parts[p], parts[p + 1]
                if not _count_sorted_products(a, row, start, stop, lo, scale, top, counts):
                    _count_products(a, row[start:stop], lo, scale, top, index, counters, bins)


@_jit
def _tally_joint(index, m, offsets, counters):
    even = m - m % 4
    for e in range(0, even, 4):
        for j in range(4):
            counters[j, index[e + j] + offsets[e + j]] += 1
    for e in range(even, m):
        counters[0, index[e] + offsets[e]] += 1


@_jit
def _count_2d(values, offsets, lo, scale, bins, counts):
    top = np.float64(bins - 1)
    index = np.empty(_BATCH, np.int32)
    counters = np.zeros((4, counts.size), np.int64)
    columns = offsets.size
    for r in range(values.shape[0]):
        for start in range(0, columns, _BATCH):
            stop = min(columns, start + _BATCH)
            _bin_values(values[r], start, stop, lo, scale, top, index)
            _tally_joint(index, stop - start, offsets[start:stop], counters)
    for j in range(4):
        counts += counters[j]


@_jit
def _count_outer_2d(delta, x, offsets, lo, scale, bins, counts):
    top = np.float64(bins - 1)
    index = np.empty(_BATCH, np.int32)
    counters = np.zeros((4, counts.size), np.int64)
    width = x.shape[1]
    for n in range(delta.shape[0]):
        row = x[n]
        for o in range(delta.shape[1]):
            for start in range(0, width, _BATCH):
                stop = min(width, start + _BATCH)
                _bin_products(delta[n, o], row, start, stop, lo, scale, top, index)
                columns = offsets[o * width + start : o * width + stop]
                _tally_joint(index, stop - start, columns, counters)
    for j in range(4):
        counts += counters[j]


def _as_numpy(values: Tensor) -> np.ndarray:
    if values.dtype not in (torch.float32, torch.float64):
        values = values.float()
    return values.detach().contiguous().numpy()


def _factors(chunk: OuterProducts) -> tuple[np.ndarray, np.ndarray]:
    delta, x = _same_dtype(chunk)
    return _as_numpy(delta), _as_numpy(x)


def _search_pays(rows: np.ndarray, factors: np.ndarray, scale: float) -> bool:
    """Whether sorting the rows pays: at least _SORT_ROWS products per sample (a factor times
    a row) span few enough bins for the search, by the estimate |a| (max - min of the row)."""
    if rows.shape[1] == 0:
        return False
    with np.errstate(invalid="ignore"):  # inf - inf, 0 * inf: NaN, not narrow
        spread = (rows.max(1) - rows.min(1)).astype(np.float64) * (scale * _SEARCH_COST)
        narrow = np.abs(factors) * spread[:, None] <= rows.shape[1]
    return int(narrow.sum()) >= _SORT_ROWS * rows.shape[0]


class Tally1d:
    """Counts of values into ``bins`` equal-width bins on [lo, hi], added up over any number
    of chunks (:meth:`add`) and read once (:meth:`counts`): a histogram's step visits one
    chunk per parameter, and the kernels' private counters (:func:`_counters`, 3 bins^2
    integers for ``bins <= PAIR_BINS``) are zeroed and collected once per tally, not once per
    chunk. CPU chunks go to the numba kernels, one set of counters per thread that counted a
    part; chunks on any other device to :func:`torch_count_1d`, counted where they are."""

    def __init__(self, bins: int, lo: float, hi: float):
        self.bins, self.lo, self.hi = bins, float(lo), float(hi)
        self.scale = bins / (self.hi - self.lo)
        self._parts: list[tuple[np.ndarray, np.ndarray]] = []  # per thread: counters, counts
        self._device_counts: Tensor | None = None  # of the chunks off the CPU

    def _part(self, thread: int) -> tuple[np.ndarray, np.ndarray]:
        while len(self._parts) <= thread:
            self._parts.append((_counters(self.bins), np.zeros(self.bins, np.int64)))
        return self._parts[thread]

    def add(self, chunk: Tensor | OuterProducts) -> None:
        """Count every element of ``chunk`` (a tensor, or a Linear layer's factors)."""
        if chunk.device.type != "cpu":
            self.add_by_torch(chunk)
            return
        lo, scale, bins = self.lo, self.scale, self.bins
        if isinstance(chunk, OuterProducts) and chunk.delta.numel() * chunk.x.shape[1] < (
            DENSE_PRODUCTS
        ):
            chunk = _products(*_same_dtype(chunk))
        if isinstance(chunk, OuterProducts):
            # the longer factor is sorted (numpy's vectorised sort), the other one iterated
            delta, x = _factors(chunk)
            rows, factors = (x, delta) if x.shape[1] >= delta.shape[1] else (delta, x)
            search = _search_pays(rows, factors, scale)

            def count(part: slice, into: tuple[np.ndarray, np.ndarray]) -> None:
                sorted_rows = np.sort(rows[part], axis=1) if search else rows[part]
                _count_outer_1d(
                    rows[part], factors[part], sorted_rows, search, lo, scale, bins, *into
                )

            threads = _threads(len(rows), rows.size * factors.shape[1])
            _in_threads(count, len(rows), [self._part(t) for t in range(threads)])
        else:
            values = _as_numpy(chunk).reshape(-1)

            def count(part: slice, into: tuple[np.ndarray, np.ndarray]) -> None:
                _count_1d(values[part], lo, scale, bins, into[0])

            threads = _threads(values.size, values.size)
            _in_threads(count, values.size, [self._part(t) for t in range(threads)])

    def add_by_torch(self, chunk: Tensor | OuterProducts) -> None:
        """:meth:`add` by torch operations on the chunk's device (:func:`torch_count_1d`):
        the path of every chunk off the CPU."""
        if self._device_counts is None:
            self._device_counts = torch.zeros(self.bins, dtype=torch.int64, device=chunk.device)
        torch_count_1d(chunk, self.lo, self.hi, self._device_counts)

    def counts(self, device: torch.device | str = "cpu") -> Tensor:
        """The counts of everything added (int64 [bins]) on ``device`` (that of the chunks
        off the CPU, where there were any)."""
        counts = self._device_counts
        if self._parts or counts is None:  # (no host tensor where every chunk was off it)
            total = np.zeros(self.bins, np.int64)
            for counters, part_counts in self._parts:
                _collect(counters, self.bins, part_counts)
                total += part_counts
            host = torch.from_numpy(total)
            counts = host.to(device) if counts is None else counts + host.to(counts.device)
        self._parts, self._device_counts = [], None  # (a tally is read once)
        return counts


def count_1d(chunk: Tensor | OuterProducts, lo: float, hi: float, counts: Tensor) -> None:
    """Add the bin counts of all per-sample gradient elements in ``chunk`` to ``counts``
    (int64 [bins], on the chunk's device): a :class:`Tally1d` of one chunk (to count several,
    add them to one tally)."""
    tally = Tally1d(counts.numel(), lo, hi)
    tally.add(chunk)
    counts += tally.counts(counts.device)


def count_2d(
    chunk: Tensor | OuterProducts,
    offsets: Tensor,
    bins: int,
    lo: float,
    hi: float,
    counts: Tensor,
) -> None:
    """Add to ``counts`` (int64, flat) the joint bins b(g_{n,d}) + offsets[d] of the
    per-sample gradient elements in ``chunk`` (D = offsets.numel() per sample), g binned into
    ``bins`` bins on [lo, hi]. Give int32 offsets: the kernel reads them once per sample."""
    scale = bins / (hi - lo)
    if chunk.device.type != "cpu":
        torch_count_2d(chunk, offsets, bins, lo, hi, counts)
        return
    offsets_np = offsets.to(torch.int32).contiguous().numpy()  # no copy when int32 already
    counts_np = counts.numpy()
    if isinstance(chunk, OuterProducts):
        delta, x = _factors(chunk)

        def count(part: slice, out: np.ndarray) -> None:
            _count_outer_2d(delta[part], x[part], offsets_np, lo, scale, bins, out)

        rows, threads = len(delta), _threads(len(delta), delta.size * x.shape[1])
    else:
        values = _as_numpy(chunk).reshape(-1, offsets.numel())

        def count(part: slice, out: np.ndarray) -> None:
            _count_2d(values[part], offsets_np, lo, scale, bins, out)

        rows, threads = len(values), _threads(len(values), values.size)
    outs = [counts_np] + [np.zeros_like(counts_np) for _ in range(threads - 1)]
    _in_threads(count, rows, outs)
    for out in outs[1:]:
        counts_np += out


# Values a thread counts at least: below that, handing a part to another thread (tens of
# microseconds) costs more than counting it saves (about 1 ns a value).
PER_THREAD = 2**18
# process id -> (workers, the pool): a forked child needs its own
_pools: dict[int, tuple[int, ThreadPoolExecutor]] = {}


def _threads(rows: int, values: int) -> int:
    """How many threads count a chunk of ``values`` in ``rows`` rows: one per torch thread
    (``torch.get_num_threads()``), at least :data:`PER_THREAD` values and a row each."""
    return max(1, min(torch.get_num_threads(), rows, values // PER_THREAD))


def _in_threads(count, rows: int, outs: list) -> None:
    """count(rows a:b, outs[t]) over ``len(outs)`` consecutive parts of the rows, part t in
    thread t (the kernels release the GIL; the calling thread counts the first part), each
    into its own private counts, which the caller adds up: the same integers in any order."""
    threads = len(outs)
    if threads == 1:
        count(slice(0, rows), outs[0])
        return
    bounds = [rows * t // threads for t in range(threads + 1)]
    parts = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    workers, pool = _pools.get(os.getpid(), (0, None))
    if workers < threads - 1:
        if pool is not None:
            pool.shutdown(wait=False)
        pool = ThreadPoolExecutor(threads - 1, "avionics-histograms")
        _pools[os.getpid()] = threads - 1, pool
    futures = [pool.submit(count, part, out) for part, out in zip(parts[1:], outs[1:])]
    count(parts[0], outs[0])
    for future in futures:
        future.result()


KERNELS = (_count_1d, _count_outer_1d, _count_2d, _count_outer_2d)


def load_kernels(dtypes, dims=(1, 2)) -> None:
    """Load the kernels that count CPU values of each dtype in ``dtypes`` (float32 or
    float64) into histograms of each dimension in ``dims`` (1: :func:`count_1d`, 2:
    :func:`count_2d`), from numba's cache or by compiling them (:data:`COMPILE_NOTICE`), by
    counting a few values of that dtype with each: the signatures those functions dispatch
    to. Once per process, dtype and dimension; later calls cost a set look-up. Loading from
    the cache takes 0.5-5 s (most of it numba's first dispatch importing its type
    registries), compiling 5-60 s."""
    for dtype in dtypes:
        for dim in set(dims) - {d for t, d in _LOADED if t == dtype}:
            values = torch.linspace(-1.0, 1.0, 8, dtype=dtype).reshape(2, 4)
            for chunk, width in ((values, 4), (OuterProducts(values[:, :2], values), 8)):
                if dim == 1:
                    if isinstance(chunk, OuterProducts):  # enough products for the fused kernel
                        chunk = OuterProducts(values[:1, :1], values.new_zeros(1, DENSE_PRODUCTS))
                    count_1d(chunk, -1.0, 1.0, torch.zeros(2, dtype=torch.int64))
                else:
                    offsets = torch.arange(width, dtype=torch.int32) * 2
                    counts = torch.zeros(2 * width, dtype=torch.int64)
                    count_2d(chunk, offsets, 2, -1.0, 1.0, counts)
            _LOADED.add((dtype, dim))


_LOADED: set[tuple[torch.dtype, int]] = set()  # (dtype, dimension)


def bin_index(values: Tensor, bins: int, lo: float, hi: float) -> Tensor:
    """The bin b(x) of each value (int64, same shape and device), as the kernels count it."""
    b = torch.add(values.detach().double(), -lo).mul_(bins / (hi - lo))
    return b.nan_to_num_(nan=bins - 1).clamp_(0, bins - 1).to(torch.int64)


# Values binned per torch operation (their float64 bins and int64 indices: 16 bytes each,
# 16 MiB a part).
TORCH_PART = 2**20


def torch_count_1d(chunk: Tensor | OuterProducts, lo: float, hi: float, counts: Tensor) -> None:
    """:func:`count_1d` in torch operations on the chunk's device, the same counts (NaN in
    the last bin): the bins of :func:`bin_index`, added with ``scatter_add_`` (no host
    synchronisation, unlike ``bincount``, whose output size is read on the host), a part of
    at most :data:`TORCH_PART` values at a time; a Linear layer's products delta_{n,o}
    x_{n,i} are formed a part at a time, rounded in the factors' dtype as the kernels round
    them."""
    bins = counts.numel()
    for part, _ in _parts(chunk, 1):
        index = bin_index(part, bins, lo, hi).reshape(-1)
        counts.scatter_add_(0, index, torch.ones_like(index))


def torch_count_2d(
    chunk: Tensor | OuterProducts, offsets: Tensor, bins: int, lo: float, hi: float, counts
) -> None:
    """:func:`count_2d` in torch operations on the chunk's device, the same counts (as
    :func:`torch_count_1d`, each element's bin plus the offset of its column)."""
    offsets = offsets.reshape(-1)
    for part, pairs in _parts(chunk, offsets.numel()):
        if pairs is None:  # part [rows, D]: the offsets of every row
            columns = offsets
        else:  # the products of pairs (n, o): the offsets of weight row o
            o = chunk.delta.shape[1]
            columns = offsets.view(o, -1)[pairs % o]
        index = bin_index(part, bins, lo, hi).add_(columns).reshape(-1)
        counts.scatter_add_(0, index, torch.ones_like(index))


def _parts(chunk: Tensor | OuterProducts, width: int):
    """(values, pairs) of consecutive parts of the chunk's values, of about
    :data:`TORCH_PART` each: a tensor [rows, ``width``] and None, or for outer products the
    products [pairs, I] of the pairs (n, o) of their rows, rounded in the factors' dtype, and
    those pairs' indices n * O + o."""
    if isinstance(chunk, OuterProducts):
        delta, x = _same_dtype(chunk)
        o, i = delta.shape[1], x.shape[1]
        flat = delta.reshape(-1)
        per = max(1, TORCH_PART // max(1, i))
        for start in range(0, flat.numel(), per):
            pairs = torch.arange(start, min(flat.numel(), start + per), device=x.device)
            yield flat[pairs, None] * x[pairs // o], pairs
        return
    values = chunk.reshape(-1, width)
    per = max(1, TORCH_PART // max(1, width))
    for start in range(0, len(values), per):
        yield values[start : start + per], None


def _products(delta: Tensor, x: Tensor) -> Tensor:
    """The products delta_{n,o} x_{n,i} [N, O, I] of factors delta [N, O] and x [N, I] (of
    one dtype: :func:`_same_dtype`), rounded in that dtype as the fused kernels round them."""
    return delta[:, :, None] * x[:, None, :]


def _same_dtype(chunk: OuterProducts) -> tuple[Tensor, Tensor]:
    """The factors in their common dtype, float32 at least (their products are rounded to
    it, by the kernels and by the torch operations alike)."""
    dtype = torch.promote_types(chunk.delta.dtype, chunk.x.dtype)
    dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    return chunk.delta.to(dtype), chunk.x.to(dtype)
