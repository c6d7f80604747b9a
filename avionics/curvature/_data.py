"""The machinery shared by the operators that are defined by a model, a loss and a data set.

A curvature operator represents a matrix summed over the batches of a data set. With the loss
of batch b, L_b = loss_fn(f(theta, X_b), y_b), reduced by its own ``reduction``, the data-set
loss is

    L(theta) = sum_b w_b L_b(theta),   w_b = B_b / N  ("mean"),   w_b = 1  ("sum"),   (1)

(B_b the batch size, N the number of data), which is the mean (sum) of the per-sample losses
over the whole data set. Every operator on (1) is the w_b-weighted sum of its per-batch
matrices; subclasses implement the product of one batch's matrix, :meth:`_matmat_batch`.
When the data set is sharded across torch.distributed processes, the sum runs over this
process's batches and one all_reduce adds the processes' sums (:mod:`._distributed`).

Each pass over the data runs with PyTorch's math kernel for ``scaled_dot_product_attention``,
whose double backward exists (the default fused CPU kernels have none), and without the fused
fast path of ``nn.MultiheadAttention`` (no forward-mode derivatives), so that curvature products
through attention just work.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value
from tqdm import tqdm

from avionics.curvature._columns import COLUMN_BLOCK_BYTES, linearisation_bytes, map_columns
from avionics.curvature._distributed import data_world, sum_on_every_process
from avionics.curvature.base import CurvatureLinearOperator
from avionics.distributed import unwrap

ModelFunction = Callable[..., Tensor]
ColumnProduct = Callable[[list[Tensor]], list[Tensor]]
Batch = tuple[Tensor | Mapping, Tensor]

DETERMINISM_RTOL, DETERMINISM_ATOL = 1e-5, 1e-7
CHUNK_SIZE_INSTEAD = "pass None to multiply all columns at once"


class MathAttention:
    """Attention that automatic differentiation can go through in every mode, while entered
    (``with MathAttention():``, or entered and exited apart: the cockpit keeps it from one
    step's end to the next step's for a forward it does not run).

    Selects the math kernel of ``scaled_dot_product_attention`` (the fused CPU kernels have no
    double backward) and turns off the fast path of ``nn.MultiheadAttention`` (a fused kernel
    without forward-mode derivatives, taken whenever autograd is not recording). The flags are
    torch's global ones, saved on entering and restored on exiting.
    """

    _FLAGS = (
        (torch.backends.mha.get_fastpath_enabled, torch.backends.mha.set_fastpath_enabled),
        (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
        (
            torch.backends.cuda.mem_efficient_sdp_enabled,
            torch.backends.cuda.enable_mem_efficient_sdp,
        ),
        (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
        (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
    )
    _MATH = (False, False, False, False, True)

    def __enter__(self) -> MathAttention:
        self._saved = [get() for get, _ in self._FLAGS]
        for (_, set_flag), value in zip(self._FLAGS, self._MATH, strict=True):
            set_flag(value)
        return self

    def __exit__(self, *exc_info) -> None:
        for (_, set_flag), value in zip(self._FLAGS, self._saved, strict=True):
            set_flag(value)


@contextmanager
def functional_pass():
    """The context of a torch.func pass: math attention, and no autograd graph outside the
    transforms (the module's own parameters that are not differentiated may require grad)."""
    with torch.no_grad(), MathAttention():
        yield


def forward_keeping_buffers(
    model: nn.Module, X: Tensor | Mapping, tensors: Mapping[str, Tensor] | None = None
) -> Tensor:
    """``model(X)``, optionally with ``tensors`` (name -> tensor) in place of the module's own,
    leaving the model's buffers as they were.

    The buffers a forward pass updates in place (running statistics of train-mode norms, see
    :func:`_updated_buffers`) are replaced by fresh copies for the call: the model is left as
    it was found, also when the pass raises, and torch.func, which cannot mutate captured
    tensors, can transform the call.
    """
    copies = {name: model.get_buffer(name).clone() for name in _updated_buffers(model)}
    return functional_call(model, {**(tensors or {}), **copies}, (X,))


def _updated_buffers(model: nn.Module) -> list[str]:
    """Names of the buffers a forward pass updates: running statistics of train-mode norms."""
    return [
        f"{module_name}.{buffer_name}" if module_name else buffer_name
        for module_name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.training
        for buffer_name, _ in module.named_buffers(recurse=False)
    ]


def check_positive_int(value, name: str, owner: str, instead: str) -> int:
    """``value`` as an int if it is a positive integer; else a ValueError that names ``name``,
    shows the value and says what to pass ``instead``."""
    if _is_integer(value) and value > 0:
        return int(value)
    raise ValueError(
        f"{owner}: {name} must be a positive integer, got {value!r} (a "
        f"{type(value).__name__}); {instead}."
    )


def check_seed(seed, owner: str) -> int:
    """``seed`` as an int (what ``torch.Generator.manual_seed`` takes); else a ValueError."""
    if _is_integer(seed):
        return int(seed)
    raise ValueError(
        f"{owner}: seed must be an integer, got {seed!r} (a {type(seed).__name__}); pass e.g. "
        "seed=0."
    )


def _is_integer(value) -> bool:
    """An integer of any integral type (Python, NumPy), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_batch(batch, dtype: torch.dtype | None, owner: str) -> None:
    """Refuse a batch that is not an (inputs, targets) pair, or whose floating-point inputs
    are not in ``dtype`` (the model's; ``None``: not checked).

    The two usual slips, ``data=[X]`` and an unwrapped ``data=(X, y)``, both make the first
    element of ``data`` a tensor where a pair is expected.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(
            f"{owner}: data must be an iterable of (inputs, targets) batches (a list of (X, y) "
            f"pairs or a DataLoader), but its first element is {_describe(batch)}; for a single "
            f"batch pass data=[(X, y)]."
        )
    if dtype is None:
        return
    X = batch[0]
    for x in X.values() if isinstance(X, Mapping) else [X]:
        if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != dtype:
            raise ValueError(
                f"{owner}: the inputs in data are {_describe(x)}, but the model computes in "
                f"{dtype}; pass data in the model's dtype, e.g. [(X.to({dtype}), y)] "
                "(X.float() for float32)."
            )


def _describe(value) -> str:
    """A value's kind for an error message: its type, a tensor's dtype and shape, a string's
    or number's value."""
    if isinstance(value, (str, numbers.Number)):
        return f"the {type(value).__name__} {value!r}"
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} elements"
    return f"a {type(value).__name__}"


def accumulate(out: list[Tensor], parts: list[Tensor], weight: float, first: bool) -> None:
    """out += weight * parts, or out = weight * parts at the ``first`` part (one pass)."""
    for total, part in zip(out, parts):
        if not first:
            total.add_(part, alpha=weight)
        elif weight != 1.0:
            torch.mul(part, weight, out=total)
        else:
            total.copy_(part)


def _relative_difference(a: list[Tensor], b: list[Tensor]) -> float:
    diff = sum((x - y).square().sum() for x, y in zip(a, b)).sqrt()
    scale = sum(x.square().sum() for x in a).sqrt()
    return float(diff / scale.clamp_min(DETERMINISM_ATOL))


class ModelDataOperator(CurvatureLinearOperator):
    """A curvature operator of a model (and loss) over a data set of (X, y) batches.

    Data sharded across torch.distributed processes (``distributed``): each process passes
    its shard of the data set as ``data``, in the same call on every process, and the operator
    is that of the whole data set, the same on every process. N is the size of the whole data
    set (each process counts its shard at construction, one all_reduce adds the counts), so
    the batches are weighted by B_b / N of the whole data set (1 for "sum"); a product sums
    the processes' shares by one all_reduce of all its columns. The determinism check runs on
    every process over its own shard. Any error on one process is raised on all of them.

    Args:
        model: An ``nn.Module`` called as ``model(X)`` (one wrapped in
            ``DistributedDataParallel`` is unwrapped: its ``.module`` is used, and parameter
            names are those of ``model.module``), or a function ``model(params, X)`` where
            ``params`` has the container type of the ``params`` argument (a dict of name ->
            tensor, or a list of tensors).
        loss_fn: A loss module ``loss_fn(output, y) -> scalar`` with ``reduction`` "mean" or
            "sum"; ``None`` for operators of the model alone (Jacobians).
        params: The parameters: ``None`` (all of the module's parameters that require grad),
            a list of parameter names, a list of the module's parameters, or (for a function
            model) a dict of name -> tensor or a list of tensors.
        data: A re-iterable of (X, y) batches (a list, a DataLoader): X a tensor, or a
            dict-like batch that the model takes (then ``batch_size_fn`` is required).
        num_data: N, the number of samples in ``data`` (a positive int: it saves the counting
            pass); counted with one pass when ``None``. Every pass over the data checks it.
            For sharded data it is the size of the whole data set, and the shards are counted
            anyway (a given num_data must equal their total).
        batch_size_fn: ``batch_size_fn(X) -> int`` for dict-like batches.
        check_deterministic: Run two passes and refuse a model or data that differ between
            them (dropout, train-mode BatchNorm with shuffling, drop_last, augmentation).
        progressbar: Show a tqdm progress bar over the batches of each pass.
        chunk_size: At most this many columns of a matrix are multiplied at once.
        distributed: Whether ``data`` is this process's shard of a data set sharded across
            torch.distributed processes: ``None`` (default) when torch.distributed is
            initialised with more than one process, ``True`` (it must be initialised),
            ``False`` for this process's data alone (no communication).
    """

    SELF_ADJOINT = True
    #: Whether the operator needs the batches in the same order on every pass.
    FIXED_DATA_ORDER = False
    #: Whether a product passes over the data (the determinism check then compares two).
    PRODUCTS_PASS_OVER_DATA = True

    def __init__(
        self,
        model: nn.Module | ModelFunction,
        loss_fn: nn.Module | None,
        params: Sequence | Mapping | None,
        data: Iterable[Batch],
        *,
        num_data: int | None = None,
        batch_size_fn: Callable[[Mapping], int] | None = None,
        check_deterministic: bool = True,
        progressbar: bool = False,
        chunk_size: int | None = 32,
        distributed: bool | None = None,
    ):
        owner = type(self).__name__
        if isinstance(model, nn.Module):
            # a forward through DistributedDataParallel would start its own collectives
            model, _ = unwrap(model)
        self._model = model
        self._loss_fn = loss_fn
        self._param_names, self._params, self._params_container = _resolve_params(model, params)
        # The same tensors as leaves of an autograd graph, for the plain-autograd products.
        self._leaves = [p.detach().requires_grad_() for p in self._params]
        dtypes = {p.dtype for p in self._params}
        devices = {p.device for p in self._params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"{owner} needs all parameters in one dtype on one device, got dtypes {dtypes} "
                f"and devices {devices}."
            )
        (dtype,), (device,) = dtypes, devices
        if loss_fn is not None and getattr(loss_fn, "reduction", None) not in ("mean", "sum"):
            raise ValueError(
                f"{owner} needs loss_fn to be a loss module with reduction 'mean' or 'sum' (the "
                f"data-set normalisation depends on it), got {loss_fn!r} with reduction "
                f"{getattr(loss_fn, 'reduction', None)!r}."
            )
        if num_data is not None:
            num_data = check_positive_int(
                num_data, "num_data", owner, "pass the number of samples in data, or None"
            )
        if chunk_size is not None:
            check_positive_int(chunk_size, "chunk_size", owner, CHUNK_SIZE_INSTEAD)
        self._world = data_world(distributed, owner)
        self._data = data
        self._batch_size_fn = batch_size_fn if batch_size_fn is not None else _leading_size
        self._progressbar = progressbar
        self._chunk_size = chunk_size
        self._linearisation_bytes: int | None = None  # measured at the first block product
        self.num_data, self._shard_size, self._first_batch = self._count_data(
            num_data, batch_size_fn, dtype, device
        )
        super().__init__(self._in_shapes(), self._out_shapes(), dtype, device)
        if check_deterministic:
            self._check_deterministic()

    # ---------------------------------------------------------------------------------------
    # Spaces and the functional model
    # ---------------------------------------------------------------------------------------

    @property
    def param_names(self) -> list[str]:
        """The names of the parameters, in the operator's order."""
        return list(self._param_names)

    def _in_shapes(self) -> list[torch.Size]:
        return [p.shape for p in self._params]

    def _out_shapes(self) -> list[torch.Size]:
        return [p.shape for p in self._params]

    def _output(self, params: Sequence[Tensor], X: Tensor | Mapping) -> Tensor:
        """The model output f(theta, X) as a function of the parameter tensors."""
        if isinstance(self._model, nn.Module):
            return forward_keeping_buffers(self._model, X, dict(zip(self._param_names, params)))
        if self._params_container is dict:
            return self._model(dict(zip(self._param_names, params)), X)
        return self._model(list(params), X)

    def _loss(self, params: Sequence[Tensor], X: Tensor | Mapping, y: Tensor) -> Tensor:
        """The batch loss L_b(theta) with the loss function's own reduction."""
        return self._loss_fn(self._output(params, X), y)

    def _batch_weight(self, X: Tensor | Mapping) -> float:
        """w_b of equation (1)."""
        if self._loss_fn is None or self._loss_fn.reduction == "sum":
            return 1.0
        return self._batch_size(X) / self.num_data

    def _batch_size(self, X: Tensor | Mapping) -> int:
        """B_b, the number of samples in a batch: a positive integer."""
        return check_positive_int(
            self._batch_size_fn(X),
            "the size of every batch of data",
            type(self).__name__,
            "leave empty batches out of data (a batch_size_fn returns the number of samples in X)",
        )

    # ---------------------------------------------------------------------------------------
    # Passes over the data
    # ---------------------------------------------------------------------------------------

    def _with_progress(self, desc: str) -> Iterable[Batch]:
        """The data, behind a tqdm progress bar if one was asked for."""
        if self._progressbar:
            return tqdm(self._data, desc=f"{type(self).__name__}: {desc}")
        return self._data

    def _batch_sizes(self) -> list[int]:
        """B_b of every batch of one pass over this process's data."""
        return [self._batch_size(X) for X, _ in self._with_progress("counting data")]

    def _count_data(
        self, num_data: int | None, batch_size_fn, dtype: torch.dtype, device: torch.device
    ) -> tuple[int, int, int]:
        """(N, the number of samples in this process's data, the index of its first batch in
        the data set), after checking the data (:meth:`_check_data`).

        One process: N is ``num_data``, or counted with one pass when None. Sharded data: each
        process counts its shard, and one all_reduce of every process's (samples, batches) in
        its own slot gives each process all the shards' sizes; N is their total, which a
        given ``num_data`` must equal.
        """
        if self._world.size == 1:
            self._check_data(self._data, batch_size_fn, dtype)
            N = sum(self._batch_sizes()) if num_data is None else num_data
            return N, N, 0

        def count_shard() -> list[Tensor]:
            self._check_data(self._data, batch_size_fn, dtype)
            sizes = self._batch_sizes()
            counts = torch.tensor([sum(sizes), len(sizes)], dtype=torch.float64, device=device)
            return [self._world.slots(counts)]

        (counts,) = self._sum_over_processes(
            count_shard, [(self._world.size, 2)], "counting of the data", device
        )
        samples, batches = counts.long().T.tolist()
        if num_data is not None and num_data != sum(samples):
            raise ValueError(
                f"{type(self).__name__}: num_data={num_data} is the number of samples in the "
                f"whole data set, but the shards of data on the {self._world.size} processes "
                f"hold {samples} samples, {sum(samples)} in all: pass num_data={sum(samples)}, "
                "or None (sharded data is counted anyway)."
            )
        rank = self._world.rank
        return sum(samples), samples[rank], sum(batches[:rank])

    def _sum_over_processes(
        self,
        compute: Callable[[], list[Tensor]],
        shapes: Sequence[Sequence[int]],
        what: str,
        device: torch.device | None = None,
    ) -> list[Tensor]:
        """``compute()`` (tensors of ``shapes``) summed over the processes that share the data
        set, by one all_reduce, with every process raising when one of them raises
        (:func:`~avionics.curvature._distributed.sum_on_every_process`); with one process,
        ``compute()`` itself."""
        return sum_on_every_process(
            compute, shapes, self._world, device or self.device, type(self).__name__, what
        )

    def _batches(self, desc: str) -> Iterator[Batch]:
        """The batches of one pass over the data set, on the operator's device.

        Every pass checks that the batches hold num_data samples (for sharded data: the
        samples of this process's shard when it was counted): the weights w_b of (1) and the
        output space of the Jacobians depend on it. A pass with more samples stops before the
        batch that goes beyond that number (the rest are counted, not yielded), one with fewer
        after its last batch, with an error that gives both numbers.
        """
        device = self._params[0].device
        batches = iter(self._with_progress(desc))
        seen = 0
        for X, y in batches:
            seen += self._batch_size(X)
            if seen > self._shard_size:
                seen += sum(self._batch_size(X) for X, _ in batches)
                break
            if isinstance(X, Tensor):
                X = X.to(device)
            yield X, y.to(device) if isinstance(y, Tensor) else y
        if seen != self._shard_size:
            raise ValueError(self._pass_size_message(seen))

    def _pass_size_message(self, seen: int) -> str:
        """What is wrong when a pass over the data gave ``seen`` samples, not the counted."""
        if self._world.size > 1:
            return (
                f"{type(self).__name__} was made for num_data={self.num_data} samples over "
                f"{self._world.size} processes, {self._shard_size} of them in the data of this "
                f"process (rank {self._world.rank}), but a pass over its data gave {seen}: data "
                "must hold the same samples on every pass (a sampler that reshuffles the "
                "shards between passes, or drop_last with shuffling, changes them)."
            )
        return (
            f"{type(self).__name__} was made for num_data={self.num_data} samples, but a "
            f"pass over data gave {seen}: pass num_data={seen} (or None to count them). "
            "num_data is the size of data itself (the curvature of a subsample normalised "
            "by a larger set's size is neither its mean nor its sum), and data must hold "
            "the same samples on every pass."
        )

    def _matmat(self, M: list[Tensor], out: list[Tensor]) -> None:
        """sum_b w_b A_b M over the batches of the data set (equation (1)): for sharded data
        the processes' sums over their own batches, added by one all_reduce."""
        shapes = [o.shape for o in out]
        summed = self._sum_over_processes(
            lambda: self._local_matmat(M, out), shapes, "matrix product"
        )
        for total, part in zip(out, summed):
            if part is not total:  # the all_reduce's buffer
                total.copy_(part)

    def _local_matmat(self, M: list[Tensor], out: list[Tensor]) -> list[Tensor]:
        """sum_b w_b A_b M over the batches of this process's data, written into ``out``."""
        first = True
        with functional_pass():
            for X, y in self._batches("matrix product"):
                accumulate(out, self._matmat_batch(X, y, M), self._batch_weight(X), first)
                first = False
        return out

    def _matmat_batch(self, X: Tensor | Mapping, y: Tensor, M: list[Tensor]) -> list[Tensor]:
        """One batch's matrix times the columns ``M`` (last axis), columns last.

        Columns go through :meth:`_column_product` in parallel (torch.func.vmap), in blocks
        of :meth:`_columns_per_block`; when a block would hold one column, the columns go one
        after the other through :meth:`_one_column_product`.
        """
        K = M[0].shape[-1]
        block = 1 if K == 1 else self._columns_per_block(X)
        if block > 1:
            return map_columns(self._column_product(X, y), M, block)
        with torch.enable_grad():
            product = self._one_column_product(X, y)
            columns = [product([m[..., k] for m in M]) for k in range(K)]
        return [torch.stack(parts, dim=-1) for parts in zip(*columns)]

    def _columns_per_block(self, X: Tensor | Mapping) -> int:
        """How many columns one vmapped block multiplies: ``chunk_size`` (all columns when
        None), fewer when their linearisations would exceed
        :data:`~avionics.curvature._columns.COLUMN_BLOCK_BYTES`.

        A column's linearisation is measured, once, as the bytes the forward pass of the
        first batch multiplied saves for its backward, the parameters left out
        (:func:`~avionics.curvature._columns.linearisation_bytes`): vmap makes every saved
        activation ``[columns, ...]``, and past this budget the blocks cost more than a loop
        over the columns (fresh memory for every batched intermediate; see
        :mod:`~avionics.curvature._columns`).
        """
        if self._linearisation_bytes is None:
            self._linearisation_bytes = linearisation_bytes(
                lambda: self._output(self._leaves, X), self._leaves
            )
        fitting = max(1, COLUMN_BLOCK_BYTES // max(1, self._linearisation_bytes))
        return fitting if self._chunk_size is None else min(fitting, self._chunk_size)

    def _column_product(self, X: Tensor | Mapping, y: Tensor) -> ColumnProduct:
        """The map v -> A_b v of batch b for one column v, written with torch.func (vmappable).

        Work that all columns share (the forward pass) is done here, before the map is made.
        """
        raise NotImplementedError

    def _one_column_product(self, X: Tensor | Mapping, y: Tensor) -> ColumnProduct:
        """The map v -> A_b v of batch b for columns one at a time (no vmap), work that they
        share done once; by default :meth:`_vector_product` for each."""
        return lambda v: self._vector_product(X, y, v)

    def _vector_product(self, X: Tensor | Mapping, y: Tensor, v: list[Tensor]) -> list[Tensor]:
        """A_b v for one vector v; by default the torch.func column product.

        Subclasses may implement it with plain autograd: it costs less per operation than
        the torch.func transforms, which matters for small networks.
        """
        with torch.no_grad():
            return self._column_product(X, y)(v)

    def loss_and_gradient(self) -> tuple[Tensor, list[Tensor]]:
        """The data-set loss (1) and its gradient w.r.t. the parameters (for sharded data, of
        the whole data set: one all_reduce)."""
        shapes = [(), *(p.shape for p in self._params)]
        loss, *gradient = self._sum_over_processes(
            self._local_loss_and_gradient, shapes, "loss and gradient"
        )
        return loss, gradient

    def _local_loss_and_gradient(self) -> list[Tensor]:
        """[sum_b w_b L_b, its gradient tensors] over the batches of this process's data."""
        loss = torch.zeros((), dtype=self.dtype, device=self.device)
        gradient = [torch.zeros_like(p) for p in self._params]
        with functional_pass():
            for X, y in self._batches("loss and gradient"):
                weight = self._batch_weight(X)
                g, value = grad_and_value(self._loss)(self._params, X, y)
                loss.add_(value.detach(), alpha=weight)
                for total, g_p in zip(gradient, g):
                    total.add_(g_p, alpha=weight)
        return [loss, *gradient]

    def _outputs(self) -> list[Tensor]:
        """The model outputs of every batch of this process's data, in data order."""
        with functional_pass():
            return [self._output(self._params, X) for X, _ in self._batches("outputs")]

    # ---------------------------------------------------------------------------------------
    # Checks
    # ---------------------------------------------------------------------------------------

    def _check_data(self, data: Iterable[Batch], batch_size_fn, dtype: torch.dtype) -> None:
        """Refuse a one-shot iterator, an empty data set, a first batch that is not an (X, y)
        pair in the model's dtype (:func:`check_batch`), and a batch_size_fn that is not a
        function or missing for batches whose X is not a tensor."""
        if iter(data) is data:
            raise TypeError(
                f"{type(self).__name__} passes over the data several times, so data must be "
                f"re-iterable (a list of batches or a DataLoader), not a one-shot iterator or "
                f"generator; wrap it in list(...)."
            )
        first = next(iter(data), None)
        if first is None:
            empty = "data set"
            if self._world.size > 1:
                empty = "shard of the data set (every process needs one batch or more)"
            raise ValueError(f"{type(self).__name__} got an empty {empty}.")
        check_batch(first, dtype, type(self).__name__)
        if batch_size_fn is not None and not callable(batch_size_fn):
            raise TypeError(
                f"{type(self).__name__}: batch_size_fn must be a function X -> number of "
                f"samples in X, got {_describe(batch_size_fn)}."
            )
        if not isinstance(first[0], Tensor) and batch_size_fn is None:
            raise ValueError(
                f"{type(self).__name__} got batches whose X is a {type(first[0]).__name__}, "
                f"not a tensor: pass batch_size_fn=lambda X: <number of samples in X>."
            )

    def _check_deterministic(self) -> None:
        """Two passes over the data must agree; so must two products with the same vector,
        where a product passes over the data (``PRODUCTS_PASS_OVER_DATA``).

        For sharded data every process compares its own passes over its shard; the products
        are of the whole data set, the same on every process.
        """
        hint = (
            "Put the model in eval mode (dropout, BatchNorm), don't use drop_last with "
            "shuffling, turn off random augmentation; or pass check_deterministic=False if you "
            "know the difference is harmless."
        )

        def passes_agree() -> list[Tensor]:
            self._check_passes_agree(hint)
            return []

        self._sum_over_processes(passes_agree, [], "determinism check")
        if not self.PRODUCTS_PASS_OVER_DATA:
            return
        generator = torch.Generator().manual_seed(0)
        v = torch.rand(self.shape[1], generator=generator, dtype=self.dtype).to(self.device)
        difference = _relative_difference([self @ v], [self @ v])
        if difference > DETERMINISM_RTOL:
            raise RuntimeError(
                f"{type(self).__name__}: two products with the same vector differ (relative "
                f"difference {difference:.2e}). {hint}"
            )

    def _check_passes_agree(self, hint: str) -> None:
        """Two passes over this process's data give the same model outputs (operators that
        need the same batch order) or loss and gradient; else a RuntimeError ending in
        ``hint``."""
        if self._loss_fn is None or self.FIXED_DATA_ORDER:
            first, second = self._outputs(), self._outputs()
            if len(first) != len(second) or any(a.shape != b.shape for a, b in zip(first, second)):
                raise RuntimeError(
                    f"{type(self).__name__}: two passes over the data gave batches of different "
                    f"sizes. {hint}"
                )
            what, difference = "model outputs", _relative_difference(first, second)
        else:
            first, second = self._local_loss_and_gradient(), self._local_loss_and_gradient()
            what, difference = "loss and gradient", _relative_difference(first, second)
        if difference > DETERMINISM_RTOL:
            raise RuntimeError(
                f"{type(self).__name__}: the {what} differ between two passes over the data "
                f"(relative difference {difference:.2e}). {hint}"
            )


def _leading_size(X: Tensor) -> int:
    return X.shape[0]


def _resolve_params(
    model: nn.Module | ModelFunction, params: Sequence | Mapping | None
) -> tuple[list[str], list[Tensor], type]:
    """Names, detached tensors and container type (dict or list) of the parameters."""
    if not isinstance(model, nn.Module):
        if isinstance(params, Mapping):
            names, tensors = list(params.keys()), list(params.values())
            container = dict
        elif isinstance(params, Sequence) and all(isinstance(p, Tensor) for p in params):
            names, tensors, container = [str(i) for i in range(len(params))], list(params), list
        else:
            raise TypeError(
                "A function model(params, X) needs params as a dict of name -> tensor or a "
                f"list of tensors, got {type(params).__name__}."
            )
        if not tensors:
            raise ValueError("params is empty: pass the tensors the curvature is taken w.r.t.")
        return names, [t.detach() for t in tensors], container

    if params is not None and (
        isinstance(params, (str, Tensor, nn.Module)) or not isinstance(params, Iterable)
    ):
        raise TypeError(
            "params must be None (all parameters that require grad), a list of parameter names "
            f"or a list of the model's parameters, got {_describe(params)}; e.g. for one "
            "parameter pass params=['0.weight'] or params=[model[0].weight]."
        )
    named = dict(model.named_parameters())
    if params is None:
        chosen = [(n, p) for n, p in named.items() if p.requires_grad]
        if not chosen:
            raise ValueError(
                "The model has no parameter that requires grad; set requires_grad or pass "
                "params=[names]."
            )
    else:
        by_identity = {id(p): n for n, p in named.items()}
        chosen = []
        for p in params:
            if isinstance(p, str):
                if p not in named:
                    raise ValueError(
                        f"The model has no parameter named {p!r}; its parameters are "
                        f"{list(named)}."
                    )
                chosen.append((p, named[p]))
            elif isinstance(p, Tensor) and id(p) in by_identity:
                chosen.append((by_identity[id(p)], p))
            else:
                raise ValueError(
                    "params must be names of the model's parameters or the model's parameter "
                    f"tensors; got a {type(p).__name__} that is neither."
                )
        frozen = [n for n, p in chosen if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"Parameters {frozen} do not require grad; set requires_grad_(True) on them or "
                "leave them out of params."
            )
        if not chosen:
            raise ValueError("params is empty: pass the parameters the curvature is taken w.r.t.")
    return [n for n, _ in chosen], [p.detach() for _, p in chosen], dict
