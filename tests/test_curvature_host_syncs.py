"""Host synchronisations of the curvature presets' tracked steps (issue 26), counted on the CPU
with tests/test_host_syncs.py's counter: business and full, like economy's bound there.

Besides economy's two budgeted transfers (step/batch.py, step/transfer.py), a business step
reads the loss's finiteness on entering (for the curvature quantities' checks of the forward):
3 in all (the exact Hessian diagonal's one-hot probes are written on the device). A full step
adds HessMaxEV's Lanczos: per product one packed read of [V^T A v, ||A v||^2] for the stopping
rule and, when a second Gram-Schmidt pass runs, one of its projections; at the end the Ritz
coefficients and the values go to the device (tensors made from host data, counted too); the
start vector's norm check reads one number.
"""

from __future__ import annotations

import pytest
import torch
from test_host_syncs import accelerator_histograms, on_device, preset_steps

from avionics.quantities import HessMaxEV

# the business step's reads (module docstring)
BUSINESS = 3


def lanczos_bound(products: int) -> int:
    """A full step's reads beyond business's: per product at most two (the stopping rule's
    packed read, a second Gram-Schmidt pass's), one for the start vector's norm, two tensors
    made from host data at the end (the Ritz coefficients, the values)."""
    return 2 * products + 3


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "transformer"])
def test_a_tracked_business_step_synchronises_three_times(architecture):
    with accelerator_histograms():
        syncs, *_ = preset_steps(*on_device(architecture, "cpu"), 4, {0, 1, 2}, {2}, "business")
    assert syncs[2].count <= BUSINESS, syncs[2].report()
    assert not [w for w in syncs[2].where if w[1].startswith("curvature/step")]


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "transformer"])
def test_a_tracked_full_step_synchronises_within_its_lanczos_bound(architecture):
    """Counted against the products HessMaxEV reports for the step; the Hessian diagonal and
    the rest of business as above."""
    with accelerator_histograms():
        syncs, _, output = preset_steps(*on_device(architecture, "cpu"), 4, {0, 1, 2}, {2}, "full")
    counted = syncs[2]
    lanczos = [w for w in counted.where if w[1].startswith("curvature/algorithms/lanczos")]
    products = _products_of_step(architecture, 2)
    assert len(lanczos) <= lanczos_bound(products), counted.report()
    assert counted.count - len(lanczos) <= BUSINESS, counted.report()
    assert not [w for w in counted.where if w[1].startswith("curvature/step")]
    assert output[2]["HessMaxEV"] > 0


def _products_of_step(architecture: str, step: int) -> int:
    """The products HessMaxEV uses at ``step`` of the same run (a fresh copy: the run is
    deterministic), read from the quantity itself."""
    model, X, y, loss_fn = on_device(architecture, "cpu")
    from avionics import Cockpit

    quantity = HessMaxEV()
    cockpit = Cockpit(model, [quantity])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for k in range(step + 1):
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        loss = losses.mean()
        info = {"loss": loss, "individual_losses": losses, "batch_size": len(losses)}
        info["optimizer"] = opt
        with cockpit(k, info):
            loss.backward(create_graph=cockpit.create_graph(k))
        opt.step()
    for p in model.parameters():
        p.grad = None
    return quantity.num_products[step]
