"""The devices that device-parametrised tests run on.

A test that takes the ``device`` fixture runs on "cpu", and also on "cuda" where torch sees
a GPU; the CUDA runs carry the ``cuda`` marker, so ``pytest -m cuda`` runs just them (the
GPU subset of ``benchmarks/gpu.py``). Import the fixture into a test module with
``from devices import device_fixture`` (named so that it is not shadowed by the test's
``device`` argument).
"""

from __future__ import annotations

import pytest
import torch

DEVICES = [pytest.param("cpu", id="cpu")]
if torch.cuda.is_available():
    DEVICES.append(pytest.param("cuda", id="cuda", marks=pytest.mark.cuda))


@pytest.fixture(params=DEVICES, name="device")
def device_fixture(request) -> str:
    """ "cpu", then "cuda" where available (marked ``cuda``)."""
    return request.param
