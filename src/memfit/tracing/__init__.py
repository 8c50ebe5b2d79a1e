"""Trace one training step on fake tensors: a log of every storage, by category and phase."""
