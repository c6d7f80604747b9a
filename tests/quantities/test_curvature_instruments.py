"""HessMaxEV, HessTrace, TICDiag, TICTrace against brute force (float64) on the test models."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from avionics import Cockpit
from avionics.curvature.step import ggn_diagonal, loss_root
from avionics.persample.rules import conv
from avionics.quantities import HessMaxEV, HessTrace, Loss, TICDiag, TICTrace
from tests.models import ARCHITECTURES, per_sample_gradients

EPS = 1e-7


@pytest.fixture(autouse=True)
def math_attention():
    """PyTorch's fused attention kernels have no second derivative; curvature needs the math
    kernel on tracked steps (the instruments say so when it is missing)."""
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _mean_loss_fn(model, X, y, loss_fn):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    shapes = [p.shape for p in _params(model)]
    sizes = [s.numel() for s in shapes]

    def f(flat):
        tensors = [t.reshape(s) for t, s in zip(flat.split(sizes), shapes, strict=True)]
        return loss_fn(functional_call(model, dict(zip(names, tensors, strict=True)), (X,)), y)

    return f


def dense_hessian(model, X, y, loss_fn):
    """Hessian of the mean loss, one autograd row per parameter coordinate."""
    flat = torch.cat([p.detach().reshape(-1) for p in _params(model)]).requires_grad_(True)
    f = _mean_loss_fn(model, X, y, loss_fn)
    (g,) = torch.autograd.grad(f(flat).mean(), flat, create_graph=True)
    eye = torch.eye(len(flat), dtype=flat.dtype)
    try:
        return torch.autograd.grad(g, flat, eye, retain_graph=True, is_grads_batched=True)[0]
    except RuntimeError:  # an operation vmap cannot batch: one row at a time
        rows = [torch.autograd.grad(g[d], flat, retain_graph=True)[0] for d in range(len(flat))]
        return torch.stack(rows)


def dense_ggn(model, X, y, loss_fn, axis=0):
    """(1/N) sum_n J_n^T H_n J_n, per sample from its own forward (sample n of X on ``axis``:
    1 for time-major token ids [T, N])."""
    flat = torch.cat([p.detach().reshape(-1) for p in _params(model)]).requires_grad_(True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    shapes = [p.shape for p in _params(model)]
    sizes = [s.numel() for s in shapes]
    total = 0
    for n in range(X.shape[axis]):
        tensors = [t.reshape(s) for t, s in zip(flat.split(sizes), shapes, strict=True)]
        sample = X.narrow(axis, n, 1)
        out = functional_call(model, dict(zip(names, tensors, strict=True)), (sample,))
        o = out.reshape(-1)
        J = torch.stack(
            [torch.autograd.grad(o[i], flat, retain_graph=True)[0] for i in range(len(o))]
        )
        H = torch.autograd.functional.hessian(
            lambda z, shape=out.shape, t=y[n : n + 1]: loss_fn(z.reshape(shape), t).sum(),
            o.detach(),
        )
        total = total + J.T @ H @ J
    return total / X.shape[axis]


def _run(model, X, y, loss_fn, quantities, steps=1, lr=0.0, reduction="mean", before_update=None):
    cockpit = Cockpit(model, quantities=quantities)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    outputs = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = loss_fn(model(X), y)
        loss = losses.mean() if reduction == "mean" else losses.sum()
        info = {"loss": loss, "individual_losses": losses, "batch_size": len(X), "optimizer": opt}
        with cockpit(step, info):
            loss.backward(create_graph=cockpit.create_graph(step))
        outputs.append(cockpit.get_output()[step])
        if before_update is not None:
            before_update(step, outputs[-1])
        opt.step()
    for p in model.parameters():
        p.grad = None
    return outputs


def _expected(model, X, y, loss_fn, h):
    params = _params(model)
    sizes = [p.numel() for p in params]
    g = per_sample_gradients(model, X, y, loss_fn)
    m2 = torch.cat([t.pow(2).mean(0).reshape(-1) for t in g])
    traces = [d.sum() for d in h.split(sizes)]
    return traces, (m2 / (h + EPS)).sum(), m2.sum() / (h.sum() + EPS)


def _assert_traces(out, traces):
    torch.testing.assert_close(
        torch.tensor(out["HessTrace"], dtype=torch.float64),
        torch.stack(traces),
        rtol=1e-7,
        atol=1e-10,
    )


def _check_against(out, model, X, y, loss_fn, h):
    """HessTrace and TICDiag of ``out`` against brute force; returns the expected values."""
    traces, tic_diag, tic_trace = _expected(model, X, y, loss_fn, h)
    _assert_traces(out, traces)
    assert out["TICDiag"] == pytest.approx(float(tic_diag), rel=1e-6)
    return traces, tic_diag, tic_trace


@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_exact"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_curvature_diagonals_match_brute_force(arch, curvature):
    model, X, y, loss_fn = ARCHITECTURES[arch]()
    qs = [
        HessTrace(curvature=curvature),
        TICDiag(curvature=curvature),
        TICTrace(curvature=curvature),
    ]
    (out,) = _run(model, X, y, loss_fn, qs)
    dense = dense_hessian if curvature == "diag_h" else dense_ggn
    h = torch.diagonal(dense(model, X, y, loss_fn))
    *_, tic_trace = _check_against(out, model, X, y, loss_fn, h)
    assert out["TICTrace"] == pytest.approx(float(tic_trace), rel=1e-7)


@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_exact"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_traces_alone_match_brute_force(arch, curvature, monkeypatch):
    """Without TICDiag, HessTrace and TICTrace need only the sums of h per parameter, which
    the GGN path forms from per-sample squared norms (ggn_diagonal(traces=True))."""
    model, X, y, loss_fn = ARCHITECTURES[arch]()
    kinds = []
    diagonal = ggn_diagonal.ggn_diagonal

    def spy(*args, **kwargs):
        kinds.append(kwargs.get("traces", False))
        return diagonal(*args, **kwargs)

    monkeypatch.setattr("avionics.quantities.curvature.ggn_diagonal", spy)
    qs = [HessTrace(curvature=curvature), TICTrace(curvature=curvature)]
    (out,) = _run(model, X, y, loss_fn, qs)
    assert all(kinds) and len(kinds) <= 1  # once per step, traces only (none: probes)
    dense = dense_hessian if curvature == "diag_h" else dense_ggn
    h = torch.diagonal(dense(model, X, y, loss_fn))
    traces, _, tic_trace = _expected(model, X, y, loss_fn, h)
    _assert_traces(out, traces)
    assert out["TICTrace"] == pytest.approx(float(tic_trace), rel=1e-7)


def relu_mlp(n=6, seed=1):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    X, y = torch.randn(n, 5), torch.randint(0, 3, (n,))
    return (
        model.double(),
        X.double(),
        y,
        lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"),
    )


def relu_cnn_mse(n=4, seed=2):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 2)
    )
    X, y = torch.randn(n, 1, 6, 6), torch.randn(n, 2)
    return model.double(), X.double(), y.double(), lambda o, t: (o - t).pow(2).sum(1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("build", [relu_mlp, relu_cnn_mse])
def test_piecewise_linear_hessian_diagonal_fast_path(build, reduction):
    """Piecewise-linear nets take the GGN route for diag_h; it must equal the Hessian diagonal
    (also for a sum-reduced loss: h is of the mean loss)."""
    model, X, y, loss_fn = build()
    (out,) = _run(model, X, y, loss_fn, [HessTrace(), TICDiag()], reduction=reduction)
    h = torch.diagonal(dense_hessian(model, X, y, loss_fn))
    _check_against(out, model, X, y, loss_fn, h)


def _ggn_exact():
    return [HessTrace(curvature="diag_ggn_exact"), TICDiag(curvature="diag_ggn_exact")]


def token_model(n=4, seed=3):
    """Per-token logits of a sequence ([N, T, V]); a sequence's loss is its mean token CE."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(7, 4), nn.Tanh(), nn.Linear(4, 5))
    X, y = torch.randint(0, 7, (n, 6)), torch.randint(0, 5, (n, 6))

    def loss_fn(o, t):
        return nn.functional.cross_entropy(o.transpose(1, 2), t, reduction="none").mean(1)

    return model.double(), X, y, loss_fn


@pytest.mark.parametrize("build", ["mlp", token_model, relu_cnn_mse])
def test_ggn_uses_closed_form_loss_hessian_roots(build, monkeypatch):
    """Softmax cross-entropy (per sample, and per token of a sequence) and squared error are
    recognised: no dense loss Hessian is formed, and the diagonal is the same."""
    model, X, y, loss_fn = ARCHITECTURES[build]() if isinstance(build, str) else build()

    def dense(*args):
        raise AssertionError("the dense loss-Hessian root was used")

    monkeypatch.setattr(loss_root, "_dense_root", dense)
    (out,) = _run(model, X, y, loss_fn, _ggn_exact())
    _check_against(out, model, X, y, loss_fn, torch.diagonal(dense_ggn(model, X, y, loss_fn)))


def test_ggn_of_an_unrecognised_loss_uses_the_dense_root(monkeypatch):
    model, X, _, _ = relu_mlp()
    targets = torch.randn(len(X), 3, dtype=torch.float64)

    def loss_fn(o, t):  # log-cosh: a diagonal loss Hessian sech^2(o - t), not a scaled identity
        return torch.log(torch.cosh(o - t)).sum(1)

    used = []
    dense = loss_root._dense_root
    monkeypatch.setattr(loss_root, "_dense_root", lambda *a: used.append(1) or dense(*a))
    (out,) = _run(model, X, targets, loss_fn, _ggn_exact())
    assert used
    h = torch.diagonal(dense_ggn(model, X, targets, loss_fn))
    _check_against(out, model, X, targets, loss_fn, h)


def test_mc_ggn_on_outputs_too_large_for_the_exact_diagonal(monkeypatch):
    """A sequence output with more entries per sample than the exact diagonal allows: the exact
    variant says so, the Monte-Carlo one (closed-form root per token) converges to it."""
    model, X, y, loss_fn = token_model()
    exact = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    traces, *_ = _expected(model, X, y, loss_fn, exact)
    monkeypatch.setattr(loss_root, "MAX_OUTPUT_SIZE", 8)
    with pytest.raises(ValueError, match="diag_ggn_mc"):
        _run(model, X, y, loss_fn, [HessTrace(curvature="diag_ggn_exact")])
    (out,) = _run(model, X, y, loss_fn, [HessTrace(curvature="diag_ggn_mc", mc_samples=500)])
    torch.testing.assert_close(
        torch.tensor(out["HessTrace"], dtype=torch.float64), torch.stack(traces), rtol=0.2, atol=0
    )


def test_mc_ggn_diagonal_converges_and_is_seedable():
    model, X, y, loss_fn = ARCHITECTURES["mlp"]()
    exact = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    traces, *_ = _expected(model, X, y, loss_fn, exact)
    values = []
    for samples, seed in [(500, 0), (500, 0), (500, 1)]:
        q = HessTrace(curvature="diag_ggn_mc", mc_samples=samples, seed=seed)
        (out,) = _run(model, X, y, loss_fn, [q])
        values.append(torch.tensor(out["HessTrace"], dtype=torch.float64))
    assert torch.equal(values[0], values[1])
    assert not torch.equal(values[0], values[2])
    torch.testing.assert_close(values[0], torch.stack(traces), rtol=0.2, atol=1e-6)
    torch.testing.assert_close(values[2], torch.stack(traces), rtol=0.2, atol=1e-6)


def test_diag_h_too_many_probes_names_modules():
    model, X, y, loss_fn = ARCHITECTURES["mlp"]()
    with pytest.raises(ValueError, match=r"'3' \(Tanh\).*diag_ggn_exact"):
        _run(model, X, y, loss_fn, [HessTrace(max_probes=10)])


def test_unknown_curvature_option():
    with pytest.raises(ValueError, match="diag_ggn_mc"):
        TICDiag(curvature="kfac")


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_hess_max_ev_matches_eigvalsh_during_training(arch):
    """The default tol (1e-3) is the relative accuracy of the eigenvalue."""
    model, X, y, loss_fn = ARCHITECTURES[arch]()
    q = HessMaxEV(max_products=400)

    def check(step, out):
        lam = torch.linalg.eigvalsh(dense_hessian(model, X, y, loss_fn))
        assert out["HessMaxEV"] == pytest.approx(float(lam[-1]), rel=1e-3)
        checked.append(step)

    checked = []
    _run(model, X, y, loss_fn, [q], steps=3, lr=0.1, before_update=check)
    assert checked == [0, 1, 2]


def test_hess_max_ev_warm_start_and_budget():
    model, X, y, loss_fn = ARCHITECTURES["cnn"]()
    lam = float(torch.linalg.eigvalsh(dense_hessian(model, X, y, loss_fn))[-1])
    q = HessMaxEV(tol=1e-4, max_products=400)
    outs = _run(model, X, y, loss_fn, [q], steps=2, lr=0.0)
    assert [o["HessMaxEV"] for o in outs] == [pytest.approx(lam, rel=1e-4)] * 2
    assert q.num_products[1] <= 2 < q.num_products[0]  # the previous eigenvector restarts
    with pytest.warns(UserWarning, match="max_products=2"):
        outs = _run(model, X, y, loss_fn, [HessMaxEV(max_products=2)], steps=2)
    assert all(isinstance(o["HessMaxEV"], float) for o in outs)


def test_instruments_leave_the_global_rng_alone():
    def train(quantities):
        model, X, y, loss_fn = ARCHITECTURES["mlp"]()
        torch.manual_seed(123)
        _run(model, X, y, loss_fn, quantities, steps=2, lr=0.1)
        return torch.rand(3)

    qs = [HessMaxEV(), HessTrace(curvature="diag_ggn_mc"), TICDiag(curvature="diag_ggn_mc")]
    assert torch.equal(train([Loss()]), train([Loss(), *qs]))


@pytest.mark.parametrize(("shape", "axis"), [((4, 5), 1), ((3, 6, 5), 2), ((3, 5, 6), 1)])
def test_softmax_root_has_one_column_fewer_per_position(shape, axis):
    """The exact GGN backpropagates V - 1 columns per position for a softmax over V classes;
    their outer products sum to the loss Hessian blockdiag_t c_t (diag p_t - p_t p_t^T)."""
    torch.manual_seed(0)
    logits = 3 * torch.randn(*shape, dtype=torch.float64)
    logits[0].select(axis - 1, -1).add_(40)  # confident samples: p = e_V and p = e_1
    logits[1].select(axis - 1, 0).add_(40)
    p = logits.softmax(axis)
    c = torch.rand(*[1 if a == axis else d for a, d in enumerate(shape)], dtype=torch.float64)
    root = loss_root.SoftmaxHessianRoot(p, c, axis, shape[0])
    cols = torch.stack(list(root.columns()))  # [K, N, M]
    positions = p[0].numel() // shape[axis]
    assert cols.shape[0] == positions * (shape[axis] - 1)
    pm, cm = p.movedim(axis, -1), c.movedim(axis, -1)
    blocks = cm[..., None] * (torch.diag_embed(pm) - pm[..., :, None] * pm[..., None, :])
    dense = torch.zeros(shape[0], p[0].numel(), p[0].numel(), dtype=torch.float64)
    idx = torch.arange(p[0].numel()).reshape(pm.shape[1:])  # entry index in the moved layout
    idx = idx.movedim(-1, axis - 1).reshape(-1)  # ... in the output's own layout
    layout = torch.empty_like(idx)
    layout[idx] = torch.arange(len(idx))
    flat = blocks.reshape(shape[0], -1, shape[axis], shape[axis])
    for t in range(flat.shape[1]):
        at = layout[t * shape[axis] : (t + 1) * shape[axis]]
        dense[:, at[:, None], at[None, :]] = flat[:, t]
    torch.testing.assert_close(torch.einsum("kni,knj->nij", cols, cols), dense)


def conv_zoo(n=3, seed=4):
    """Convolutions of every kind the GGN's convolution path takes: 1d, 2d with groups, stride,
    dilation, reflect padding and no bias, 3d; a Linear with a shared axis (engine path)."""
    torch.manual_seed(seed)

    class Zoo(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv1d(2, 4, 3, padding=1)
            self.c2 = nn.Conv2d(4, 4, 3, stride=2, dilation=1, groups=2, padding=1, bias=False)
            self.c2r = nn.Conv2d(4, 2, 2, padding=1, padding_mode="reflect")
            self.c3 = nn.Conv3d(1, 2, 2)
            self.shared = nn.Linear(3, 2)
            self.out = nn.Linear(2 * 3 * 2 + 2 * 2 * 2 * 2, 3)

        def forward(self, x):
            n = x.shape[0]
            h = torch.tanh(self.c1(x.reshape(n, 2, 18)))  # [n, 4, 18]
            h = torch.relu(self.c2(h.reshape(n, 4, 3, 6)))  # [n, 4, 2, 3]
            h = torch.sigmoid(self.c2r(h))  # [n, 2, 3, 4]
            h = self.shared(h[..., :3])  # [n, 2, 3, 2]: shared axes
            v = self.c3(x[:, :27].reshape(n, 1, 3, 3, 3))  # [n, 2, 2, 2, 2]
            return self.out(torch.cat([h.reshape(n, -1), v.reshape(n, -1)], 1))

    X, y = torch.randn(n, 36), torch.randint(0, 3, (n,))
    return (
        Zoo().double(),
        X.double(),
        y,
        lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"),
    )


@pytest.mark.parametrize("budget", [None, 1])
def test_ggn_convolution_path_matches_brute_force(budget, monkeypatch):
    """Every convolution goes through the batched column path (also when each column's
    gradients are reduced alone, one sample at a time) and matches the dense GGN."""
    if budget is not None:
        monkeypatch.setattr(conv, "CONV_PENDING_BYTES", budget)
        monkeypatch.setattr(conv, "CONV_CHUNK_BYTES", budget)
    model, X, y, loss_fn = conv_zoo()
    used = []
    init = conv.ConvColumnSums.__init__

    def spy(self, module, call, names, n, traces):
        used.append(module)
        init(self, module, call, names, n, traces)

    monkeypatch.setattr(conv.ConvColumnSums, "__init__", spy)
    (out,) = _run(model, X, y, loss_fn, [*_ggn_exact(), TICTrace(curvature="diag_ggn_exact")])
    assert set(used) == {model.c1, model.c2, model.c2r, model.c3}
    h = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    *_, tic_trace = _check_against(out, model, X, y, loss_fn, h)
    assert out["TICTrace"] == pytest.approx(float(tic_trace), rel=1e-7)


def test_quantity_order_does_not_matter():
    """TICDiag overwrites the shared diagonal in place; HessTrace and TICTrace after it still
    read its sums, and a second diagonal is never computed."""
    model, X, y, loss_fn = ARCHITECTURES["cnn"]()
    calls = []
    diagonal = ggn_diagonal.ggn_diagonal

    def counted(*args, **kwargs):
        calls.append(1)
        return diagonal(*args, **kwargs)

    outs = []
    for order in [(HessTrace, TICDiag, TICTrace), (TICDiag, TICTrace, HessTrace)]:
        qs = [q(curvature="diag_ggn_exact") for q in order]
        with pytest.MonkeyPatch.context() as m:
            m.setattr("avionics.quantities.curvature.ggn_diagonal", counted)
            (out,) = _run(*ARCHITECTURES["cnn"](), qs)
        outs.append(out)
    assert len(calls) == 2
    assert outs[0] == outs[1]


def test_hess_trace_asks_for_the_captured_calls_only():
    """HessTrace backpropagates through the captured calls itself: no per-sample statistic."""
    request = HessTrace(curvature="diag_ggn_exact").request(0)
    assert request and not request.asks_statistics
    assert TICDiag().request(0).sum_sq and TICTrace().request(0).sum_sq


class _TinyViT(nn.Module):
    """A class token concatenated in front of the patches and a position table added to the
    sequence, both parameters of the root module (as a ViT's)."""

    def __init__(self, width=6, classes=3):
        super().__init__()
        self.patches = nn.Conv2d(2, width, 2, stride=2)  # 4 x 4 images -> 4 patches
        self.cls_token = nn.Parameter(0.5 * torch.randn(1, 1, width))
        self.pos_embed = nn.Parameter(0.5 * torch.randn(1, 5, width))
        self.block = nn.TransformerEncoderLayer(
            width, 2, 8, dropout=0.0, batch_first=True, norm_first=True
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.patches(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls_token.expand(len(h), -1, -1), h], 1) + self.pos_embed
        return self.head(self.block(h)[:, 0])


class _TinyEncoder(nn.Module):
    """Token embeddings scaled by a root vector and a root position table sliced to the
    sequence (``pos[:T]``, T < its rows: the last row unused) before an nn.TransformerEncoder."""

    def __init__(self, vocab=7, width=6, context=5, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.scale = nn.Parameter(1 + 0.3 * torch.randn(width))
        self.pos = nn.Parameter(0.5 * torch.randn(context, width))
        layer = nn.TransformerEncoderLayer(width, 2, 8, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        h = self.embed(tokens) * self.scale + self.pos[: tokens.shape[1]]
        return self.head(self.encoder(h).mean(1))


def tiny_vit(n=4, seed=5):
    torch.manual_seed(seed)
    X, y = torch.randn(n, 2, 4, 4), torch.randint(0, 3, (n,))
    return _TinyViT().double(), X.double(), y, _cross_entropy


def tiny_encoder(n=4, seed=6):
    torch.manual_seed(seed)
    X, y = torch.randint(0, 7, (n, 4)), torch.randint(0, 3, (n,))
    return _TinyEncoder().double(), X, y, _cross_entropy


def _cross_entropy(o, t):
    return nn.functional.cross_entropy(o, t, reduction="none")


def _no_model_rerun(monkeypatch) -> list:
    """A list that gets the modules whose per-sample gradients the generic rule computed (its
    re-run of a module's forward under vmap)."""
    from avionics.persample.rules.generic import GenericRule

    reruns = []
    gradients = GenericRule._call_gradients

    def spy(self, call, start, stop):
        reruns.append(self.module)
        return gradients(self, call, start, stop)

    monkeypatch.setattr(GenericRule, "_call_gradients", spy)
    return reruns


@pytest.mark.parametrize("traces", [False, True])
@pytest.mark.parametrize("build", [tiny_vit, tiny_encoder])
def test_ggn_of_root_parameters_by_their_closed_forms(build, traces, monkeypatch):
    """The root's own parameters (class token, position table, a scale) reach the GGN
    columns by the broadcast rule's closed forms: the exact diagonal (and its traces alone)
    matches the dense J^T H J, and no module's forward is re-run."""
    model, X, y, loss_fn = build()
    reruns = _no_model_rerun(monkeypatch)
    qs = [HessTrace(curvature="diag_ggn_exact"), TICTrace(curvature="diag_ggn_exact")]
    if not traces:
        qs.append(TICDiag(curvature="diag_ggn_exact"))
    (out,) = _run(model, X, y, loss_fn, qs)
    assert reruns == []
    h = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    traces_expected, tic_diag, tic_trace = _expected(model, X, y, loss_fn, h)
    _assert_traces(out, traces_expected)
    assert out["TICTrace"] == pytest.approx(float(tic_trace), rel=1e-7)
    if not traces:
        assert out["TICDiag"] == pytest.approx(float(tic_diag), rel=1e-6)
    if build is tiny_encoder:  # pos[4] is not used: its diagonal is zero
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        sizes = [p.numel() for p in _params(model)]
        pos = dict(zip(names, h.split(sizes), strict=True))["pos"].reshape(5, 6)
        assert torch.all(pos[4] == 0) and torch.all(pos[:4].abs().sum(1) > 0)


@pytest.mark.parametrize("build", [pytest.param(tiny_vit, marks=pytest.mark.slow), tiny_encoder])
def test_mc_ggn_of_root_parameters_converges_and_is_seedable(build, monkeypatch):
    """The Monte-Carlo diagonal by the same closed forms: one seed gives one value, another
    seed another, and 150 draws approach the dense GGN's traces (E[S z z^T S^T] = H)."""
    model, X, y, loss_fn = build()
    reruns = _no_model_rerun(monkeypatch)
    traces, *_ = _expected(model, X, y, loss_fn, torch.diagonal(dense_ggn(model, X, y, loss_fn)))
    values = []
    for seed in (0, 0, 1):
        q = HessTrace(curvature="diag_ggn_mc", mc_samples=150, seed=seed)
        (out,) = _run(model, X, y, loss_fn, [q])
        values.append(torch.tensor(out["HessTrace"], dtype=torch.float64))
    assert reruns == []
    assert torch.equal(values[0], values[1])
    assert not torch.equal(values[0], values[2])
    for value in (values[0], values[2]):
        torch.testing.assert_close(value, torch.stack(traces), rtol=0.25, atol=1e-6)


def batch_norm_cnn(n=4, seed=7):
    """BatchNorm2d and LayerNorm by running statistics (eval mode: per sample separable, so
    the dense per-sample J^T H J is the reference), with non-trivial running statistics."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(), nn.LayerNorm(12),
        nn.Linear(12, 3),
    )  # fmt: skip
    bn = model[1]
    bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 2.0)
    bn.weight.data.uniform_(0.5, 1.5), bn.bias.data.uniform_(-0.5, 0.5)
    X, y = torch.randn(n, 2, 4, 4), torch.randint(0, 3, (n,))
    return model.double().eval(), X.double(), y, _cross_entropy


def test_ggn_of_normalization_layers_matches_brute_force(monkeypatch):
    """The normalisation layers' column sums (x_hat once for all columns) match the dense
    GGN, and are the ones used."""
    from avionics.persample.rules import normalization

    model, X, y, loss_fn = batch_norm_cnn()
    used = []
    init = normalization.NormalizationColumnSums.__init__

    def spy(self, module, *args):
        used.append(module)
        init(self, module, *args)

    monkeypatch.setattr(normalization.NormalizationColumnSums, "__init__", spy)
    (out,) = _run(model, X, y, loss_fn, [*_ggn_exact(), TICTrace(curvature="diag_ggn_exact")])
    assert set(used) == {model[1], model[4]}
    h = torch.diagonal(dense_ggn(model, X, y, loss_fn))
    *_, tic_trace = _check_against(out, model, X, y, loss_fn, h)
    assert out["TICTrace"] == pytest.approx(float(tic_trace), rel=1e-7)
