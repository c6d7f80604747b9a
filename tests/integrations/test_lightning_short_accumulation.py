"""CockpitCallback with accumulate_grad_batches=3 over epochs of 8 batches (issue 28, item 2):
each epoch's last step has the remainder, 2 batches; every step is tracked, with the values of
one batch of all its samples, and the fit goes on to the next epoch."""

from __future__ import annotations

import copy
import warnings

import pytest

pl = pytest.importorskip("lightning.pytorch")

from avionics import configuration  # noqa: E402
from avionics.integrations.lightning import CockpitCallback  # noqa: E402
from avionics.records.encoding import to_python  # noqa: E402
from integrations.test_lightning import (  # noqa: E402
    Classifier,
    N,
    assert_close,
    fit,
    make_data,
    make_net,
    plain_loop,
)


def test_an_epochs_short_last_step_is_tracked_over_its_micro_batches(tmp_path):
    data, net = make_data(batches=8), make_net()
    # the steps of 3, 3 and 2 batches, each as one batch of its samples
    expected = plain_loop(copy.deepcopy(net), configuration("full"), data, batch_size=3 * N)
    callback = CockpitCallback(configuration("full"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(Classifier(net), callback, tmp_path, data, accumulate_grad_batches=3)
    assert not [w for w in caught if "skipped" in str(w.message)]
    output = callback.cockpit.get_output()
    assert sorted(output) == [0, 1, 2]
    assert_close(to_python(dict(output)), to_python(dict(expected)), rel=1e-10)


def test_the_fit_goes_on_after_a_short_step(tmp_path):
    data, net = make_data(batches=8), make_net()
    callback = CockpitCallback(configuration("economy"))
    trainer = fit(
        Classifier(net), callback, tmp_path, data, accumulate_grad_batches=3, max_epochs=2
    )
    assert trainer.global_step == 6
    assert sorted(
        step for step, values in callback.cockpit.get_output().items() if "Loss" in values
    ) == list(range(6))
