"""memfit in a custom Hugging Face ``accelerate`` loop, at its public import path.

    from memfit.accelerate import MemoryPlanner

    planner = MemoryPlanner(accelerator, budget="h100")
    loader = planner.plan(model, optimizer, loader)  # before accelerator.prepare
    ...                                              # planner.step_end() after each optimizer step
    planner.end()

The implementation lives in :mod:`memfit.integrations.accelerate`.
"""

from __future__ import annotations

try:
    import accelerate as _accelerate  # noqa: F401  (the loop's own; memfit only reads it)
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("memfit.accelerate needs accelerate: pip install 'memfit[hf]'") from error

from memfit.integrations.accelerate import MemoryPlanner

__all__ = ["MemoryPlanner"]
