"""Host synchronisations of a tracked step, counted on the CPU.

On a GPU every read of a tensor's value by the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``, ``.numpy()``, ``.cpu()``, and the operations whose output shape depends on the
values: ``nonzero``, boolean-mask indexing, ``unique``, ``bincount``) waits for the device
to finish everything queued before it: a pipeline stall. :class:`HostSyncs` counts them
where they happen on the CPU too, so that a CPU test bounds what a GPU step would stall on.
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

from avionics import Cockpit, configuration
from avionics.quantities import binning, histograms

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
        _patched(histograms, "count_1d", binning.torch_count_1d),
        _patched(histograms, "count_2d", binning.torch_count_2d),
    ):
        yield


def economy_steps(model, X, y, loss_fn, steps, tracked, counted):
    """Train ``steps`` SGD steps under an economy cockpit; the host syncs of the steps in
    ``counted`` (from the user's forward to the end of the block), one HostSyncs each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cockpit = Cockpit(model, configuration("economy", schedule=lambda step: step in tracked))
    syncs = {}
    for step in range(steps):
        opt.zero_grad()
        mode = HostSyncs() if step in counted else contextlib.nullcontext()
        with mode:
            losses = loss_fn(model(X), y)
            loss = losses.mean()
            info = {"loss": loss, "individual_losses": losses, "batch_size": len(losses)}
            info["optimizer"] = opt
            with cockpit(step, info):
                loss.backward()
        if step in counted:
            syncs[step] = mode
        opt.step()
    return syncs


# Host synchronisations per economy step, where they are now (each names its place):
# the step's end (1 transfer of every value's finiteness per step of values, cockpit.py), the
# loss's finiteness, the backward's scale c and the loss's reduction (cockpit.py), a message
# built with float(loss) (cockpit.py), Alpha's fit (one transfer), the gradient tests' check
# of a zero mean gradient (one, shared). The target is 2 per tracked step; what is
# left and how to remove it is in the report of issue 26.
TRACKED_BOUND = 8
# the next step, untracked, ends the tracked step's Alpha (its update is known only then)
ALPHA_END_BOUND = 6


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "transformer"])
def test_a_tracked_economy_step_synchronises_at_most_a_few_times(architecture, device):
    model, X, y, loss_fn = models.ARCHITECTURES[architecture](n=8)
    model = model.to(device=device, dtype=torch.float32)
    X = (X.float() if X.is_floating_point() else X).to(device)
    with accelerator_histograms():
        syncs = economy_steps(model, X, y.to(device), loss_fn, 5, {0, 1, 2, 3}, {2, 4})
    assert syncs[2].count <= TRACKED_BOUND, syncs[2].report()
    assert syncs[4].count <= ALPHA_END_BOUND, syncs[4].report()
    # none in the engine's rules or the histograms
    assert not [w for w in syncs[2].where if w[1].startswith(("persample", "quantities/bin"))]


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "transformer"])
def test_an_untracked_step_never_synchronises(architecture, device):
    """Counted on every device; on a GPU also under torch.cuda.set_sync_debug_mode("error"),
    which raises at any synchronising call."""
    model, X, y, loss_fn = models.ARCHITECTURES[architecture](n=8)
    model = model.to(device=device, dtype=torch.float32)
    X = (X.float() if X.is_floating_point() else X).to(device)
    debug = torch.cuda.get_sync_debug_mode() if device == "cuda" else None
    try:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        with accelerator_histograms():
            syncs = economy_steps(model, X, y.to(device), loss_fn, 4, {0, 1}, {3})
    finally:
        if debug is not None:
            torch.cuda.set_sync_debug_mode(debug)
    assert syncs[3].count == 0, syncs[3].report()


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
    kinds = [what for what, _ in syncs.where]
    assert kinds.count("_local_scalar_dense") == 3
    assert {"tolist", "numpy", "cpu", "_unique2", "index by a boolean mask"} <= set(kinds)
    assert syncs.count == 8, syncs.report()
