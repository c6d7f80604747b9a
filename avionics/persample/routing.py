"""Where each tracked parameter's per-sample gradient comes from: the module calls it sums.

For every tracked parameter, :class:`Routing` finds the module calls its gradient flows
through:

* the modules that register it (several when weights are tied, e.g. an LM head tied to the
  token embedding), when they were called;
* otherwise the nearest called ancestor, which *adopts* it: a parameter used directly in a
  parent's forward (``nn.MultiheadAttention`` uses ``out_proj.weight`` without calling
  ``out_proj``; a vision transformer adds its position table in its own forward);
* a parameter that the engine's gradient check moved to the root module's generic rule
  (:meth:`~avionics.persample.engine.PerSampleEngine.check`): the root's call.

It also names the model's modules and parameters for the messages of the rules that fail or
take a slow path. A :class:`~avionics.persample.step.CapturedStep` reads the routing of the
engine that made it (the engine is a :class:`Routing`).
"""

from __future__ import annotations

import warnings

from torch import Tensor, nn

from avionics.persample.calls import ModuleCall

# Patterns of calls whose contributions are kept (a model called in few ways has few).
MAX_PATTERNS = 64


class Routing:
    """The module calls whose per-sample gradients each of ``params`` (parameters of
    ``model``, in this order: the parameter index k) sums."""

    def __init__(self, model: nn.Module, params: list[Tensor]):
        self.model, self.params = model, params
        self.index = {id(p): k for k, p in enumerate(params)}  # id(parameter) -> its index
        self._names = {m: name for name, m in model.named_modules()}
        self._parent: dict[nn.Module, nn.Module] = {}
        for m in self._names:
            for child in m.children():
                self._parent.setdefault(child, m)
        # owners[k]: (module, attribute name) pairs that register parameter k
        self.owners: list[list[tuple[nn.Module, str]]] = [[] for _ in params]
        for m in self._names:
            for name, p in m.named_parameters(recurse=False, remove_duplicate=False):
                if id(p) in self.index:
                    self.owners[self.index[id(p)]].append((m, name))
        self._from_root: set[int] = set()  # the parameters moved to the root's generic rule
        self._slow: set[nn.Module] = set()  # modules already reported by warn_slow_path
        # contributions() by the pattern of calls it was asked for
        self._contributions: dict[tuple, list] = {}
        # request -> [the request with its visitors called with index k, for each k]
        self.indexed_requests: dict[object, list] = {}

    def rerouted(self, k: int) -> bool:
        """Whether the gradient check moved parameter k to the root module's generic rule."""
        return k in self._from_root

    def _relative_name(self, ancestor: nn.Module, module: nn.Module, name: str) -> str:
        prefix, path = self._names[ancestor], self._names[module]
        inner = path if prefix == "" else path[len(prefix) + 1 :]
        return f"{inner}.{name}" if inner else name

    def contributions(
        self, calls: dict[nn.Module, list[ModuleCall]], n: int, captured_backward: bool = False
    ):
        """For each parameter index: the (module, name) pairs its per-sample gradient sums.

        A module counts as called only where its calls carry the batch: a position table
        looked up with ``arange(T)`` is shared by all samples, and its per-sample gradients
        only separate in the parent that adds it to each sample. With ``captured_backward``
        (the calls' output gradients are the captured backward's), a call whose shared output
        has per-sample gradients from its consumers (:mod:`avionics.persample.rules.broadcast`)
        counts as carrying the batch.
        """

        def carries(call: ModuleCall) -> bool:
            shared = captured_backward and any(g is not None for g in call.broadcast_grad_outputs)
            return shared or call.carries_batch(n)

        batched = {m: all(carries(c) for c in cs) for m, cs in calls.items()}
        # the same modules called with the batch and the same routing give the same pairs
        key = (tuple((id(m), b) for m, b in batched.items()), frozenset(self._from_root))
        if key not in self._contributions:
            if len(self._contributions) >= MAX_PATTERNS:
                self._contributions.clear()
            self._contributions[key] = self._pairs(batched)
        return self._contributions[key]

    def _pairs(self, batched: dict[nn.Module, bool]) -> list[list[tuple[nn.Module, str]]]:
        """:meth:`contributions` where ``batched[m]`` says whether module m's calls carry the
        batch."""
        result: list[list[tuple[nn.Module, str]]] = []
        for k, owners in enumerate(self.owners):
            if k in self._from_root:
                result.append([(self.model, self._relative_name(self.model, *owners[0]))])
                continue
            pairs: dict[nn.Module, str] = {}
            for module, name in owners:
                host = module
                while host is not None and not batched.get(host, False):
                    host = self._parent.get(host)
                if host is not None:
                    pairs.setdefault(host, self._relative_name(host, module, name))
            result.append(list(pairs.items()))
        return result

    def warn_slow_path(
        self, module: nn.Module, names: list[str], reason: str | None, seconds: float, samples: int
    ) -> None:
        """Warn once per module whose per-sample gradients took a slow path of the generic
        rule (``seconds`` for ``samples`` samples), naming its parameters and the cost: the
        per-sample loop (``reason``: why vmap could not batch the module), or a re-run of the
        whole model (parameters used directly in the root's forward, not by additions)."""
        if module in self._slow or (reason is None and module is not self.model):
            return
        self._slow.add(module)
        prefix = self._names[module] + "." if self._names[module] else ""
        params = ", ".join(prefix + name for name in names)
        cost = f"{seconds:.3g} s for {samples} samples, at every step that needs them"
        if reason is None:
            how = (
                f"The per-sample gradients of {params} (used directly in the model's forward) "
                f"come from re-running the whole model under torch.func.vmap: {cost}. Add such "
                "a parameter to the batch (x + p), or move it into a module of its own."
            )
        else:
            how = (
                f"Module '{self.module_name(module)}' ({type(module).__name__}): "
                f"torch.func.vmap cannot batch its forward ({reason}), so the per-sample "
                f"gradients of {params} are computed one sample at a time: {cost}, about "
                f"{1e3 * seconds / samples:.3g} ms per sample. Replace the operation vmap "
                "cannot batch, or register a closed-form rule for the module "
                "(avionics.persample.rules)."
            )
        warnings.warn(how, stacklevel=2)

    def naming(self, module: nn.Module) -> _Naming:
        """A context that re-raises a rule's error with the module it failed on."""
        return _Naming(self, module)

    def module_name(self, module: nn.Module) -> str:
        """The module's name in the model, or "the model" for the root."""
        return self._names[module] or "the model"

    def _param_name(self, k: int) -> str:
        module, name = self.owners[k][0]
        prefix = self._names[module]
        return f"{prefix}.{name}" if prefix else name


class _Naming:
    """Re-raise a rule's error with the module it failed on (:meth:`Routing.naming`; a class,
    not a generator: entered for every rule at every step)."""

    __slots__ = ("routing", "module")

    def __init__(self, routing: Routing, module: nn.Module):
        self.routing, self.module = routing, module

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if not isinstance(error, (RuntimeError, NotImplementedError, ValueError)):
            return False
        if str(error).startswith("Module '"):
            return False
        name = self.routing.module_name(self.module)
        raise type(error)(
            f"Module '{name}' ({type(self.module).__name__}): the per-sample engine cannot "
            f"compute its per-sample gradients: {error}"
        ) from error
