"""Curvature operators over a data set sharded across torch.distributed processes.

2 and 3 gloo processes (spawned once per world size by ``tests/spawned.py``) each hold a shard
of one float64 data set (equal shards; unequal ones, one process with several batches) and
build the operators with ``distributed`` at its default. On every process, every product,
Kronecker factor and algorithm result equals (rel 1e-10) that of one process with the whole
data set (the shards' batches in rank order), and is the same on every process. The
per-sample operators (Jacobians, activation Hessian) stay on their process's data, and an
error on one process is raised on all of them, with nothing changed.
"""

from __future__ import annotations

import pytest
import torch
from curvature_problems import Tied
from spawned import on_ranks
from torch import nn

from avionics.curvature import (
    ActivationHessianOperator,
    EFOperator,
    EKFACOperator,
    GGNOperator,
    HessianOperator,
    IdentityOperator,
    JacobianOperator,
    KFACOperator,
    MCFisherOperator,
    TransposedJacobianOperator,
    bottom_eigenpairs,
    conjugate_gradient,
    frobenius_norm_squared,
    hutchinson_diagonal,
    hutchinson_trace,
    hutchpp_trace,
    neumann_inverse,
    spectral_density,
    top_eigenpairs,
    xdiag,
    xtrace,
)

NUM_DATA = 12
#: Batch sizes of every process's shard, per world size.
SHARDS = {2: ((3, 3), (3, 3)), 3: ((4,), (2, 3, 1), (2,))}
REL = 1e-10


def make_problem(name: str):
    """(model, loss_fn, X, y): the whole data set, float64, the same in every process."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        X = torch.randn(NUM_DATA, 4, generator=generator)
        y, loss_fn = torch.randint(0, 3, (NUM_DATA,), generator=generator), nn.CrossEntropyLoss()
    elif name == "cnn":
        model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(18, 2))
        X = torch.randn(NUM_DATA, 1, 5, 5, generator=generator)
        y, loss_fn = torch.randn(NUM_DATA, 2, generator=generator), nn.MSELoss(reduction="sum")
    else:
        model = Tied()
        X = torch.randn(NUM_DATA, 4, generator=generator)
        y, loss_fn = torch.randint(0, 3, (NUM_DATA,), generator=generator), nn.CrossEntropyLoss()
    y = y.double() if y.is_floating_point() else y
    return model.double().eval(), loss_fn, X.double(), y


def _batches(X, y, sizes, start: int = 0) -> list:
    out = []
    for size in sizes:
        out.append((X[start : start + size], y[start : start + size]))
        start += size
    return out


def shard(X, y, world: int, rank: int) -> list:
    """Process ``rank``'s batches."""
    return _batches(X, y, SHARDS[world][rank], sum(map(sum, SHARDS[world][:rank])))


def whole(X, y, world: int) -> list:
    """Every process's batches, in rank order: the data set one process sees."""
    return _batches(X, y, [size for sizes in SHARDS[world] for size in sizes])


#: name: (problem, operator class, options). The determinism check (on by default) is left
#: to the operators whose checks differ (model outputs for the MC Fisher, KFAC's own) and to
#: the Hessians of the other tests, to keep the runs short.
OPERATORS = {
    "hessian-mlp": ("mlp", HessianOperator, {"check_deterministic": False}),
    "ggn-mlp": ("mlp", GGNOperator, {"check_deterministic": False}),
    "ef-mlp": ("mlp", EFOperator, {"check_deterministic": False}),
    "mc-fisher-mlp": ("mlp", MCFisherOperator, {"mc_samples": 2, "seed": 3}),
    "kfac-type-2-mlp": ("mlp", KFACOperator, {"fisher_type": "type-2"}),
    "kfac-mc-mlp": (
        "mlp",
        KFACOperator,
        {"mc_samples": 2, "seed": 3, "check_deterministic": False},
    ),
    "kfac-empirical-joint-mlp": (
        "mlp",
        KFACOperator,
        {
            "fisher_type": "empirical",
            "separate_weight_and_bias": False,
            "check_deterministic": False,
        },
    ),
    "ekfac-type-2-mlp": (
        "mlp",
        EKFACOperator,
        {"fisher_type": "type-2", "check_deterministic": False},
    ),
    "ekfac-mc-mlp": ("mlp", EKFACOperator, {"seed": 3, "check_deterministic": False}),
    "hessian-cnn": ("cnn", HessianOperator, {"check_deterministic": False}),
    "ggn-cnn": ("cnn", GGNOperator, {"check_deterministic": False}),
    "kfac-type-2-cnn": (
        "cnn",
        KFACOperator,
        {"fisher_type": "type-2", "check_deterministic": False},
    ),
    "ekfac-type-2-cnn": (
        "cnn",
        EKFACOperator,
        {"fisher_type": "type-2", "check_deterministic": False},
    ),
    "hessian-tied": ("tied", HessianOperator, {"check_deterministic": False}),
    "ggn-tied": ("tied", GGNOperator, {"check_deterministic": False}),
    "ef-tied": ("tied", EFOperator, {"check_deterministic": False}),
}


def build(name: str, data_of):
    """The operator ``name`` on ``data_of(X, y)`` of its problem."""
    problem_name, operator, options = OPERATORS[name]
    model, loss_fn, X, y = make_problem(problem_name)
    return operator(model, loss_fn, None, data_of(X, y), **options)


def products(A) -> dict:
    """The dense matrix (A @ I, all columns at once), a product with one vector (the
    single-vector path) and one with a list of per-parameter tensors, of ``A``."""
    D = A.shape[1]
    v = torch.linspace(-1, 1, D, dtype=torch.float64)
    parts = list(
        torch.linspace(1, 2, D, dtype=torch.float64).split([s.numel() for s in A.in_shapes])
    )
    as_list = [p.view(s) for p, s in zip(parts, A.in_shapes)]
    return {
        "dense": A @ torch.eye(D, dtype=torch.float64),
        "vector": A @ v,
        "list": torch.cat([t.flatten() for t in A @ as_list]),
    }


def factors(A) -> list:
    return [(block.B, block.A) for block in A.blocks] if isinstance(A, KFACOperator) else []


def algorithms(H, G) -> dict:
    """Every algorithm on the Hessian (and the damped GGN for the solves), fixed seeds."""
    b = torch.linspace(-1, 1, G.shape[1], dtype=torch.float64)
    return {
        "top": top_eigenpairs(H, k=3, tol=1e-10).values,
        "bottom": bottom_eigenpairs(H, k=2, tol=1e-10).values,
        "hutchinson": hutchinson_trace(H, 10, seed=1),
        "hutchpp": hutchpp_trace(H, 12, seed=2),
        "xtrace": xtrace(H, 12, seed=3),
        "hutchinson diagonal": hutchinson_diagonal(H, 10, seed=4),
        "xdiag": xdiag(H, 12, seed=5),
        "frobenius": frobenius_norm_squared(H, 6, seed=6),
        "density": spectral_density(H, num_probes=2, num_steps=8, seed=7).density,
        "cg": conjugate_gradient(G + 1.0 * IdentityOperator(G), b, tol=1e-13).solution,
        "neumann": neumann_inverse(G + 1.0 * IdentityOperator(G), b, num_terms=10),
    }


class Changing(list):
    """A list of batches that can leave its last batch out of a pass, or add fresh noise to
    every input on every pass (a random augmentation)."""

    leave_out_last = False
    noisy = False

    def __iter__(self):
        batches = list.__iter__(self[:-1] if self.leave_out_last else self)
        for X, y in batches:
            yield (X + 0.1 * torch.randn_like(X) if self.noisy else X), y


def unchanged(model, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def raised(build) -> tuple[str, str] | None:
    """(type name, message) of what ``build()`` raises, or None."""
    try:
        build()
    except Exception as error:
        return type(error).__name__, str(error)
    return None


def errors(rank: int, world: int) -> dict:
    """The errors of sharded data, on every process, and what is left after them."""
    model, loss_fn, X, y = make_problem("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    data = Changing(shard(X, y, world, rank))
    out = {
        "num_data": raised(lambda: HessianOperator(model, loss_fn, None, data, num_data=13)),
        "empty": raised(lambda: HessianOperator(model, loss_fn, None, data if rank else [])),
    }
    H = HessianOperator(model, loss_fn, None, data, check_deterministic=False)
    data.leave_out_last = rank == world - 1
    out["pass"] = raised(lambda: H @ torch.ones(H.shape[1], dtype=torch.float64))
    data.leave_out_last = False
    out["after pass"] = H.num_data, products(H)["dense"]
    data.noisy = rank == 1
    out["determinism"] = raised(lambda: HessianOperator(model, loss_fn, None, data))
    data.noisy = False
    out["model unchanged"] = unchanged(model, before)
    return out


def one_rank(rank: int, world: int) -> dict:
    """Everything the tests compare, on this process's shard."""
    results = {"products": {}, "factors": {}}
    for name in OPERATORS:
        A = build(name, lambda X, y: shard(X, y, world, rank))
        results["products"][name], results["factors"][name] = products(A), factors(A)
    model, loss_fn, X, y = make_problem("mlp")
    data = shard(X, y, world, rank)
    H = HessianOperator(model, loss_fn, None, data)
    results["algorithms"] = algorithms(H, GGNOperator(model, loss_fn, None, data))
    loss, gradient = H.loss_and_gradient()
    results["loss and gradient"] = torch.cat([loss[None], *(g.flatten() for g in gradient)])
    results["num_data"] = H.num_data
    explicit = HessianOperator(model, loss_fn, None, data, num_data=NUM_DATA, distributed=True)
    results["explicit"] = products(explicit)["dense"]
    ddp = nn.parallel.DistributedDataParallel(model)
    results["ddp"] = {
        "hessian": products(HessianOperator(ddp, loss_fn, None, data))["dense"],
        "kfac": products(KFACOperator(ddp, loss_fn, None, data, fisher_type="type-2"))["dense"],
        "activation": products(
            ActivationHessianOperator(ddp, loss_fn, ("1", "output", 0), data[:1])
        )["dense"],
    }
    results["per process"] = per_process(model, loss_fn, data)
    results["errors"] = errors(rank, world)
    return results


def per_process(model, loss_fn, data) -> dict:
    """The operators that stay on this process's data (explicitly so, or by their nature)."""
    return {
        "hessian": products(HessianOperator(model, loss_fn, None, data, distributed=False))[
            "dense"
        ],
        "jacobian": products(JacobianOperator(model, None, data))["dense"],
        "transposed jacobian": products(TransposedJacobianOperator(model, None, data))["dense"],
        "activation": products(
            ActivationHessianOperator(model, loss_fn, ("1", "output", 0), data[:1])
        )["dense"],
    }


# -------------------------------------------------------------------------------------------
# The runs, and the single-process references
# -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(SHARDS), ids=lambda world: f"{world}-processes")
def world(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def ranks(world, tmp_path_factory) -> list[dict]:
    return on_ranks(one_rank, world, tmp_path_factory.mktemp("sharded"))


@pytest.fixture(scope="module")
def reference(world) -> dict:
    """What one process gives on the whole data set."""
    out = {"products": {}, "factors": {}}
    for name in OPERATORS:
        A = build(name, lambda X, y: whole(X, y, world))
        out["products"][name], out["factors"][name] = products(A), factors(A)
    model, loss_fn, X, y = make_problem("mlp")
    data = whole(X, y, world)
    H = HessianOperator(model, loss_fn, None, data)
    out["algorithms"] = algorithms(H, GGNOperator(model, loss_fn, None, data))
    loss, gradient = H.loss_and_gradient()
    out["loss and gradient"] = torch.cat([loss[None], *(g.flatten() for g in gradient)])
    out["per process"] = [
        per_process(model, loss_fn, shard(X, y, world, rank)) for rank in range(world)
    ]
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what) -> None:
    """||actual - expected|| <= REL ||expected||."""
    assert actual.shape == expected.shape, what
    error = (actual - expected).norm() / expected.norm()
    assert error <= REL, f"{what}: relative error {float(error):.2e}"


def assert_same_on_every_process(ranks: list[dict], get) -> None:
    first = get(ranks[0])
    for rank, results in enumerate(ranks[1:], start=1):
        assert torch.equal(get(results), first), f"process {rank} differs from process 0"


# -------------------------------------------------------------------------------------------
# Sharded data: the whole data set's operator on every process
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPERATORS))
def test_every_product_is_the_whole_data_set_s_on_every_process(ranks, reference, name):
    for kind, expected in reference["products"][name].items():
        for rank, results in enumerate(ranks):
            assert_close(results["products"][name][kind], expected, (name, kind, rank))
        assert_same_on_every_process(ranks, lambda r, kind=kind: r["products"][name][kind])


@pytest.mark.parametrize("name", [n for n in OPERATORS if "kfac" in n])
def test_kronecker_factors_are_the_whole_data_set_s(ranks, reference, name):
    expected = reference["factors"][name]
    for rank, results in enumerate(ranks):
        assert len(results["factors"][name]) == len(expected)
        for i, ((B, A), (B_ref, A_ref)) in enumerate(zip(results["factors"][name], expected)):
            assert_close(B, B_ref, (name, "B", i, rank))
            assert_close(A, A_ref, (name, "A", i, rank))


@pytest.mark.parametrize(
    "algorithm",
    ["top", "bottom", "hutchinson", "hutchpp", "xtrace", "hutchinson diagonal", "xdiag",
     "frobenius", "density", "cg", "neumann"],
)  # fmt: skip
def test_algorithms_give_on_every_process_what_one_process_gives(ranks, reference, algorithm):
    for rank, results in enumerate(ranks):
        assert_close(results["algorithms"][algorithm], reference["algorithms"][algorithm], rank)
    assert_same_on_every_process(ranks, lambda r: r["algorithms"][algorithm])


def test_loss_gradient_and_num_data_are_the_whole_data_set_s(ranks, reference):
    for rank, results in enumerate(ranks):
        assert results["num_data"] == NUM_DATA
        assert_close(results["loss and gradient"], reference["loss and gradient"], rank)


def test_given_num_data_and_distributed_true_are_the_whole_data_set_s(ranks, reference):
    for rank, results in enumerate(ranks):
        assert_close(results["explicit"], reference["products"]["hessian-mlp"]["dense"], rank)


def test_a_model_in_distributed_data_parallel_is_unwrapped(ranks, reference):
    for rank, results in enumerate(ranks):
        ddp = results["ddp"]
        assert_close(ddp["hessian"], reference["products"]["hessian-mlp"]["dense"], rank)
        assert_close(ddp["kfac"], reference["products"]["kfac-type-2-mlp"]["dense"], rank)
        assert_close(ddp["activation"], reference["per process"][rank]["activation"], rank)


def test_per_sample_operators_and_distributed_false_stay_on_their_process(ranks, reference):
    for rank, results in enumerate(ranks):
        for name, expected in reference["per process"][rank].items():
            assert_close(results["per process"][name], expected, (name, rank))


# -------------------------------------------------------------------------------------------
# Errors: raised on every process, nothing changed
# -------------------------------------------------------------------------------------------


def test_a_num_data_other_than_the_shards_total_is_refused_on_every_process(ranks):
    for results in ranks:
        kind, message = results["errors"]["num_data"]
        assert kind == "ValueError"
        assert "num_data=13" in message and f"num_data={NUM_DATA}" in message


def test_an_empty_shard_is_refused_on_every_process(ranks):
    kind, message = ranks[0]["errors"]["empty"]
    assert kind == "ValueError" and "empty shard of the data set" in message
    for results in ranks[1:]:
        kind, message = results["errors"]["empty"]
        assert kind == "RuntimeError" and "process(es) [0]" in message


def test_a_pass_with_other_samples_on_one_process_raises_on_every_process(ranks, reference):
    last = len(ranks) - 1
    kind, message = ranks[last]["errors"]["pass"]
    assert kind == "ValueError" and "data must hold the same samples" in message
    assert f"rank {last}" in message
    for results in ranks[:last]:
        kind, message = results["errors"]["pass"]
        assert kind == "RuntimeError" and f"process(es) [{last}]" in message
    for rank, results in enumerate(ranks):  # the operator is as it was, the processes in step
        num_data, dense = results["errors"]["after pass"]
        assert num_data == NUM_DATA
        assert_close(dense, reference["products"]["hessian-mlp"]["dense"], rank)


def test_no_error_of_sharded_data_changes_the_model(ranks):
    assert all(results["errors"]["model unchanged"] for results in ranks)


def test_the_determinism_check_of_one_process_raises_on_every_process(ranks):
    kind, message = ranks[1]["errors"]["determinism"]
    assert kind == "RuntimeError" and "differ between two passes" in message
    for rank, results in enumerate(ranks):
        if rank != 1:
            kind, message = results["errors"]["determinism"]
            assert kind == "RuntimeError" and "process(es) [1]" in message


# -------------------------------------------------------------------------------------------
# Errors without torch.distributed
# -------------------------------------------------------------------------------------------


def test_distributed_true_needs_torch_distributed_initialised():
    model, loss_fn, X, y = make_problem("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="distributed=True .* not initialised"):
        HessianOperator(model, loss_fn, None, [(X, y)], distributed=True)
    assert unchanged(model, before)


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_distributed_must_be_none_or_a_bool(value):
    model, loss_fn, X, y = make_problem("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        ValueError, match=f"distributed must be None, True or False, got {value!r}"
    ):
        GGNOperator(model, loss_fn, None, [(X, y)], distributed=value)
    assert unchanged(model, before)


@pytest.mark.parametrize(
    "build",
    [
        lambda m, f, d: JacobianOperator(m, None, d, distributed=True),
        lambda m, f, d: TransposedJacobianOperator(m, None, d, distributed=True),
        lambda m, f, d: ActivationHessianOperator(m, f, ("1", "output", 0), d, distributed=True),
    ],
    ids=["jacobian", "transposed jacobian", "activation hessian"],
)
def test_per_sample_operators_refuse_distributed_true(build):
    model, loss_fn, X, y = make_problem("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="distributed must be None or False .* got True"):
        build(model, loss_fn, [(X, y)])
    assert unchanged(model, before)
