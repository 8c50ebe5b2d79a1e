"""The rich console the command line prints its tables with."""

from __future__ import annotations

from typing import Any

from rich.console import Console

__all__ = ["stdout_console"]


class _Console(Console):
    """rich's console, but a closed pipe (``memfit plan ... | head``) reaches ``memfit.cli.main.main`` as
    ``BrokenPipeError``, which ends every subcommand the same quiet way, instead of rich's own exit."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def stdout_console(**options: Any) -> Console:
    """A console on standard output (``options`` as ``rich.console.Console`` takes them). Emoji codes are off: the
    tables print names the user wrote (``mymod:factory:`` would otherwise render ``:factory:`` as an emoji)."""
    return _Console(**{"emoji": False, **options})
