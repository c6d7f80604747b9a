"""Progress bars of the long curvature algorithms: on stderr once a call runs long (tqdm's
``delay``), at once with ``progress=True``, never with ``False`` or on a short default call;
they count the operator-vector products and change no result."""

import pytest
import torch

from avionics.curvature import algorithms
from avionics.curvature.algorithms import _progress

D = 40


class CountingOperator:
    """A dense symmetric matrix that counts the vectors it is multiplied with."""

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        B = torch.randn(D, D, generator=gen, dtype=torch.float64)
        self.matrix = B @ B.T / D + torch.diag(torch.linspace(0.1, 3.0, D, dtype=torch.float64))
        self.shape, self.dtype = self.matrix.shape, self.matrix.dtype
        self.products = 0

    def __matmul__(self, X):
        self.products += 1 if X.ndim == 1 else X.shape[1]
        return self.matrix @ X

    def adjoint(self):
        return self  # symmetric


# (name, call); each call returns a tensor, or a result whose ``values`` or ``density`` is one
CALLS = {
    "top_eigenpairs": lambda A, **kw: algorithms.top_eigenpairs(A, 2, **kw).values,
    "bottom_eigenpairs": lambda A, **kw: algorithms.bottom_eigenpairs(A, 1, **kw).values,
    "spectral_density": lambda A, **kw: (
        algorithms.spectral_density(A, 3, 10, num_points=64, **kw).density
    ),
    "hutchinson_trace": lambda A, **kw: algorithms.hutchinson_trace(A, 12, chunk_size=5, **kw),
    "hutchpp_trace": lambda A, **kw: algorithms.hutchpp_trace(A, 12, **kw),
    "xtrace": lambda A, **kw: algorithms.xtrace(A, 12, **kw),
    "hutchinson_diagonal": lambda A, **kw: algorithms.hutchinson_diagonal(A, 12, **kw),
    "xdiag": lambda A, **kw: algorithms.xdiag(A, 12, **kw),
}


class RecordedBar(_progress.tqdm):
    """tqdm that records (desc, n, total) when the ``with`` block of a shown bar ends."""

    closed: list[tuple[str, int, int]] = []

    def __exit__(self, *exc):
        if not self.disable:
            RecordedBar.closed.append((self.desc, self.n, self.total))
        return super().__exit__(*exc)


@pytest.fixture
def recorded(monkeypatch):
    RecordedBar.closed = []
    monkeypatch.setattr(_progress, "tqdm", RecordedBar)
    return RecordedBar.closed


@pytest.mark.parametrize("name", list(CALLS))
def test_progress_true_shows_a_bar_that_counts_the_products(name, capfd, recorded):
    A = CountingOperator()
    shown = CALLS[name](A, progress=True)
    err = capfd.readouterr().err
    assert f"{name}:" in err and "product" in err, err
    ((desc, n, total),) = recorded
    assert desc == name
    assert n == A.products > 0
    if "eigenpairs" not in name:  # Lanczos stops at convergence, before its budget of 500
        assert n == total
    torch.testing.assert_close(shown, CALLS[name](CountingOperator(), progress=False))


@pytest.mark.parametrize("name", list(CALLS))
def test_auto_shows_the_bar_after_the_delay(name, capfd, monkeypatch):
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    CALLS[name](CountingOperator())
    assert f"{name}:" in capfd.readouterr().err


@pytest.mark.parametrize("name", list(CALLS))
def test_a_short_default_call_and_progress_false_show_nothing(name, capfd, monkeypatch):
    CALLS[name](CountingOperator())
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    CALLS[name](CountingOperator(), progress=False)
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_bad_progress_is_refused_before_any_product(name, bad):
    A = CountingOperator()
    with pytest.raises(ValueError, match=rf"progress={bad!r}\): use 'auto'"):
        CALLS[name](A, progress=bad)
    assert A.products == 0


def test_only_rank_zero_shows_the_bar(capfd, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    algorithms.hutchinson_trace(CountingOperator(), 8, progress=True)
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    algorithms.hutchinson_trace(CountingOperator(), 8, progress=True)
    assert "hutchinson_trace:" in capfd.readouterr().err
