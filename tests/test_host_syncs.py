"""Host synchronisations of a tracked step, counted on the CPU.

On a GPU every read of a tensor's value by the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``, ``.numpy()``, ``.cpu()``, and the operations whose output shape depends on the
values: ``nonzero``, boolean-mask indexing, ``unique``, ``bincount``) waits for the device
to finish everything queued before it: a pipeline stall; so does a tensor made from host data
on the device (``torch.tensor(x, device=...)``, ``t.new_tensor(x)``: a copy from pageable
memory that the host waits for). :class:`HostSyncs` counts them where they happen on the CPU
too, so that a CPU test bounds what a GPU step would stall on; on CUDA,
``torch.cuda.set_sync_debug_mode("error")`` checks the same directly.
The histogram kernels take the path of tensors on an accelerator (torch operations, not the
host's numba kernels, which a GPU tensor never reaches).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from pathlib import Path

import models
import pytest
import torch
from devices import device_fixture  # noqa: F401 (the fixture `device`)
from torch.utils._python_dispatch import TorchDispatchMode

from avionics import Cockpit, configuration, read_run
from avionics.quantities import binning, histograms
from avionics.step import batch, transfer

aten = torch.ops.aten
# operations that read a value on the host, or whose output shape depends on the values
SYNCING_OPS = {
    aten._local_scalar_dense,  # .item(), float(t), int(t), bool(t)
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.bincount,
    aten.repeat_interleave,
    aten.equal,
    aten.lift_fresh,  # a tensor made from host data (torch.tensor, new_tensor)
}
# indexing, which reads the number of True entries of a boolean mask on the host
MASKED_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
# methods that copy a tensor to the host without an aten operation on the CPU
SYNCING_METHODS = ("tolist", "numpy", "cpu")
PACKAGE = str(Path(__file__).resolve().parents[1] / "avionics")


class HostSyncs(TorchDispatchMode):
    """Within the block, every host synchronisation (module docstring) is recorded in
    :attr:`where` as (what, the innermost avionics file:line that caused it)."""

    def __init__(self):
        super().__init__()
        self.where: list[tuple[str, str]] = []
        self._stack = contextlib.ExitStack()

    def _record(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(PACKAGE)]
        place = "outside avionics"
        if frames:
            place = f"{Path(frames[-1].filename).relative_to(PACKAGE)}:{frames[-1].lineno}"
        self.where.append((what, place))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in SYNCING_OPS:
            self._record(func.overloadpacket.__name__)
        elif func.overloadpacket in MASKED_INDEXING and _boolean_index(args):
            self._record(f"{func.overloadpacket.__name__} by a boolean mask")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in SYNCING_METHODS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                self._record(_name)
                return _original(tensor, *args, **kwargs)

            self._stack.enter_context(_patched(torch.Tensor, name, counted))
        return super().__enter__()

    def __exit__(self, *exc):
        self._stack.close()
        return super().__exit__(*exc)

    @property
    def count(self) -> int:
        return len(self.where)

    def report(self) -> str:
        return "\n".join(f"{n} x {what} at {place}" for (what, place), n in
                         Counter(self.where).most_common())  # fmt: skip


def _boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@contextlib.contextmanager
def _patched(owner, name, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def accelerator_histograms():
    """The histogram kernels' accelerator path (torch operations), as for a GPU tensor."""
    with (
        _patched(binning.Tally1d, "add", binning.Tally1d.add_by_torch),
        _patched(histograms, "count_2d", binning.torch_count_2d),
    ):
        yield


# The host synchronisations of a tracked step (issue 26: at most 2, none on an untracked
# step), each one transfer: after the backward, the backward's scale c with whether the loss and
# the gradients are finite (step/batch.py); when the step is stored, whether each value is
# finite with the scalars of the deferred values (Alpha's fit, the gradient tests' check of a
# zero mean gradient) and, where there are sinks, the values themselves (step/transfer.py).
BUDGETED = ((batch, "read_after_backward"), (transfer._Reads, "host"))
BOUND = len(BUDGETED)
# Measured with this file's models (mlp, cnn, transformer), the other presets' tracked steps:
# business 3 (the loss's finiteness read on entering, for the curvature quantities' checks of
# the forward), full 9, 7, 11 (the same, and Lanczos' one packed read per product in
# HessMaxEV), transformer (with Adam) 17, 13, 18 (Lanczos in PreconditionedSharpness);
# tests/test_curvature_host_syncs.py bounds them. Their steps that only end a two-step
# quantity: 2. Not counted here: with plain SGD, Alpha's check when optimizer.step() starts
# that it steps on the gradient the tracked step saw (one read).
PRESET_BOUNDS = {"economy": BOUND, "business": BOUND + 1}


def preset_steps(model, X, y, loss_fn, steps, tracked, counted, preset="economy", log=None):
    """Train ``steps`` SGD steps under a cockpit of ``preset`` tracking the steps in
    ``tracked``; the host syncs of the steps in ``counted`` (from the user's forward to the end
    of the block), one HostSyncs each. On CUDA the counted steps also run under
    :func:`cuda_sync_errors`. Returns (the HostSyncs, the calls of the budgeted transfers, the
    cockpit's output)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    schedule = lambda step: step in tracked  # noqa: E731
    cockpit = Cockpit(model, configuration(preset, schedule=schedule), log=log)
    syncs, budgeted = {}, Counter()
    for step in range(steps):
        opt.zero_grad()
        counting = step in counted
        mode = HostSyncs() if counting else contextlib.nullcontext()
        errors = cuda_sync_errors(budgeted) if counting and X.is_cuda else contextlib.nullcontext()
        with mode, errors:
            losses = loss_fn(model(X), y)
            loss = losses.mean()
            info = {"loss": loss, "individual_losses": losses, "batch_size": len(losses)}
            info["optimizer"] = opt
            with cockpit(step, info):
                loss.backward(create_graph=cockpit.create_graph(step))
        if counting:
            syncs[step] = mode
        opt.step()
    cockpit.close()
    for p in model.parameters():
        p.grad = None  # (break create_graph's reference cycle)
    return syncs, budgeted, cockpit.get_output()


@contextlib.contextmanager
def cuda_sync_errors(calls: Counter):
    """Every synchronisation with the GPU raises (``torch.cuda.set_sync_debug_mode("error")``)
    but those inside the :data:`BUDGETED` transfers, whose calls are counted in ``calls``."""
    before = torch.cuda.get_sync_debug_mode()
    with contextlib.ExitStack() as stack:
        for owner, name in BUDGETED:
            stack.enter_context(_patched(owner, name, _allowed(getattr(owner, name), calls)))
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)


def _allowed(function, calls: Counter):
    """``function``, allowed to synchronise (its calls counted)."""

    def allowed(*args, **kwargs):
        calls[function.__qualname__] += 1
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return function(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    return allowed


def on_device(architecture: str, device):
    model, X, y, loss_fn = models.ARCHITECTURES[architecture](n=8)
    model = model.to(device=device, dtype=torch.float32)
    X = (X.float() if X.is_floating_point() else X).to(device)
    return model, X, y.to(device), loss_fn


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "transformer"])
def test_a_tracked_economy_step_synchronises_at_most_twice(architecture, device):
    with accelerator_histograms():
        syncs, *_ = preset_steps(*on_device(architecture, device), 5, {0, 1, 2, 3}, {2, 4})
    assert syncs[2].count <= BOUND, syncs[2].report()
    # the next step, untracked, ends the tracked step's Alpha (its update is known only then)
    assert syncs[4].count <= BOUND, syncs[4].report()
    # none in the engine's rules or the histograms
    assert not [w for w in syncs[2].where if w[1].startswith(("persample", "quantities/bin"))]


def test_a_tracked_step_with_a_log_synchronises_at_most_twice(device, tmp_path):
    """The values written to the log cross to the host in the step's one transfer, exactly
    as a run without sinks converts them when asked (one by one)."""
    log = tmp_path / "run"
    with accelerator_histograms():
        syncs, _, output = preset_steps(*on_device("cnn", device), 4, {0, 1, 2}, {2}, log=log)
        *_, unlogged = preset_steps(*on_device("cnn", device), 4, {0, 1, 2}, {2})
    assert syncs[2].count <= BOUND, syncs[2].report()
    logged = read_run(log).steps
    assert {"Alpha", "NormTest", "GradNorm", "Loss", "Distance"} <= set(logged[1])
    for step in (0, 1, 2):
        assert output[step] == unlogged[step]
        assert {k: logged[step][k] for k in unlogged[step]} == unlogged[step]


def test_a_tracked_business_step_synchronises_as_measured():
    with accelerator_histograms():
        syncs, *_ = preset_steps(*on_device("mlp", "cpu"), 4, {0, 1, 2}, {2}, preset="business")
    assert syncs[2].count <= PRESET_BOUNDS["business"], syncs[2].report()


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "transformer"])
def test_an_untracked_step_never_synchronises(architecture, device):
    """Counted on every device; on a GPU also under torch.cuda.set_sync_debug_mode("error"),
    which raises at any synchronising call."""
    with accelerator_histograms():
        syncs, budgeted, _ = preset_steps(*on_device(architecture, device), 4, {0, 1}, {3})
    assert syncs[3].count == 0, syncs[3].report()
    assert not budgeted


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_tracked_economy_step_on_cuda_synchronises_only_in_its_budgeted_transfers():
    """Under torch.cuda.set_sync_debug_mode("error") every synchronisation outside the
    budgeted transfers raises; each of those runs once per step that stores values."""
    with accelerator_histograms():
        _, budgeted, _ = preset_steps(*on_device("transformer", "cuda"), 5, {0, 1, 2, 3}, {2, 4})
    # steps 2 and 4 (4 ends step 3's Alpha): one transfer after the backward, one at storing
    assert sorted(budgeted.values()) == [2] * BOUND, budgeted


def test_the_counter_counts_every_kind_of_host_read():
    """The counter itself: each kind of read once, nothing for device-side work."""
    t = torch.arange(6.0)
    with HostSyncs() as syncs:
        t.sum().item()
        float(t[0])
        bool(t[1] > 0)
        t.tolist()
        t.numpy()
        t.cpu()
        t[t > 2]
        torch.unique(t)
        (t * 2).add_(1).sum()  # device-side only
        t.new_full((), 3.0)
        torch.tensor([1.0, 2.0])
    kinds = [what for what, _ in syncs.where]
    assert kinds.count("_local_scalar_dense") == 3
    assert {"tolist", "numpy", "cpu", "_unique2", "index by a boolean mask"} <= set(kinds)
    assert "lift_fresh" in kinds
    assert syncs.count == 9, syncs.report()
