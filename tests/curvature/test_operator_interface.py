"""The operator interface: input formats, lazy algebra, adjoint, SciPy export, identity."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg
import torch
from curvature_problems import dense_ggn, dense_hessian, dense_jacobian, problem

from avionics.curvature import (
    GGNOperator,
    HessianOperator,
    IdentityOperator,
    JacobianOperator,
)


@pytest.fixture(scope="module")
def mlp():
    model, loss_fn, data, _ = problem("mlp")
    H = HessianOperator(model, loss_fn, None, data)
    G = GGNOperator(model, loss_fn, None, data)
    J = JacobianOperator(model, None, data)
    references = {
        "H": dense_hessian(model, loss_fn, data),
        "G": dense_ggn(model, loss_fn, data),
        "J": dense_jacobian(model, data),
    }
    return H, G, J, references


def test_every_input_format(mlp):
    H, _, _, ref = mlp
    D = H.shape[1]
    generator = torch.Generator().manual_seed(0)
    v = torch.randn(D, dtype=torch.float64, generator=generator)
    V = torch.randn(D, 3, dtype=torch.float64, generator=generator)
    Hv, HV = H @ v, H @ V
    assert Hv.shape == (D,) and HV.shape == (D, 3)
    torch.testing.assert_close(Hv, ref["H"] @ v)
    torch.testing.assert_close(HV, ref["H"] @ V)
    # list of per-parameter tensors: vector and matrix
    sizes = [s.numel() for s in H.in_shapes]
    v_list = [x.view(s) for x, s in zip(v.split(sizes), H.in_shapes)]
    V_list = [x.view(*s, 3) for x, s in zip(V.split(sizes), H.in_shapes)]
    Hv_list, HV_list = H @ v_list, H @ V_list
    assert isinstance(Hv_list, list) and [t.shape for t in Hv_list] == H.out_shapes
    assert [t.shape for t in HV_list] == [(*s, 3) for s in H.out_shapes]
    torch.testing.assert_close(torch.cat([t.flatten() for t in Hv_list]), Hv)
    torch.testing.assert_close(torch.cat([t.reshape(-1, 3) for t in HV_list]), HV)
    # NumPy in, NumPy out
    Hv_np, HV_np = H @ v.numpy(), H @ V.numpy()
    assert isinstance(Hv_np, np.ndarray) and Hv_np.shape == (D,)
    np.testing.assert_allclose(Hv_np, Hv.numpy(), rtol=1e-10)
    np.testing.assert_allclose(HV_np, HV.numpy(), rtol=1e-10)
    # two products in a row agree exactly
    torch.testing.assert_close(H @ V, HV, rtol=0, atol=0)


def test_lazy_algebra_and_adjoint(mlp):
    H, G, J, ref = mlp
    V = torch.randn(H.shape[1], 4, dtype=torch.float64)
    torch.testing.assert_close((H + G) @ V, (ref["H"] + ref["G"]) @ V)
    torch.testing.assert_close((H - G) @ V, (ref["H"] - ref["G"]) @ V)
    torch.testing.assert_close((2.5 * H) @ V, 2.5 * ref["H"] @ V)
    torch.testing.assert_close((H * 2.5) @ V, 2.5 * ref["H"] @ V)
    torch.testing.assert_close((-H) @ V, -ref["H"] @ V)
    torch.testing.assert_close((H @ G) @ V, ref["H"] @ ref["G"] @ V)
    JH_adjoint = (J @ H).adjoint()  # (J H)^T = H J^T
    torch.testing.assert_close(JH_adjoint @ (J @ V), ref["H"] @ ref["J"].T @ ref["J"] @ V)
    assert H.adjoint() is H
    damped = H + 0.5 * IdentityOperator(H)
    torch.testing.assert_close(damped @ V, (ref["H"] + 0.5 * torch.eye(H.shape[0])) @ V)
    identity = IdentityOperator(H.in_shapes, dtype=torch.float64)
    torch.testing.assert_close(identity @ V, V)


def test_to_scipy(mlp):
    H, _, J, ref = mlp
    H_scipy = H.to_scipy()
    assert isinstance(H_scipy, scipy.sparse.linalg.LinearOperator)
    assert H_scipy.shape == H.shape and H_scipy.dtype == np.float64
    v = np.random.default_rng(0).standard_normal(H.shape[1])
    np.testing.assert_allclose(H_scipy @ v, ref["H"].numpy() @ v, rtol=1e-10)
    J_scipy = J.to_scipy()
    u = np.random.default_rng(1).standard_normal(J.shape[0])
    np.testing.assert_allclose(J_scipy.rmatvec(u), ref["J"].numpy().T @ u, rtol=1e-10)
    V = np.random.default_rng(2).standard_normal((J.shape[1], 2))
    np.testing.assert_allclose(J_scipy.matmat(V), ref["J"].numpy() @ V, rtol=1e-10)
    largest = scipy.sparse.linalg.eigsh(H_scipy, k=1, which="LA", return_eigenvectors=False)
    np.testing.assert_allclose(largest[0], torch.linalg.eigvalsh(ref["H"])[-1].item())


def test_bad_inputs(mlp):
    H, G, J, _ = mlp
    D = H.shape[1]
    with pytest.raises(ValueError, match=rf"must be \[{D}\] or \[{D}, K\], got \[{D + 1}\]"):
        H @ torch.zeros(D + 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="computes in torch.float64.*X is torch.float32"):
        H @ torch.zeros(D)
    with pytest.raises(ValueError, match="acts on 4 tensors"):
        H @ [torch.zeros(3, dtype=torch.float64)]
    with pytest.raises(ValueError, match="trailing axis of K columns"):
        H @ [torch.zeros(*s, k, dtype=torch.float64) for k, s in enumerate(H.in_shapes)]
    with pytest.raises(TypeError, match="needs X to be a tensor"):
        H @ "v"
    with pytest.raises(ValueError, match="operators on the same spaces"):
        H + J
    with pytest.raises(ValueError, match="A's input space to be B's output space"):
        J @ J
    with pytest.raises(TypeError, match="Only an operator can be added"):
        H + 1.0


def test_columns_in_chunks(mlp):
    _, _, _, ref = mlp
    model, loss_fn, data, _ = problem("mlp")
    V = torch.randn(ref["G"].shape[1], 7, dtype=torch.float64)
    for chunk_size in (2, None):
        G = GGNOperator(model, loss_fn, None, data, chunk_size=chunk_size)
        torch.testing.assert_close(G @ V, ref["G"] @ V)
