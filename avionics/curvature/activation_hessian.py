"""The Hessian of the loss w.r.t. an intermediate tensor of the network.

It hooks the one module itself rather than use :class:`avionics.persample.capture.Capture`:
it differentiates twice w.r.t. the tensor Z and compares its values between two passes, so it
needs Z itself (a capture keeps only the shapes of outputs), and it replaces Z by a leaf in
the forward where that is exact, which a capture, which only observes, never does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from avionics.curvature._data import (
    CHUNK_SIZE_INSTEAD,
    MathAttention,
    check_batch,
    check_positive_int,
    forward_keeping_buffers,
)
from avionics.curvature._distributed import refuse_distributed
from avionics.curvature._layer_rules import is_covered, layer_rule
from avionics.curvature._losses import differentiable_output_gradient, output_hessian_product
from avionics.curvature.base import CurvatureLinearOperator
from avionics.distributed import unwrap

IO_TYPES = ("input", "output")


def _check_activation(activation, module_names: list[str]) -> tuple[str, str, int]:
    """``activation`` as (module_name, io, index) if it has that form, with a module name of
    the model, an io type of :data:`IO_TYPES` and an int index; else a ValueError that says
    which part is wrong and what goes there (whether the index exists shows in the forward)."""
    if not isinstance(activation, (tuple, list)) or len(activation) != 3:
        raise ValueError(
            f"activation must be a tuple (module_name, io, index): a module name of the model "
            f"(one of {module_names}), io one of {IO_TYPES}, and index the position in that "
            f"module's input or output tuple (0 for single-tensor layers), e.g. "
            f"({module_names[-1]!r}, 'output', 0); got {activation!r}."
        )
    module_name, io, index = activation
    if module_name not in module_names:
        raise ValueError(
            f"The model has no module named {module_name!r}; the available names are "
            f"{module_names}."
        )
    if io not in IO_TYPES:
        raise ValueError(f"The io type must be one of {IO_TYPES}, got {io!r}.")
    if not isinstance(index, int) or isinstance(index, bool):
        raise ValueError(
            f"activation {tuple(activation)}: the index must be an int, the position in the "
            f"module's {io} tuple (0 for single-tensor layers), got {index!r} (a "
            f"{type(index).__name__})."
        )
    return module_name, io, index


def _layers_after(model: nn.Module, module: nn.Module, io: str) -> list[nn.Module] | None:
    """The modules applied to Z, in order, where ``model`` is a plain nn.Sequential (no hooks)
    and Z is its own input or output or that of one of its children (called once); else None."""
    if type(model) is not nn.Sequential or model._forward_hooks or model._forward_pre_hooks:
        return None
    children = list(model)
    if module is model:
        return children if io == "input" else []
    positions = [i for i, child in enumerate(children) if child is module]
    if len(positions) != 1:
        return None
    return children[positions[0] + (io == "output") :]


def _columns_last_hessian(layers, Z: Tensor, output, loss_fn, y) -> Callable | None:
    """V [*Z, K] -> (d2 L / dZ2) V [*Z, K] by the rules of :mod:`._layer_rules`, when every
    layer after Z has one, the loss has a closed-form Hessian and replaying the layers from Z
    gives the network's output; else None.

    Forward, the columns go through the layers, V_{l+1} = J_l V_l; at the output
    U = (d2 L / df2) V; backward, U_l = J_l^T U_{l+1} + diag(sigma_l''(h_l) g_l) V_l with g_l the
    gradient at the output of layer l (Hessian backpropagation, see :mod:`._layer_rules`).
    """
    if not all(is_covered(layer) for layer in layers):
        return None
    with torch.no_grad():
        rules, h = [], Z.detach().clone()  # an in-place layer must not overwrite Z
        for layer in layers:
            rules.append(layer_rule(layer, h))
            h = layer(h)
        if not (isinstance(output, Tensor) and torch.equal(h, output.detach())):
            return None
        gradient = differentiable_output_gradient(loss_fn, h, y)
        if gradient is None:
            return None
        curvatures = []  # of each layer, from the gradient at its output
        for rule in reversed(rules):
            curvatures.insert(0, rule.curvature(gradient))
            gradient = rule.vjp(gradient.unsqueeze(-1)).squeeze(-1)
    loss_product = output_hessian_product(loss_fn, h, y)

    def product(V: Tensor) -> Tensor:
        inputs = []  # V_l where layer l has a second-order term
        for rule, curvature in zip(rules, curvatures):
            inputs.append(None if curvature is None else V)
            V = rule.jvp(V)
        U = loss_product(V)
        for rule, curvature, V in zip(rules[::-1], curvatures[::-1], inputs[::-1]):
            U = rule.vjp(U)
            if curvature is not None:
                U = U.addcmul_(curvature.unsqueeze(-1), V)
        return U

    return product


def _floating_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating-point parameter (None if it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


class ActivationHessianOperator(CurvatureLinearOperator):
    r"""The Hessian d2 L / dZ2 of a batch loss w.r.t. an intermediate tensor Z.

    Z is named by ``activation = (module_name, io, index)``: a name from
    ``model.named_modules()`` ("" is the whole model), ``"input"`` or ``"output"`` of that
    module, and the position in its input tuple or output tuple (0 for single-tensor layers).
    Z is the tensor itself, with every use the network makes of it, so the Hessian w.r.t. the
    input of a layer equals the Hessian w.r.t. the output of the layer feeding it. The
    operator's space has Z's shape including the batch axis (size N dim(z)), and

    .. math:: \nabla^2_Z L \, V = \nabla_Z \big( (\nabla_Z L)^\top V \big)

    by reverse-over-reverse differentiation. The forward pass and the first backward
    (d L / dZ, with its graph) are computed once, at construction; a product is one backward
    through d L / dZ for all columns together (``is_grads_batched``, ``chunk_size`` columns at
    a time), which runs only the part of the graph between Z and the loss. For
    CrossEntropyLoss, MSELoss and BCEWithLogitsLoss d L / dZ is the backward from the network
    output f of the closed-form d L / df (e.g. kappa (softmax f - onehot y)), written with
    elementwise ops and reductions whose backward is batched over the columns (log_softmax's
    double backward is not: it loops over them). The layers before
    Z are constants of the Hessian: a module's output Z is replaced by a leaf in the forward,
    so their graph is not kept; a module's input Z is the tensor given to it, whose graph is kept
    (cutting it there would lose its uses outside the module, e.g. a residual connection),
    unless it does not require grad (the network input): then the module gets a
    differentiable copy. The network runs on from a copy of Z, so an in-place operation after
    it (``ReLU(inplace=True)``) leaves Z as it was.

    One decision, at construction, replaces that backward by a faster product with the columns
    last: where the model is a plain ``nn.Sequential``, Z is its input or output or that of
    one of its children, every module after Z is an ``nn.Linear``, ``nn.ReLU``,
    ``nn.Sigmoid``, ``nn.Tanh`` or ``nn.GELU`` (without hooks), and the loss is one of the
    three above with its closed form, the product is Hessian backpropagation by per-layer rules
    (:mod:`avionics.curvature._layer_rules`): V [*Z, K] goes forward as J V (one batched
    matrix product per Linear, sigma'(h) V per activation), meets d2 L / df2 in closed form,
    and comes back as J^T U plus each activation's second-order term
    diag(sigma''(h) g) V (g the gradient at its output), giving the exact Hessian in the result
    block row-major, with no transpose. Anything else takes the batched backward.

    Its space is the samples of one batch on this process, so with torch.distributed
    initialised it is that batch's Hessian, with no communication (``distributed=True`` is
    refused: a batch is not a shard of a data set whose curvature could be summed).

    Args:
        model: The network (one in ``DistributedDataParallel`` is unwrapped: its ``.module``
            is used, module names as in ``model.module.named_modules()``).
        loss_fn: A loss function ``loss_fn(output, y) -> scalar``.
        activation: ``(module_name, "input" | "output", index)``.
        data: A single batch, as a re-iterable of one (X, y) pair (e.g. ``[(X, y)]``).
        check_deterministic: Refuse a forward pass that gives a different loss or Z when run
            twice (dropout, train-mode BatchNorm, ...).
        chunk_size: At most this many columns are multiplied at once.
        distributed: None or False: the Hessian of this process's batch (True is refused).
    """

    SELF_ADJOINT = True

    def __init__(
        self,
        model: nn.Module,
        loss_fn,
        activation: tuple[str, str, int],
        data: Iterable[tuple[Tensor, Tensor]],
        *,
        check_deterministic: bool = True,
        chunk_size: int | None = 32,
        distributed: bool | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(
                "ActivationHessianOperator needs model to be an nn.Module (it hooks one of its "
                f"modules), got a {type(model).__name__}."
            )
        refuse_distributed(
            distributed,
            "ActivationHessianOperator",
            "its space is the samples of one batch on this process; for the curvature of a "
            "data set sharded across processes use HessianOperator or GGNOperator with "
            "distributed=True.",
        )
        model, _ = unwrap(model)  # a forward through DistributedDataParallel starts collectives
        modules = dict(model.named_modules())
        module_name, io, index = _check_activation(activation, list(modules))
        if chunk_size is not None:
            check_positive_int(
                chunk_size, "chunk_size", "ActivationHessianOperator", CHUNK_SIZE_INSTEAD
            )
        batches = list(data)
        if batches:
            check_batch(batches[0], _floating_dtype(model), "ActivationHessianOperator")
        if len(batches) != 1:
            raise ValueError(
                f"ActivationHessianOperator requires a single batch, got {len(batches)} "
                "batches; pass [(X, y)]."
            )
        self._model, self._loss_fn, self._chunk_size = model, loss_fn, chunk_size
        self._module, self._io, self._index, self._activation = (
            modules[module_name], io, index, activation
        )  # fmt: skip
        self._X, self._y = batches[0]
        with MathAttention():
            self._Z, output, loss = self._forward()
            layers = _layers_after(model, self._module, io)
            self._columns_last = (
                None
                if layers is None
                else _columns_last_hessian(layers, self._Z, output, loss_fn, self._y)
            )
            if self._columns_last is None:
                self._loss_gradient = self._gradient(output, loss)
            if check_deterministic:
                Z, _, second_loss = self._forward()
                if not (torch.equal(Z, self._Z) and torch.equal(second_loss, loss)):
                    raise RuntimeError(
                        "ActivationHessianOperator: two forward passes gave different values. "
                        "Put the model in eval mode (dropout, BatchNorm) or pass "
                        "check_deterministic=False."
                    )
        self.loss = loss.detach()
        super().__init__([self._Z.shape], [self._Z.shape], self._Z.dtype, self._Z.device)

    def _gradient(self, output: Tensor, loss: Tensor) -> Tensor:
        """d L / dZ with its graph: the backward of the closed-form d L / df from f to Z
        where the loss has one (its graph then has batched ops only, so a product's batched
        backward needs no loop over the columns), else the backward of the loss."""
        with torch.enable_grad():
            output_gradient = differentiable_output_gradient(self._loss_fn, output, self._y)
        if output_gradient is None:
            return torch.autograd.grad(loss, self._Z, create_graph=True)[0]
        return torch.autograd.grad(output, self._Z, output_gradient, create_graph=True)[0]

    def _forward(self) -> tuple[Tensor, Tensor, Tensor]:
        """Run the model, capturing Z (made differentiable if it is not), return Z, the
        network output and the loss."""
        captured = []

        def select(values: tuple) -> Tensor:
            if not -len(values) <= self._index < len(values):
                raise IndexError(
                    f"activation {self._activation}: the module's {self._io} has "
                    f"{len(values)} element(s), there is no index {self._index}."
                )
            value = values[self._index]
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"activation {self._activation} is a {type(value).__name__}, not a tensor."
                )
            return value

        def differentiable(values: tuple) -> tuple:
            Z = select(values)
            if self._io == "output" or not Z.requires_grad:  # every later use sees the leaf
                Z = Z.detach().requires_grad_()
            captured.append(Z)
            # The network goes on with a copy, which an in-place operation (ReLU(inplace=True))
            # may overwrite while Z keeps its values.
            return (*values[: self._index % len(values)], Z.clone(),
                    *values[self._index % len(values) + 1 :])  # fmt: skip

        if self._io == "input":
            handle = self._module.register_forward_pre_hook(
                lambda module, args: differentiable(args)
            )
        else:

            def output_hook(module, args, output):
                if isinstance(output, Tensor):
                    return differentiable((output,))[0]
                return type(output)(differentiable(tuple(output)))

            handle = self._module.register_forward_hook(output_hook)
        try:
            with torch.enable_grad():
                output = forward_keeping_buffers(self._model, self._X)
                loss = self._loss_fn(output, self._y)
        finally:
            handle.remove()
        if not captured:
            raise RuntimeError(
                f"activation {self._activation}: the module was not called in the forward pass."
            )
        return captured[-1], output, loss

    def _new_result(self, K: int) -> Tensor:
        if self._columns_last is not None:
            return super()._new_result(K)
        # [K, D] transposed: the batched backward takes and gives the columns on a leading
        # axis, so the result block holds them that way (see _matmat)
        return torch.empty(K, self.shape[0], dtype=self.dtype, device=self.device).T

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        K = M[0].shape[-1]
        chunk = self._chunk_size or K
        for start in range(0, K, chunk):  # columns [*Z, K], chunk_size of them at a time
            columns = slice(start, start + chunk)
            if self._columns_last is not None:
                out[0][..., columns].copy_(self._columns_last(M[0][..., columns]))
                continue
            V, HV = (x[..., columns].movedim(-1, 0) for x in (M[0], out[0]))  # [k, *Z]
            if HV.is_contiguous() and not V.is_contiguous():
                # The backward's matrix products need the columns contiguous on the leading
                # axis: transpose them into the result's memory, which the product then
                # overwrites, rather than into a copy the backward allocates.
                V = HV.copy_(V)
            HV.copy_(self._hessian_columns(V))

    def _hessian_columns(self, V: Tensor) -> Tensor:
        """d2 L / dZ2 applied to the columns of V [k, *Z] (leading axis), in one batched
        backward: [k, *Z]."""
        batched = len(V) > 1
        (HV,) = torch.autograd.grad(
            self._loss_gradient,
            self._Z,
            V if batched else V[0],
            retain_graph=True,
            is_grads_batched=batched,
            materialize_grads=True,
        )
        return HV if batched else HV.unsqueeze(0)
