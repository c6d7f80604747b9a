"""The cockpit's instruments, one small module per idea (docs/definitions.md), and the public
protocol to write your own (:mod:`avionics.quantities.base`)."""

from avionics.persample import Request, Statistics
from avionics.quantities.activation_health import ActivationHealth
from avionics.quantities.alpha import Alpha
from avionics.quantities.base import Quantity, StepData, TwoStepQuantity
from avionics.quantities.clock import Time
from avionics.quantities.curvature import HessTrace, TICDiag, TICTrace
from avionics.quantities.distance import Distance
from avionics.quantities.grad_norm import GradNorm
from avionics.quantities.gradient_tests import InnerTest, NormTest, OrthoTest
from avionics.quantities.hess_max_ev import HessMaxEV
from avionics.quantities.histograms import GradAbsMax, GradHist1d, GradHist2d, ParamAbsMax
from avionics.quantities.loss import Loss, LossOutliers
from avionics.quantities.noise_scale import (
    GradCovTrace,
    GradientNoiseScale,
    SimpleNoiseScale,
    TrueGradSqNorm,
)
from avionics.quantities.outputs import (
    HISTOGRAM_1D,
    HISTOGRAM_2D,
    SCALAR,
    TENSORS,
    Output,
    per_parameter,
)
from avionics.quantities.parameters import Parameters
from avionics.quantities.preconditioned_sharpness import PreconditionedSharpness
from avionics.quantities.ranks import Ranks
from avionics.quantities.update_ratio import UpdateRatio
from avionics.quantities.update_size import UpdateSize
from avionics.quantities.variance import CABS, EarlyStopping, MeanGSNR
from avionics.records.outputs import BUILTIN_OUTPUTS  # (each class's output, by name)

BUILTIN = (
    ActivationHealth,
    Alpha,
    CABS,
    Distance,
    EarlyStopping,
    GradCovTrace,
    GradHist1d,
    GradHist2d,
    GradNorm,
    GradientNoiseScale,
    HessMaxEV,
    HessTrace,
    InnerTest,
    Loss,
    LossOutliers,
    MeanGSNR,
    NormTest,
    OrthoTest,
    Parameters,
    PreconditionedSharpness,
    Ranks,
    SimpleNoiseScale,
    TICDiag,
    TICTrace,
    Time,
    TrueGradSqNorm,
    UpdateRatio,
    UpdateSize,
)

__all__ = [
    "ActivationHealth",
    "Alpha",
    "BUILTIN",
    "BUILTIN_OUTPUTS",
    "CABS",
    "Distance",
    "EarlyStopping",
    "GradAbsMax",
    "GradCovTrace",
    "GradHist1d",
    "GradHist2d",
    "GradNorm",
    "GradientNoiseScale",
    "HISTOGRAM_1D",
    "HISTOGRAM_2D",
    "HessMaxEV",
    "HessTrace",
    "InnerTest",
    "Loss",
    "LossOutliers",
    "MeanGSNR",
    "NormTest",
    "OrthoTest",
    "Output",
    "ParamAbsMax",
    "Parameters",
    "PreconditionedSharpness",
    "Quantity",
    "Ranks",
    "Request",
    "SCALAR",
    "SimpleNoiseScale",
    "Statistics",
    "StepData",
    "TENSORS",
    "TICDiag",
    "TICTrace",
    "Time",
    "TrueGradSqNorm",
    "TwoStepQuantity",
    "UpdateRatio",
    "UpdateSize",
    "per_parameter",
]
