"""The memfit command."""

from memfit.cli.main import main

__all__ = ["main"]
