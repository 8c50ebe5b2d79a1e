"""``python -m memfit``: the same command line as the ``memfit`` console script."""

from __future__ import annotations

from memfit.cli.entry import console

if __name__ == "__main__":
    console()
