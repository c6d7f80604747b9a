"""Data passes: determinism check, dict batches, parameter selection, progress bar, errors."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import problem
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from avionics.curvature import GGNOperator, HessianOperator, JacobianOperator, MCFisherOperator


def _classification_data(n: int = 10):
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    return TensorDataset(X, torch.randint(0, 3, (n,), generator=generator))


class _Augmented(Dataset):
    """Adds fresh noise to every sample on every access (random augmentation)."""

    def __init__(self):
        self.data = _classification_data()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        X, y = self.data[i]
        return X + 0.1 * torch.randn_like(X), y


def _model(*extra: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), *extra, nn.Tanh(), nn.Linear(5, 3)).double()


@pytest.mark.parametrize(
    "case", ["dropout", "batchnorm with shuffling", "drop_last with shuffling", "augmentation"]
)
def test_determinism_check_refuses_what_changes_between_passes(case):
    loss_fn = nn.CrossEntropyLoss()
    if case == "dropout":
        model, data = _model(nn.Dropout(0.5)).train(), DataLoader(_classification_data(), 4)
    elif case == "batchnorm with shuffling":
        model = _model(nn.BatchNorm1d(5)).train()
        data = DataLoader(_classification_data(), 4, shuffle=True)
    elif case == "drop_last with shuffling":
        model = _model()
        data = DataLoader(_classification_data(), 4, shuffle=True, drop_last=True)
    else:
        model, data = _model(), DataLoader(_Augmented(), 4)
    torch.manual_seed(1)
    with pytest.raises(RuntimeError, match="differ.*eval mode"):
        HessianOperator(model, loss_fn, None, data)
    torch.manual_seed(1)
    GGNOperator(model, loss_fn, None, data, check_deterministic=False)  # switched off: fine


def test_shuffled_data_is_fine_for_sums_but_not_for_jacobians():
    model, data = _model(), DataLoader(_classification_data(), 4, shuffle=True)
    ordered = GGNOperator(model, nn.CrossEntropyLoss(), None, list(DataLoader(data.dataset, 4)))
    shuffled = GGNOperator(model, nn.CrossEntropyLoss(), None, data)
    v = torch.randn(shuffled.shape[1], dtype=torch.float64)
    torch.testing.assert_close(shuffled @ v, ordered @ v)
    with pytest.raises(RuntimeError, match="model outputs differ between two passes"):
        JacobianOperator(model, None, data)
    with pytest.raises(RuntimeError, match="model outputs differ between two passes"):
        MCFisherOperator(model, nn.CrossEntropyLoss(), None, data)


def test_dict_batches_need_batch_size_fn():
    model, loss_fn, data, batch_size_fn = problem("dict", "mse")
    with pytest.raises(ValueError, match="X is a dict.*batch_size_fn"):
        GGNOperator(model, loss_fn, None, data)
    G = GGNOperator(model, loss_fn, None, data, batch_size_fn=batch_size_fn)
    assert G.num_data == 9


def test_bad_arguments():
    model, loss_fn, data, _ = problem("mlp")
    with pytest.raises(TypeError, match="must be re-iterable"):
        HessianOperator(model, loss_fn, None, iter(data))
    with pytest.raises(ValueError, match="empty data set"):
        HessianOperator(model, loss_fn, None, [])
    with pytest.raises(ValueError, match=r"no parameter named '9.weight'.*'0.weight'"):
        HessianOperator(model, loss_fn, ["9.weight"], data)
    with pytest.raises(ValueError, match="reduction 'mean' or 'sum'.*'none'"):
        HessianOperator(model, nn.CrossEntropyLoss(reduction="none"), None, data)
    with pytest.raises(ValueError, match="known for MSELoss.*use GGNOperator"):
        MCFisherOperator(model, nn.HuberLoss(), None, data)
    with pytest.raises(ValueError, match="mc_samples must be a positive integer"):
        MCFisherOperator(model, loss_fn, None, data, mc_samples=0)
    with pytest.raises(ValueError, match="neither"):
        HessianOperator(model, loss_fn, [torch.zeros(3)], data)
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"\['0.weight'\] do not require grad"):
        HessianOperator(model, loss_fn, ["0.weight"], data)
    H = HessianOperator(model, loss_fn, None, data)  # default: only what requires grad
    assert len(H.in_shapes) == 3
    with pytest.raises(TypeError, match="function model.*dict of name -> tensor"):
        HessianOperator(lambda p, X: X, loss_fn, None, data)


def test_progress_bar(capsys):
    model, loss_fn, data, _ = problem("mlp")
    H = HessianOperator(model, loss_fn, None, data, progressbar=True)
    H @ torch.zeros(H.shape[1], dtype=torch.float64)
    assert "HessianOperator: matrix product" in capsys.readouterr().err


def test_multihead_attention_module_just_works():
    """nn.MultiheadAttention calls the fused attention kernel by default, which has no double
    backward on CPU; the operators select the math kernel during their own passes."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(4, 2, batch_first=True).double()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.out = attention, nn.Linear(4, 2).double()

        def forward(self, x):
            return self.out(self.attention(x, x, x, need_weights=False)[0].mean(1))

    model = Model().eval()
    X = torch.randn(3, 5, 4, dtype=torch.float64)
    data = [(X, torch.randint(0, 2, (3,)))]
    loss = nn.CrossEntropyLoss()(model(X), data[0][1])
    params = list(model.parameters())
    gradient = torch.autograd.grad(loss, params, create_graph=True)
    with pytest.raises(RuntimeError, match="derivative for .*flash_attention.* not implemented"):
        torch.autograd.grad(gradient, params, [torch.ones_like(g) for g in gradient])
    H = HessianOperator(model, nn.CrossEntropyLoss(), None, data)
    G = GGNOperator(model, nn.CrossEntropyLoss(), None, data)
    J = JacobianOperator(model, None, data)  # forward mode: MHA's fused fast path has none
    v = torch.ones(H.shape[1], dtype=torch.float64)
    for product in (H @ v, G @ v, J @ v, G @ torch.stack([v, 2 * v], 1)):
        assert product.isfinite().all() and product.abs().max() > 0
    torch.testing.assert_close(J.adjoint() @ (J @ v), (J.adjoint() @ J) @ v)


def test_train_mode_batchnorm_with_fixed_batches_works_and_leaves_running_stats():
    model = _model(nn.BatchNorm1d(5)).train()
    data = list(DataLoader(_classification_data(), 4))
    running_mean = model[1].running_mean.clone()
    H = HessianOperator(model, nn.CrossEntropyLoss(), None, data)
    G = GGNOperator(model, nn.CrossEntropyLoss(), None, data)
    v = torch.randn(H.shape[1], dtype=torch.float64)
    assert (H @ v).isfinite().all() and (G @ v).isfinite().all()
    torch.testing.assert_close(model[1].running_mean, running_mean, rtol=0, atol=0)
