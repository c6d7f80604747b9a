"""The cockpit's instruments, one small module per idea (see SPEC section 2)."""

from avionics.quantities.alpha import Alpha
from avionics.quantities.base import Quantity, StepData
from avionics.quantities.clock import Time
from avionics.quantities.curvature import HessTrace, TICDiag, TICTrace
from avionics.quantities.distance import Distance
from avionics.quantities.grad_norm import GradNorm
from avionics.quantities.gradient_tests import InnerTest, NormTest, OrthoTest
from avionics.quantities.hess_max_ev import HessMaxEV
from avionics.quantities.histograms import GradAbsMax, GradHist1d, GradHist2d, ParamAbsMax
from avionics.quantities.loss import Loss
from avionics.quantities.parameters import Parameters
from avionics.quantities.update_size import UpdateSize
from avionics.quantities.variance import CABS, EarlyStopping, MeanGSNR

__all__ = [
    "Alpha",
    "CABS",
    "Distance",
    "EarlyStopping",
    "GradAbsMax",
    "GradHist1d",
    "GradHist2d",
    "GradNorm",
    "HessMaxEV",
    "HessTrace",
    "InnerTest",
    "Loss",
    "MeanGSNR",
    "NormTest",
    "OrthoTest",
    "ParamAbsMax",
    "Parameters",
    "Quantity",
    "StepData",
    "TICDiag",
    "TICTrace",
    "Time",
    "UpdateSize",
]
