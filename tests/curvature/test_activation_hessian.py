"""The activation Hessian: against autograd references, layer-input/-output agreement, errors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from curvature_problems import TinyTransformer, problem
from torch import nn
from torch.autograd.functional import hessian
from torch.nn.attention import SDPBackend, sdpa_kernel

from avionics.curvature import ActivationHessianOperator


def dense(A) -> torch.Tensor:
    return A @ torch.eye(A.shape[1], dtype=A.dtype)


def test_mlp_layer_input_equals_output_of_layer_feeding_it_and_reference():
    model, loss_fn, data, _ = problem("mlp")
    X, y = data[2]
    by_input = ActivationHessianOperator(model, loss_fn, ("2", "input", 0), [(X, y)])
    by_output = ActivationHessianOperator(model, loss_fn, ("1", "output", 0), [(X, y)])
    Z = model[:2](X).detach()
    expected = hessian(lambda z: loss_fn(model[2](z.view_as(Z)), y), Z.flatten())
    assert by_input.shape == (Z.numel(), Z.numel()) == (20, 20)
    torch.testing.assert_close(dense(by_input), expected)
    torch.testing.assert_close(dense(by_output), expected)


@pytest.mark.parametrize("reduction,scale", [("mean", 1 / 4), ("sum", 1.0)])
def test_identity_before_softmax_cross_entropy_is_block_diagonal(reduction, scale):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Identity()).double()
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 5, (4,))
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    A = ActivationHessianOperator(model, loss_fn, ("1", "output", 0), [(X, y)])
    p = model(X).softmax(-1).detach()
    blocks = [torch.diag(p_n) - torch.outer(p_n, p_n) for p_n in p]
    torch.testing.assert_close(dense(A), scale * torch.block_diag(*blocks))
    by_input = ActivationHessianOperator(model, loss_fn, ("1", "input", 0), [(X, y)])
    torch.testing.assert_close(dense(by_input), dense(A))


def test_transformer_sequence_activation_through_attention():
    model, loss_fn, data, _ = problem("transformer")
    X, y = data[0]
    A = ActivationHessianOperator(model, loss_fn, ("head", "input", 0), [(X, y)])
    with torch.no_grad():
        x = model.embedding(X)
        N, T, W = x.shape
        q, k, v = model.qkv(model.norm(x)).split(W, dim=-1)
        q, k, v = (t.view(N, T, 2, -1).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        Z = x + attended.transpose(1, 2).reshape(N, T, W)
    expected = hessian(lambda z: loss_fn(model.head(z.view_as(Z)).transpose(1, 2), y), Z.flatten())
    assert A.in_shapes == [Z.shape]
    torch.testing.assert_close(dense(A), expected)
    # The embedding output feeds the norm and the residual: all uses count.
    embedding = ActivationHessianOperator(model, loss_fn, ("embedding", "output", 0), [(X, y)])
    with sdpa_kernel(SDPBackend.MATH):
        expected = hessian(lambda z: _from_embedding(model, z.view_as(x), y, loss_fn), x.flatten())
    torch.testing.assert_close(dense(embedding), expected)


def _from_embedding(model: TinyTransformer, x, y, loss_fn):
    N, T, W = x.shape
    q, k, v = model.qkv(model.norm(x)).split(W, dim=-1)
    q, k, v = (t.view(N, T, 2, -1).transpose(1, 2) for t in (q, k, v))
    attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return loss_fn(model.head(x + attended.transpose(1, 2).reshape(N, T, W)).transpose(1, 2), y)


@pytest.mark.parametrize(
    "activation,cut,size", [(("3", "input", 0), 3, 24), (("1", "output", 0), 2, 96)]
)
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_cnn_activations_against_the_autograd_hessian(activation, cut, size, chunk_size):
    model, loss_fn, data, _ = problem("cnn")
    X, y = data[0]
    A = ActivationHessianOperator(model, loss_fn, activation, [(X, y)], chunk_size=chunk_size)
    Z = model[:cut](X).detach()
    expected = hessian(lambda z: loss_fn(model[cut:](z.view_as(Z)), y), Z.flatten())
    assert A.shape == (Z.numel(), Z.numel()) == (size, size)
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(dense(A), expected)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_every_column_layout_and_result_block_against_the_autograd_hessian(chunk_size):
    # The columns reach the batched backward through the result's memory (row-major V),
    # directly (column-major V), or as given when the result block is row-major (a scaled
    # operator's): every way gives the dense Hessian's product, bit for bit the same.
    model, loss_fn, data, _ = problem("cnn")
    X, y = data[0]
    A = ActivationHessianOperator(
        model, loss_fn, ("3", "input", 0), [(X, y)], chunk_size=chunk_size
    )
    Z = model[:3](X).detach()
    expected = hessian(lambda z: loss_fn(model[3:](z.view_as(Z)), y), Z.flatten())
    V = torch.randn(A.shape[1], 12, dtype=torch.float64)
    given = V.clone()
    row_major = A @ V
    torch.testing.assert_close(row_major, expected @ V)
    for other in (A @ V.T.contiguous().T, (1.0 * A) @ V, A @ [V.view(*Z.shape, 12)]):
        other = other[0].view(-1, 12) if isinstance(other, list) else other
        torch.testing.assert_close(other, row_major, rtol=0, atol=0)
    assert torch.equal(V, given)  # the operator did not write into the columns given


def test_tied_weights_activation_against_the_autograd_hessian():
    # Z is the first layer's output: the layer after it shares the first one's weight.
    model, loss_fn, data, _ = problem("tied")
    X, y = data[1]
    A = ActivationHessianOperator(model, loss_fn, ("first", "output", 0), [(X, y)])
    Z = model.first(X).detach()

    def loss(z):
        return loss_fn(model.head(torch.tanh(model.second(torch.tanh(z.view_as(Z))))), y)

    expected = hessian(loss, Z.flatten())
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(dense(A), expected)
    V = torch.randn(A.shape[1], 7, dtype=torch.float64)
    torch.testing.assert_close(A @ V, expected @ V)


def test_input_used_outside_its_module_counts_every_use():
    """The norm's input is the embedding output, which the residual connection also uses."""
    model, loss_fn, data, _ = problem("transformer")
    X, y = data[0]
    A = ActivationHessianOperator(model, loss_fn, ("norm", "input", 0), [(X, y)])
    x = model.embedding(X).detach()
    with sdpa_kernel(SDPBackend.MATH):
        expected = hessian(lambda z: _from_embedding(model, z.view_as(x), y, loss_fn), x.flatten())
    torch.testing.assert_close(dense(A), expected)


def test_an_output_activation_keeps_no_graph_of_the_layers_before_it():
    """The Tanh output, saved by the graph of the last Linear, is freed at construction."""
    model, loss_fn, data, _ = problem("mlp")
    tanh_outputs = []
    handle = model[1].register_forward_hook(
        lambda module, args, output: tanh_outputs.append(weakref.ref(output))
    )
    A = ActivationHessianOperator(model, loss_fn, ("2", "output", 0), [data[0]])
    handle.remove()
    gc.collect()
    assert len(tanh_outputs) == 2  # the forward and the determinism check's
    assert all(output() is None for output in tanh_outputs)
    p = model(data[0][0]).softmax(-1).detach()
    blocks = [torch.diag(p_n) - torch.outer(p_n, p_n) for p_n in p]
    torch.testing.assert_close(dense(A), torch.block_diag(*blocks) / len(p))


@pytest.mark.parametrize("activation", [("0", "output", 0), ("1", "input", 0)])
def test_an_in_place_operation_after_the_activation_leaves_it_as_it_was(activation):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)).double()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    loss_fn = nn.CrossEntropyLoss()
    A = ActivationHessianOperator(model, loss_fn, activation, [(X, y)])
    Z = model[0](X).detach()
    expected = hessian(lambda z: loss_fn(model[1:](z.view_as(Z).clone()), y), Z.flatten())
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(dense(A), expected)


def test_columns_in_chunks_agree_with_single_columns():
    model, loss_fn, data, _ = problem("cnn")
    X, y = data[0]
    A = ActivationHessianOperator(model, loss_fn, ("1", "output", 0), [(X, y)], chunk_size=5)
    H = dense(A)
    torch.testing.assert_close(H, H.T)
    v = torch.randn(A.shape[1], dtype=torch.float64)
    torch.testing.assert_close(A @ v, H @ v)
    torch.testing.assert_close(A @ v, A @ v, rtol=0, atol=0)
    assert H.abs().max() > 1e-3


def test_whole_model_output_and_input_of_model():
    model, loss_fn, data, _ = problem("mlp", "mse", "sum")
    X, y = data[0]
    A = ActivationHessianOperator(model, loss_fn, ("", "output", 0), [(X, y)])
    torch.testing.assert_close(dense(A), 2 * torch.eye(A.shape[0], dtype=torch.float64))
    inputs = ActivationHessianOperator(model, loss_fn, ("", "input", 0), [(X, y)])
    expected = hessian(lambda x: loss_fn(model(x.view_as(X)), y), X.flatten())
    torch.testing.assert_close(dense(inputs), expected)


def test_errors():
    model, loss_fn, data, _ = problem("mlp")
    batch = [data[0]]
    with pytest.raises(ValueError, match=r"no module named '3'.*\['', '0', '1', '2'\]"):
        ActivationHessianOperator(model, loss_fn, ("3", "output", 0), batch)
    with pytest.raises(ValueError, match=r"one of \('input', 'output'\), got 'outputs'"):
        ActivationHessianOperator(model, loss_fn, ("1", "outputs", 0), batch)
    with pytest.raises(IndexError, match="has 1 element.*no index 1"):
        ActivationHessianOperator(model, loss_fn, ("1", "input", 1), batch)
    with pytest.raises(IndexError, match="has 1 element.*no index 2"):
        ActivationHessianOperator(model, loss_fn, ("1", "output", 2), batch)
    with pytest.raises(ValueError, match="requires a single batch, got 3"):
        ActivationHessianOperator(model, loss_fn, ("1", "output", 0), data)


def test_the_benchmark_floor_and_curvlinops_agree_with_the_operator():
    """benchmarks/activation_hessian.py times these and its hand-written floors; they must
    compute the same product."""
    pytest.importorskip("curvlinops")
    from benchmarks.activation_hessian import AGREEMENT_RTOL, CHECKED_CASE, check_agreement

    assert check_agreement(CHECKED_CASE) <= AGREEMENT_RTOL


@pytest.mark.parametrize("activation", [nn.ReLU, nn.Tanh, nn.Sigmoid])
@pytest.mark.parametrize("cut", [0, 1, 2, 4])
def test_the_benchmark_columns_last_floor_against_the_autograd_hessian(activation, cut):
    """benchmarks/activation_hessian.py's hand-written Hessian backpropagation: every column
    of d2 L / dZ2 at each cut, the smooth activations' own sigma''(h) (d L / da) V term
    included, against the dense float64 Hessian by double backward."""
    from benchmarks.activation_hessian import columns_last_floor

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 5), activation(), nn.Linear(5, 4), activation(), nn.Linear(4, 3)
    ).double()
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    loss_fn = nn.CrossEntropyLoss()
    Z = model[:cut](X).detach()
    product = columns_last_floor(model[cut:], loss_fn, Z, y)
    expected = hessian(lambda z: loss_fn(model[cut:](z.view_as(Z)), y), Z.flatten())
    torch.testing.assert_close(product(torch.eye(Z.numel(), dtype=torch.float64)), expected)


def _loss_cases():
    """(loss, labels) for each closed-form output gradient and for losses without one."""
    generator = torch.Generator().manual_seed(1)
    classes = torch.randint(0, 4, (6, 3), generator=generator)  # [N, T]: a sequence axis
    ignored = classes.clone()
    ignored[0, 1] = -100
    targets = torch.rand(6, 4, 3, generator=generator, dtype=torch.float64)
    return {
        "cross-entropy, mean, sequence": (nn.CrossEntropyLoss(), classes),
        "cross-entropy, sum": (nn.CrossEntropyLoss(reduction="sum"), classes),
        "cross-entropy, an ignored label": (nn.CrossEntropyLoss(), ignored),
        "cross-entropy, label smoothing": (nn.CrossEntropyLoss(label_smoothing=0.1), classes),
        "MSE, mean": (nn.MSELoss(), targets),
        "MSE, sum": (nn.MSELoss(reduction="sum"), targets),
        "BCE with logits, mean": (nn.BCEWithLogitsLoss(), targets),
        "BCE with logits, pos_weight": (
            nn.BCEWithLogitsLoss(pos_weight=torch.full((3,), 2.0, dtype=torch.float64)),
            targets,
        ),
    }


@pytest.mark.parametrize("case", list(_loss_cases()))
@pytest.mark.parametrize("activation", [("1", "input", 0), ("2", "output", 0)])
def test_every_loss_against_the_autograd_hessian(case, activation):
    """The closed-form d L / df (cross-entropy, MSE, BCE) and the loss's own backward (the
    others) give the dense double-backward Hessian w.r.t. Z."""
    loss_fn, y = _loss_cases()[case]
    torch.manual_seed(0)
    # [N, 5, T] -> Conv1d(5, 4, 1): the class / output axis 1, a sequence axis 2
    model = nn.Sequential(nn.Conv1d(5, 4, 1), nn.Tanh(), nn.Conv1d(4, 4, 1)).double()
    X = torch.randn(6, 5, 3, dtype=torch.float64)
    A = ActivationHessianOperator(model, loss_fn, activation, [(X, y)])
    if activation[1] == "input":
        Z, above = model[0](X).detach(), model[1:]
    else:
        Z, above = model(X).detach(), nn.Identity()
    expected = hessian(lambda z: loss_fn(above(z.view_as(Z)), y), Z.flatten())
    torch.testing.assert_close(dense(A), expected)


_ACTIVATIONS = {
    "relu": nn.ReLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
    "gelu-tanh": lambda: nn.GELU(approximate="tanh"),
}


@pytest.mark.parametrize("name", list(_ACTIVATIONS))
@pytest.mark.parametrize("loss_name", ["cross-entropy", "mse"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("N", [1, 4])
def test_the_columns_last_rules_against_the_autograd_hessian(name, loss_name, reduction, N):
    """Every covered activation, both losses, both reductions, cuts at inputs and outputs."""
    torch.manual_seed(0)
    make = _ACTIVATIONS[name]
    model = nn.Sequential(nn.Linear(3, 5), make(), nn.Linear(5, 4), make(), nn.Linear(4, 3))
    model = model.double()
    X = torch.randn(N, 3, dtype=torch.float64)
    if loss_name == "cross-entropy":
        loss_fn, y = nn.CrossEntropyLoss(reduction=reduction), torch.randint(0, 3, (N,))
    else:
        loss_fn, y = nn.MSELoss(reduction=reduction), torch.randn(N, 3, dtype=torch.float64)
    cuts = {("0", "input", 0): 0, ("1", "input", 0): 1, ("1", "output", 0): 2,
            ("3", "input", 0): 3, ("4", "output", 0): 5, ("", "input", 0): 0}  # fmt: skip
    for activation, cut in cuts.items():
        A = ActivationHessianOperator(model, loss_fn, activation, [(X, y)])
        assert A._columns_last is not None
        Z = model[:cut](X).detach()
        expected = hessian(
            lambda z, cut=cut, Z=Z: loss_fn(model[cut:](z.view_as(Z)), y), Z.flatten()
        )
        torch.testing.assert_close(dense(A), expected)


def test_the_batched_backward_is_kept_for_what_the_rules_do_not_cover():
    for name, activation in [("cnn", ("3", "input", 0)), ("transformer", ("head", "input", 0))]:
        model, loss_fn, data, _ = problem(name)
        A = ActivationHessianOperator(model, loss_fn, activation, [data[0]])
        assert A._columns_last is None
