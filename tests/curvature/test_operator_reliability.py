"""Bad arguments are refused before anything happens, and the model is left as it was found.

Every refused argument: the error type, a message that names the argument, and nothing changed
(the model's parameters, buffers and train/eval flags bit for bit, no pass over the data).
"""

from __future__ import annotations

import copy

import pytest
import torch
from curvature_problems import dense_ggn, dense_hessian
from torch import nn

from avionics.curvature import (
    ActivationHessianOperator,
    EFOperator,
    EKFACOperator,
    GGNOperator,
    HessianOperator,
    JacobianOperator,
    KFACOperator,
    MCFisherOperator,
    TransposedJacobianOperator,
)

#: name -> operator(model, loss_fn, params, data, **options), one signature for all
OPERATORS = {
    "hessian": HessianOperator,
    "ggn": GGNOperator,
    "ef": EFOperator,
    "mc_fisher": MCFisherOperator,
    "kfac": KFACOperator,
    "ekfac": EKFACOperator,
    "jacobian": lambda model, _, params, data, **kw: JacobianOperator(model, params, data, **kw),
    "transposed_jacobian": lambda model, _, params, data, **kw: TransposedJacobianOperator(
        model, params, data, **kw
    ),
}


class CountingData(list):
    """A list of batches that counts how many batches were taken from it."""

    def __init__(self, batches):
        super().__init__(batches)
        self.taken = 0

    def __iter__(self):
        for batch in super().__iter__():
            self.taken += 1
            yield batch


def snapshot(model: nn.Module) -> dict:
    """Copies of everything an operator must leave as it is: parameters, buffers, flags."""
    return {
        "tensors": {name: t.detach().clone() for name, t in model.state_dict().items()},
        "training": [m.training for m in model.modules()],
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["training"] == before["training"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for name, tensor in before["tensors"].items():
        assert after["tensors"][name].dtype == tensor.dtype, name
        assert torch.equal(after["tensors"][name], tensor), name


def mlp_problem():
    """A float32 MLP and 16 samples in two batches of 8."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    X, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    return model, nn.CrossEntropyLoss(), CountingData([(X[:8], y[:8]), (X[8:], y[8:])])


def batchnorm_problem():
    """A float64 network with train-mode BatchNorm2d and BatchNorm1d, two fixed batches.

    Conv2d -> BatchNorm2d -> ReLU -> Flatten -> Linear -> BatchNorm1d -> Tanh -> Linear; the
    parameters are those of the Conv2d and Linear layers (the layers KFAC supports).
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 2), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(),
        nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3),
    ).double().train()  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randn(4, 1, 3, 3, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (4,), generator=generator),
        )
        for _ in range(2)
    ]
    params = [f"{i}.{kind}" for i in (0, 4, 7) for kind in ("weight", "bias")]
    return model, nn.CrossEntropyLoss(), params, data


# -------------------------------------------------------------------------------------------
# 1. num_data
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_data", [0, -16, 16.0, "16", True])
@pytest.mark.parametrize("operator", OPERATORS)
def test_num_data_that_is_not_a_positive_int_is_refused_before_any_pass(operator, num_data):
    model, loss_fn, data = mlp_problem()
    before = snapshot(model)
    with pytest.raises(
        ValueError, match=rf"num_data must be a positive integer, got {num_data!r}"
    ):
        OPERATORS[operator](model, loss_fn, None, data, num_data=num_data)
    assert data.taken == 0
    assert_unchanged(model, before)


@pytest.mark.parametrize("num_data", [5, 12, 20])
@pytest.mark.parametrize("operator", OPERATORS)
def test_num_data_other_than_the_samples_in_data_is_refused(operator, num_data):
    """16 samples: num_data 5 (less than the first batch), 12 (within the second), 20."""
    model, loss_fn, data = mlp_problem()
    before = snapshot(model)
    with pytest.raises(
        ValueError, match=rf"num_data={num_data} samples.*gave 16: pass num_data=16"
    ):
        OPERATORS[operator](model, loss_fn, None, data, num_data=num_data)
    assert_unchanged(model, before)


@pytest.mark.parametrize("operator", ["hessian", "ggn", "ef", "mc_fisher", "jacobian"])
def test_num_data_is_checked_by_every_pass_without_the_determinism_check(operator):
    """Without the determinism check a construction need not pass over the data; the first
    product does, and refuses to return a product normalised by the wrong N."""
    model, loss_fn, data = mlp_problem()
    A = OPERATORS[operator](model, loss_fn, None, data, num_data=20, check_deterministic=False)
    with pytest.raises(ValueError, match=r"num_data=20 samples.*gave 16: pass num_data=16"):
        A @ torch.ones(A.shape[1])
    J = JacobianOperator(model, None, data, num_data=20, check_deterministic=False)
    with pytest.raises(ValueError, match=r"num_data=20 samples.*gave 16"):
        J.adjoint() @ torch.ones(J.shape[0])


def test_num_data_given_right_is_the_brute_force_curvature():
    model, loss_fn, data = mlp_problem()
    model, data = model.double(), [(X.double(), y) for X, y in data]
    for operator, reference in ((HessianOperator, dense_hessian), (GGNOperator, dense_ggn)):
        A = operator(model, loss_fn, None, data, num_data=16, check_deterministic=False)
        dense = A @ torch.eye(A.shape[1], dtype=torch.float64)
        torch.testing.assert_close(dense, reference(model, loss_fn, data))


@pytest.mark.parametrize("operator", OPERATORS)
def test_an_empty_batch_is_refused(operator):
    """A batch without samples (mean loss NaN; as the only batch, N = 0)."""
    model, loss_fn, data = mlp_problem()
    X, y = data[0]
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"size of every batch of data.*got 0.*empty batches"):
        OPERATORS[operator](model, loss_fn, None, [(X[:0], y[:0])])
    assert_unchanged(model, before)


# -------------------------------------------------------------------------------------------
# 2. The form and dtype of the data
# -------------------------------------------------------------------------------------------

NOT_PAIRS = r"data must be an iterable of \(inputs, targets\) batches.*first element is a torch"
WRONG_DATA = {
    "tensors, not pairs": (lambda X, y: [X], NOT_PAIRS),
    "one pair, unwrapped": (lambda X, y: (X, y), NOT_PAIRS),
    "float64 inputs": (
        lambda X, y: [(X.double(), y)],
        r"inputs in data are a torch.float64 tensor.*computes in torch.float32.*X.float\(\)",
    ),
}


@pytest.mark.parametrize("wrong", WRONG_DATA)
@pytest.mark.parametrize("operator", [*OPERATORS, "activation_hessian"])
def test_data_that_is_not_batches_in_the_model_dtype_is_refused(operator, wrong):
    model, loss_fn, _ = mlp_problem()
    X, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    make_data, message = WRONG_DATA[wrong]
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        if operator == "activation_hessian":
            ActivationHessianOperator(model, loss_fn, ("1", "output", 0), make_data(X, y))
        else:
            OPERATORS[operator](model, loss_fn, None, make_data(X, y))
    assert_unchanged(model, before)


def test_data_errors_say_what_to_pass():
    model, loss_fn, _ = mlp_problem()
    X, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    with pytest.raises(
        ValueError, match=r"shape \[16, 4\]; for a single batch pass data=\[\(X, y\)\]"
    ):
        HessianOperator(model, loss_fn, None, (X, y))
    with pytest.raises(ValueError, match=r"\[\(X.to\(torch.float32\), y\)\]"):
        HessianOperator(model, loss_fn, None, [(X.double(), y)])


# -------------------------------------------------------------------------------------------
# 3. The activation of the activation Hessian
# -------------------------------------------------------------------------------------------


NAMES = r"\['', '0', '1', '2'\]"  # the module names of the MLP


@pytest.mark.parametrize(
    "activation,message",
    [
        ("0", rf"activation must be a tuple \(module_name, io, index\).*{NAMES}.*got '0'"),
        (("0", "output"), r"activation must be a tuple.*got \('0', 'output'\)"),
        (("0", "output", "0"), r"index must be an int.*output tuple.*got '0' \(a str\)"),
        (("0", "input", 0.0), r"index must be an int.*got 0.0 \(a float\)"),
        (("0", "output", True), r"index must be an int.*got True"),
        ((0, "output", 0), rf"no module named 0.*{NAMES}"),
    ],
)  # fmt: skip
def test_activation_of_the_wrong_form_is_refused_naming_the_valid_forms(activation, message):
    model, loss_fn, data = mlp_problem()
    batch = CountingData(data[:1])
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        ActivationHessianOperator(model, loss_fn, activation, batch)
    assert batch.taken == 0
    assert_unchanged(model, before)


def test_activation_hessian_refuses_a_function_model_and_a_bad_chunk_size():
    model, loss_fn, data = mlp_problem()
    with pytest.raises(TypeError, match="model to be an nn.Module.*got a function"):
        ActivationHessianOperator(lambda X: X, loss_fn, ("", "input", 0), data[:1])
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 0"):
        ActivationHessianOperator(model, loss_fn, ("1", "output", 0), data[:1], chunk_size=0)


# -------------------------------------------------------------------------------------------
# 4. The Jacobians take no loss function
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("operator", [JacobianOperator, TransposedJacobianOperator])
def test_jacobian_given_a_loss_function_says_what_goes_where(operator):
    model, loss_fn, data = mlp_problem()
    before = snapshot(model)
    name = operator.__name__
    calls = [
        lambda: operator(model, loss_fn, None, data),  # as for the curvature operators
        lambda: operator(model, loss_fn, data),  # in place of params
        lambda: operator(model, None, data, loss_fn=loss_fn),
    ]
    for call in calls:
        expected = rf"{name} .*takes no loss function: call {name}\(model, params, data\)"
        with pytest.raises(TypeError, match=expected) as error:
            call()
        assert "_OutputsOperator" not in str(error.value)
    with pytest.raises(TypeError, match=r"got params=CrossEntropyLoss\(\) and 1 more positional"):
        operator(model, loss_fn, None, data)
    assert data.taken == 0
    assert_unchanged(model, before)


@pytest.mark.parametrize(
    "params,message",
    [
        ("0.weight", r"got the str '0.weight'; e.g. for one parameter pass params=\['0.weight'\]"),
        (torch.zeros(5, 4), r"got a torch.float32 tensor of shape \[5, 4\]"),
        (nn.Linear(4, 5), r"got a Linear"),
        (3, r"got the int 3"),
    ],
)
def test_params_that_are_not_a_list_of_parameters_are_refused(params, message):
    model, loss_fn, data = mlp_problem()
    with pytest.raises(TypeError, match=rf"params must be None.*{message}"):
        HessianOperator(model, loss_fn, params, data)
    assert data.taken == 0


# -------------------------------------------------------------------------------------------
# 5. Train-mode BatchNorm: buffers and flags as they were
# -------------------------------------------------------------------------------------------


def _activation_hessian(model, loss_fn, params, data, **kwargs):
    return ActivationHessianOperator(model, loss_fn, ("5", "output", 0), data[:1], **kwargs)


@pytest.mark.parametrize("operator", [*OPERATORS, "activation_hessian"])
def test_every_operator_leaves_train_mode_batchnorm_as_it_was(operator):
    model, loss_fn, params, data = batchnorm_problem()
    make = _activation_hessian if operator == "activation_hessian" else OPERATORS[operator]
    before = snapshot(model)
    A = make(model, loss_fn, params, data)
    assert_unchanged(model, before)
    v = torch.randn(A.shape[1], dtype=torch.float64)
    assert (A @ v).isfinite().all()
    assert_unchanged(model, before)
    V = torch.randn(A.shape[1], 3, dtype=torch.float64)
    assert (A @ V).isfinite().all()
    assert_unchanged(model, before)


def test_operators_that_raise_leave_train_mode_batchnorm_as_it_was():
    """Each raises after forward passes through the BatchNorm layers."""
    model, loss_fn, params, data = batchnorm_problem()
    before = snapshot(model)
    with pytest.raises(ValueError, match="exact square root of the loss Hessian"):
        KFACOperator(model, nn.HuberLoss(), params, data, fisher_type="type-2")
    with pytest.raises(IndexError, match="no index 1"):
        ActivationHessianOperator(model, loss_fn, ("7", "input", 1), data[:1])
    with pytest.raises(ValueError, match="num_data=7 samples"):
        HessianOperator(model, loss_fn, params, data, num_data=7)
    assert_unchanged(model, before)


def test_products_with_train_mode_batchnorm_are_the_brute_force_ones():
    """The curvature of the network with batch statistics (the reference on a copy without
    running statistics)."""
    model, loss_fn, params, data = batchnorm_problem()
    reference_model = copy.deepcopy(model)
    torch.func.replace_all_batch_norm_modules_(reference_model)  # batch statistics only
    for name, p in reference_model.named_parameters():
        p.requires_grad_(name in params)
    for operator, reference in ((HessianOperator, dense_hessian), (GGNOperator, dense_ggn)):
        A = operator(model, loss_fn, params, data)
        dense = A @ torch.eye(A.shape[1], dtype=torch.float64)
        torch.testing.assert_close(dense, reference(reference_model, loss_fn, data))


# -------------------------------------------------------------------------------------------
# The other arguments of the operators
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("operator", [MCFisherOperator, KFACOperator])
def test_sampling_arguments_are_refused_before_any_pass(operator):
    model, loss_fn, data = mlp_problem()
    with pytest.raises(ValueError, match=r"mc_samples must be a positive integer, got 0"):
        operator(model, loss_fn, None, data, mc_samples=0)
    with pytest.raises(ValueError, match=r"seed must be an integer, got 0.5"):
        operator(model, loss_fn, None, data, seed=0.5)
    with pytest.raises(ValueError, match=r"loss_fn=HuberLoss\(\).*use GGNOperator"):
        operator(model, nn.HuberLoss(), None, data, check_deterministic=False)
    smoothed = nn.CrossEntropyLoss(label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"without class weights or label smoothing"):
        operator(model, smoothed, None, data, check_deterministic=False)
    assert data.taken == 0


@pytest.mark.parametrize("operator", ["hessian", "ggn", "jacobian"])
def test_chunk_size_must_be_a_positive_int(operator):
    model, loss_fn, data = mlp_problem()
    with pytest.raises(ValueError, match=r"chunk_size must be a positive integer, got -1"):
        OPERATORS[operator](model, loss_fn, None, data, chunk_size=-1)
    assert data.taken == 0


def test_batch_size_fn_must_be_a_function():
    model, loss_fn, data = mlp_problem()
    with pytest.raises(TypeError, match=r"batch_size_fn must be a function.*got the int 8"):
        HessianOperator(model, loss_fn, None, data, batch_size_fn=8)
    assert data.taken == 1  # the first batch, checked


@pytest.mark.parametrize("damping", [0.0, -1.0, float("inf"), float("nan"), "0.1", None])
def test_kfac_inverse_refuses_a_damping_that_is_not_positive_and_finite(damping):
    model, loss_fn, data = mlp_problem()
    K = KFACOperator(model, loss_fn, None, data)
    with pytest.raises(ValueError, match=rf"damping must be positive and finite, got {damping!r}"):
        K.inverse(damping)
