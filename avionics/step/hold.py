"""What the cockpit holds between its steps: its hold on the process's global state, the
hooks of the two-step quantities' pending starts, and the module a compiled model wraps."""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from avionics.quantities.base import TwoStepQuantity


class Held:
    """The cockpit's hold on the process's global state: the armed capture (a global forward
    hook), the compiler's eager stance, the math attention kernel of a step that
    differentiates twice. :meth:`release` lets go of all three (a cockpit dropped without
    ``close()``: every compiled model of the process would run eagerly)."""

    def __init__(self):
        self.capture = None
        self.eager = None
        self.graph_step = None

    def release(self) -> None:
        if self.capture is not None:
            self.capture.disarm()
            self.capture.release()
        for context in (self.eager, self.graph_step):
            if context is not None:
                context.__exit__(None, None, None)
        self.capture = self.eager = self.graph_step = None


def forget_pending(quantity: TwoStepQuantity) -> None:
    """Drop ``quantity``'s pending start, and with it every hook the start holds (Alpha's on
    the optimizer's step: left there, it would fire at the user's ``optimizer.step()`` and
    remove itself while the optimizer iterates over its hooks)."""
    if quantity.pending is not None:
        release_hooks([quantity.pending])
    quantity.pending = None


def release_hooks(pending: list) -> None:
    """Remove the hooks that the (step, start) pairs of ``pending`` hold."""
    for _, start in pending:
        for held in getattr(start, "__dict__", {}).values():
            if isinstance(held, RemovableHandle):
                held.remove()


def uncompiled(model: nn.Module) -> tuple[bool, nn.Module]:
    """(whether ``model`` is a torch.compile'd module, the module it compiles)."""
    # (by name: importing torch._dynamo to compare the class takes seconds)
    if type(model).__name__ == "OptimizedModule" and isinstance(model._orig_mod, nn.Module):
        return True, model._orig_mod
    return False, model
