"""The memfit command: ``memfit.cli.main.main(argv)`` runs it; ``memfit.cli.entry.console`` is the console script.

Nothing is imported here, so that a kept answer is replayed without importing the planner (``memfit.cli.entry``).
"""
