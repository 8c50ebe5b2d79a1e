"""From the replayed trace to a MemoryEstimate (and the formula tier, evaluation and host RAM)."""
