"""Gradient accumulation: k micro-batches per optimizer step, one block each
(docs/definitions.md, section 2).

``with cockpit(step, info_i, micro_batch=i, micro_batches=k):`` around micro-batch i's own
backward; the step's values are those of one batch made of the k micro-batches, exactly.
"""

import copy

import models
import pytest
import torch
from compare import assert_same_output

from avionics import Cockpit, configuration, quantities

CURVATURE = ("HessTrace", "HessMaxEV", "TICDiag")

# what the accumulated values must equal one batch's to
EXACT = {"rel": 1e-10, "abs": 1e-13}


def economy_and_curvature(curvature="diag_ggn_exact"):
    return configuration("economy") + [
        quantities.HessTrace(curvature=curvature),
        quantities.HessMaxEV(tol=1e-12),
        quantities.TICDiag(curvature=curvature),
    ]


ONE_BATCH = {}  # reduction -> the output of the one-batch run (shared by the parameters)


def run(
    model, X, y, loss_fn, k, make_quantities, steps=2, reduction="mean", sizes=None, batch_axis=0
):
    """Train ``steps`` SGD steps on (X, y), each accumulated over k micro-batches (of
    ``sizes`` samples, default equal chunks; X split along ``batch_axis``, y along axis 0),
    backpropagating each micro-batch's share of the whole batch's loss; the cockpit's
    output."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, make_quantities())
    sizes = sizes or [len(c) for c in y.chunk(k)]
    parts = list(zip(X.split(sizes, batch_axis), y.split(sizes), strict=True))
    for step in range(steps):
        opt.zero_grad()
        for i, (xb, yb) in enumerate(parts):
            losses = loss_fn(model(xb), yb)
            loss = losses.mean() if reduction == "mean" else losses.sum()
            info = {"loss": loss, "individual_losses": losses, "batch_size": len(yb)}
            info["optimizer"] = opt
            share = len(yb) / len(y) if reduction == "mean" else 1.0
            with cockpit(step, info, micro_batch=i, micro_batches=k):
                (loss * share).backward(create_graph=cockpit.create_graph(step))
        opt.step()
    for p in model.parameters():
        p.grad = None  # (create_graph's reference cycle)
    return cockpit.get_output()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_accumulated_steps_equal_one_batch(k, reduction):
    model, X, y, loss_fn = models.mlp(n=6)
    if reduction not in ONE_BATCH:
        ONE_BATCH[reduction] = run(
            model, X, y, loss_fn, 1, economy_and_curvature, reduction=reduction
        )
    ours = run(model, X, y, loss_fn, k, economy_and_curvature, reduction=reduction)
    assert {"Alpha", "NormTest", *CURVATURE} <= set(ours[0])
    assert_same_output(ours, ONE_BATCH[reduction], **EXACT)


def test_activation_health_of_accumulated_steps_equals_one_batch():
    """A unit dead in one micro-batch but alive in another is alive in the step's batch: the
    micro-batches' counts are added, not their calls listed side by side."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3), torch.nn.Tanh()
    ).double()
    with torch.no_grad():
        model[0].bias.sub_(0.6)  # most units alive on a few samples only
    X, y = torch.randn(9, 4, dtype=torch.float64), torch.randint(0, 3, (9,))

    def loss_fn(output, target):
        return torch.nn.functional.cross_entropy(output, target, reduction="none")

    def make_quantities():
        return [quantities.ActivationHealth()]

    one = run(model, X, y, loss_fn, 1, make_quantities)
    dead = [one[s]["ActivationHealth"]["1"]["dead"] for s in one]
    assert all(0 < d < 0.5 for d in dead), dead  # some units dead, most alive somewhere
    for k, sizes in ((3, None), (2, [2, 7])):
        assert_same_output(
            run(model, X, y, loss_fn, k, make_quantities, sizes=sizes), one, **EXACT
        )


def test_the_exact_hessian_diagonal_of_accumulated_steps_equals_one_batch():
    model, X, y, loss_fn = models.mlp(n=4)

    def make():
        return [quantities.HessTrace(curvature="diag_h"), quantities.TICTrace(curvature="diag_h")]

    assert_same_output(
        run(model, X, y, loss_fn, 2, make), run(model, X, y, loss_fn, 1, make), **EXACT
    )


def test_unequal_micro_batches_and_the_ggn_diagonal_equal_one_batch():
    model, X, y, loss_fn = models.cnn(n=5)

    def make():
        return [
            quantities.TICDiag(curvature="diag_ggn_exact"),
            quantities.NormTest(),
            quantities.GradHist1d(),
        ]

    one_batch = run(model, X, y, loss_fn, 1, make, steps=1)
    assert_same_output(
        run(model, X, y, loss_fn, 3, make, steps=1, sizes=[2, 1, 2]), one_batch, **EXACT
    )


def test_accumulation_on_a_transformer_equals_one_batch():
    model, X, y, loss_fn = models.transformer(n=4)

    def make():
        return configuration("economy")

    assert_same_output(
        run(model, X, y, loss_fn, 2, make), run(model, X, y, loss_fn, 1, make), **EXACT
    )


def block(cockpit, step, model, x, y, loss_fn, **micro):
    losses = loss_fn(model(x), y)
    info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(x)}
    return cockpit(step, info, **micro), losses.mean()


WRONG_ORDERS = {
    # (micro_batch, micro_batches) of the blocks entered before, the bad one, the message
    "a first block after micro-batch 0": ([(0, 2)], (0, 2), "enter its micro-batch 1 next"),
    "a skipped micro-batch": ([(0, 3)], (2, 3), "expected step 0, micro-batch 1 of 3"),
    "another k": ([(0, 3)], (1, 2), "expected step 0, micro-batch 1 of 3"),
    "no micro-batch 0": ([], (1, 2), "no micro-batch 0 of this step"),
    "an index past k": ([], (2, 2), r"micro_batch=2 with micro_batches=2.*0, \.\.\., 1"),
    "no micro-batches": ([], (0, 0), "micro_batches=0: an optimizer step has at least one"),
    "a float index": ([], (0.0, 2), "micro_batch=...* takes an int, got 0.0"),
}


@pytest.mark.parametrize("case", sorted(WRONG_ORDERS))
def test_micro_batches_out_of_order_raise_before_anything_changes(case):
    before, (i, k), message = WRONG_ORDERS[case]
    model, X, y, loss_fn = models.mlp(n=6)
    reference = run(model, X, y, loss_fn, 2, lambda: [quantities.NormTest()], steps=1)
    model = copy.deepcopy(model)
    cockpit = Cockpit(model, [quantities.NormTest()])
    for j, kk in before:
        context, loss = block(
            cockpit, 0, model, X[:3], y[:3], loss_fn, micro_batch=j, micro_batches=kk
        )
        with context:
            (loss / 2).backward()
    error = TypeError if isinstance(i, float) else ValueError
    context, loss = block(cockpit, 0, model, X[3:], y[3:], loss_fn, micro_batch=i, micro_batches=k)
    with pytest.raises(error, match=message):
        with context:
            pytest.fail("the block must not run")
    assert cockpit.get_output() == {}
    if before:  # the step goes on where it was
        context, loss = block(
            cockpit, 0, model, X[3:], y[3:], loss_fn, micro_batch=1, micro_batches=before[0][1]
        )
    else:
        model.zero_grad()
        cockpit = Cockpit(model, [quantities.NormTest()])
        for j, (xb, yb) in enumerate(zip(X.chunk(2), y.chunk(2))):
            context, loss = block(
                cockpit, 0, model, xb, yb, loss_fn, micro_batch=j, micro_batches=2
            )
            if j == 0:
                with context:
                    (loss / 2).backward()
    if before and before[0][1] == 3:
        return  # (a 3-batch step: its values are tested above)
    with context:
        (loss / 2).backward()
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(
        reference[0]["NormTest"], rel=1e-10
    )


def test_a_second_block_without_micro_batch_is_still_refused():
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = Cockpit(model, [quantities.Loss()])
    context, loss = block(cockpit, 0, model, X, y, loss_fn)
    with context:
        loss.backward()
    context, loss = block(cockpit, 0, model, X, y, loss_fn)
    with pytest.raises(ValueError, match="Step 0 was already tracked"):
        with context:
            pass


def test_an_exception_in_a_micro_batch_abandons_its_step_and_a_retry_works():
    model, X, y, loss_fn = models.mlp(n=6)
    reference = run(model, X, y, loss_fn, 2, lambda: [quantities.NormTest()], steps=1)
    model = copy.deepcopy(model)
    cockpit = Cockpit(model, [quantities.NormTest()])
    context, loss = block(cockpit, 0, model, X[:3], y[:3], loss_fn, micro_batch=0, micro_batches=2)
    with context:
        (loss / 2).backward()
    context, loss = block(cockpit, 0, model, X[3:], y[3:], loss_fn, micro_batch=1, micro_batches=2)
    with pytest.raises(KeyboardInterrupt):
        with context:
            raise KeyboardInterrupt
    assert cockpit.get_output() == {}
    model.zero_grad()
    for j, (xb, yb) in enumerate(zip(X.chunk(2), y.chunk(2))):
        context, loss = block(cockpit, 0, model, xb, yb, loss_fn, micro_batch=j, micro_batches=2)
        with context:
            (loss / 2).backward()
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(
        reference[0]["NormTest"], rel=1e-10
    )


def test_micro_batches_need_their_sizes_and_one_reduction():
    model, X, y, loss_fn = models.mlp(n=6)
    cockpit = Cockpit(model, [quantities.GradNorm()])
    losses = loss_fn(model(X[:3]), y[:3])
    with pytest.raises(ValueError, match=r"micro-batch 0: .*pass info\['batch_size'\]"):
        with cockpit(0, {"loss": losses.mean()}, micro_batch=0, micro_batches=2):
            pass
    context, loss = block(cockpit, 0, model, X[:3], y[:3], loss_fn, micro_batch=0, micro_batches=2)
    with context:
        (loss / 2).backward()
    losses = loss_fn(model(X[3:]), y[3:])
    info = {"loss": losses.sum(), "individual_losses": losses, "batch_size": 3}
    with pytest.raises(ValueError, match="is the sum of the per-sample losses, micro-batch 0's"):
        with cockpit(0, info, micro_batch=1, micro_batches=2):
            pass
