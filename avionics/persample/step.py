"""One tracked step's per-sample information: its captured layer calls and their rules.

A :class:`CapturedStep` is made by :meth:`PerSampleEngine.step
<avionics.persample.engine.PerSampleEngine.step>` after the user's backward. It knows, for
every tracked parameter, which module calls its per-sample gradient g_n sums over (its
*contributions*, see :mod:`avionics.persample.engine`), builds each module's rule once, and
answers every :class:`~avionics.persample.request.Request` of the step from them:

* :meth:`CapturedStep.statistics`: the step's own statistics (one call for the merged request
  of all active quantities), or, later, projections onto a direction known only after the
  update (Alpha projects the start step's g_n onto theta_{t+1} - theta_t), with the step's
  parameter values swapped back in;
* :meth:`CapturedStep.mean_gradient_factors`: the factors of g = (1/N) sum_n delta_n x_n^T
  where a Linear weight has them (Alpha keeps them instead of a copy of g).

Its results are plain per-parameter tensors: sums over the samples of this process's batch.
The rules hold copies of the step's output gradients multiplied by the output-gradient factor
(:attr:`CapturedStep.output_gradient_factor`); :meth:`release_rules` lets them go while the
step itself is still wanted, and dropping the step releases everything it captured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn

from avionics.persample.calls import ModuleCall
from avionics.persample.precision import computing, computing_dtype
from avionics.persample.request import Accumulator, Request, Statistics
from avionics.persample.routing import Routing
from avionics.persample.rules import rule_for
from avionics.persample.rules.base import Rule, chunk_size
from avionics.persample.rules.bilinear import BilinearRule
from avionics.persample.rules.broadcast import SharedParameterRule
from avionics.persample.rules.factored import FactoredDirection, dense
from avionics.persample.rules.generic import GenericRule
from avionics.persample.rules.linear import LinearRule


class CapturedStep:
    """The per-sample statistics of one captured forward and backward.

    Args:
        engine: the routing of the parameters' gradients this step follows (the
            :class:`~avionics.persample.engine.PerSampleEngine` that made it).
        calls: the captured calls that received a gradient, grouped by module.
        n: the number of samples N.
        output_gradient_factor: the factor that turns a captured output gradient into the
            per-sample one: g_n = factor * (the sample-n part of the backpropagated gradient),
            N for a mean-reduced loss (whose backward carries dl_n/dout / N), 1 for a sum.
    """

    def __init__(
        self,
        engine: Routing,
        calls: dict[nn.Module, list[ModuleCall]],
        n: int,
        output_gradient_factor: float,
    ):
        self.engine, self.calls, self.n = engine, calls, n
        self.output_gradient_factor = output_gradient_factor
        # contributions[k]: the (module, parameter name) pairs whose g_n parameter k sums
        self.contributions = engine.contributions(calls, n, captured_backward=True)
        self._rules: dict[nn.Module, Rule] | None = None
        self._all_rules = False  # whether _rules holds every module's rule

    @property
    def rules(self) -> dict[nn.Module, Rule]:
        """Each contributing module's rule, built on first use and kept until
        :meth:`release_rules`."""
        if not self._all_rules:
            self._rules, self._all_rules = self._build_rules(), True
        return self._rules

    def _build_rules(self) -> dict[nn.Module, Rule]:
        names: dict[nn.Module, list[str]] = {}
        for pairs in self.contributions:
            for module, name in pairs:
                module_names = names.setdefault(module, [])
                if name not in module_names:
                    module_names.append(name)
        rules = {}
        root_calls = self.calls.get(self.engine.model, [])
        # per-sample gradients of parameters used directly and broadcast by additions
        shared = root_calls[0].shared_parameter_gradients if len(root_calls) == 1 else {}
        for module, module_names in names.items():
            where = self.engine.module_name(module)
            for call in self.calls[module]:
                call.check_inputs_unchanged(where)
            rule = rule_for(module, module_names)
            args = (module, self.calls[module], module_names, self.n, self.output_gradient_factor)
            given = (
                []
                if rule is not GenericRule or not shared
                else [shared.get(id(module.get_parameter(name))) for name in module_names]
            )
            with self.engine.naming(module):
                if given and all(g is not None for g in given):
                    rules[module] = SharedParameterRule(*args, given)
                else:
                    rules[module] = rule(*args)
            if isinstance(rules[module], GenericRule):
                rules[module].on_slow_path = self.engine.warn_slow_path
        return rules

    def release_rules(self, keep: Callable[[Rule], bool] | None = None) -> None:
        """Forget the rules (they hold scaled copies of the output gradients), except those
        for which ``keep(rule)`` is true; later requests rebuild what they need."""
        if self._rules is not None:
            kept = {m: r for m, r in self._rules.items() if keep is not None and keep(r)}
            self._rules, self._all_rules = kept, False

    # ----------------------------------------------------------------------------------------
    def statistics(
        self,
        request: Request,
        directions: dict[str, list[Tensor]],
        params: list[Tensor] | None = None,
        sample_mean: str | None = None,
    ) -> Statistics:
        """The request's statistics of this step's g_n, one entry per tracked parameter.

        ``directions[name][k]`` is direction ``name`` for parameter k (a tensor, or a
        :class:`~avionics.persample.rules.factored.FactoredDirection`). Once the parameters
        have changed (after ``optimizer.step()``), pass ``params``, their values at this step:
        they are swapped in while it runs, for the rules that re-run a module's forward, and
        rules are built afresh for them. ``sample_mean``: the direction that is the mean of
        this step's g_n (the step's mean gradient, where this step's samples are the whole
        batch; see :attr:`Request.sample_mean <avionics.persample.request.Request>`), or None.
        """
        if sample_mean in request.directions:
            request = replace(request, sample_mean=sample_mean)
        if params is None:
            return self._statistics(self.rules, request, directions)
        tracked = self.engine.params
        now = [p.data for p in tracked]
        try:
            for p, value in zip(tracked, params, strict=True):
                p.data = value
            return self._statistics(self._build_rules(), request, directions)
        finally:
            for p, value in zip(tracked, now, strict=True):
                p.data = value

    def _statistics(self, rules, request: Request, directions) -> Statistics:
        contributions, params = self.contributions, self.engine.params
        # directions of a 16-bit model (its mean gradient, its update) in float32
        directions = {d: [_computing(v) for v in vs] for d, vs in directions.items()}
        with torch.no_grad():
            per_param: list[dict] = [{} for _ in params]
            # Projections are linear in g_n: a parameter with several contributions (tied
            # weights) gets them as the sum of each contribution's closed form when only
            # directions are asked (no direction is the mean of one contribution's g_n); norms
            # and visitors need the summed g_n materialised.
            linear_only = not (request.sq_norms or request.sum_sq or request.visitors)
            partial = Request(directions=request.directions)
            summed: dict[int, dict[str, Tensor]] = {}
            indexed = self._indexed(request)
            for rule in rules.values():
                # factored directions reach the bilinear rules only (dense for the others)
                keep = _unchanged if isinstance(rule, BilinearRule) else dense
                requests, dirs, indices = [], [], []
                for p in rule.params:  # (the parameters of rule.names)
                    k = self.engine.index[id(p)]
                    if len(contributions[k]) == 1:
                        requests.append(indexed[k])
                        dirs.append({d: keep(directions[d][k]) for d in request.directions})
                    elif linear_only:
                        requests.append(partial)
                        dirs.append({d: dense(directions[d][k]) for d in request.directions})
                    else:
                        requests.append(Request())
                        dirs.append({})
                    indices.append(k)
                with self.engine.naming(rule.module):
                    results = rule.statistics(requests, dirs)
                for k, result in zip(indices, results, strict=True):
                    if len(contributions[k]) == 1:
                        per_param[k] = result
                    elif linear_only and request.directions:
                        into = summed.setdefault(k, {})
                        for d in request.directions:
                            value = result["projections"][d]
                            into[d] = value if d not in into else into[d] + value
            for k, pairs in enumerate(contributions):
                if len(pairs) > 1 and linear_only:
                    per_param[k] = {"projections": summed.get(k, {})}
                elif len(pairs) > 1:
                    per_param[k] = summed_statistics(
                        self.engine, rules, pairs, params[k], k, request, directions, self.n
                    )
                elif not pairs:
                    per_param[k] = _zero_statistics(params[k], request, directions, self.n, k)
        return _collect(per_param, request)

    def _indexed(self, request: Request) -> list[Request]:
        """``request`` for each parameter k, its visitors called with k (the engine's parameter
        index, not the rule's). The copies are kept on the engine (:attr:`Routing.indexed_requests
        <avionics.persample.routing.Routing>`), one list per request: a cockpit asks the same
        request every step, and one look-up a step finds them."""
        if not request.visitors:
            return [request] * len(self.engine.params)
        kept = self.engine.indexed_requests
        if request not in kept:
            if len(kept) >= 4:  # (requests that changed)
                kept.clear()
            kept[request] = [_reindexed(request, k) for k in range(len(self.engine.params))]
        return kept[request]

    def totals(self):
        """Yield (k, sum_n g_n of one contribution of parameter k) for every contribution,
        rule by rule (the gradient check's sums; one rule's sums are made at a time)."""
        where = {pair: k for k, pairs in enumerate(self.contributions) for pair in pairs}
        for module, rule in self.rules.items():
            with torch.no_grad(), self.engine.naming(module):
                sums = rule.total()
            for name, total in zip(rule.names, sums, strict=True):
                if (module, name) in where:
                    yield where[module, name], total
            del sums

    def mean_gradient_factors(self) -> list[tuple[Tensor, Tensor] | None]:
        """For each parameter, (delta, x) with g = (1/N) sum_m delta_m x_m^T (delta [N, O]
        already scaled, x [N, I]) where it is a Linear weight without shared axes whose factors
        are smaller than the weight (see :mod:`avionics.persample.rules.factored`); else None.
        """
        # the factorable rules are all kept by release_rules(keep=factorable)
        rules = self.rules if self._rules is None else self._rules
        factors: list[tuple | None] = [None] * len(self.engine.params)
        for k, pairs in enumerate(self.contributions):
            if len(pairs) != 1 or self.engine.rerouted(k):
                continue
            module, name = pairs[0]
            rule = rules.get(module)
            if name != "weight" or rule is None or not factorable(rule):
                continue
            weight = rule._weight()
            if FactoredDirection.worth_it(self.n, weight.i, weight.o):
                factors[k] = (weight.delta[:, 0, 0], weight.x[:, 0, 0])
        return factors


def summed_statistics(engine, rules, pairs, p: Tensor, k: int, request, directions, n) -> dict:
    """The statistics of parameter k (``p``) whose g_n sums several contributions ``pairs``
    (tied weights): their materialised gradients are summed in chunks before reducing, since
    ||a + b||^2 is not ||a||^2 + ||b||^2. ``rules`` maps each module to its rule."""
    acc = Accumulator(request, {d: dense(directions[d][k]) for d in request.directions}, k)
    step = chunk_size(n, p.numel(), p.element_size())
    for start in range(0, n, step):
        stop = min(n, start + step)
        chunk = 0
        for module, name in pairs:
            rule = rules[module]
            with engine.naming(module):
                chunk = chunk + rule.materialize(start, stop)[rule.names.index(name)]
        acc.add(chunk)
    return acc.result()


def factorable(rule: Rule) -> bool:
    """Whether :meth:`CapturedStep.mean_gradient_factors` may factor the rule's weight: a
    Linear layer without shared axes (T = 1)."""
    return isinstance(rule, LinearRule) and rule.delta.shape[2] == 1


def _computing(v):
    """A direction in the dtype the engine computes in (a factored one is so already: its
    factors are captured tensors)."""
    return v if isinstance(v, FactoredDirection) else computing(v)


def _unchanged(v):
    return v


def _reindexed(request: Request, k: int) -> Request:
    def at(visit):
        return lambda _, chunk: visit(k, chunk)

    return replace(request, visitors=tuple(at(v) for v in request.visitors))


def _zero_statistics(p: Tensor, request: Request, directions, n: int, k: int) -> dict:
    """A parameter no gradient reached: every g_n is zero."""
    acc = Accumulator(request, {d: dense(directions[d][k]) for d in request.directions}, k)
    acc.add(p.new_zeros(n, *p.shape, dtype=computing_dtype(p.dtype)))
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
