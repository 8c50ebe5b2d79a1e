"""From an estimate and a capacity to a Plan: micro batch, accumulation, checkpointing, and why."""
