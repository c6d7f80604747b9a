"""Small float64 problems for the curvature operators, and dense references built by autograd.

A problem is (model, loss_fn, data) with data a list of batches of unequal size. The dense
references use ``torch.autograd.functional.hessian`` / ``jacobian`` (double backward) on the
flattened parameter vector, independently of the operators' torch.func code.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.functional import hessian, jacobian
from torch.func import functional_call
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BATCH_SIZES = (3, 2, 4)


class TinyTransformer(nn.Module):
    """Embedding, LayerNorm, causal 2-head attention (scaled_dot_product_attention), LM head.

    The output is [N, vocab, T] (class axis 1), as CrossEntropyLoss wants for sequences.
    """

    def __init__(self, vocab: int = 5, width: int = 4, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.embedding = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.embedding(idx)
        N, T, W = x.shape
        q, k, v = self.qkv(self.norm(x)).split(W, dim=-1)
        q, k, v = (t.view(N, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attended.transpose(1, 2).reshape(N, T, W)
        return self.head(x).transpose(1, 2)


class Tied(nn.Module):
    """Two Linear layers sharing one weight (each called once), then a head."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.second.weight = self.first.weight
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))


class DictInput(nn.Module):
    """A model whose batches are dicts {"a": [N, 3], "b": [N, 2]}."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(2, 2, bias=False)

    def forward(self, batch):
        return torch.tanh(self.a(batch["a"])) * self.b(batch["b"])


def _targets(loss_name: str, shape: tuple[int, ...], generator: torch.Generator):
    if loss_name == "mse":
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    if loss_name == "bce":
        return torch.randint(0, 2, shape, generator=generator).double()
    return torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=generator)


LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss}


def problem(name: str, loss_name: str = "ce", reduction: str = "mean", seed: int = 0):
    """(model, loss_fn, data, batch_size_fn) for 'mlp', 'cnn', 'transformer', 'tied' or
    'dict'."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    batch_size_fn = None
    if name == "mlp":
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        inputs = [torch.randn(n, 4, generator=generator) for n in BATCH_SIZES]
    elif name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 2, 2, stride=2),
            nn.Flatten(), nn.Linear(8, 3),
        )  # fmt: skip
        inputs = [torch.randn(n, 2, 4, 4, generator=generator) for n in BATCH_SIZES]
    elif name == "tied":
        model = Tied()
        inputs = [torch.randn(n, 4, generator=generator) for n in BATCH_SIZES]
    elif name == "transformer":
        model = TinyTransformer()
        inputs = [torch.randint(0, 5, (n, 3), generator=generator) for n in BATCH_SIZES]
    elif name == "dict":
        model = DictInput()
        inputs = [
            {
                "a": torch.randn(n, 3, generator=generator),
                "b": torch.randn(n, 2, generator=generator),
            }
            for n in BATCH_SIZES
        ]
        batch_size_fn = _dict_batch_size
    else:
        raise ValueError(name)
    model = model.double().eval()
    inputs = (
        [X.double() if X.is_floating_point() else X for X in inputs]
        if name != "dict"
        else [{k: v.double() for k, v in X.items()} for X in inputs]
    )
    with torch.no_grad():
        shapes = [tuple(model(X).shape) for X in inputs]
    data = [(X, _targets(loss_name, s, generator)) for X, s in zip(inputs, shapes)]
    return model, LOSSES[loss_name](reduction=reduction), data, batch_size_fn


def _dict_batch_size(X) -> int:
    return X["a"].shape[0]


def _size(X) -> int:
    return X["a"].shape[0] if isinstance(X, dict) else X.shape[0]


class Flat:
    """The model as a function of one flat parameter vector theta."""

    def __init__(self, model: nn.Module):
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.theta = torch.cat([p.detach().flatten() for _, p in named])

    def params(self, theta):
        sizes = [s.numel() for s in self.shapes]
        return {n: t.view(s) for n, t, s in zip(self.names, theta.split(sizes), self.shapes)}

    def output(self, theta, X):
        return functional_call(self.model, self.params(theta), (X,))


def block_diagonal_part(matrix: torch.Tensor, model: nn.Module, groups: list[list[int]]):
    """Keep the blocks of ``matrix`` whose rows and columns belong to one group of the
    model's parameters (indices into ``model.parameters()``); zero elsewhere."""
    sizes = [p.numel() for p in model.parameters()]
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    mask = torch.zeros_like(matrix, dtype=torch.bool)
    for group in groups:
        index = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in group])
        mask[index[:, None], index[None, :]] = True
    return matrix * mask


def _weights(loss_fn, data):
    total = sum(_size(X) for X, _ in data)
    return [_size(X) / total if loss_fn.reduction == "mean" else 1.0 for X, _ in data]


def dense_hessian(model, loss_fn, data):
    with sdpa_kernel(SDPBackend.MATH):  # the fused CPU kernels have no double backward
        return _dense_hessian(model, loss_fn, data)


def _dense_hessian(model, loss_fn, data):
    flat = Flat(model)
    return sum(
        w * hessian(lambda t, X=X, y=y: loss_fn(flat.output(t, X), y), flat.theta, vectorize=True)
        for w, (X, y) in zip(_weights(loss_fn, data), data)
    )


def dense_jacobian(model, data):
    flat = Flat(model)
    blocks = [
        jacobian(lambda t, X=X: flat.output(t, X), flat.theta, vectorize=True) for X, _ in data
    ]
    return torch.cat([b.reshape(b.shape[0], -1, b.shape[-1]) for b in blocks]).flatten(0, 1)


def dense_ggn(model, loss_fn, data):
    flat = Flat(model)
    total = 0
    for w, (X, y) in zip(_weights(loss_fn, data), data):
        J = jacobian(lambda t, X=X: flat.output(t, X), flat.theta, vectorize=True).flatten(0, -2)
        out = flat.output(flat.theta, X).detach()
        H = hessian(
            lambda o, y=y, out=out: loss_fn(o.view_as(out), y), out.flatten(), vectorize=True
        )
        total = total + w * J.T @ H @ J
    return total


def dense_empirical_fisher(model, loss_fn, data):
    """sum_n c g_n g_n^T with g_n the gradient of sample n's loss (own reduction), brute force."""
    flat = Flat(model)
    num_data = sum(_size(X) for X, _ in data)
    scale = 1.0 / num_data if loss_fn.reduction == "mean" else 1.0
    total = 0
    for X, y in data:
        for n in range(_size(X)):
            X_n = {k: v[n : n + 1] for k, v in X.items()} if isinstance(X, dict) else X[n : n + 1]
            theta = flat.theta.clone().requires_grad_()
            (g,) = torch.autograd.grad(loss_fn(flat.output(theta, X_n), y[n : n + 1]), theta)
            total = total + scale * torch.outer(g, g)
    return total
