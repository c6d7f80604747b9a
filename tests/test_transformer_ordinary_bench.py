"""benchmarks/transformer_ordinary.py times only ordinary steps of the transformer preset."""

from torch import nn

from avionics import Cockpit, configuration
from benchmarks.transformer_ordinary import FIRST_STEP, SPARSE, ordinary_steps


def test_the_timed_steps_are_those_no_sparse_quantity_tracks():
    cockpit = Cockpit(nn.Linear(2, 1), configuration("transformer"))
    steps = ordinary_steps(cockpit, 300)  # (past the schedule's step near 1259)
    sparse = [q for q in cockpit.quantities if type(q).__name__ in SPARSE]
    assert len(sparse) == 2 and len(steps) == 300 and steps[0] >= FIRST_STEP
    assert steps == sorted(set(steps))
    assert not any(q.is_active(s) for q in sparse for s in steps)
    # the steps left out are the sparse schedule's own
    skipped = set(range(FIRST_STEP, steps[-1] + 1)) - set(steps)
    assert skipped and all(any(q.is_active(s) for q in sparse) for s in skipped)
