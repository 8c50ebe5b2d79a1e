"""Replay the traced storage log through a model of the CUDA caching allocator."""
