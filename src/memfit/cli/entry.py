"""The ``memfit`` console script (and ``python -m memfit``), light enough to replay a kept answer at once.

A question answered before (``memfit.cli.answers``) is printed from its kept answer before anything heavy is
imported: not the planner, torch or transformers, which take seconds on a laptop and which the answer does not need.
Every other command line goes to :func:`memfit.cli.main.main`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, NoReturn

from memfit.cli import answers

__all__ = ["console", "reader_gone", "show_warning"]

_PACKAGE = Path(__file__).resolve().parents[1]


def console() -> NoReturn:
    """The ``memfit`` command: its kept answer, else ``main()``; then the process ends without the interpreter's
    teardown. Tearing down torch and transformers module by module takes longer than many answers (1.4 s of a 7 s
    question on a 2-core laptop), and nothing in it is the answer's: the output is flushed and the exit handlers
    run first, as at a normal exit. A process with other threads still running exits the normal way."""
    code = _kept(sys.argv[1:])
    if code is None:
        from memfit.cli.main import main

        code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # the reader went away, or the stream was closed
            stream.flush()
    if threading.active_count() > 1:
        raise SystemExit(code)
    atexit._run_exitfuncs()  # logging's shutdown and every library's own clean-up, as the interpreter runs them
    os._exit(code)


def _kept(argv: list[str]) -> int | None:
    """The exit code of ``argv``'s kept answer, printed; ``None`` when there is none (or it could not be read)."""
    answers.prepare_environment()
    shown_before, warnings.showwarning = warnings.showwarning, show_warning
    try:
        code = answers.replay_kept(argv)
        if code is not None:
            sys.stdout.flush()
        return code
    except BrokenPipeError:
        return reader_gone()
    finally:
        warnings.showwarning = shown_before


def reader_gone() -> int:
    """The command reading our output closed it (``memfit ... | head -1``): stop quietly, as a Unix tool ended by
    SIGPIPE does, with its exit status (128 + 13). Later writes, Python's own flush at exit included, go nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file (captured): nothing will flush it at exit
        pass
    return 128 + int(getattr(signal, "SIGPIPE", 13))


def show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                 line: str | None = None) -> None:  # fmt: skip
    """memfit's own warnings as one line, ``memfit: warning: ...``, as its errors are; other libraries' as Python
    shows them."""
    if Path(filename).resolve().is_relative_to(_PACKAGE):
        print(f"memfit: warning: {' '.join(str(message).split())}", file=file or sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
