"""The Lightning callback (lightning and pytorch_lightning share it)."""
