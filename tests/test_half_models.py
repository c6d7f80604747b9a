"""Half-precision models: parameters in float16 or bfloat16 (not autocast, see
tests/test_mixed_precision.py for that).

The engine and every quantity compute in float32 (float64 where their accumulation needs it)
from the 16-bit tensors of the model: the captured layer inputs and output gradients, the
gradients, the parameters and the optimizer's state. The reference is the same model and data
cast to float64 (the 16-bit values exactly), run in lockstep: after each step the reference
takes the 16-bit model's updated parameters and optimizer state, so that both measure the
same trajectory, and the only differences are the 16-bit roundings of the model's own
forward and backward (each product rounded to the dtype: relative 2^-11 ~ 5e-4 in float16,
2^-8 ~ 4e-3 in bfloat16, summed over a few layers).

Tolerances (:data:`RTOL`, :data:`MOVED`), per dtype:

* every float value v of a quantity at a step: |ours - v| <= RTOL * max(|v|, s), s the
  largest finite magnitude among the quantity's float values at that step (a per-parameter
  list, a dict), so that an entry that cancels to near zero is held to the scale of its
  quantity: 5e-3 in float16, 4e-2 in bfloat16 (measured worst: 1.5e-3 and 1.6e-2, both
  GradientNoiseScale);
* the same for the quantities of second derivatives, HessMaxEV, HessTrace and
  PreconditionedSharpness (Hessian-vector products through the double backward of the 16-bit
  graph; the preconditioner of gradient coordinates below float16's normal range): 3e-2 in
  float16, 6e-2 in bfloat16 (measured worst: 1.7e-2 and 2.9e-2, PreconditionedSharpness;
  HessMaxEV within 6e-4 and 5e-3), except PreconditionedSharpness in bfloat16, 0.15: at step
  0 Adam's preconditioner sqrt(v) + eps is |g| itself, whose small coordinates carry
  bfloat16's relative error 4e-3 into 1 / P, and the transformer's value moves with the
  order of the 16-bit sums (measured: 2.9e-2 with 2 torch threads, 0.11 with 1);
* histogram counts: the same total, and at most MOVED of the elements in another bin (an
  element within rounding of a bin edge lands on either side): 2 % in float16, 5 % in
  bfloat16 (measured worst: 0.6 % and 1.6 %);
* TICDiag, sum_d s_d / (h_d + eps), is ill-conditioned where a diagonal entry h_d is near
  -eps (its condition grows as 1 / (h_d + eps)^2 without bound): it is checked finite and
  present, not against the reference; HessTrace checks the same diagonal h.
"""

from __future__ import annotations

import copy
import math
import warnings

import models
import pytest
import torch
from devices import device_fixture  # noqa: F401 (the fixture `device`)

from avionics import Cockpit, configuration
from avionics.persample import Request

RTOL = {torch.float16: 5e-3, torch.bfloat16: 4e-2}
# the quantities of the second derivative (through the double backward of the 16-bit graph)
SECOND_ORDER = {"HessMaxEV", "HessTrace", "PreconditionedSharpness"}
SECOND_ORDER_RTOL = {torch.float16: 3e-2, torch.bfloat16: 6e-2}
# (PreconditionedSharpness in bfloat16: see the module docstring)
PRECONDITIONED_BFLOAT16_RTOL = 0.15
MOVED = {torch.float16: 0.02, torch.bfloat16: 0.05}
HALF = [pytest.param(torch.float16, id="float16"), pytest.param(torch.bfloat16, id="bfloat16")]
NOT_COMPARED = {"TICDiag"}  # (ill-conditioned: module docstring)
HISTOGRAMS = {"GradHist1d", "GradHist2d"}
ECONOMY_ADAM = "economy (Adam)"


def _optimizer(model, preset: str):
    # PreconditionedSharpness (transformer preset) reads Adam's state; with Adam, Alpha projects
    # after the update with the start step's parameters swapped in. eps 1e-3 is a float16
    # number (Adam's default 1e-8 rounds to 0 there, and a zero second moment divides by 0)
    if preset in ("transformer", ECONOMY_ADAM):
        return torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.05)


def lockstep(half, X, y, loss_fn, preset: str, steps: int = 2):
    """Cockpit outputs of ``half`` and of its float64 copy, run in lockstep (module
    docstring): (ours, reference). ``preset``: a configuration's label, or
    :data:`ECONOMY_ADAM` (economy with Adam)."""
    reference = copy.deepcopy(half).double()
    X_ref = X.double() if X.is_floating_point() else X
    models_ = [(half, X), (reference, X_ref)]
    optimizers = [_optimizer(m, preset) for m, _ in models_]
    cockpits = [Cockpit(m, configuration(preset.split(" ")[0])) for m, _ in models_]
    for step in range(steps):
        for (model, inputs), opt, cockpit in zip(models_, optimizers, cockpits, strict=True):
            opt.zero_grad()
            losses = loss_fn(model(inputs), y)
            loss = losses.mean()
            info = {"loss": loss, "individual_losses": losses, "batch_size": len(losses)}
            info["optimizer"] = opt
            with cockpit(step, info):
                loss.backward(create_graph=cockpit.create_graph(step))
        optimizers[0].step()
        with torch.no_grad():
            for p, q in zip(half.parameters(), reference.parameters(), strict=True):
                q.copy_(p)
                state = optimizers[0].state.get(p)
                if state:
                    optimizers[1].state[q] = {
                        key: v.double() if v.is_floating_point() and v.dim() else v.clone()
                        for key, v in state.items()
                    }
        for model, _ in models_:
            for p in model.parameters():
                p.grad = None  # (create_graph's reference cycle)
    return cockpits[0].get_output(), cockpits[1].get_output()


def _leaves(tree, path=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from _leaves(value, (*path, i))
    else:
        yield path, tree


def mismatches(ours: dict, expected: dict, dtype: torch.dtype) -> list[str]:
    """What of ``ours`` is outside the tolerances of ``dtype`` (module docstring)."""
    assert set(ours) == set(expected)
    found = []
    for step in expected:
        assert set(ours[step]) == set(expected[step]), (
            step,
            set(ours[step]) ^ set(expected[step]),
        )
        for name, value in expected[step].items():
            if name in NOT_COMPARED:
                assert all(math.isfinite(v) for _, v in _leaves(ours[step][name])), name
                continue
            mine, theirs = dict(_leaves(ours[step][name])), dict(_leaves(value))
            assert set(mine) == set(theirs), (step, name)
            if name in HISTOGRAMS:
                found += _histogram_mismatch(step, name, mine, theirs, dtype)
                continue
            floats = [abs(v) for v in theirs.values() if isinstance(v, float)]
            floats = [v for v in floats if math.isfinite(v)]
            scale = max(floats, default=0.0)
            for path, v in theirs.items():
                w = mine[path]
                rtol = (SECOND_ORDER_RTOL if name in SECOND_ORDER else RTOL)[dtype]
                if name == "PreconditionedSharpness" and dtype == torch.bfloat16:
                    rtol = PRECONDITIONED_BFLOAT16_RTOL
                if isinstance(v, float) and math.isnan(v):  # (undefined in both: equal)
                    if not (isinstance(w, float) and math.isnan(w)):
                        found.append(f"step {step} {name}{list(path)}: {w!r}, not nan")
                elif isinstance(v, float) and w != v:  # (equal infinities are equal)
                    if not abs(w - v) <= rtol * max(abs(v), scale):
                        found.append(
                            f"step {step} {name}{list(path)}: {w!r} against the float64 "
                            f"reference {v!r}, beyond {rtol:g} x {max(abs(v), scale):.3g} "
                            f"(the {dtype} tolerance)"
                        )
                elif w != v:
                    found.append(f"step {step} {name}{list(path)}: {w!r} != {v!r}")
    return found


def _histogram_mismatch(step, name, mine: dict, theirs: dict, dtype) -> list[str]:
    counts = [p for p, v in theirs.items() if isinstance(v, int) and not isinstance(v, bool)]
    found = []
    for path, v in theirs.items():  # the edges and every other entry
        if path not in counts and mine[path] != pytest.approx(v, rel=RTOL[dtype], abs=1e-12):
            found.append(f"step {step} {name}{list(path)}: {mine[path]!r} != {v!r}")
    total = sum(theirs[p] for p in counts)
    if sum(mine[p] for p in counts) != total:
        found.append(f"step {step} {name}: {sum(mine[p] for p in counts)} counts, not {total}")
    moved = sum(abs(mine[p] - theirs[p]) for p in counts) / 2
    if moved > MOVED[dtype] * total:
        found.append(
            f"step {step} {name}: {moved:g} of {total} elements in another bin than in the "
            f"float64 reference, beyond {MOVED[dtype]:g} of them (the {dtype} tolerance)"
        )
    return found


@pytest.mark.parametrize("preset", ["economy", ECONOMY_ADAM, "business", "full", "transformer"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("architecture", ["mlp", "cnn", "transformer"])
def test_every_preset_of_a_half_model_matches_its_float64_reference(
    architecture, dtype, preset, device
):
    model, X, y, loss_fn = models.ARCHITECTURES[architecture](n=8)
    model = model.to(device=device, dtype=dtype)
    X = (X.to(dtype) if X.is_floating_point() else X).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (BatchNorm-free models; Lanczos' stopping warnings)
        ours, expected = lockstep(model, X, y.to(device), loss_fn, preset)
    assert {"GradNorm", "Loss", "GradHist1d"} <= set(ours[0])
    found = mismatches(ours, expected, dtype)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("architecture", sorted(models.ARCHITECTURES))
def test_the_engine_computes_a_half_models_statistics_in_float32(architecture, dtype, device):
    """Straight from the engine (no cockpit): the statistics of a 16-bit model are float32
    tensors on the model's device, within RTOL of the brute-force float64 per-sample
    gradients of the same model, relative to the largest of each statistic (the projections
    g_n . g: to max_n ||g_n|| ||g||, their bound)."""
    model, X, y, loss_fn = models.ARCHITECTURES[architecture](n=4)
    model = model.to(device=device, dtype=dtype)
    X = (X.to(dtype) if X.is_floating_point() else X).to(device)
    y = y.to(device)
    engine, step, mean_grad, params = models.captured_engine_step(model, X, y, loss_fn)
    request = Request(sq_norms=True, sum_sq=True, directions=frozenset({"grad"}))
    stats = step.statistics(request, {"grad": mean_grad}, sample_mean="grad")
    reference = copy.deepcopy(model).double()
    X_ref = X.double() if X.is_floating_point() else X
    per_sample = models.per_sample_gradients(reference, X_ref, y, loss_fn)
    mean_ref = [g.mean(0) for g in per_sample]
    for k, g in enumerate(per_sample):
        flat = g.reshape(len(g), -1)
        expected = {
            "sq_norms": flat.square().sum(1),
            "sum_sq": g.square().sum(0),
            "projections": flat @ mean_ref[k].reshape(-1),
        }
        got = {
            "sq_norms": stats.sq_norms[k],
            "sum_sq": stats.sum_sq[k],
            "projections": stats.projections["grad"][k],
        }
        # the projections' scale by Cauchy-Schwarz, max_n ||g_n|| ||g|| (they cancel)
        scales = {key: want.abs().max().item() for key, want in expected.items()}
        scales["projections"] = flat.norm(dim=1).max().item() * mean_ref[k].norm().item()
        for key, want in expected.items():
            value, scale = got[key], scales[key]
            assert value.dtype == torch.float32 and value.device.type == device, (k, key)
            error = (value.double() - want).abs().max().item()
            assert error <= RTOL[dtype] * scale + 1e-12, (
                f"parameter {k} {key}: {error:.3g} from the float64 reference, beyond "
                f"{RTOL[dtype]:g} x {scale:.3g} (the {dtype} tolerance)"
            )
