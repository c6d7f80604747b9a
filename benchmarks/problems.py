"""The benchmark problems: shaped like the classic optimizer benchmarks, on synthetic data.

Each problem builds a seeded model, one seeded batch (X, y) and a per-sample loss
``loss_fn(output, y) -> [N]`` (the training loss is its mean):

* ``logreg``: logistic regression 784 -> 10 (MNIST-shaped), batch 128;
* ``mlp``: 784-1000-500-100-10 with ReLU (DeepOBS mnist_mlp), batch 128;
* ``2c2d``: conv(1->32, 5x5, same) relu maxpool(2), conv(32->64, 5x5, same) relu maxpool(2),
  dense 1024 relu, dense 10 on 28x28x1 (DeepOBS mnist_2c2d), batch 128;
* ``3c3d``: conv 64 5x5 valid relu maxpool(3,2), conv 96 3x3 valid relu maxpool(3,2),
  conv 128 3x3 same relu maxpool(3,2), dense 512 relu, 256 relu, 10 on 32x32x3
  (DeepOBS cifar10_3c3d), batch 128;
* ``gpt``: a small GPT, 2 pre-LN blocks of width 128 with 4 heads (causal attention written
  with nn.Linear and F.scaled_dot_product_attention, as in nanoGPT), context 64, vocabulary
  512, LM head tied to the token embedding, batch 32; the loss of a sequence is its mean token
  cross-entropy.

Use: ``from benchmarks.problems import PROBLEMS``; ``model, X, y, loss_fn = PROBLEMS[name]()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

SEED = 0

# Subnormal floats (which the synthetic GPT's training produces) make some CPU kernels ~5x
# slower, plain and instrumented steps alike; flushing them measures the ordinary step.
torch.set_flush_denormal(True)


def cross_entropy(output: Tensor, y: Tensor) -> Tensor:
    """Per-sample cross-entropy, shape [N]."""
    return F.cross_entropy(output, y, reduction="none")


def sequence_cross_entropy(logits: Tensor, y: Tensor) -> Tensor:
    """Per-sequence mean token cross-entropy: logits [N, T, V], y [N, T] -> [N]."""
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)


def _images(n: int, shape: tuple[int, ...], classes: int = 10):
    return torch.randn(n, *shape), torch.randint(0, classes, (n,))


def logreg(batch: int = 128):
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    return (model, *_images(batch, (1, 28, 28)), cross_entropy)


def mlp(batch: int = 128):
    torch.manual_seed(SEED)
    widths = [784, 1000, 500, 100, 10]
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return (nn.Sequential(*layers), *_images(batch, (1, 28, 28)), cross_entropy)


def c2d2(batch: int = 128):
    torch.manual_seed(SEED)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(7 * 7 * 64, 1024), nn.ReLU(), nn.Linear(1024, 10),
    )  # fmt: skip
    return (model, *_images(batch, (1, 28, 28)), cross_entropy)


def c3d3(batch: int = 128):
    torch.manual_seed(SEED)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 5), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(64, 96, 3), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(96, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Flatten(), nn.Linear(3 * 3 * 128, 512), nn.ReLU(),
        nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10),
    )  # fmt: skip
    return (model, *_images(batch, (3, 32, 32)), cross_entropy)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: a qkv projection, SDPA, an output projection."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        n, t, width = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, width // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(n, t, width))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embedding, pre-LN blocks, final LayerNorm, head tied to the tokens."""

    def __init__(self, vocab=512, width=128, heads=4, blocks=2, context=64):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: Tensor) -> Tensor:
        # positions indexed per sequence ([N, T]): every module call carries the batch axis
        positions = torch.arange(idx.shape[1], device=idx.device).expand(idx.shape[0], -1)
        x = self.tokens(idx) + self.positions(positions)
        return self.head(self.ln(self.blocks(x)))


def gpt(batch: int = 32, vocab: int = 512, context: int = 64):
    torch.manual_seed(SEED)
    model = GPT(vocab=vocab, context=context)
    tokens = torch.randint(0, vocab, (batch, context + 1))
    return model, tokens[:, :-1], tokens[:, 1:], sequence_cross_entropy


PROBLEMS: dict[str, Callable] = {
    "logreg": logreg,
    "mlp": mlp,
    "2c2d": c2d2,
    "3c3d": c3d3,
    "gpt": gpt,
}
