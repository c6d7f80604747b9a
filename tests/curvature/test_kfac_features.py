"""KFAC / EKFAC from their factors (trace, det, logdet, Frobenius norm, damped inverses),
FOOF, kfac_approx="reduce", and the state dict: against dense float64 references."""

from __future__ import annotations

import io

import pytest
import torch
from curvature_problems import block_diagonal_part, dense_ggn, problem
from torch import nn
from torch.nn import functional as F

from avionics.curvature import EKFACOperator, KFACOperator

DT = torch.float64
# the layers KFAC supports in each problem (the transformer's qkv input is a LayerNorm
# output, zero-mean across features: its A is singular, so det/logdet use the head only)
KFAC_PARAMS = {
    "mlp": None,
    "cnn": None,
    "tied": None,
    "transformer": ["qkv.weight", "qkv.bias", "head.weight", "head.bias"],
}
NONSINGULAR = {**KFAC_PARAMS, "transformer": ["head.weight", "head.bias"]}


def dense(A) -> torch.Tensor:
    return A @ torch.eye(A.shape[1], dtype=A.dtype)


def blockwise_dense(K, block_matrix) -> torch.Tensor:
    """The dense matrix with ``block_matrix(block)`` on every block (one parameter each,
    separate_weight_and_bias=True), at the block's parameter's offsets."""
    sizes = [s.numel() for s in K.in_shapes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    matrix = torch.zeros(K.shape, dtype=DT)
    for block in K.blocks:
        (i,) = block.param_indices
        index = slice(offsets[i], offsets[i] + sizes[i])
        matrix[index, index] = block_matrix(block)
    return matrix


def kronecker(B, A, block):
    return torch.kron(B, A) if block.has_weight else B


@pytest.mark.parametrize("operator", [KFACOperator, EKFACOperator])
@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_trace_det_logdet_frobenius_norm_of_the_dense_matrix(name, separate, operator):
    model, loss_fn, data, _ = problem(name, "mse", "sum")
    K = operator(model, loss_fn, NONSINGULAR[name], data, fisher_type="type-2",
                 separate_weight_and_bias=separate)  # fmt: skip
    matrix = dense(K)
    sign, logabsdet = torch.linalg.slogdet(matrix)
    assert sign > 0 and logabsdet > -200  # non-singular: det and logdet can be compared
    torch.testing.assert_close(K.trace(), torch.trace(matrix))
    torch.testing.assert_close(K.logdet(), logabsdet)
    torch.testing.assert_close(K.det(), torch.linalg.det(matrix))
    torch.testing.assert_close(K.frobenius_norm(), torch.linalg.matrix_norm(matrix))
    if operator is KFACOperator:  # the Kronecker identities themselves
        tr = sum(torch.trace(b.B) * torch.trace(b.A) for b in K.blocks)
        torch.testing.assert_close(K.trace(), tr)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_inverse_with_damping_per_factor_and_heuristic_damping(name):
    model, loss_fn, data, _ = problem(name)
    K = KFACOperator(model, loss_fn, KFAC_PARAMS[name], data, fisher_type="type-2")
    torch.testing.assert_close(dense(K), blockwise_dense(K, lambda b: kronecker(b.B, b.A, b)))

    def damped_inverse(block, lambda_A, lambda_B):
        eye_B, eye_A = torch.eye(len(block.B), dtype=DT), torch.eye(len(block.A), dtype=DT)
        inverse_B = torch.linalg.inv(block.B + lambda_B * eye_B)
        return kronecker(inverse_B, torch.linalg.inv(block.A + lambda_A * eye_A), block)

    lambda_A, lambda_B = 0.3, 0.05
    expected = blockwise_dense(K, lambda b: damped_inverse(b, lambda_A, lambda_B))
    torch.testing.assert_close(dense(K.inverse((lambda_A, lambda_B), mode="factors")), expected)
    same = blockwise_dense(K, lambda b: damped_inverse(b, 0.1, 0.1))
    torch.testing.assert_close(dense(K.inverse(0.1, mode="factors")), same)

    damping = 0.02

    def heuristic(block):
        if not block.has_weight:
            return damped_inverse(block, 0.0, damping)
        pi = (torch.trace(block.A) / len(block.A)) / (torch.trace(block.B) / len(block.B))
        pi = float(pi.sqrt())
        return damped_inverse(block, pi * damping**0.5, damping**0.5 / pi)

    heuristic_inverse = K.inverse(damping, mode="heuristic")
    torch.testing.assert_close(dense(heuristic_inverse), blockwise_dense(K, heuristic))
    assert (
        dense(heuristic_inverse) - dense(K.inverse(damping**0.5, mode="factors"))
    ).abs().max() > 1e-6  # pi is not 1: the heuristic is not plain factored damping


def test_damping_errors():
    model, loss_fn, data, _ = problem("mlp")
    K = KFACOperator(model, loss_fn, None, data, fisher_type="type-2")
    with pytest.raises(ValueError, match=r"mode must be one of \('exact', 'factors'"):
        K.inverse(0.1, mode="tikhonov")
    with pytest.raises(ValueError, match=r"one number or a pair"):
        K.inverse((0.1, 0.2, 0.3), mode="factors")
    with pytest.raises(ValueError, match=r"damping must be non-negative and finite, got -1"):
        K.inverse((-1, 0.2), mode="factors")
    with pytest.raises(ValueError, match=r"damped block of '2.weight' is singular"):
        K.inverse((0.0, 0.0), mode="factors")  # the CE loss Hessian sums to zero: B singular
    ekfac = EKFACOperator(model, loss_fn, None, data, fisher_type="type-2")
    with pytest.raises(ValueError, match=r"supports mode='exact' only"):
        ekfac.inverse(0.1, mode="factors")


def _input_rows(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows of a layer's input, brute force: unfolded patches for a Conv2d."""
    if isinstance(layer, nn.Conv2d):
        patches = F.unfold(x, layer.kernel_size, layer.dilation, layer.padding, layer.stride)
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])
    return x.reshape(-1, x.shape[-1])


def _input_covariances(model, data, layers):
    """A = (1/R) sum_r a_r a_r^T of every layer by forward hooks over the data."""
    rows = {layer: [] for layer in layers}
    handles = [layer.register_forward_pre_hook(
        lambda module, args: rows[module].append(_input_rows(module, args[0].detach())))
        for layer in layers]  # fmt: skip
    with torch.no_grad():
        for X, _ in data:
            model(X)
    for handle in handles:
        handle.remove()
    return {layer: torch.cat(r).T @ torch.cat(r) / len(torch.cat(r)) for layer, r in rows.items()}


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_forward_only_is_identity_times_the_input_covariance(name):
    """FOOF: B = I, A the input covariance (brute force by forward hooks)."""
    model, loss_fn, data, _ = problem(name)
    K = KFACOperator(model, loss_fn, KFAC_PARAMS[name], data, fisher_type="forward-only")
    covariances = _input_covariances(model, data, list({id(b.layer): b.layer
                                                         for b in K.blocks}.values()))  # fmt: skip

    def expected(block):
        eye = torch.eye(block.layer.weight.shape[0], dtype=DT)
        return torch.kron(eye, covariances[block.layer]) if block.has_weight else eye

    torch.testing.assert_close(dense(K), blockwise_dense(K, expected))
    with pytest.raises(ValueError, match=r"fisher_type must be one of \('mc', 'type-2', 'emp"):
        EKFACOperator(model, loss_fn, KFAC_PARAMS[name], data, fisher_type="forward-only")


class MeanOverPositions(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return x.mean(self.dim)


def _shared_axis_problems():
    """A Linear layer on sequences and a convolution, each averaged over its shared axis
    before a linear map and an MSE loss, several batches: KFAC-reduce is exact there."""
    torch.manual_seed(0)
    sequence = nn.Sequential(nn.Linear(3, 2), MeanOverPositions(1)).double()
    sequence_data = [(torch.randn(n, 4, 3, dtype=DT), torch.randn(n, 2, dtype=DT))
                     for n in (3, 2)]  # fmt: skip
    convolution = nn.Sequential(nn.Conv2d(2, 3, 2), MeanOverPositions((2, 3)), nn.Linear(3, 2))
    convolution = convolution.double()
    image_data = [(torch.randn(n, 2, 4, 4, dtype=DT), torch.randn(n, 2, dtype=DT))
                  for n in (3, 2)]  # fmt: skip
    return {"sequence": (sequence, sequence_data), "convolution": (convolution, image_data)}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["sequence", "convolution"])
def test_reduce_is_exact_for_outputs_averaged_over_the_shared_axis(name, reduction):
    model, data = _shared_axis_problems()[name]
    loss_fn = nn.MSELoss(reduction=reduction)
    expected = dense_ggn(model, loss_fn, data)
    num_params = len(list(model.parameters()))
    for separate in (True, False):
        groups = ([[i] for i in range(num_params)] if separate
                  else [[i, i + 1] for i in range(0, num_params, 2)])  # fmt: skip
        reference = block_diagonal_part(expected, model, groups)
        reduce = KFACOperator(model, loss_fn, None, data, fisher_type="type-2",
                              kfac_approx="reduce", separate_weight_and_bias=separate)  # fmt: skip
        torch.testing.assert_close(dense(reduce), reference)
        expand = KFACOperator(model, loss_fn, None, data, fisher_type="type-2",
                              separate_weight_and_bias=separate)  # fmt: skip
        assert (dense(expand) - reference).abs().max() > 1e-3  # expand is not exact here


@pytest.mark.parametrize("operator", [KFACOperator, EKFACOperator])
def test_reduce_equals_expand_without_shared_axes(operator):
    model, loss_fn, data, _ = problem("mlp")
    expand = operator(model, loss_fn, None, data, fisher_type="type-2")
    reduce = operator(model, loss_fn, None, data, fisher_type="type-2", kfac_approx="reduce")
    torch.testing.assert_close(dense(reduce), dense(expand))
    with pytest.raises(ValueError, match=r"kfac_approx must be one of \('expand', 'reduce'\)"):
        operator(model, loss_fn, None, data, kfac_approx="mean")


def test_ekfac_reduce_is_exact_in_its_eigenbasis():
    """EKFAC-reduce: the eigenbasis of the reduced factors, the corrections of the exact
    per-sample gradients, so its diagonal in that basis is the GGN's."""
    model, data = _shared_axis_problems()["convolution"]
    loss_fn = nn.MSELoss()
    ekfac = EKFACOperator(model, loss_fn, ["0.weight"], data, fisher_type="type-2",
                          kfac_approx="reduce")  # fmt: skip
    ggn = dense_ggn(model, loss_fn, data)[:24, :24]
    Q_B, Q_A = ekfac._spectra[id(ekfac.blocks[0])][:2]
    basis = torch.kron(Q_B, Q_A)
    torch.testing.assert_close(torch.diag(basis.T @ dense(ekfac) @ basis),
                               torch.diag(basis.T @ ggn @ basis))  # fmt: skip


def _reduce_factors_by_autograd(model, data, layer):
    """KFAC-reduce's factors of one layer for the MSE loss with reduction "sum", brute
    force: abar_n the mean over sample n's input rows (all calls), A = (1/N) sum_n abar_n
    abar_n^T; the loss Hessian 2 I, so s_k = sqrt(2) e_k per output entry k and
    gbar_k = sum over the layer's output rows of d f_k / dz (autograd, one entry at a time),
    B = sum_k gbar_k gbar_k^T."""
    inputs, outputs = [], []

    def record(module, args, out):
        inputs.append(args[0])
        outputs.append(out)

    handle = layer.register_forward_hook(record)
    A, B, num_data = 0, 0, 0
    for X, _ in data:
        inputs.clear()
        outputs.clear()
        f = model(X).flatten()
        N = len(X)
        rows = [_input_rows(layer, a).view(N, -1, layer.weight[0].numel()) for a in inputs]
        abar = torch.cat(rows, dim=1).mean(dim=1)
        A, num_data = A + abar.T @ abar, num_data + N
        channel = 1 if isinstance(layer, nn.Conv2d) else -1
        for k in range(len(f)):
            grads = torch.autograd.grad(f[k], outputs, retain_graph=True)
            gbar = sum(g.movedim(channel, -1).reshape(-1, g.shape[channel]).sum(0) for g in grads)
            B = B + 2 * torch.outer(gbar, gbar)
    handle.remove()
    return B, A / num_data


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_reduce_against_its_definition_by_autograd(name):
    """KFAC-reduce's blocks B (x) A on the four architectures: the factors by forward hooks
    and autograd from Eschenhagen et al.'s definition; expand differs wherever the layer has
    shared axes (the CNN's convolutions, the transformer's positions)."""
    model, loss_fn, data, _ = problem(name, "mse", "sum")
    options = {"fisher_type": "type-2", "separate_weight_and_bias": True}
    K = KFACOperator(model, loss_fn, KFAC_PARAMS[name], data, kfac_approx="reduce", **options)
    factors = {id(b.layer): _reduce_factors_by_autograd(model, data, b.layer) for b in K.blocks}

    def expected_block(block):
        B, A = factors[id(block.layer)]
        return kronecker(B, A, block)

    expected = blockwise_dense(K, expected_block)
    torch.testing.assert_close(dense(K), expected)
    if name in ("cnn", "transformer"):
        expand = KFACOperator(model, loss_fn, KFAC_PARAMS[name], data, **options)
        assert (dense(expand) - expected).abs().max() > 1e-3


class CountingData(list):
    """A list of batches that counts the batches taken from it."""

    taken = 0

    def __iter__(self):
        for batch in super().__iter__():
            CountingData.taken += 1
            yield batch


@pytest.mark.parametrize("operator", [KFACOperator, EKFACOperator])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_state_dict_round_trip(name, operator):
    model, loss_fn, data, _ = problem(name)
    K = operator(model, loss_fn, KFAC_PARAMS[name], data, seed=3, kfac_approx="reduce")
    buffer = io.BytesIO()
    torch.save(K.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    # the B of the first weight and its bias is one tensor, also after torch.save / load
    assert state["factors"][0]["B"] is state["factors"][1]["B"]
    CountingData.taken = 0
    counted = CountingData(data)
    loaded = operator.from_state_dict(state, model, loss_fn, KFAC_PARAMS[name], counted)
    assert CountingData.taken == 1  # the first batch checked; num_data is the state's
    torch.testing.assert_close(dense(loaded), dense(K), rtol=0, atol=0)
    torch.testing.assert_close(dense(loaded.inverse(0.1)), dense(K.inverse(0.1)), rtol=0,
                               atol=0)  # fmt: skip
    assert loaded.state_dict()["configuration"] == {
        "fisher_type": "mc", "mc_samples": 1, "seed": 3, "separate_weight_and_bias": True,
        "kfac_approx": "reduce", "convention": "avionics",
    }  # fmt: skip
    # load_state_dict into an operator of other factors (another seed) makes it K
    other = operator(model, loss_fn, KFAC_PARAMS[name], data, seed=4, kfac_approx="reduce")
    assert (dense(other) - dense(K)).abs().max() > 1e-6
    with pytest.raises(ValueError, match=r"state's configuration is .*'seed': 3"):
        other.load_state_dict(state)


def test_a_state_saved_before_the_convention_option_loads_as_avionics():
    model, loss_fn, data, _ = problem("mlp")
    K = KFACOperator(model, loss_fn, KFAC_PARAMS["mlp"], data, seed=3)
    state = K.state_dict()
    del state["configuration"]["convention"]  # as saved before the option existed
    loaded = KFACOperator.from_state_dict(state, model, loss_fn, KFAC_PARAMS["mlp"], data)
    torch.testing.assert_close(dense(loaded), dense(K), rtol=0, atol=0)
    assert loaded.state_dict()["configuration"]["convention"] == "avionics"


def test_bad_states_are_refused_and_change_nothing():
    model, loss_fn, data, _ = problem("mlp")
    K = KFACOperator(model, loss_fn, None, data, fisher_type="type-2")
    before = dense(K)
    state = K.state_dict()
    wrong_shape = {**state, "factors": [dict(f) for f in state["factors"]]}
    wrong_shape["factors"][1]["B"] = torch.zeros(4, 4, dtype=DT)
    not_finite = {**state, "factors": [dict(f) for f in state["factors"]]}
    not_finite["factors"][0]["A"] = torch.full((4, 4), float("nan"), dtype=DT)
    cases = [
        ({k: v for k, v in state.items() if k != "factors"}, r"the state has no \['factors'\]"),
        ({**state, "version": 0}, r"state's version is 0, but this operator's is 1"),
        ({**state, "operator": "EKFACOperator"}, r"operator is 'EKFACOperator'"),
        ({**state, "parameters": ["0.weight"]}, r"state's parameters is \['0.weight'\]"),
        ({**state, "num_data": 4}, r"state's num_data is 4, but this operator's is 9"),
        (wrong_shape, r"factor B of block '0.bias' must be a tensor of shape \(5, 5\), got"),
        (not_finite, r"factor A of block '0.weight' is not finite"),
        ("state", r"needs the dict that state_dict\(\) returns, got str"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            K.load_state_dict(bad)
        torch.testing.assert_close(dense(K), before, rtol=0, atol=0)
    # data of another size: the first pass over it (here the determinism check) says so
    with pytest.raises(ValueError, match=r"made for num_data=9 samples, but a pass over data"):
        KFACOperator.from_state_dict(state, model, loss_fn, None, data[:2],
                                     check_deterministic=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"state's num_data must be a positive int, got None"):
        KFACOperator.from_state_dict({**state, "num_data": None}, model, loss_fn, None, data)
    ekfac_state = EKFACOperator(model, loss_fn, None, data, fisher_type="type-2").state_dict()
    with pytest.raises(ValueError, match=r"state's operator is 'EKFACOperator'"):
        KFACOperator.from_state_dict(ekfac_state, model, loss_fn, None, data)


def test_finite_factors_whose_sums_overflow_load():
    """The finiteness check sums the factors: finite ones whose sum overflows are accepted."""
    model, loss_fn, data, _ = problem("mlp")
    K = KFACOperator(model, loss_fn, None, data, fisher_type="type-2")
    state = K.state_dict()
    huge = {**state, "factors": [dict(f) for f in state["factors"]]}
    huge["factors"][0]["A"] = torch.full_like(state["factors"][0]["A"], 1e308)
    K.load_state_dict(huge)
    assert torch.equal(K.state_dict()["factors"][0]["A"], huge["factors"][0]["A"])


def test_logdet_of_a_singular_factor_is_minus_infinity():
    """An input feature that is always 0: A has a zero row, det = 0, log det = -inf."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    X = torch.randn(6, 4, dtype=DT)
    X[:, 0] = 0
    K = KFACOperator(model, nn.MSELoss(), ["weight"], [(X, torch.randn(6, 2, dtype=DT))],
                     fisher_type="type-2")  # fmt: skip
    assert K.logdet() == -float("inf")
    assert float(K.det()) == 0.0 == float(torch.linalg.det(dense(K)))


@pytest.mark.parametrize("operator", [KFACOperator, EKFACOperator])
def test_a_loaded_state_with_a_non_finite_factor_raises_at_its_first_use(operator):
    """from_state_dict checks the factors' finiteness at their first use, naming the
    factor, and at every use until a good state is loaded; load_state_dict at once."""
    model, loss_fn, data, _ = problem("mlp")
    K = operator(model, loss_fn, None, data, fisher_type="type-2")
    state = K.state_dict()
    key = "S" if operator is EKFACOperator else "A"
    bad = {**state, "factors": [dict(f) for f in state["factors"]]}
    bad["factors"][2][key] = bad["factors"][2][key].clone()
    bad["factors"][2][key][1, 0] = float("inf")
    message = rf"from_state_dict: factor {key} of block '2.weight' is not finite"
    loaded = operator.from_state_dict(bad, model, loss_fn, None, data)
    uses = [lambda: loaded @ torch.ones(loaded.shape[1], dtype=DT), loaded.trace,
            loaded.logdet, loaded.frobenius_norm, loaded.state_dict,
            lambda: loaded.inverse(1e-2), lambda: loaded.blocks]  # fmt: skip
    for use in uses:
        with pytest.raises(ValueError, match=message):
            use()
    with pytest.raises(ValueError, match=message):
        operator.from_state_dict(bad, model, loss_fn, None, data, check_deterministic=True)
    loaded.load_state_dict(state)  # a good state replaces the bad factors unseen
    torch.testing.assert_close(dense(loaded), dense(K), rtol=0, atol=0)
    with pytest.raises(ValueError, match=rf"load_state_dict: factor {key} of block '2.weight'"):
        loaded.load_state_dict(bad)
    torch.testing.assert_close(dense(loaded), dense(K), rtol=0, atol=0)
    good = operator.from_state_dict(state, model, loss_fn, None, data)
    torch.testing.assert_close(dense(good), dense(K), rtol=0, atol=0)
