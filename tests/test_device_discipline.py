"""Every tensor the engine and the histogram kernels make is made on the parameters' device,
and the collectives' buffers live where the process group's backend communicates.

On the CPU this is checked on the ``meta`` device: a model, its data and its gradients on
``meta`` run the engine's rules and the histograms' torch path (shapes only), and any tensor
made on the CPU and combined with them raises ("Tensor on device cpu is not on the expected
device meta"). Reading a value on the host raises there too, so the run also shows that the
rules' statistics need no host synchronisation.
"""

from __future__ import annotations

import models
import pytest
import torch
from devices import device_fixture  # noqa: F401 (the fixture `device`)

from avionics.distributed import collective_device
from avionics.persample import PerSampleEngine, Request
from avionics.quantities import binning


@pytest.mark.parametrize("architecture", sorted(models.ARCHITECTURES))
def test_the_engine_makes_every_tensor_on_the_models_device(architecture):
    model, X, y, loss_fn = models.ARCHITECTURES[architecture](n=4)
    model = model.float().to("meta")
    X = (X.float() if X.is_floating_point() else X).to("meta")
    params = list(model.parameters())
    engine = PerSampleEngine(model, params)
    capture = engine.capture()
    capture.arm()
    losses = loss_fn(model(X), y.to("meta"))
    capture.disarm()
    capture.record_gradients()
    losses.mean().backward()
    capture.stop_recording()
    # (no gradient check: it compares norms on the host)
    step = engine.step(capture.calls_by_module(), 4, 4.0)
    counts = torch.zeros(10, dtype=torch.int64, device="meta")
    joint = torch.zeros(30, dtype=torch.int64, device="meta")

    def visit(k, chunk):
        binning.torch_count_1d(chunk, -1.0, 1.0, counts)
        width = params[k].numel()
        offsets = torch.zeros(width, dtype=torch.int32, device="meta")
        binning.torch_count_2d(chunk, offsets, 10, -1.0, 1.0, joint)

    request = Request(sq_norms=True, sum_sq=True, directions=frozenset({"grad"}))
    stats = step.statistics(request, {"grad": [p.grad for p in params]}, sample_mean="grad")
    step.statistics(Request(visitors=(visit,)), {})
    results = [*stats.sq_norms, *stats.sum_sq, *stats.projections["grad"]]
    assert len(results) == 3 * len(params)
    assert {t.device.type for t in results} == {"meta"}
    assert [t.shape for t in stats.sum_sq] == [p.shape for p in params]


def test_a_collective_buffer_lives_where_its_backend_communicates(device):
    """NCCL takes CUDA tensors only: a CPU tensor's buffer moves to the current CUDA device
    there; gloo (CPU and CUDA) keeps the tensors' device."""
    cpu = torch.device("cpu")
    assert collective_device("gloo", cpu) == cpu
    assert collective_device("nccl", torch.device("cuda", 0)) == torch.device("cuda", 0)
    if device == "cuda":
        assert collective_device("nccl", cpu).type == "cuda"
        assert collective_device("gloo", torch.device("cuda", 0)).type == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU it runs the whole GPU section")
def test_the_gpu_script_says_there_is_no_gpu_and_exits_0(capsys):
    from benchmarks import gpu

    assert gpu.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
