"""The per-sample engine: statistics of per-sample gradients from one captured step.

For every tracked parameter it finds the module calls its gradient flows through:

* the modules that register it (several when weights are tied, e.g. an LM head tied to the
  token embedding), when they were called;
* otherwise the nearest called ancestor, which *adopts* it: a parameter used directly in a
  parent's forward (``nn.MultiheadAttention`` uses ``out_proj.weight`` without calling
  ``out_proj``; a vision transformer adds its position table in its own forward);
* on the first step, and whenever the pattern of calls changes, the sum over samples of the
  result is checked against autograd's gradient. A parameter whose check fails (it is also used
  outside the modules that own it) is handled from then on by the root module's generic rule,
  which covers every use in the forward.

A parameter with one contribution gets its statistics from that rule's closed forms; one with
several (tied weights, adopted parameters) is materialised in chunks, summed over its
contributions, and reduced, because ||a + b||^2 is not ||a||^2 + ||b||^2. Projections alone
are linear, (a + b) . v = a . v + b . v: a request of directions only sums each contribution's
closed form instead.

A direction may be given, per parameter, as a :class:`~avionics.persample.rules.factored.
FactoredDirection` (the factors of a mean of outer products, which Alpha keeps for plain SGD);
the bilinear rules project onto it directly, every other path receives it as a tensor.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from avionics.persample.capture import Capture, ModuleCall
from avionics.persample.request import Accumulator, Request, Statistics
from avionics.persample.rules import rule_for
from avionics.persample.rules.base import Rule, chunk_size
from avionics.persample.rules.bilinear import BilinearRule
from avionics.persample.rules.factored import FactoredDirection, dense
from avionics.persample.rules.linear import LinearRule

# Relative tolerance of the check of summed per-sample gradients against autograd's.
CHECK_RTOL = {torch.float64: 1e-8, torch.float32: 1e-3}


class PerSampleEngine:
    """Per-sample statistics of ``params`` (parameters of ``model``), one step at a time."""

    def __init__(self, model: nn.Module, params: list[Tensor]):
        self.model, self.params = model, params
        self._index = {id(p): k for k, p in enumerate(params)}
        self._names = {m: name for name, m in model.named_modules()}
        self._parent: dict[nn.Module, nn.Module] = {}
        for m in self._names:
            for child in m.children():
                self._parent.setdefault(child, m)
        # owners[k]: (module, attribute name) pairs that register parameter k
        self.owners: list[list[tuple[nn.Module, str]]] = [[] for _ in params]
        for m in self._names:
            for name, p in m.named_parameters(recurse=False, remove_duplicate=False):
                if id(p) in self._index:
                    self.owners[self._index[id(p)]].append((m, name))
        self._from_root: set[int] = set()
        self._checked_pattern: tuple | None = None
        self._last: tuple | None = None  # (calls, contributions, rules) of the last statistics

    def capture(self) -> Capture:
        """A capture watching every module that owns a tracked parameter, and its ancestors."""
        watched = set()
        for owners in self.owners:
            for m, _ in owners:
                while m is not None and m not in watched:
                    watched.add(m)
                    m = self._parent.get(m)
        return Capture(self.model, sorted(watched, key=lambda m: self._names[m]))

    def restricted(self, indices: list[int]) -> PerSampleEngine:
        """An engine for the parameters ``indices`` only, routed as this one routes them (the
        gradient check's moves to the root's generic rule included). The curvature diagonals
        (:mod:`avionics.persample.second_order`) run the rules on the parameters that have no
        shortcut of their own."""
        sub = PerSampleEngine(self.model, [self.params[k] for k in indices])
        sub._from_root = {i for i, k in enumerate(indices) if k in self._from_root}
        sub._checked_pattern = self._checked_pattern
        return sub

    def rerouted(self, k: int) -> bool:
        """Whether the gradient check moved parameter k to the root module's generic rule."""
        return k in self._from_root

    # ----------------------------------------------------------------------------------------
    def _relative_name(self, ancestor: nn.Module, module: nn.Module, name: str) -> str:
        prefix, path = self._names[ancestor], self._names[module]
        inner = path if prefix == "" else path[len(prefix) + 1 :]
        return f"{inner}.{name}" if inner else name

    def _contributions(self, calls: dict[nn.Module, list[ModuleCall]], n: int):
        """For each parameter index: the (module, name) pairs its per-sample gradient sums.

        A module counts as called only where its calls carry the batch: a position table
        looked up with ``arange(T)`` is shared by all samples, and its per-sample gradients
        only separate in the parent that adds it to each sample.
        """
        batched = {m: all(c.carries_batch(n) for c in cs) for m, cs in calls.items()}
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

    def _rules(self, calls, contributions, n: int, scale: float) -> dict[nn.Module, Rule]:
        names: dict[nn.Module, list[str]] = defaultdict(list)
        for pairs in contributions:
            for module, name in pairs:
                if name not in names[module]:
                    names[module].append(name)
        rules = {}
        for module, module_names in names.items():
            for call in calls[module]:
                call.check_inputs_unchanged(self._names[module] or "the model")
            with self._naming(module):
                rule = rule_for(module, module_names)(
                    module, calls[module], module_names, n, scale
                )
            rules[module] = rule
        return rules

    # ----------------------------------------------------------------------------------------
    def statistics(
        self,
        calls: dict[nn.Module, list[ModuleCall]],
        request: Request,
        directions: dict[str, list[Tensor]],
        n: int,
        scale: float,
        keep_rules: bool = False,
    ) -> Statistics:
        """The request's statistics of g_n = scale * (captured sample-n gradient). With
        ``keep_rules`` (the step's own statistics), the rules that
        :meth:`mean_gradient_factors` can reuse are kept until :meth:`release`."""
        with torch.no_grad():
            contributions = self._contributions(calls, n)
            rules = self._rules(calls, contributions, n, scale)
            per_param: list[dict] = [{} for _ in self.params]
            empty = Request()
            # Projections are linear in g_n: a parameter with several contributions (tied
            # weights) gets them as the sum of each contribution's closed form when only
            # directions are asked; norms and visitors need the summed g_n materialised.
            # The directions are renamed there, so that no rule takes "grad" for the mean of
            # its own contribution.
            linear_only = not (request.sq_norms or request.sum_sq or request.visitors)
            part = {d: f"{d} (one contribution)" for d in request.directions}
            partial = Request(directions=frozenset(part.values()))
            summed: dict[int, dict[str, Tensor]] = {}
            for rule in rules.values():
                # factored directions reach the bilinear rules only (dense for the others)
                keep = _kept if isinstance(rule, BilinearRule) else dense
                requests, dirs, indices = [], [], []
                for name in rule.names:
                    k = self._index[id(rule.module.get_parameter(name))]
                    if len(contributions[k]) == 1:
                        requests.append(request)
                        dirs.append({d: keep(directions[d][k]) for d in request.directions})
                    elif linear_only:
                        requests.append(partial)
                        dirs.append({part[d]: dense(directions[d][k]) for d in part})
                    else:
                        requests.append(empty)
                        dirs.append({})
                    indices.append(k)
                for k, result in zip(
                    indices,
                    self._statistics(rule, _visitors_at(requests, indices), dirs),
                    strict=True,
                ):
                    if len(contributions[k]) == 1:
                        per_param[k] = result
                    elif linear_only and part:
                        into = summed.setdefault(k, {})
                        for d, renamed in part.items():
                            value = result["projections"][renamed]
                            into[d] = value if d not in into else into[d] + value
            for k, pairs in enumerate(contributions):
                if len(pairs) > 1 and linear_only:
                    per_param[k] = {"projections": summed.get(k, {})}
                elif len(pairs) > 1:
                    per_param[k] = self._summed_statistics(k, pairs, rules, request, directions, n)
                elif not pairs:
                    per_param[k] = _zero_statistics(self.params[k], request, directions, n, k)
            if keep_rules:  # only the rules it can use: the others hold scaled copies of the
                # step's output gradients
                factored = {m: r for m, r in rules.items() if _factored(r)}
                self._last = (calls, contributions, factored)
        return _collect(per_param, request)

    def mean_gradient_factors(self, calls, n: int, scale: float) -> list[tuple | None]:
        """For each parameter, (delta, x) with g = (1/N) sum_m delta_m x_m^T (delta [N, O]
        already scaled, x [N, I]) where it is a Linear weight without shared axes whose factors
        are smaller than the weight (see :mod:`avionics.persample.rules.factored`); else None.
        Reuses the rules of the last :meth:`statistics` of the same ``calls``."""
        with torch.no_grad():
            if self._last is not None and self._last[0] is calls:
                _, contributions, rules = self._last
            else:
                contributions = self._contributions(calls, n)
                rules = self._rules(calls, contributions, n, scale)
            factors: list[tuple | None] = [None] * len(self.params)
            for k, pairs in enumerate(contributions):
                if len(pairs) != 1 or k in self._from_root:
                    continue
                module, name = pairs[0]
                rule = rules.get(module)
                if name != "weight" or rule is None or not _factored(rule):
                    continue
                weight = rule._weight()
                if FactoredDirection.worth_it(n, weight.i, weight.o):
                    factors[k] = (weight.delta[:, 0, 0], weight.x[:, 0, 0])
        return factors

    def release(self) -> None:
        """Forget the rules of the last step (they hold its captured tensors)."""
        self._last = None

    def _statistics(self, rule: Rule, requests: list[Request], directions) -> list[dict]:
        with self._naming(rule.module):
            return rule.statistics(requests, directions)

    def _summed_statistics(self, k, pairs, rules, request, directions, n) -> dict:
        p = self.params[k]
        acc = Accumulator(request, {d: dense(directions[d][k]) for d in request.directions}, k)
        step = chunk_size(n, p.numel(), p.element_size())
        for start in range(0, n, step):
            stop = min(n, start + step)
            chunk = 0
            for module, name in pairs:
                rule = rules[module]
                with self._naming(module):
                    chunk = chunk + rule.materialize(start, stop)[rule.names.index(name)]
            acc.add(chunk)
        return acc.result()

    # ----------------------------------------------------------------------------------------
    def needs_check(self, calls: dict[nn.Module, list[ModuleCall]]) -> bool:
        return self._pattern(calls) != self._checked_pattern

    def _pattern(self, calls) -> tuple:
        return tuple(sorted((self._names[m], len(c)) for m, c in calls.items()))

    def check(self, calls, gradients: list[Tensor | None], n: int, scale: float) -> None:
        """Compare sum_n g_n with autograd's gradient (times ``scale``); reroute mismatches.

        ``gradients[k]`` is the gradient parameter k received in the captured backward.
        """
        with torch.no_grad():
            contributions = self._contributions(calls, n)
            rules = self._rules(calls, contributions, n, scale)
            totals = {}
            for module, rule in rules.items():
                with self._naming(module):
                    totals[module] = rule.total()
            # absolute slack relative to the whole gradient: a parameter whose gradient is
            # zero up to rounding (a bias before BatchNorm) must not fail the check
            total_norm = sum(g.norm() ** 2 for g in gradients if g is not None) ** 0.5 * scale
            for k, pairs in enumerate(contributions):
                actual = gradients[k]
                if actual is None or k in self._from_root:
                    continue
                ours = [totals[module][rules[module].names.index(name)] for module, name in pairs]
                # one temporary of the parameter's size: the difference is taken in place
                expected = actual * scale
                rtol = CHECK_RTOL.get(actual.dtype, 1e-2)
                atol = 100 * torch.finfo(actual.dtype).eps * total_norm
                bound = rtol * expected.norm() + atol
                for total in ours:
                    expected -= total
                if expected.norm() > bound:
                    if self.model not in calls:
                        raise RuntimeError(
                            f"Parameter '{self._param_name(k)}' receives gradient from uses "
                            "outside the modules that own it, and the model's own forward was "
                            "not captured. Call the model (not its submodules) in the forward."
                        )
                    self._from_root.add(k)
        self._checked_pattern = self._pattern(calls)

    @contextmanager
    def _naming(self, module: nn.Module):
        """Re-raise a rule's error with the module it failed on."""
        try:
            yield
        except (RuntimeError, NotImplementedError, ValueError) as error:
            if str(error).startswith("Module '"):
                raise
            name = self._names[module] or "the model"
            raise type(error)(
                f"Module '{name}' ({type(module).__name__}): the per-sample engine cannot "
                f"compute its per-sample gradients: {error}"
            ) from error

    def _param_name(self, k: int) -> str:
        module, name = self.owners[k][0]
        prefix = self._names[module]
        return f"{prefix}.{name}" if prefix else name


def _factored(rule: Rule) -> bool:
    """Whether :meth:`PerSampleEngine.mean_gradient_factors` may factor the rule's weight: a
    Linear layer without shared axes (T = 1)."""
    return isinstance(rule, LinearRule) and rule.delta.shape[2] == 1


def _kept(v):
    return v


def _visitors_at(requests: list[Request], indices: list[int]) -> list[Request]:
    """Visitors are called with the engine's parameter index, not the rule's."""
    return [
        r if not r.visitors else _reindexed(r, k) for r, k in zip(requests, indices, strict=True)
    ]


def _reindexed(request: Request, k: int) -> Request:
    def at(visit):
        return lambda _, chunk: visit(k, chunk)

    return Request(
        sq_norms=request.sq_norms,
        sum_sq=request.sum_sq,
        directions=request.directions,
        visitors=tuple(at(v) for v in request.visitors),
    )


def _zero_statistics(p: Tensor, request: Request, directions, n: int, k: int) -> dict:
    """A parameter no gradient reached: every g_n is zero."""
    acc = Accumulator(request, {d: dense(directions[d][k]) for d in request.directions}, k)
    acc.add(p.new_zeros(n, *p.shape))
    return acc.result()


def _collect(per_param: list[dict], request: Request) -> Statistics:
    stats = Statistics()
    if request.sq_norms:
        stats.sq_norms = [r["sq_norms"] for r in per_param]
    if request.sum_sq:
        stats.sum_sq = [r["sum_sq"] for r in per_param]
    for d in request.directions:
        stats.projections[d] = [r["projections"][d] for r in per_param]
    return stats
