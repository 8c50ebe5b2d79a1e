"""The Hugging Face ``Trainer`` integration, at its public import path.

    from memfit.huggingface import attach

    trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
    attach(trainer, budget="h100")  # plans, applies the plan to the built Trainer, attaches
    trainer.train()

The implementation lives in :mod:`memfit.integrations.huggingface`.
"""

from __future__ import annotations

from memfit.integrations.huggingface.callback import MemoryPlannerCallback, attach
from memfit.integrations.huggingface.evaluation import predict_evaluation, predict_trainer_pass
from memfit.integrations.huggingface.planning import PLAN_FILE, PlannedArguments, plan_training_arguments
from memfit.tracing.batch import longest_examples

__all__ = [
    "PLAN_FILE",
    "MemoryPlannerCallback",
    "PlannedArguments",
    "attach",
    "longest_examples",
    "plan_training_arguments",
    "predict_evaluation",
    "predict_trainer_pass",
]
