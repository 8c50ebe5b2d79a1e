"""memfit: predict the peak GPU memory of a PyTorch training step, and pick the batch size that fits."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from memfit.prediction.estimator import BatchPeak, MemoryEstimate, PhaseModel, StepCurve, estimate, trace
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

# Each public name and the module it comes from, imported when first used: ``import memfit`` alone does not import
# torch, so the command line answers a question it has answered before without it (``memfit.cli.answers``).
_EXPORTS = {
    "Category": "memfit.categories",
    "Phase": "memfit.categories",
    "EstimationError": "memfit.errors",
    "InsufficientMemoryError": "memfit.errors",
    "InvalidInputError": "memfit.errors",
    "MemfitError": "memfit.errors",
    "TraceError": "memfit.errors",
    "UnrecoverableOutOfMemoryError": "memfit.errors",
    "ValueDependentError": "memfit.errors",
    "Plan": "memfit.planning.planner",
    "plan": "memfit.planning.planner",
    "Precision": "memfit.precision",
    "BatchPeak": "memfit.prediction.estimator",
    "MemoryEstimate": "memfit.prediction.estimator",
    "PhaseModel": "memfit.prediction.estimator",
    "StepCurve": "memfit.prediction.estimator",
    "estimate": "memfit.prediction.estimator",
    "trace": "memfit.prediction.estimator",
    "EvaluationPeak": "memfit.prediction.evaluation",
    "evaluation_peak": "memfit.prediction.evaluation",
    "FormulaEstimate": "memfit.prediction.formula",
    "estimate_from_counts": "memfit.prediction.formula",
    "PhasePeak": "memfit.simulation.replay",
    "CudaRuntime": "memfit.simulation.runtime",
    "Target": "memfit.tracing.config",
    "TrainingLoop": "memfit.tracing.config",
    "DDPConfig": "memfit.tracing.ddp",
    "ShardingConfig": "memfit.tracing.sharding",
    "format_bytes": "memfit.units",
    "parse_bytes": "memfit.units",
}

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
    "StepCurve",
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
    "trace",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
