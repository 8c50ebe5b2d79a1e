"""The Hugging Face ``Trainer`` integration, at its public import path.

    from memfit.huggingface import MemoryPlannerCallback, plan_training_arguments

The implementation lives in :mod:`memfit.integrations.huggingface`.
"""

from __future__ import annotations

from memfit.integrations.huggingface.trainer import (
    PLAN_FILE,
    MemoryPlannerCallback,
    PlannedArguments,
    longest_examples,
    plan_training_arguments,
    predict_evaluation,
    predict_trainer_pass,
)

__all__ = [
    "PLAN_FILE",
    "MemoryPlannerCallback",
    "PlannedArguments",
    "longest_examples",
    "plan_training_arguments",
    "predict_evaluation",
    "predict_trainer_pass",
]
