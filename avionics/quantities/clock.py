"""Time: the wall-clock time (seconds since the epoch) when the step's backward finished."""

import time

from avionics.quantities.base import Quantity, StepData


class Time(Quantity):
    """The wall-clock time, in seconds since the epoch, when the step's backward finished (no
    loss involved)."""

    def compute(self, data: StepData):
        return {data.step: time.time()}
