"""The test architectures every numerical test runs on, and brute-force float64 references.

Each builder returns ``(model, X, y, loss_fn)``, float64, deterministic (eval mode, no
dropout), where ``loss_fn(out, y)`` returns the per-sample losses, shape [N]. A "sample" is
an index of the batch axis; for the language model it is a whole sequence, whose loss is the
mean over its tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from avionics.persample import PerSampleEngine


def _classification_losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


def mlp(n: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 4), nn.Tanh())
    model.append(nn.Linear(4, 3))
    X, y = torch.randn(n, 6), torch.randint(0, 3, (n,))
    return model.double(), X.double(), y, _classification_losses


def cnn(n: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, stride=2, groups=2, dilation=1, padding=1),
        nn.Sigmoid(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 3),
    )
    X, y = torch.randn(n, 2, 8, 8), torch.randint(0, 3, (n,))
    return model.double(), X.double(), y, _classification_losses


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x):
        T = x.shape[1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-LN blocks, LM head tied to the token embedding."""

    def __init__(self, vocab: int = 11, width: int = 8, heads: int = 2, context: int = 6):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(0.1 * torch.randn(context, width))
        self.block = Block(width, heads)
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        return self.head(self.ln(self.block(x)))


def _lm_losses(out, y):
    per_token = F.cross_entropy(out.transpose(1, 2), y, reduction="none")
    return per_token.mean(1)


def transformer(n: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT()
    X, y = torch.randint(0, 11, (n, 6)), torch.randint(0, 11, (n, 6))
    return model.double(), X, y, _lm_losses


class RNNClassifier(nn.Module):
    def __init__(self, cell=nn.LSTM):
        super().__init__()
        self.rnn = cell(3, 4, batch_first=True)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.rnn(x)[0]
        return self.out(h[:, -1])


def rnn(n: int = 3, seed: int = 0, cell=nn.LSTM):
    torch.manual_seed(seed)
    model = RNNClassifier(cell)
    X, y = torch.randn(n, 5, 3), torch.randint(0, 2, (n,))
    return model.double(), X.double(), y, _classification_losses


class Scale(nn.Module):
    """A custom parameterised module: elementwise affine map with a learned exponent."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.shift = nn.Parameter(torch.zeros(dim) + 0.1)

    def forward(self, x):
        return torch.sinh(self.scale * x) + self.shift


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.scale = Scale(5)
        self.norm = nn.GroupNorm(1, 5)
        self.out = nn.Linear(5, 3)
        self.temperature = nn.Parameter(torch.tensor(1.3))  # used directly in this forward

    def forward(self, x):
        h = self.norm(self.scale(self.lin(x)))
        return self.out(h) * self.temperature


def custom(n: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = Custom()
    X, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
    return model.double(), X.double(), y, _classification_losses


ARCHITECTURES = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer,
    "lstm": rnn,
    "custom": custom,
}


def per_sample_gradients(model, X, y, loss_fn, params=None):
    """Brute force: one ``torch.autograd.grad`` per sample loss -> list over params of [N, *p]."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    losses = loss_fn(model(X), y)
    rows = [torch.autograd.grad(l, params, retain_graph=True, allow_unused=True) for l in losses]
    return [
        torch.stack([r[k] if r[k] is not None else torch.zeros_like(p) for r in rows])
        for k, p in enumerate(params)
    ]


class NanGradient(torch.autograd.Function):
    """The identity whose backward returns NaN: an overflow in a custom op."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def captured_engine_step(model, X, y, loss_fn, reduction="mean", engine=None):
    """One forward and backward captured by the per-sample engine, as the cockpit runs them:
    (the engine, its step, the mean gradient over the batch, the tracked parameters).
    ``engine``: one that has run earlier steps of ``model`` (default: a new one)."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    engine = PerSampleEngine(model, params) if engine is None else engine
    capture = engine.capture()
    capture.arm()
    losses = loss_fn(model(X), y)
    capture.disarm()
    loss = losses.mean() if reduction == "mean" else losses.sum()
    capture.record_gradients()
    received = [None] * len(params)
    handles = [
        p.register_hook(lambda g, k=k: received.__setitem__(k, g)) for k, p in enumerate(params)
    ]
    loss.backward()
    for handle in handles:
        handle.remove()
    capture.stop_recording()
    n = len(losses)
    step = engine.step(capture.calls_by_module(), n, n if reduction == "mean" else 1, received)
    mean_grad = [p.grad / (1 if reduction == "mean" else n) for p in params]
    return engine, step, mean_grad, params
