"""KFAC: a block-diagonal Kronecker-factored approximation of the GGN / Fisher."""

from __future__ import annotations

import math
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
from avionics.curvature.conventions import check_convention, datum_scale, per_column_vectors
from avionics.curvature.kfac_inverse import (
    KFACInverseOperator,
    blockwise,
    check_damping,
    exact_inverse,
    factored_inverse,
    left_product,
    right_product,
)
from avionics.curvature.kfac_rows import CONVOLUTIONS, accumulate_gram, input_rows, output_rows
from avionics.curvature.kfac_state import check_finite, check_state, operator_state
from avionics.persample.capture import Capture, ModuleCall, output_edge

FISHER_TYPES = ("mc", "type-2", "empirical", "forward-only")
KFAC_APPROXIMATIONS = ("expand", "reduce")
SUPPORTED_LAYERS = (nn.Linear, *CONVOLUTIONS)


@dataclass
class KroneckerBlock:
    """One block B (x) A: a layer's weight, its bias, or both (weight first)."""

    layer: nn.Module
    param_indices: list[int]
    has_weight: bool
    has_bias: bool
    names: list[str]
    B: Tensor | None = None  # [d_out, d_out]
    A: Tensor | None = None  # [d_in (+ 1 for a joint bias), same] ([1, 1] for a lone bias)

    def describe(self) -> str:
        return " and ".join(repr(name) for name in self.names)


class KFACOperator(ModelDataOperator):
    r"""KFAC: the GGN (or a Fisher) approximated per layer by a Kronecker product B (x) A.

    Every block belongs to one ``nn.Linear`` or ``nn.Conv1d/2d/3d`` layer z = W a (+ b), a
    its input (for a convolution the unfolded patches, with any padding mode: see
    :func:`~avionics.curvature.kfac_rows.patch_rows`), z its output. With the GGN
    sum_b w_b J_b^T Lambda_b J_b (:class:`~avionics.curvature.ggn.GGNOperator`),
    Lambda_b = sum_k s_k s_k^T, and g_k = (dz/df)^T s_k the vectors backpropagated to z, the
    block of W is approximated by (Martens & Grosse, "Optimizing neural networks with
    Kronecker-factored approximate curvature", 2015, eq. 1; Grosse & Martens, "A
    Kronecker-factored approximate Fisher matrix for convolution layers", 2016)

    .. math:: B \otimes A, \qquad B = \sum_b w_b \sum_{k, r} g_{k,r} g_{k,r}^\top, \qquad
              A = \frac{1}{R} \sum_r a_r a_r^\top,

    r running over the rows of the layer input over the data set (R rows: one per sample,
    or per position for sequences and convolutions, and per call of a layer called more than
    once: the "expand" approximation of Eschenhagen et al., "Kronecker-factored approximate
    curvature for modern neural network architectures", 2023). It is exact for
    single-sample batches without positions and ``fisher_type="type-2"``. On a weight
    V [out, in] the product is B V A; a bias gets its own block with A = 1
    (``separate_weight_and_bias=True``) or joins the weight, with a column of ones appended
    to a.

    ``kfac_approx="reduce"`` (Eschenhagen et al., 2023, section 3) first reduces the rows of
    each sample n (its positions and calls) to its mean input and its summed output vectors,

    .. math:: \bar a_n = \frac{1}{R_n} \sum_{r \in n} a_r, \qquad
              \bar g_{k,n} = \sum_{r \in n} g_{k,r}, \qquad
              B = \sum_b w_b \sum_{k, n} \bar g_{k,n} \bar g_{k,n}^\top, \qquad
              A = \frac{1}{N} \sum_n \bar a_n \bar a_n^\top,

    exact where a layer's outputs are averaged over the shared axis before a linear map and
    an MSE loss (e.g. global average pooling), and the same as "expand" without shared axes.

    The s_k: ``"mc"`` draws labels from the model's predictive distribution
    (:func:`~avionics.curvature._losses.sampled_output_gradients`), ``"type-2"`` is the exact
    square root of the loss Hessian (one s_k per output dimension and position), and
    ``"empirical"`` the gradients at the true labels (the empirical Fisher).
    ``"forward-only"`` is FOOF (Benzing, "Gradient descent on neurons and its link to
    approximate second-order optimization", 2022): B = I, no backward pass, I (x) A.

    The two conventions, side by side (``convention``; see
    :mod:`~avionics.curvature.conventions`):

    * ``"avionics"`` (default, the definitions above): for ``"type-2"`` every column of
      every sample's and position's loss-Hessian square root is backpropagated on its own
      (Lambda_b exactly, no products between positions); for ``"empirical"`` Lambda_b is
      that of :class:`~avionics.curvature.ef.EFOperator`, a datum a sample.
    * ``"curvlinops"`` (curvlinops' KFACLinearOperator and EKFACLinearOperator, the same
      numbers): the output rows (class axis split off) are the data; ``"type-2"``
      backpropagates one vector s_c per column c of the rows' square roots, all rows at
      once (B gains the products between positions where a layer's rows reach several
      output rows, e.g. before an attention), and ``"empirical"`` scales B by
      rho_b / B_b (rows, times C for MSELoss and BCEWithLogitsLoss, per sample, with
      reduction "mean"). Without positions the two agree, but for that factor C of the
      empirical B; ``"forward-only"`` is the same in both, ``"mc"`` too in expectation (the
      libraries draw differently). Weight sharing across modules and calls:

      - a weight several modules hold (tied): curvlinops writes each module's block over
        the previous one's, so the weight gets the block of the last module that holds it
        (its factors from that module's rows only), each module's bias its own; avionics'
        convention takes the first module's. (curvlinops' trace, logdet and norm still add
        every module's block; ours are those of the matrix.) With
        ``separate_weight_and_bias=False`` curvlinops' product is not symmetric there (an
        earlier module's bias reads the weight's columns), and convention="curvlinops"
        refuses it;
      - a layer called more than once: curvlinops adds each call's factors, A = sum_c A_c
        with A_c = (1/N) sum_n (1/R_c) sum_{r in c} a_r a_r^T (R_c the call's rows per
        sample; for "reduce" A_c = (1/N) sum_n abar_{n,c} abar_{n,c}^T and B = sum_c B_c,
        every call reduced on its own), where avionics' convention averages over all calls'
        rows together (as the definitions above say). curvlinops' EKFAC pairs every call's
        output gradients with the last call's inputs, no defined matrix:
        ``EKFACOperator`` refuses a layer called more than once in that convention.

    From the factors, exactly for the matrix B (x) A itself: :meth:`trace`, :meth:`det`,
    :meth:`logdet`, :meth:`frobenius_norm` (tr(B (x) A) = tr B tr A, det = det(B)^{d_A}
    det(A)^{d_B}, ||B (x) A||_F = ||B||_F ||A||_F, summed or multiplied over the blocks);
    :meth:`inverse` with exact, per-factor or heuristic (pi) damping
    (:class:`~avionics.curvature.kfac_inverse.KFACInverseOperator`); :meth:`state_dict`,
    :meth:`load_state_dict` and :meth:`from_state_dict` to store the factors and rebuild the
    operator without a pass over the data.

    Args:
        model: The network (an ``nn.Module``).
        loss_fn: ``MSELoss``, ``CrossEntropyLoss`` or ``BCEWithLogitsLoss``, reduction "mean"
            or "sum".
        params: Weights and biases of Linear and (one-group) Conv1d/2d/3d layers; ``None``
            for all parameters that require grad.
        data: A re-iterable of (X, y) batches.
        fisher_type: ``"mc"`` (default), ``"type-2"``, ``"empirical"`` or ``"forward-only"``.
        mc_samples: Labels drawn per output for ``"mc"``.
        seed: Seed of the draws.
        separate_weight_and_bias: Give each bias its own block.
        kfac_approx: ``"expand"`` (default) or ``"reduce"``, for layers with shared axes.
        convention: ``"avionics"`` (default) or ``"curvlinops"`` (see above; MSELoss,
            CrossEntropyLoss and BCEWithLogitsLoss only).
        **kwargs: ``num_data``, ``batch_size_fn``, ``check_deterministic``, ``progressbar``,
            ``distributed``.

    With ``data`` a shard of a data set across torch.distributed processes (``distributed``,
    see :class:`~avionics.curvature._data.ModelDataOperator`), the factors are those of the
    whole data set: each process sums sum_r a_r a_r^T, B and the row count R of every layer
    over its shard, one all_reduce adds them at construction, and A is divided by the total
    R. The draws of ``"mc"`` are seeded per batch (by its index in the data set, shards in
    rank order), so sharded data gets the factors of one process with all the batches. The
    products then need no communication.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from avionics.curvature import KFACOperator
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(3, 2).double()
        >>> X, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
        >>> K = KFACOperator(model, nn.CrossEntropyLoss(), None, [(X, y)], fisher_type="type-2")
        >>> dense = K @ torch.eye(K.shape[1], dtype=torch.float64)
        >>> bool(torch.isclose(K.trace(), torch.trace(dense)))
        True
        >>> inverse = K.inverse(1e-2, mode="heuristic")
        >>> (inverse @ (K @ torch.ones(8, dtype=torch.float64))).shape
        torch.Size([8])
    """

    FISHER_TYPES = FISHER_TYPES
    STATE_FACTORS = ("B", "A")
    PRODUCTS_PASS_OVER_DATA = False  # they read the stored factors only

    def __init__(self, model: nn.Module, loss_fn, params, data, *, fisher_type: str = "mc",
                 mc_samples: int = 1, seed: int = 0, separate_weight_and_bias: bool = True,
                 kfac_approx: str = "expand", convention: str = "avionics",
                 check_deterministic: bool = True, **kwargs):  # fmt: skip
        self._configure(model, loss_fn, params, data, fisher_type=fisher_type,
                        mc_samples=mc_samples, seed=seed, kfac_approx=kfac_approx,
                        separate_weight_and_bias=separate_weight_and_bias,
                        convention=convention, **kwargs)  # fmt: skip
        self._compute_factors()
        if check_deterministic:
            self._check_deterministic()

    def _configure(self, model, loss_fn, params, data, *, fisher_type: str, mc_samples: int,
                   seed: int, kfac_approx: str, separate_weight_and_bias: bool,
                   convention: str = "avionics", **kwargs) -> None:  # fmt: skip
        """Check the arguments, resolve the parameters and find the blocks (no factors)."""
        owner = type(self).__name__
        if not isinstance(model, nn.Module):
            raise TypeError(f"{owner} needs the model as an nn.Module (it hooks its layers).")
        if fisher_type not in self.FISHER_TYPES:
            raise ValueError(
                f"{owner}: fisher_type must be one of {self.FISHER_TYPES}, got {fisher_type!r}."
            )
        if kfac_approx not in KFAC_APPROXIMATIONS:
            raise ValueError(
                f"{owner}: kfac_approx must be one of {KFAC_APPROXIMATIONS}, got {kfac_approx!r}."
            )
        if fisher_type == "mc":
            check_samplable(loss_fn)
        self._convention = check_convention(convention, loss_fn, owner)
        self._fisher_type = fisher_type
        self._mc_samples = check_positive_int(
            mc_samples, "mc_samples", owner, "pass the number of draws, e.g. 1"
        )
        self._seed = check_seed(seed, owner)
        self._separate_weight_and_bias = bool(separate_weight_and_bias)
        self._kfac_approx = kfac_approx
        super().__init__(model, loss_fn, params, data, check_deterministic=False, **kwargs)
        self._unchecked: list[dict[str, Tensor]] | None = None  # see from_state_dict
        self.blocks = self._find_blocks()
        self._spectra: dict[int, tuple[Tensor, Tensor, Tensor, Tensor, Tensor]] = {}

    @property
    def FIXED_DATA_ORDER(self) -> bool:  # noqa: N802 (the base class's attribute)
        """For ``"mc"``, whose draws are seeded by the batch's index (the determinism check
        compares the outputs batch by batch); the other types sum the batches in any order."""
        return self._fisher_type == "mc"

    @property
    def blocks(self) -> list[KroneckerBlock]:
        """The Kronecker blocks, in parameter order, with their factors B and A. (Factors
        loaded by :meth:`from_state_dict` are checked finite here, at their first use.)"""
        if self._unchecked is not None:
            check_finite(self, self._unchecked, f"{type(self).__name__}.from_state_dict")
            self._unchecked = None
        return self._blocks

    @blocks.setter
    def blocks(self, blocks: list[KroneckerBlock]) -> None:
        self._blocks = blocks

    def _configuration(self) -> dict:
        """What the factors depend on besides the model and data (for :meth:`state_dict`)."""
        return {
            "fisher_type": self._fisher_type,
            "mc_samples": self._mc_samples,
            "seed": self._seed,
            "separate_weight_and_bias": self._separate_weight_and_bias,
            "kfac_approx": self._kfac_approx,
            "convention": self._convention,
        }

    def _find_blocks(self) -> list[KroneckerBlock]:
        """One block per weight and bias (or per layer, weight and bias joined), in module
        order. A weight that several modules hold (tied) is named after its first module and
        gets the block of one of them: the first in avionics' convention, the last in
        curvlinops' (whose product writes every module's block over the previous ones)."""
        index = {name: i for i, name in enumerate(self._param_names)}
        by_identity = {}  # of every parameter, for those held under a second name (tied)

        def position(name: str, tensor: Tensor | None) -> int | None:
            if name in index or tensor is None:
                return index.get(name)
            if not by_identity:
                by_identity.update(
                    {id(p): index.get(n) for n, p in self._model.named_parameters()}
                )
            return by_identity.get(id(tensor))

        blocks, weight_blocks = [], {}  # weight_blocks: parameter index -> its block
        for layer_name, layer in self._model.named_modules():
            if not isinstance(layer, SUPPORTED_LAYERS):
                continue
            prefix = f"{layer_name}." if layer_name else ""
            weight = position(prefix + "weight", layer.weight)
            bias = position(prefix + "bias", layer.bias)
            if weight is None and bias is None:
                continue
            if isinstance(layer, CONVOLUTIONS) and layer.groups != 1:
                raise ValueError(
                    f"{type(self).__name__}: layer {layer_name!r} is a {type(layer).__name__} "
                    "with groups "
                    f"({layer.groups}), which is not supported; leave its parameters out."
                )
            if weight in weight_blocks:  # a tied weight, already held by an earlier module
                if self._convention == "avionics":
                    weight = None
                elif not self._separate_weight_and_bias:
                    raise ValueError(
                        f"{type(self).__name__}: the weight {self._param_names[weight]!r} is "
                        f"shared by several modules (also {layer_name!r}); with "
                        "convention='curvlinops' and separate_weight_and_bias=False, "
                        "curvlinops' product is not symmetric there (an earlier module's "
                        "bias reads the weight's columns, the weight not the bias's); pass "
                        "separate_weight_and_bias=True or convention='avionics'."
                    )
                else:
                    blocks.remove(weight_blocks.pop(weight))
            names = self._param_names
            if weight is not None and bias is not None and not self._separate_weight_and_bias:
                blocks.append(
                    KroneckerBlock(layer, [weight, bias], True, True, [names[weight], names[bias]])
                )
                weight_blocks[weight] = blocks[-1]
                continue
            if weight is not None:
                blocks.append(KroneckerBlock(layer, [weight], True, False, [names[weight]]))
                weight_blocks[weight] = blocks[-1]
            if bias is not None:
                blocks.append(KroneckerBlock(layer, [bias], False, True, [names[bias]]))
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
        identities = {}  # FOOF: B = I, one per layer (nothing was summed for it)
        for block in self.blocks:
            A_sum, B, rows = factors[id(block.layer)]
            if self._fisher_type == "forward-only":
                if id(block.layer) not in identities:
                    d_out = block.layer.weight.shape[0]
                    identities[id(block.layer)] = torch.eye(d_out, dtype=self.dtype,
                                                            device=self.device)  # fmt: skip
                B = identities[id(block.layer)]
            block.B = B
            block.A = A_sum.div_(float(rows)) if block.has_weight else one  # one per layer

    def _local_factor_sums(self) -> list[Tensor]:
        """[sum_r a_r a_r^T, B, R] of every layer in turn, over this process's data."""
        layers = self._layers()
        sums = {id(layer): [None, None] for layer in layers}  # [sum_r a_r a_r^T, B]
        rows = {id(layer): 0 for layer in layers}
        for weight, layer, a, g, calls in self._backpropagated_rows("Kronecker factors"):
            # curvlinops' A of a layer called more than once: each call's rows averaged
            per_call = len(calls) > 1 and self._convention == "curvlinops"
            samples = len(a)
            if per_call:
                a, g = _curvlinops_calls(a, g, calls, self._kfac_approx)
            elif self._kfac_approx == "reduce":  # one row per sample: mean a, summed g
                a, g = a.mean(dim=1), None if g is None else g.sum(dim=2)
            a = a.flatten(0, -2)
            layer_sums = sums[id(layer)]
            accumulate_gram(layer_sums, 0, a, 1.0)
            if g is not None:
                accumulate_gram(layer_sums, 1, g.flatten(0, -2), weight)
            rows[id(layer)] += samples if per_call else len(a)
        result = []
        for layer in layers:
            for i, shape in enumerate(self._factor_shapes(layer)[:2]):  # FOOF: B's is [0]
                if sums[id(layer)][i] is None:
                    sums[id(layer)][i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            R = torch.tensor(float(rows[id(layer)]), dtype=torch.float64, device=self.device)
            result += [*sums[id(layer)], R]  # R in float64: an exact count
        return result

    def _factor_shapes(self, layer: nn.Module) -> list[tuple[int, ...]]:
        """The shapes of a layer's sums: [d_in (+ 1), same], [d_out, d_out] ([0] for
        ``"forward-only"``, whose B = I needs no sum), []."""
        joint = any(b.layer is layer and b.has_bias for b in self.blocks if b.has_weight)
        d_out = layer.weight.shape[0]
        d_in = layer.weight.numel() // d_out + joint
        B_shape = (0,) if self._fisher_type == "forward-only" else (d_out, d_out)
        return [(d_in, d_in), B_shape, ()]

    def _layers(self) -> list[nn.Module]:
        return list({id(block.layer): block.layer for block in self.blocks}.values())

    def _backpropagated_rows(self, desc: str):
        """Per batch and layer: (w_b, layer, a [N, R, d_in (+1)], g [K, N, R, d_out], the
        rows per sample of each call); g is None for ``"forward-only"`` (no backward pass).

        The rows of all calls of a layer are concatenated, call after call. The draws of a
        batch are seeded by its index in the data set
        (:func:`~avionics.curvature._losses.batch_generator`), so every pass sees the same
        sample, and sharded data the sample of one process.
        """
        layers = self._layers()
        joint = {id(b.layer) for b in self.blocks if b.has_weight and b.has_bias}
        forward_only = self._fisher_type == "forward-only"
        capture = None if forward_only else Capture(self._model, layers)
        with MathAttention():
            for index, (X, y) in enumerate(self._batches(desc), start=self._first_batch):
                gradients = None
                if forward_only:  # no backward pass: the inputs of a forward without a graph
                    inputs = self._layer_inputs(X, layers)
                else:
                    output, calls = self._forward(X, capture, layers)
                    inputs = {layer: [c.args[0].detach() for c in calls[layer]]
                              for layer in layers}  # fmt: skip
                    generator = batch_generator(self._seed, index, self.device)
                    vectors = self._output_vectors(output.detach(), y, generator)  # [K, *f]
                    gradients = _output_gradients(output, calls, vectors)
                weight = self._batch_weight(X)
                for layer in layers:
                    a = [input_rows(layer, x, id(layer) in joint) for x in inputs[layer]]
                    g = None
                    if gradients is not None:
                        g = _concatenated([output_rows(layer, t) for t in gradients[layer]], 2)
                    yield weight, layer, _concatenated(a, 1), g, [len(t[0]) for t in a]

    def _forward(
        self, X, capture: Capture, layers: list[nn.Module]
    ) -> tuple[Tensor, dict[nn.Module, list[ModuleCall]]]:
        """Run the model; return its output (in the graph) and each layer's calls."""
        capture.arm()
        try:
            with torch.enable_grad():  # the capture records calls with gradients enabled
                output = forward_keeping_buffers(self._model, X)
        finally:
            capture.disarm()
        calls = {layer: [c for c in capture.calls if c.module is layer] for layer in layers}
        capture.release()
        self._check_called(calls)
        return output, calls

    def _layer_inputs(self, X, layers: list[nn.Module]) -> dict[nn.Module, list[Tensor]]:
        """The input of every call of each layer, by forward pre-hooks on a forward pass
        without autograd (``"forward-only"`` needs no graph)."""
        inputs = {layer: [] for layer in layers}
        handles = [layer.register_forward_pre_hook(
            lambda module, args: inputs[module].append(args[0])) for layer in layers]  # fmt: skip
        try:
            with torch.no_grad():
                forward_keeping_buffers(self._model, X)
        finally:
            for handle in handles:
                handle.remove()
        self._check_called(inputs)
        return inputs

    def _check_called(self, calls: dict[nn.Module, list]) -> None:
        not_called = [name for name, m in self._model.named_modules() if m in calls
                      and not calls[m]]  # fmt: skip
        if not_called:
            raise ValueError(
                f"{type(self).__name__}: the layers {not_called} were not called in the forward "
                "pass "
                "(e.g. the out_proj of nn.MultiheadAttention, whose weight is used directly), "
                "so their inputs and outputs cannot be seen; leave their parameters out."
            )

    def _output_vectors(self, output: Tensor, y: Tensor, generator) -> Tensor:
        """The s_k, stacked [K, *output.shape], with Lambda_b = sum_k s_k s_k^T."""
        if self._fisher_type == "mc":
            S, kappa = sampled_output_gradients(self._loss_fn, output, self._mc_samples, generator)
            return (kappa / self._mc_samples) ** 0.5 * S
        curvlinops = self._convention == "curvlinops"
        if self._fisher_type == "type-2":
            roots = output_hessian_square_root(self._loss_fn, output, y)
            return per_column_vectors(roots, output, self._loss_fn) if curvlinops else roots
        # empirical: Lambda_b = blockdiag_n(G_n G_n^T) / c_b (see EFOperator), or rho_b
        # blockdiag_r(G_r G_r^T) in curvlinops' convention (avionics.curvature.conventions)
        G = grad(lambda f: self._loss_fn(f, y))(output)
        inverse_c = output.shape[0] if self._loss_fn.reduction == "mean" else 1.0
        if curvlinops:
            inverse_c = datum_scale(output, self._loss_fn, type(self).__name__)
        return (inverse_c**0.5 * G).unsqueeze(0)

    # ---------------------------------------------------------------------------------------
    # Products
    # ---------------------------------------------------------------------------------------

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        def apply(block: KroneckerBlock, V: Tensor, result: Tensor) -> None:
            left_product(block.B, right_product(V, block.A), result)  # B V A

        blockwise(self.blocks, M, out, apply)

    def _spectrum(self, block: KroneckerBlock) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(Q_B, Q_A, b, a, S) of a block: the eigendecompositions of its factors and the
        eigenvalues S of the block in the basis Q_B (x) Q_A (b a^T for KFAC), cached."""
        if id(block) not in self._spectra:
            (b, Q_B), (a, Q_A) = torch.linalg.eigh(block.B), torch.linalg.eigh(block.A)
            self._spectra[id(block)] = (Q_B, Q_A, b, a, torch.outer(b, a))
        return self._spectra[id(block)]

    # ---------------------------------------------------------------------------------------
    # From the factors: inverse, trace, determinant, Frobenius norm
    # ---------------------------------------------------------------------------------------

    def inverse(self, damping: float | tuple[float, float], *, mode: str = "exact",
                min_damping: float = 1e-8) -> CurvatureLinearOperator:  # fmt: skip
        """The damped inverse, block by block (:class:`KFACInverseOperator`, which states
        the modes): ``"exact"`` (B (x) A + damping I)^{-1}, ``"factors"``
        (B + lambda_B I)^{-1} (x) (A + lambda_A I)^{-1} with damping = lambda or
        (lambda_A, lambda_B), ``"heuristic"`` the factored damping with Martens & Grosse's pi
        (``min_damping`` the least damping of a factor)."""
        owner = type(self).__name__
        damping = check_damping(damping, mode, min_damping, owner)
        inverses, inverted = {}, {}
        for block in self.blocks:
            if mode == "exact":
                Q_B, Q_A, _, _, S = self._spectrum(block)
                inverses[id(block)] = exact_inverse(block, Q_B, Q_A, S, damping, owner)
            else:
                inverses[id(block)] = factored_inverse(block, damping, mode, min_damping, owner,
                                                       inverted)  # fmt: skip
        return KFACInverseOperator(self, inverses)

    def trace(self) -> Tensor:
        """tr = sum_blocks tr(B) tr(A), exactly."""
        return sum(torch.trace(b.B) * torch.trace(b.A) for b in self.blocks)

    def logdet(self) -> Tensor:
        """log det = sum_blocks (d_A log det B + d_B log det A); -inf if a factor is singular
        to working precision (its Cholesky factorisation fails)."""
        return sum(len(b.A) * _logdet(b.B) + len(b.B) * _logdet(b.A) for b in self.blocks)

    def det(self) -> Tensor:
        """det = prod_blocks det(B)^{d_A} det(A)^{d_B}; over- and underflows easily: prefer
        :meth:`logdet`."""
        return math.prod(torch.linalg.det(b.B) ** len(b.A) * torch.linalg.det(b.A) ** len(b.B)
                         for b in self.blocks)  # fmt: skip

    def frobenius_norm(self) -> Tensor:
        """||K||_F = sqrt(sum_blocks ||B||_F^2 ||A||_F^2)."""
        return sum(b.B.square().sum() * b.A.square().sum() for b in self.blocks).sqrt()

    # ---------------------------------------------------------------------------------------
    # State: the factors, to store and load without a pass over the data
    # ---------------------------------------------------------------------------------------

    def _factor_state(self) -> list[dict[str, Tensor]]:
        return [{"B": block.B, "A": block.A} for block in self.blocks]

    def _load_factor_state(self, factors: list[dict[str, Tensor]]) -> None:
        for block, entry in zip(self.blocks, factors):
            block.B, block.A = entry["B"], entry["A"]
        self._spectra = {}

    def state_dict(self) -> dict:
        """The factors with what they were computed for: the operator's kind, the parameter
        names, the block layout, ``num_data`` and the configuration (fisher_type,
        mc_samples, seed, separate_weight_and_bias, kfac_approx, convention). Not the model's own
        parameters: store ``model.state_dict()`` beside it."""
        return operator_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Replace the factors by those of ``state`` (from :meth:`state_dict`), after checking
        that everything in it matches this operator and its factors are finite; nothing
        changes otherwise."""
        factors = check_state(self, state)
        self._unchecked = None  # factors loaded before are replaced unseen
        self._load_factor_state(factors)

    @classmethod
    def from_state_dict(cls, state: dict, model: nn.Module, loss_fn, params, data, *,
                        check_deterministic: bool = False, **kwargs):  # fmt: skip
        """The operator of ``state`` (from :meth:`state_dict`) on ``model``, ``loss_fn``,
        ``params`` and ``data`` with the stored factors, configuration and ``num_data``: no
        pass over the data (a later pass, e.g. ``check_deterministic``, checks that its size
        is the stored ``num_data``; sharded data is counted, as every process needs the
        shards' sizes). ``kwargs``: ``batch_size_fn``, ``progressbar``, ``distributed``.

        Everything in the state is checked here but the factors' finiteness, which is checked
        at their first use (a product, :meth:`inverse`, a scalar, :meth:`state_dict`,
        ``blocks``), or here with ``check_deterministic``: a factor with a NaN or inf entry
        raises a ValueError naming it."""
        configuration = state.get("configuration") if isinstance(state, dict) else None
        if not isinstance(configuration, dict):
            raise ValueError(
                f"{cls.__name__}.from_state_dict needs the dict that state_dict() returns, got "
                f"{type(state).__name__} without a 'configuration'."
            )
        num_data = state.get("num_data")
        if not isinstance(num_data, int) or isinstance(num_data, bool) or num_data < 1:
            raise ValueError(
                f"{cls.__name__}.from_state_dict: the state's num_data must be a positive int, "
                f"got {num_data!r} (is it from state_dict()?)."
            )
        operator = cls.__new__(cls)
        operator._configure(model, loss_fn, params, data, **configuration, num_data=num_data,
                            **kwargs)  # fmt: skip
        # the factors are checked finite at their first use (any product, inverse, scalar or
        # state): the check reads every entry, as long as loading all the rest
        factors = check_state(operator, state, finite=False)
        operator._load_factor_state(factors)
        if check_deterministic:  # the whole check: the factors too, and the passes
            check_finite(operator, factors, f"{cls.__name__}.from_state_dict")
            operator._check_deterministic()
        else:
            operator._unchecked = factors
        return operator


def _logdet(factor: Tensor) -> Tensor:
    """log det of a positive semi-definite factor by Cholesky, 2 sum log diag(L); -inf where
    the factor is singular to working precision (its Cholesky factorisation fails)."""
    L, info = torch.linalg.cholesky_ex(factor)
    if int(info) != 0:
        return torch.tensor(-math.inf, dtype=factor.dtype, device=factor.device)
    return 2 * torch.diagonal(L).log().sum()


def _curvlinops_calls(a: Tensor, g: Tensor | None, calls: list[int], kfac_approx: str):
    """Rows a [N, R, d_A] and g [K, N, R, d_out] of a layer called more than once, made
    so that the Gram matrices over samples are curvlinops' factors: the sum over the calls c
    of each call's A_c (its rows averaged) and B_c. For "expand" each call's rows a are
    scaled by 1 / sqrt(R_c), its R_c rows per sample (A = (1/N) sum_c (1/R_c) sum_r a a^T);
    for "reduce" every call is reduced on its own (mean a, summed g): one row per sample and
    call."""
    a_calls = a.split(calls, dim=1)
    if kfac_approx == "reduce":
        a = torch.stack([part.mean(dim=1) for part in a_calls], dim=1)
        if g is not None:
            g = torch.stack([part.sum(dim=2) for part in g.split(calls, dim=2)], dim=2)
        return a, g
    return torch.cat([part / math.sqrt(len(part[0])) for part in a_calls], dim=1), g


def _concatenated(tensors: list[Tensor], dim: int) -> Tensor:
    """The tensors of a layer's calls joined along ``dim`` (no copy for a single call)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def _output_gradients(
    output: Tensor, calls: dict[nn.Module, list[ModuleCall]], vectors: Tensor
) -> dict[nn.Module, list[Tensor]]:
    """g_k = (dz/df)^T s_k for the output z of every call, each [K, *z.shape]: one batched
    backward for all k and calls (a plain one for K = 1: vmap's per-operation overhead, e.g.
    on GELU's backward, was 40% of a GPT's factor pass); zeros for a z that the model output
    does not depend on."""
    flat = [call for layer_calls in calls.values() for call in layer_calls]
    edges = [output_edge(call.nodes[0]) for call in flat]
    if len(vectors) == 1:  # one vector (e.g. one MC draw): a plain backward, without vmap
        raw = torch.autograd.grad(output, edges, vectors[0], allow_unused=True)
        raw = [None if g is None else g.unsqueeze(0) for g in raw]
    else:
        raw = torch.autograd.grad(output, edges, vectors, is_grads_batched=True, allow_unused=True)
    gradients = iter(
        g if g is not None else _zeros(len(vectors), call) for g, call in zip(raw, flat)
    )
    return {layer: [next(gradients) for _ in layer_calls] for layer, layer_calls in calls.items()}


def _zeros(K: int, call: ModuleCall) -> Tensor:
    """The K gradients of a call output that does not reach the model output."""
    z = call.outputs[0]
    return torch.zeros(K, *z.shape, dtype=z.dtype, device=z.device)
