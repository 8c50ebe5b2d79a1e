"""memfit: predict the peak GPU memory of a PyTorch training step, and pick the batch size that fits."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from memfit.categories import Category, Phase
from memfit.errors import (
    EstimationError,
    InsufficientMemoryError,
    InvalidInputError,
    MemfitError,
    TraceError,
    UnrecoverableOutOfMemoryError,
    ValueDependentError,
)
from memfit.planning.planner import Plan, plan
from memfit.precision import Precision
from memfit.prediction.estimator import BatchPeak, MemoryEstimate, PhaseModel, estimate
from memfit.prediction.evaluation import EvaluationPeak, evaluation_peak
from memfit.prediction.formula import FormulaEstimate, estimate_from_counts
from memfit.simulation.replay import PhasePeak
from memfit.simulation.runtime import CudaRuntime
from memfit.tracing.config import Target, TrainingLoop
from memfit.tracing.ddp import DDPConfig
from memfit.tracing.sharding import ShardingConfig
from memfit.units import format_bytes, parse_bytes

try:
    __version__ = version("memfit")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "BatchPeak",
    "Category",
    "CudaRuntime",
    "DDPConfig",
    "EstimationError",
    "EvaluationPeak",
    "FormulaEstimate",
    "InsufficientMemoryError",
    "InvalidInputError",
    "MemfitError",
    "MemoryEstimate",
    "Phase",
    "PhaseModel",
    "PhasePeak",
    "Plan",
    "Precision",
    "ShardingConfig",
    "Target",
    "TraceError",
    "TrainingLoop",
    "UnrecoverableOutOfMemoryError",
    "ValueDependentError",
    "__version__",
    "estimate",
    "estimate_from_counts",
    "evaluation_peak",
    "format_bytes",
    "parse_bytes",
    "plan",
]
