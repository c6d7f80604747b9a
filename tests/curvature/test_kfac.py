"""KFAC: exact where the Kronecker factorisation is exact, its damped inverse, MC, errors."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import block_diagonal_part, dense_empirical_fisher, dense_ggn
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from avionics.curvature import EKFACOperator, KFACOperator
from avionics.curvature.kfac_rows import patch_rows
from avionics.persample.rules.conv import unfold


def dense(A) -> torch.Tensor:
    return A @ torch.eye(A.shape[1], dtype=A.dtype)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _single_sample(loss_name: str):
    X = torch.randn(1, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (1,)) if loss_name == "ce" else torch.randn(1, 3, dtype=torch.float64)
    return [(X, y)]


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("loss_fn", [nn.CrossEntropyLoss(), nn.MSELoss(reduction="sum")])
def test_type2_is_exact_for_a_single_sample(loss_fn, separate):
    model = _mlp()
    data = _single_sample("ce" if isinstance(loss_fn, nn.CrossEntropyLoss) else "mse")
    K = KFACOperator(
        model, loss_fn, None, data, fisher_type="type-2", separate_weight_and_bias=separate
    )
    groups = [[0], [1], [2], [3]] if separate else [[0, 1], [2, 3]]
    expected = block_diagonal_part(dense_ggn(model, loss_fn, data), model, groups)
    torch.testing.assert_close(dense(K), expected)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_layer_with_mse_is_exact_over_batches_and_sequences(reduction):
    """With MSE the loss Hessian is a multiple of I: B (x) A is the exact GGN of one layer,
    also over several batches of unequal size and a sequence axis (the expand case)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2, bias=False).double()
    data = [
        (torch.randn(n, 4, 3, dtype=torch.float64), torch.randn(n, 4, 2, dtype=torch.float64))
        for n in (2, 3)
    ]
    loss_fn = nn.MSELoss(reduction=reduction)
    K = KFACOperator(model, loss_fn, None, data, fisher_type="type-2")
    torch.testing.assert_close(dense(K), dense_ggn(model, loss_fn, data))


def test_convolution_with_one_output_position_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Sigmoid(), nn.Linear(3, 2))
    model = model.double()
    data = [(torch.randn(1, 2, 3, 3, dtype=torch.float64), torch.randint(0, 2, (1,)))]
    loss_fn = nn.CrossEntropyLoss()
    K = KFACOperator(model, loss_fn, None, data, fisher_type="type-2")
    expected = block_diagonal_part(dense_ggn(model, loss_fn, data), model, [[0], [1], [2], [3]])
    torch.testing.assert_close(dense(K), expected)


def test_empirical_is_the_empirical_fisher_block_for_a_single_sample():
    model = _mlp()
    data, loss_fn = _single_sample("ce"), nn.CrossEntropyLoss()
    K = KFACOperator(model, loss_fn, None, data, fisher_type="empirical")
    groups = [[0], [1], [2], [3]]
    expected = block_diagonal_part(dense_empirical_fisher(model, loss_fn, data), model, groups)
    torch.testing.assert_close(dense(K), expected)


def test_mc_converges_to_type2():
    model = _mlp()
    data = [(torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))) for n in (3, 2)]
    loss_fn = nn.CrossEntropyLoss()
    exact = dense(KFACOperator(model, loss_fn, None, data, fisher_type="type-2"))
    errors = [
        (dense(KFACOperator(model, loss_fn, None, data, mc_samples=m)) - exact).norm()
        / exact.norm()
        for m in (1, 3000)
    ]
    assert errors[1] < 0.05 < errors[0]


def test_the_determinism_check_refuses_shuffled_data_for_mc_only():
    """The MC draws are seeded by the batch's index: with the batches in another order the
    factors differ, and the check (which then compares the model outputs batch by batch)
    refuses shuffled data; type-2 sums over the batches in any order and takes it."""
    model, loss_fn = _mlp(), nn.CrossEntropyLoss()
    data = [(torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))) for n in (3, 2)]
    in_order, reversed_order = (KFACOperator(model, loss_fn, None, batches)
                                for batches in (data, data[::-1]))  # fmt: skip
    assert not torch.allclose(dense(in_order), dense(reversed_order))
    shuffled = DataLoader(TensorDataset(torch.randn(10, 4, dtype=torch.float64),
                                        torch.randint(0, 3, (10,))), 4, shuffle=True)  # fmt: skip
    torch.manual_seed(1)
    for operator in (KFACOperator, EKFACOperator):
        with pytest.raises(RuntimeError, match="model outputs differ between two passes"):
            operator(model, loss_fn, None, shuffled)
    KFACOperator(model, loss_fn, None, shuffled, fisher_type="type-2")


def test_damped_inverse():
    model = _mlp()
    data = [(torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,)))]
    K = KFACOperator(model, nn.CrossEntropyLoss(), None, data)
    damping = 0.1
    inverse = K.inverse(damping)
    identity = torch.eye(K.shape[1], dtype=torch.float64)
    torch.testing.assert_close(dense(inverse), torch.linalg.inv(dense(K) + damping * identity))
    with pytest.raises(ValueError, match="damping must be positive"):
        K.inverse(0.0)


def test_errors():
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)).double()
    data = [(torch.randn(2, 4, dtype=torch.float64), torch.randint(0, 3, (2,)))]
    loss_fn = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match=r"\['1.weight', '1.bias'\] belong to other modules"):
        KFACOperator(model, loss_fn, None, data)
    K = KFACOperator(model, loss_fn, ["0.weight", "0.bias"], data)
    assert K.shape == (15, 15)
    with pytest.raises(ValueError, match="fisher_type must be one of"):
        KFACOperator(model, loss_fn, ["0.weight"], data, fisher_type="exact")
    with pytest.raises(TypeError, match="needs the model as an nn.Module"):
        KFACOperator(lambda p, X: X, loss_fn, {"w": torch.zeros(1)}, data)
    grouped = nn.Sequential(nn.Conv2d(2, 2, 1, groups=2), nn.Flatten()).double()
    images = [(torch.randn(2, 2, 1, 1, dtype=torch.float64), torch.randint(0, 2, (2,)))]
    with pytest.raises(ValueError, match="Conv2d with groups"):
        KFACOperator(grouped, loss_fn, None, images)


def test_ekfac_is_the_exact_diagonal_in_the_kronecker_eigenbasis():
    model = _mlp()
    data = [(torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))) for n in (3, 2)]
    loss_fn = nn.CrossEntropyLoss()
    kfac = KFACOperator(model, loss_fn, ["2.weight"], data, fisher_type="type-2")
    ekfac = EKFACOperator(model, loss_fn, ["2.weight"], data, fisher_type="type-2")
    ggn = block_diagonal_part(dense_ggn(model, loss_fn, data), model, [[2]])[25:40, 25:40]
    (block,) = kfac.blocks
    Q_B, Q_A = torch.linalg.eigh(block.B)[1], torch.linalg.eigh(block.A)[1]
    basis = torch.stack([torch.outer(Q_B[:, i], Q_A[:, j]).flatten()
                         for i in range(3) for j in range(5)], dim=1)  # fmt: skip
    exact_diagonal = torch.diag(basis.T @ ggn @ basis)
    torch.testing.assert_close(torch.diag(basis.T @ dense(ekfac) @ basis), exact_diagonal)
    assert not torch.allclose(torch.diag(basis.T @ dense(kfac) @ basis), exact_diagonal)
    torch.testing.assert_close(basis.T @ dense(ekfac) @ basis, torch.diag(exact_diagonal))


def test_ekfac_is_the_exact_diagonal_in_the_kronecker_eigenbasis_of_convolutions():
    """Convolutions with R rows a sample more or fewer than d_out and d_A (each of EKFAC's
    rotations on the rows or on the per-sample gradients): in the basis Q_B (x) Q_A of each
    block, S is the diagonal of the GGN's block (type-2 sums the per-sample gradients'
    squares exactly)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(4, 3, 3), nn.Tanh(),  # R = 4: rotates g first, G by Q_A
        nn.Conv1d(3, 2, 1), nn.Tanh(),  # R = 4 >= d_A = 3, d_out = 2: G by both
        nn.Conv1d(2, 5, 2), nn.Tanh(),  # R = 3 < d_A = 4, d_out = 5: rows by both
        nn.Flatten(), nn.Linear(15, 2),
    ).double()  # fmt: skip
    data = [(torch.randn(n, 4, 6, dtype=torch.float64), torch.randint(0, 2, (n,))) for n in (3, 2)]
    loss_fn = nn.CrossEntropyLoss()
    ekfac = EKFACOperator(model, loss_fn, None, data, fisher_type="type-2")
    ggn = dense_ggn(model, loss_fn, data)
    offsets = [0]
    for p in model.parameters():
        offsets.append(offsets[-1] + p.numel())
    for block in ekfac.blocks:
        (i,) = block.param_indices
        Q_B, Q_A, _, _, S = ekfac._spectra[id(block)]
        basis = torch.kron(Q_B, Q_A)
        part = ggn[offsets[i] : offsets[i + 1], offsets[i] : offsets[i + 1]]
        torch.testing.assert_close(S.flatten(), torch.diag(basis.T @ part @ basis))


def test_ekfac_equals_kfac_where_kfac_is_exact_and_its_damped_inverse():
    model = _mlp()
    data, loss_fn = _single_sample("ce"), nn.CrossEntropyLoss()
    kfac = KFACOperator(model, loss_fn, None, data, fisher_type="type-2")
    ekfac = EKFACOperator(model, loss_fn, None, data, fisher_type="type-2")
    torch.testing.assert_close(dense(ekfac), dense(kfac))
    identity = torch.eye(ekfac.shape[1], dtype=torch.float64)
    torch.testing.assert_close(
        dense(ekfac.inverse(0.5)), torch.linalg.inv(dense(ekfac) + 0.5 * identity)
    )


def test_layers_whose_forward_is_not_called_are_refused():
    torch.manual_seed(0)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.head = (
                nn.MultiheadAttention(4, 2, batch_first=True),
                nn.Linear(4, 2),
            )

        def forward(self, x):
            return self.head(self.attention(x, x, x, need_weights=False)[0].mean(1))

    model = Attention().double().eval()
    data = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randint(0, 2, (3,)))]
    loss_fn = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match=r"\['attention.out_proj'\] were not called"):
        KFACOperator(model, loss_fn, ["attention.out_proj.weight", "head.weight"], data)
    K = KFACOperator(model, loss_fn, ["head.weight", "head.bias"], data, fisher_type="type-2")
    assert dense(K).shape == (10, 10)


class ExplicitPad(nn.Module):
    """F.pad(x, pad, mode=mode) as a module, in front of a convolution without padding."""

    def __init__(self, pad: tuple[int, ...], mode: str):
        super().__init__()
        self.pad, self.mode = pad, mode

    def forward(self, x):
        return F.pad(x, self.pad, mode=self.mode)


CONVOLUTIONS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def _padded_and_explicitly_padded(dims: int, padding_mode: str, padding):
    """Conv(padding, padding_mode) -> Tanh -> Linear, and the same layers with the padding
    done by F.pad in front of the convolution (padding=0); the same weights."""
    torch.manual_seed(0)
    Conv = CONVOLUTIONS[dims]
    conv = Conv(2, 3, 3, padding=padding, padding_mode=padding_mode).double()
    unpadded = Conv(2, 3, 3).double()
    unpadded.load_state_dict(conv.state_dict())
    X = torch.randn(4, 2, *(5, 6, 4)[:dims], dtype=torch.float64)
    head = nn.Linear(conv(X).numel() // len(X), 3).double()
    mode = "constant" if padding_mode == "zeros" else padding_mode
    pad = ExplicitPad(conv._reversed_padding_repeated_twice, mode)
    padded = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), head)
    explicit = nn.Sequential(pad, unpadded, nn.Tanh(), nn.Flatten(), head)
    return padded, explicit, [(X, torch.randint(0, 3, (4,)))]


@pytest.mark.parametrize("operator", [KFACOperator, EKFACOperator])
@pytest.mark.parametrize(
    ("dims", "padding_mode", "padding"),
    [pytest.param(dims, mode, (1, 2, 1)[:dims], id=f"conv{dims}d-{mode}")
     for dims in (1, 2, 3) for mode in ("circular", "reflect", "replicate")]
    + [pytest.param(2, "zeros", "same", id="conv2d-same")],
)  # fmt: skip
def test_padding_modes_equal_explicit_padding(operator, dims, padding_mode, padding):
    """A convolution's padding (any mode, and "same") gives the factors and products of an
    explicit F.pad followed by the convolution with padding 0."""
    padded, explicit, data = _padded_and_explicitly_padded(dims, padding_mode, padding)
    loss_fn = nn.CrossEntropyLoss()
    K = operator(padded, loss_fn, None, data, fisher_type="type-2")
    reference = operator(explicit, loss_fn, None, data, fisher_type="type-2")
    for block, expected in zip(K.blocks, reference.blocks, strict=True):
        torch.testing.assert_close(block.A, expected.A, rtol=0, atol=1e-12)
        torch.testing.assert_close(block.B, expected.B, rtol=0, atol=1e-12)
    torch.testing.assert_close(dense(K), dense(reference), rtol=0, atol=1e-12)


def test_an_in_place_activation_after_a_layer_does_not_change_its_output_gradients():
    """ReLU(inplace=True) overwrites the layer output; g is still d f / d z of z as the layer
    returned it, so the operator equals that of the same model with ReLU()."""
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3)).double()
    data = [(torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)))]
    loss_fn = nn.CrossEntropyLoss()
    K = KFACOperator(model, loss_fn, None, data, fisher_type="type-2")
    model[1].inplace = False
    torch.testing.assert_close(
        dense(K), dense(KFACOperator(model, loss_fn, None, data, fisher_type="type-2"))
    )


@pytest.mark.parametrize("operator", [KFACOperator, EKFACOperator])
def test_a_layer_called_twice_has_the_rows_of_both_calls(operator):
    """A layer applied to the two positions of a sequence separately has the operator of
    the same layer applied to the sequence at once (each call's rows are positions)."""

    class Network(nn.Module):
        def __init__(self, per_position: bool):
            super().__init__()
            self.per_position = per_position
            self.layer, self.head = nn.Linear(3, 4), nn.Linear(8, 2)

        def forward(self, x):
            if self.per_position:
                h = torch.cat([self.layer(x[:, 0]), self.layer(x[:, 1])], dim=-1)
            else:
                h = self.layer(x).flatten(1)
            return self.head(torch.tanh(h))

    once = Network(per_position=False).double()
    twice = Network(per_position=True).double()
    twice.load_state_dict(once.state_dict())
    data = [(torch.randn(5, 2, 3, dtype=torch.float64), torch.randint(0, 2, (5,)))]
    loss_fn = nn.CrossEntropyLoss()
    K = operator(twice, loss_fn, None, data, fisher_type="type-2")
    expected = operator(once, loss_fn, None, data, fisher_type="type-2")
    torch.testing.assert_close(dense(K), dense(expected), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv1d(3, 2, 3, stride=2, padding=1),
        nn.Conv2d(3, 2, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        nn.Conv2d(3, 2, 3, padding="same", padding_mode="reflect"),
        nn.Conv2d(3, 2, 2, padding=1, padding_mode="circular"),
        nn.Conv3d(2, 2, (2, 3, 1), stride=(1, 2, 1), padding=(0, 1, 1), dilation=(2, 1, 1)),
    ],
)
def test_patch_rows_are_the_unfolded_input_transposed(conv):
    """The rows of KFAC's input factor (windows of the channels-last input) are the unfolded
    patches of the per-sample rules, one row per output position, exactly."""
    x = torch.randn(2, conv.in_channels, *[7] * (conv.weight.dim() - 2), dtype=torch.float64)
    expected = unfold(conv.double(), x).transpose(1, 2)
    assert torch.equal(patch_rows(conv, x), expected)
    assert patch_rows(conv, x).shape[1] == conv(x)[0, 0].numel()
