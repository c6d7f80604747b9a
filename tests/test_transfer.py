"""The step's one host transfer (avionics/step/transfer.py): the values it converts are exactly
those of the one-by-one conversion (to_python), deferred values are finished on the host in
order, and the non-finite values are named, with one read of the host per device."""

from __future__ import annotations

import math

import numpy as np
import torch
from test_host_syncs import HostSyncs

from avionics.quantities.deferred import Deferred
from avionics.records.encoding import to_python
from avionics.step.transfer import read


def step_values():
    torch.manual_seed(0)
    return {
        3: {
            "f32": torch.randn((), dtype=torch.float32),
            "f64": torch.randn((), dtype=torch.float64) * 1e300,
            "bf16": torch.randn(5, dtype=torch.bfloat16),
            "counts": torch.randint(0, 2**40, (3, 4), dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "layered": {"global": torch.randn(()), "per_parameter": torch.randn(4).double()},
            "listed": [torch.randn(2, 2), 7, "text", None],
            "array": np.arange(6).reshape(2, 3),
            "empty": torch.zeros(0, 3),
            "rate": 0.1,
        },
        2: {"two": torch.tensor(2.5, dtype=torch.float16)},
    }


def test_the_conversion_is_exactly_to_python():
    values = step_values()
    expected = {
        step: {k: to_python(v) for k, v in named.items()} for step, named in values.items()
    }
    with HostSyncs() as syncs:
        converted, non_finite = read(values, convert=True)
    assert converted == expected and non_finite == {}
    assert type(converted[3]["counts"][0][0]) is int and type(converted[3]["mask"][0]) is bool
    assert syncs.count == 1, syncs.report()  # one transfer for both steps


def test_without_conversion_the_values_stay_as_they_are():
    values = step_values()
    with HostSyncs() as syncs:
        kept, _ = read(values, convert=False)
    assert all(kept[s][k] is values[s][k] for s in values for k in values[s])
    assert syncs.count == 1, syncs.report()


def test_deferred_values_are_finished_on_the_host_in_order_and_none_is_not_stored():
    finished = []

    def finish(tag):
        def done(floats, value):
            finished.append((tag, floats, value))
            return None if tag == "dropped" else sum(floats)

        return done

    a, b = torch.tensor(1.5, dtype=torch.float64), torch.tensor(2.0)
    values = {
        0: {"first": Deferred((a, b), finish("first"), {"t": torch.ones(2)})},
        1: {"dropped": Deferred((b,), finish("dropped")), "nan": torch.tensor(math.nan)},
    }
    with HostSyncs() as syncs:
        out, non_finite = read(values, convert=True)
    assert syncs.count == 1, syncs.report()
    assert out == {0: {"first": 3.5}, 1: {"nan": out[1]["nan"]}} and math.isnan(out[1]["nan"])
    assert finished == [("first", [1.5, 2.0], {"t": [1.0, 1.0]}), ("dropped", [2.0], None)]
    assert non_finite == {1: ["nan"]}


def test_non_finite_values_are_named_per_step():
    values = {
        5: {"ok": torch.ones(3), "inf": torch.tensor([1.0, math.inf]), "rate": math.nan},
        6: {"count": torch.tensor(3), "fine": 1.0},
        # finite values whose sum overflows; a NaN, and a -inf in half precision, in a vector
        8: {"large": torch.full((4,), 3e38), "nan": torch.tensor([0.0, math.nan]),
            "half": torch.tensor([-math.inf, 2.0], dtype=torch.bfloat16),
            "empty": torch.zeros(0)},
    }  # fmt: skip
    for convert in (False, True):
        _, non_finite = read(values, convert=convert)
        assert non_finite == {5: ["inf", "rate"], 8: ["nan", "half"]}
    deferred = {7: {"Alpha": Deferred((torch.tensor(0.0),), lambda floats, _: math.nan)}}
    assert read(deferred, convert=False)[1] == {7: ["Alpha"]}
