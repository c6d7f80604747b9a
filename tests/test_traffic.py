"""What the cockpit sends under DDP per tracked step (issue 29, traffic; issue 26, one
collective): every torch.distributed collective is counted in real spawned gloo processes (DDP's
own gradient all-reduce runs in its C++ reducer and is not among them), by calls and bytes.

Per tracked single-batch step of the economy preset on 2 processes, with equal shards: ONE
collective, the step's agreement made when the block ends (each process learns of one that
failed), held until the quantities' sums are made: W rows of (raised, N_r, L_r, seconds,
skipped) float64 and the sums (a process that raised sends zeros of their size, known from the
last step with the same active quantities). The step before must have had equal shards (the
first tracked step, not knowing, carries the gradient sums). With unequal shards the global
mean gradient, sum_r N_r g_r / N, is not DDP's average: the agreement carries the gradient
sums, and the sums, which project on that mean, travel after it (2).
"""

from __future__ import annotations

import contextlib

import models
import pytest
import torch
import torch.distributed as dist
from spawned import on_ranks
from torch import nn

from avionics import Cockpit, configuration, quantities

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
)
BYTES_BEYOND_GRADIENTS = 1024


class Counted:
    """Every torch.distributed collective while ``on``: (name, bytes of its tensor, None for
    an object collective). Restores the functions on ``close``."""

    def __init__(self):
        self.calls: list[tuple[str, int | None]] = []
        self.on = False
        self._original = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, function in self._original.items():
            setattr(dist, name, self._counting(name, function))

    def _counting(self, name, function):
        def counted(*args, **kwargs):
            if self.on:
                tensor = args[0] if args else None
                size = None
                if isinstance(tensor, torch.Tensor):
                    size = tensor.numel() * tensor.element_size()
                elif isinstance(tensor, list) and tensor and isinstance(tensor[0], torch.Tensor):
                    size = sum(t.numel() * t.element_size() for t in tensor)
                self.calls.append((name, size))
            return function(*args, **kwargs)

        return counted

    def close(self):
        for name, function in self._original.items():
            setattr(dist, name, function)


def counted_step(rank, world, sizes, names):
    """The collectives of the third tracked step (the first arms, the second is warm), and the
    tensors' devices seen by them."""
    devices = set()
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        devices.add(str(tensor.device))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    counted = Counted()
    try:
        model, X, y, loss_fn = models.mlp(n=sum(sizes))
        start = sum(sizes[:rank])
        X, y = X[start : start + sizes[rank]], y[start : start + sizes[rank]]
        forward = nn.parallel.DistributedDataParallel(model)
        chosen = [getattr(quantities, name)() for name in names or ()]
        cockpit = Cockpit(forward, chosen if names else configuration("economy"))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(3):
            counted.on = step == 2
            opt.zero_grad()
            losses = loss_fn(forward(X), y)
            info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(X)}
            info["optimizer"] = opt
            with cockpit(step, info=info):
                losses.mean().backward()
            opt.step()
        cockpit.close()
        parameters = sum(p.numel() for p in model.parameters())
        return list(counted.calls), parameters, devices, cockpit.get_output()[2]
    finally:
        counted.close()
        dist.all_reduce = original


def scenarios(rank, world, cases):
    """Every case in one spawn (starting processes is what costs)."""
    return [counted_step(rank, world, sizes, names) for sizes, names in cases]


CASES = [((3, 3), None), ((3, 4), None), ((3, 3), ("Loss",)), ((3, 3), ("Loss", "Ranks"))]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Per case, rank 0's and rank 1's (collectives, parameters, devices, values)."""
    results = on_ranks(scenarios, 2, tmp_path_factory.mktemp("traffic"), CASES)
    return [list(case) for case in zip(*results)]


ROW_BYTES = 5 * 8  # (raised, N_r, L_r, seconds, skipped) per process, float64


def check_equal_shards(results, world):
    for calls, _, devices, _ in results:
        assert [name for name, _ in calls] == ["all_reduce"]
        ((_, size),) = calls
        assert size > world * ROW_BYTES  # the rows, and the sums
        assert size <= BYTES_BEYOND_GRADIENTS
        assert devices == {"cpu"}  # the parameters' device (NCCL: the CUDA tensors)


def test_economy_sends_one_small_all_reduce_with_equal_shards(two_processes):
    check_equal_shards(two_processes[0], 2)


def first_step_s_collectives(rank, world, steps):
    """The collectives of each tracked step: the first with a set of active quantities
    makes the sums' all-reduce apart (the room for them in the closing agreement is learnt
    then), the later ones carry them in the closing agreement."""
    model, X, y, loss_fn = models.mlp(n=6)
    X, y = X[3 * rank : 3 * rank + 3], y[3 * rank : 3 * rank + 3]
    forward = nn.parallel.DistributedDataParallel(model)
    cockpit = Cockpit(forward, configuration("economy"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counted, per_step = Counted(), []
    try:
        for step in range(steps):
            counted.on, counted.calls = True, []
            opt.zero_grad()
            losses = loss_fn(forward(X), y)
            info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}
            info["optimizer"] = opt
            with cockpit(step, info=info):
                losses.mean().backward()
            counted.on = False
            per_step.append([size for _, size in counted.calls])
            opt.step()
    finally:
        counted.close()
    cockpit.close()
    return per_step, cockpit.get_output()


def test_the_sums_ride_in_the_closing_agreement_from_the_second_step_on(tmp_path):
    (steps0, values0), (steps1, values1) = on_ranks(first_step_s_collectives, 2, tmp_path, 4)
    assert steps0 == steps1
    first, second, *later = steps0
    model = models.mlp(n=6)[0]
    parameters = sum(p.numel() for p in model.parameters())
    # step 0 knows nothing of the others' N_r: its agreement carries the gradient sums, and
    # the sums follow
    assert len(first) == 2 and first[0] == 2 * ROW_BYTES + parameters * 8
    # step 1, laid out for the equal shards step 0 had, holds its agreement for the sums, with
    # no room for them yet: they travel apart once more (the room learnt here; they are more
    # than at step 0: step 1 ends Alpha's first start); from then on, in the agreement
    assert second == [2 * ROW_BYTES, second[1]] and second[1] > first[1]
    for sizes in later:
        assert sizes == [2 * ROW_BYTES + second[1]]  # the rows and the sums: one collective
    assert sorted(values0) == sorted(values1) == [0, 1, 2, 3]
    for step, values in values0.items():
        assert values["Loss"] == values1[step]["Loss"]
        assert values["NormTest"] == values1[step]["NormTest"]


def test_with_three_processes_too(tmp_path):
    (results,) = zip(*on_ranks(scenarios, 3, tmp_path, [((3, 3, 3), None)]))
    check_equal_shards(results, 3)


def test_unequal_shards_carry_the_gradient_sums_in_the_closing_agreement(two_processes):
    for calls, parameters, _, _ in two_processes[1]:
        assert [name for name, _ in calls] == ["all_reduce"] * 2
        closing, sums = (size for _, size in calls)
        assert closing == 2 * ROW_BYTES + parameters * 8  # the rows and sum_r N_r g_r, float64
        assert sums > 0  # the sums, which project on the global mean gradient
        assert closing + sums - parameters * 8 <= BYTES_BEYOND_GRADIENTS


def test_loss_alone_sends_the_agreement_only(two_processes):
    for calls, _, _, values in two_processes[2]:
        assert [size for _, size in calls] == [2 * ROW_BYTES]  # (no sums: an empty room)
        assert "Loss" in values


def test_the_per_rank_view_adds_one_number_per_process_to_the_packed_sums(two_processes):
    for calls, _, _, values in two_processes[3]:
        assert [size for _, size in calls] == [2 * ROW_BYTES + 2 * 8]  # ||g_r||^2 per rank
        assert sorted(values["Ranks"]) == ["batch_size", "grad_norm", "loss", "step_time"]


def raising_after_backward(rank, world):
    """Unequal shards; rank 1 raises after its backward at step 1: its closing agreement must
    match the others' (the flags and the gradient sums' size) for them to learn of it."""
    model, X, y, loss_fn = models.mlp(n=7)
    forward = nn.parallel.DistributedDataParallel(model)
    cockpit = Cockpit(forward, [quantities.Loss(), quantities.GradNorm()])
    X, y = (X[:3], y[:3]) if rank == 0 else (X[3:], y[3:])
    for step in range(3):
        losses = loss_fn(forward(X), y)
        try:
            with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses}):
                losses.mean().backward()
                if rank == 1 and step == 1:
                    raise ValueError("the user's own error")
        except (ValueError, RuntimeError) as error:
            return type(error).__name__, str(error), sorted(cockpit.get_output())
    return "finished"


def test_a_rank_raising_at_a_step_with_unequal_shards_is_named(tmp_path):
    (error0, message0, steps0), (error1, _, steps1) = on_ranks(raising_after_backward, 2, tmp_path)
    assert (error0, error1) == ("RuntimeError", "ValueError")
    assert "Step 1, micro-batch 0: the process(es) of rank 1 raised inside" in message0
    assert steps0 == steps1 == [0]


def one_rank_s_scaled_gradients_not_finite(rank, world):
    """Equal shards, a scaled backward (c = 2, as GradScaler's); at step 2 rank 1's gradients
    are infinite (a hook of its own): (each step's collectives, values, warnings)."""
    model, X, y, loss_fn = models.mlp(n=6)
    X, y = X[3 * rank : 3 * rank + 3], y[3 * rank : 3 * rank + 3]
    forward = nn.parallel.DistributedDataParallel(model)
    cockpit = Cockpit(forward, [quantities.Loss(), quantities.GradNorm(), quantities.NormTest()])
    counted, per_step, said = Counted(), [], []
    weight = next(model.parameters())
    for step in range(4):
        hook = None
        if rank == 1 and step == 2:
            hook = weight.register_hook(lambda g: g * float("inf"))
        counted.on, counted.calls = True, []
        losses = loss_fn(forward(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}
        with pytest.warns(UserWarning) if step == 2 else contextlib.nullcontext() as caught:
            with cockpit(step, info=info):
                (2.0 * info["loss"]).backward()
        counted.on = False
        per_step.append([size for _, size in counted.calls])
        said.append([str(w.message) for w in caught] if step == 2 else [])
        if hook is not None:
            hook.remove()
        model.zero_grad()
    counted.close()
    cockpit.close()
    return per_step, cockpit.get_output(), said


def test_a_rank_s_scaled_gradients_not_finite_skip_the_step_on_every_rank_in_one_collective(
    tmp_path,
):
    """The rank whose gradients are not finite says so in its row of the step's one
    collective ("skipped"): every rank stores the Loss alone, with a warning naming it."""
    results = on_ranks(one_rank_s_scaled_gradients_not_finite, 2, tmp_path)
    for per_step, values, said in results:
        assert len(per_step[2]) == 1  # the agreement only, the sums riding in it
        assert sorted(values[2]) == ["Loss"]
        assert sorted(values[3]) == ["GradNorm", "Loss", "NormTest"]
        assert any("not finite after a scaled backward" in message for message in said[2])
    (_, values0, said0), (_, values1, said1) = results
    assert values0[2]["Loss"] == values1[2]["Loss"]
    assert any("the gradients of rank 1 are not finite" in message for message in said0[2])
