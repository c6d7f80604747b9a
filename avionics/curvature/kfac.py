"""KFAC: a block-diagonal Kronecker-factored approximation of the GGN / Fisher."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import grad

from avionics.curvature._data import (
    MathAttention,
    ModelDataOperator,
    check_positive_int,
    check_seed,
    forward_keeping_buffers,
)
from avionics.curvature._losses import (
    batch_generator,
    check_samplable,
    output_hessian_square_root,
    sampled_output_gradients,
)
from avionics.curvature.base import CurvatureLinearOperator
from avionics.persample.capture import Capture, ModuleCall, output_edge
from avionics.persample.rules.conv import unfold

FISHER_TYPES = ("mc", "type-2", "empirical")
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
SUPPORTED_LAYERS = (nn.Linear, *CONVOLUTIONS)


@dataclass
class KroneckerBlock:
    """One block B (x) A: a layer's weight, its bias, or both (weight first)."""

    layer: nn.Module
    param_indices: list[int]
    has_weight: bool
    has_bias: bool
    B: Tensor | None = None  # [d_out, d_out]
    A: Tensor | None = None  # [d_in (+ 1 for a joint bias), same] ([1, 1] for a lone bias)


class KFACOperator(ModelDataOperator):
    r"""KFAC: the GGN (or a Fisher) approximated per layer by a Kronecker product B (x) A.

    Every block belongs to one ``nn.Linear`` or ``nn.Conv1d/2d/3d`` layer z = W a (+ b), a
    its input (for a convolution the unfolded patches, with any padding mode: see
    :func:`~avionics.persample.rules.conv.unfold`), z its output. With the GGN
    sum_b w_b J_b^T Lambda_b J_b (:class:`~avionics.curvature.ggn.GGNOperator`),
    Lambda_b = sum_k s_k s_k^T, and g_k = (dz/df)^T s_k the vectors backpropagated to z, the
    block of W is approximated by (Martens & Grosse, "Optimizing neural networks with
    Kronecker-factored approximate curvature", 2015, eq. 1; Grosse & Martens, "A
    Kronecker-factored approximate Fisher matrix for convolution layers", 2016)

    .. math:: B \otimes A, \qquad B = \sum_b w_b \sum_{k, r} g_{k,r} g_{k,r}^\top, \qquad
              A = \frac{1}{R} \sum_r a_r a_r^\top,

    r running over the rows of the layer input over the data set (R rows: one per sample,
    or per position for sequences and convolutions, and per call of a layer called more than
    once: the "expand" approximation of Eschenhagen et al., 2023). It is exact for
    single-sample batches without positions and ``fisher_type="type-2"``. On a weight
    V [out, in] the product is B V A; a bias gets its own block with A = 1
    (``separate_weight_and_bias=True``) or joins the weight, with a column of ones appended
    to a.

    The s_k: ``"mc"`` draws labels from the model's predictive distribution
    (:func:`~avionics.curvature._losses.sampled_output_gradients`), ``"type-2"`` is the exact
    square root of the loss Hessian (one s_k per output dimension and position), and
    ``"empirical"`` the gradients at the true labels (the empirical Fisher).

    Args:
        model: The network (an ``nn.Module``).
        loss_fn: ``MSELoss``, ``CrossEntropyLoss`` or ``BCEWithLogitsLoss``, reduction "mean"
            or "sum".
        params: Weights and biases of Linear and (one-group) Conv1d/2d/3d layers; ``None``
            for all parameters that require grad.
        data: A re-iterable of (X, y) batches.
        fisher_type: ``"mc"`` (default), ``"type-2"`` or ``"empirical"``.
        mc_samples: Labels drawn per output for ``"mc"``.
        seed: Seed of the draws.
        separate_weight_and_bias: Give each bias its own block.
        **kwargs: ``num_data``, ``batch_size_fn``, ``check_deterministic``, ``progressbar``,
            ``distributed``.

    With ``data`` a shard of a data set across torch.distributed processes (``distributed``,
    see :class:`~avionics.curvature._data.ModelDataOperator`), the factors are those of the
    whole data set: each process sums sum_r a_r a_r^T, B and the row count R of every layer
    over its shard, one all_reduce adds them at construction, and A is divided by the total
    R. The draws of ``"mc"`` are seeded per batch (by its index in the data set, shards in
    rank order), so sharded data gets the factors of one process with all the batches. The
    products then need no communication.
    """

    def __init__(self, model: nn.Module, loss_fn, params, data, *, fisher_type: str = "mc",
                 mc_samples: int = 1, seed: int = 0, separate_weight_and_bias: bool = True,
                 check_deterministic: bool = True, **kwargs):  # fmt: skip
        if not isinstance(model, nn.Module):
            raise TypeError("KFACOperator needs the model as an nn.Module (it hooks its layers).")
        if fisher_type not in FISHER_TYPES:
            raise ValueError(f"fisher_type must be one of {FISHER_TYPES}, got {fisher_type!r}.")
        if fisher_type == "mc":
            check_samplable(loss_fn)
        owner = type(self).__name__
        self._fisher_type = fisher_type
        self._mc_samples = check_positive_int(
            mc_samples, "mc_samples", owner, "pass the number of draws, e.g. 1"
        )
        self._seed = check_seed(seed, owner)
        self._separate_weight_and_bias = separate_weight_and_bias
        super().__init__(model, loss_fn, params, data, check_deterministic=False, **kwargs)
        self.blocks = self._find_blocks()
        self._compute_factors()
        if check_deterministic:
            self._check_deterministic()

    def _find_blocks(self) -> list[KroneckerBlock]:
        index = {name: i for i, name in enumerate(self._param_names)}
        blocks = []
        for layer_name, layer in self._model.named_modules():
            prefix = f"{layer_name}." if layer_name else ""
            weight, bias = index.get(prefix + "weight"), index.get(prefix + "bias")
            if not isinstance(layer, SUPPORTED_LAYERS) or (weight is None and bias is None):
                continue
            if isinstance(layer, CONVOLUTIONS) and layer.groups != 1:
                raise ValueError(
                    f"KFACOperator: layer {layer_name!r} is a {type(layer).__name__} with groups "
                    f"({layer.groups}), which is not supported; leave its parameters out."
                )
            if weight is not None and bias is not None and not self._separate_weight_and_bias:
                blocks.append(KroneckerBlock(layer, [weight, bias], True, True))
                continue
            if weight is not None:
                blocks.append(KroneckerBlock(layer, [weight], True, False))
            if bias is not None:
                blocks.append(KroneckerBlock(layer, [bias], False, True))
        covered = {i for block in blocks for i in block.param_indices}
        others = [name for i, name in enumerate(self._param_names) if i not in covered]
        if others:
            raise ValueError(
                "KFACOperator supports the weights and biases of Linear and Conv1d/2d/3d "
                f"layers; parameters {others} belong to other modules: pass params=[names] "
                "without them."
            )
        return blocks

    # ---------------------------------------------------------------------------------------
    # The Kronecker factors: one pass over the data
    # ---------------------------------------------------------------------------------------

    def _compute_factors(self) -> None:
        """B and A of every block, in one pass over the data (for sharded data: over each
        process's shard, the sums of all layers added by one all_reduce)."""
        layers = self._layers()
        shapes = [shape for layer in layers for shape in self._factor_shapes(layer)]
        sums = self._sum_over_processes(self._local_factor_sums, shapes, "Kronecker factors")
        factors = {id(layer): sums[3 * i : 3 * i + 3] for i, layer in enumerate(layers)}
        one = torch.ones(1, 1, dtype=self.dtype, device=self.device)
        for block in self.blocks:
            A_sum, B, rows = factors[id(block.layer)]
            block.B = B
            block.A = A_sum / rows if block.has_weight else one

    def _local_factor_sums(self) -> list[Tensor]:
        """[sum_r a_r a_r^T, B, R] of every layer in turn, over this process's data."""
        layers = self._layers()
        A_sum = {id(layer): 0.0 for layer in layers}
        B = {id(layer): 0.0 for layer in layers}
        rows = {id(layer): 0 for layer in layers}
        for weight, layer, a, g in self._backpropagated_rows("Kronecker factors"):
            a, g = a.flatten(0, -2), g.flatten(0, -2)
            A_sum[id(layer)] = A_sum[id(layer)] + a.T @ a
            B[id(layer)] = B[id(layer)] + weight * (g.T @ g)
            rows[id(layer)] += len(a)
        sums = []
        for layer in layers:
            R = torch.tensor(float(rows[id(layer)]), dtype=torch.float64, device=self.device)
            sums += [A_sum[id(layer)], B[id(layer)], R]  # R in float64: an exact count
        return sums

    def _factor_shapes(self, layer: nn.Module) -> list[tuple[int, ...]]:
        """The shapes of a layer's sums: [d_in (+ 1), same], [d_out, d_out], []."""
        joint = any(b.layer is layer and b.has_weight and b.has_bias for b in self.blocks)
        d_in, d_out = layer.weight[0].numel() + joint, layer.weight.shape[0]
        return [(d_in, d_in), (d_out, d_out), ()]

    def _layers(self) -> list[nn.Module]:
        return list({id(block.layer): block.layer for block in self.blocks}.values())

    def _backpropagated_rows(self, desc: str):
        """Per batch and layer: (w_b, layer, a [N, R, d_in (+1)], g [K, N, R, d_out]).

        The rows of all calls of a layer are concatenated. The draws of a batch are seeded by
        its index in the data set (:func:`~avionics.curvature._losses.batch_generator`), so
        every pass sees the same sample, and sharded data the sample of one process.
        """
        layers = self._layers()
        joint = {id(b.layer) for b in self.blocks if b.has_weight and b.has_bias}
        capture = Capture(self._model, layers)
        with MathAttention():
            for index, (X, y) in enumerate(self._batches(desc), start=self._first_batch):
                output, calls = self._forward(X, capture, layers)
                generator = batch_generator(self._seed, index, self.device)
                vectors = self._output_vectors(output.detach(), y, generator)  # [K, *f]
                gradients = _output_gradients(output, calls, vectors)
                weight = self._batch_weight(X)
                for layer in layers:
                    a = [_input_rows(layer, c.args[0].detach(), id(layer) in joint)
                         for c in calls[layer]]  # fmt: skip
                    g = [_output_rows(layer, gradient) for gradient in gradients[layer]]
                    yield weight, layer, torch.cat(a, dim=1), torch.cat(g, dim=2)

    def _forward(
        self, X, capture: Capture, layers: list[nn.Module]
    ) -> tuple[Tensor, dict[nn.Module, list[ModuleCall]]]:
        """Run the model; return its output (in the graph) and each layer's calls."""
        capture.arm()
        try:
            with torch.enable_grad():
                output = forward_keeping_buffers(self._model, X)
        finally:
            capture.disarm()
        calls = {layer: [c for c in capture.calls if c.module is layer] for layer in layers}
        capture.release()
        not_called = [name for name, m in self._model.named_modules() if m in layers
                      and not calls[m]]  # fmt: skip
        if not_called:
            raise ValueError(
                f"KFACOperator: the layers {not_called} were not called in the forward pass "
                "(e.g. the out_proj of nn.MultiheadAttention, whose weight is used directly), "
                "so their inputs and outputs cannot be seen; leave their parameters out."
            )
        return output, calls

    def _output_vectors(self, output: Tensor, y: Tensor, generator) -> Tensor:
        """The s_k, stacked [K, *output.shape], with Lambda_b = sum_k s_k s_k^T."""
        if self._fisher_type == "mc":
            S, kappa = sampled_output_gradients(self._loss_fn, output, self._mc_samples, generator)
            return (kappa / self._mc_samples) ** 0.5 * S
        if self._fisher_type == "type-2":
            return output_hessian_square_root(self._loss_fn, output, y)
        # empirical: Lambda_b = blockdiag_n(G_n G_n^T) / c_b (see EFOperator)
        G = grad(lambda f: self._loss_fn(f, y))(output)
        inverse_c = output.shape[0] if self._loss_fn.reduction == "mean" else 1.0
        return (inverse_c**0.5 * G).unsqueeze(0)

    # ---------------------------------------------------------------------------------------
    # Products
    # ---------------------------------------------------------------------------------------

    def _matmat(self, M: list[Tensor]) -> list[Tensor]:
        return _blockwise(self.blocks, M, lambda block, V: block.B @ V @ block.A)

    def inverse(self, damping: float) -> CurvatureLinearOperator:
        """The damped inverse (B (x) A + damping I)^{-1}, block by block (KFACInverseOperator)."""
        eigenbases = {}
        for block in self.blocks:
            (b, Q_B), (a, Q_A) = torch.linalg.eigh(block.B), torch.linalg.eigh(block.A)
            eigenbases[id(block)] = (Q_B, Q_A, b[:, None] * a[None, :])
        return KFACInverseOperator(self, eigenbases, damping)


class EKFACOperator(KFACOperator):
    r"""EKFAC: KFAC with its eigenvalues corrected to the exact second moments.

    In the eigenbasis of B (x) A (B = Q_B diag(b) Q_B^T, A = Q_A diag(a) Q_A^T) KFAC's
    eigenvalues b_i a_j are replaced by the diagonal of the curvature block in that basis
    (George et al., "Fast approximate natural gradient descent in a Kronecker-factored
    eigenbasis", 2018, eq. 7),

    .. math:: S_{ij} = \sum_b w_b \sum_{k, n} \big( Q_B^\top G_{k,n} Q_A \big)_{ij}^2,
              \qquad G_{k,n} = \sum_r g_{k,n,r} a_{n,r}^\top,

    G_{k,n} the per-sample gradients of the backpropagated vectors (see
    :class:`KFACOperator`), computed in a second pass over the data with the same draws. The
    product is Q_B ((Q_B^T V Q_A) * S) Q_A^T. For sharded data the eigenbases are those of
    the all-reduced factors, the same on every process, and one all_reduce adds the
    processes' sums S. Arguments as for :class:`KFACOperator`.
    """

    def _compute_factors(self) -> None:
        super()._compute_factors()
        bases = {}
        for block in self.blocks:
            bases[id(block)] = torch.linalg.eigh(block.B)[1], torch.linalg.eigh(block.A)[1]
        shapes = [(len(Q_B), len(Q_A)) for Q_B, Q_A in bases.values()]
        corrections = self._sum_over_processes(
            lambda: self._local_corrections(bases), shapes, "eigenvalue corrections"
        )
        self._eigenbases = {
            id(block): (*bases[id(block)], S) for block, S in zip(self.blocks, corrections)
        }

    def _local_corrections(self, bases: dict) -> list[Tensor]:
        """S of every block over this process's data, from the eigenbases (Q_B, Q_A)."""
        S = {
            key: torch.zeros(len(Q_B), len(Q_A), dtype=self.dtype, device=self.device)
            for key, (Q_B, Q_A) in bases.items()
        }
        for weight, layer, a, g in self._backpropagated_rows("eigenvalue correction"):
            for block in (b for b in self.blocks if b.layer is layer):
                Q_B, Q_A = bases[id(block)]
                rows = a if block.has_weight else torch.ones_like(a[..., :1])
                rotated = torch.einsum("knro,nri->knoi", g @ Q_B, rows @ Q_A)
                S[id(block)].add_(rotated.square().sum(dim=(0, 1)), alpha=weight)
        return [S[id(block)] for block in self.blocks]

    def _matmat(self, M: list[Tensor]) -> list[Tensor]:
        def apply(block: KroneckerBlock, V: Tensor) -> Tensor:
            Q_B, Q_A, S = self._eigenbases[id(block)]
            return Q_B @ ((Q_B.T @ V @ Q_A) * S) @ Q_A.T

        return _blockwise(self.blocks, M, apply)

    def inverse(self, damping: float) -> CurvatureLinearOperator:
        """The damped inverse (EKFAC + damping I)^{-1}, block by block (KFACInverseOperator)."""
        return KFACInverseOperator(self, self._eigenbases, damping)


class KFACInverseOperator(CurvatureLinearOperator):
    r"""The damped inverse of a Kronecker-factored operator, block by block, exactly.

    A block with eigenbases Q_B, Q_A and eigenvalues S (b a^T for KFAC; the corrected ones
    for EKFAC) has the damped inverse

    .. math:: (Q_B \otimes Q_A) \operatorname{diag}(S + \lambda)^{-1} (Q_B \otimes Q_A)^\top:
              \quad V \mapsto Q_B \big[ (Q_B^\top V Q_A) \oslash (S + \lambda) \big] Q_A^\top

    (Martens & Grosse, 2015, section 6.3, with exact rather than factored damping).
    """

    SELF_ADJOINT = True

    def __init__(self, kfac: KFACOperator, eigenbases: dict, damping: float):
        if not (isinstance(damping, numbers.Real) and 0 < damping < math.inf):
            raise ValueError(
                f"damping must be positive and finite, got {damping!r}; pass e.g. damping=1e-3."
            )
        super().__init__(kfac.in_shapes, kfac.out_shapes, kfac.dtype, kfac.device)
        self._blocks, self._eigenbases, self._damping = kfac.blocks, eigenbases, damping

    def _matmat(self, M: list[Tensor]) -> list[Tensor]:
        def apply(block: KroneckerBlock, V: Tensor) -> Tensor:
            Q_B, Q_A, S = self._eigenbases[id(block)]
            return Q_B @ ((Q_B.T @ V @ Q_A) / (S + self._damping)) @ Q_A.T

        return _blockwise(self._blocks, M, apply)


def _blockwise(
    blocks: list[KroneckerBlock],
    M: list[Tensor],
    apply: Callable[[KroneckerBlock, Tensor], Tensor],
) -> list[Tensor]:
    """Apply each block's map to its parameters' columns, as matrices V [K, d_out, d_in]."""
    result = [None] * len(M)
    for block in blocks:
        # weights [K, d_out, C_in (kh kw)], biases [K, d_out, 1]
        parts = [M[i].reshape(M[i].shape[0], M[i].shape[1], -1) for i in block.param_indices]
        AV = apply(block, torch.cat(parts, dim=2))
        widths = [p.shape[-1] for p in parts]
        for i, part in zip(block.param_indices, AV.split(widths, dim=2)):
            result[i] = part.reshape(M[i].shape)
    return result


def _output_gradients(
    output: Tensor, calls: dict[nn.Module, list[ModuleCall]], vectors: Tensor
) -> dict[nn.Module, list[Tensor]]:
    """g_k = (dz/df)^T s_k for the output z of every call, each [K, *z.shape]: one batched
    backward for all k and calls; zeros for a z that the model output does not depend on."""
    flat = [call for layer_calls in calls.values() for call in layer_calls]
    edges = [output_edge(call.nodes[0]) for call in flat]
    raw = torch.autograd.grad(output, edges, vectors, is_grads_batched=True, allow_unused=True)
    gradients = iter(
        g if g is not None else _zeros(len(vectors), call) for g, call in zip(raw, flat)
    )
    return {layer: [next(gradients) for _ in layer_calls] for layer, layer_calls in calls.items()}


def _zeros(K: int, call: ModuleCall) -> Tensor:
    """The K gradients of a call output that does not reach the model output."""
    z = call.outputs[0]
    return torch.zeros(K, *z.shape, dtype=z.dtype, device=z.device)


def _input_rows(layer: nn.Module, a: Tensor, joint_bias: bool) -> Tensor:
    """The rows a_r of the layer input, [N, R, d_in] (+ a column of ones for a joint bias):
    for a convolution its unfolded patches, one row per output position."""
    if isinstance(layer, CONVOLUTIONS):
        a = unfold(layer, a).transpose(1, 2)  # [N, positions, C_in prod(kernel)]
    a = a.reshape(a.shape[0], -1, a.shape[-1])
    if joint_bias:
        a = torch.cat([a, torch.ones_like(a[..., :1])], dim=-1)
    return a


def _output_rows(layer: nn.Module, g: Tensor) -> Tensor:
    """The rows g_{k,n,r} of the vectors backpropagated to the layer output, [K, N, R, d_out]."""
    if isinstance(layer, CONVOLUTIONS):
        g = g.flatten(3).transpose(-1, -2)  # [K, N, positions, C_out]
    return g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])
