"""How memfit speaks: info lines on rank zero, one warning per problem, and a strict switch for tests.

memfit never lets its own failure end a training run: where a prediction, a measurement or a report
fails, the run goes on as configured and memfit says so once (:func:`degrade`). That leniency could
also hide a bug in memfit, so the environment variable

``MEMFIT_STRICT``
    ``1`` (or ``true``, ``yes``, ``on``) turns every such path into an error: :func:`degrade` raises
    :class:`~memfit.errors.StrictModeError` chained to the original exception instead of warning.
    Read at each call, so it can be set or unset while a process runs. memfit's test suite sets it.

Info lines go to the ``logging.getLogger("memfit")`` logger on rank 0 only (the rank from
``torch.distributed`` once it is initialised, else the ``RANK`` then ``LOCAL_RANK`` environment
variables, else 0). As Lightning does for its own logger, memfit's prints its INFO lines to stderr
when the application has configured no logging at all (the root logger has no handler); once it
has, they propagate to it like any library's. Warnings are ``UserWarning`` (one per key),
so the usual ``warnings`` filters apply.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

from memfit.errors import StrictModeError

__all__ = [
    "STRICT_ENV",
    "degrade",
    "forget_warnings",
    "info",
    "is_rank_zero",
    "is_strict",
    "logger",
    "raise_if_strict",
    "rank",
    "warn_once",
]

STRICT_ENV = "MEMFIT_STRICT"
_TRUE = ("1", "true", "yes", "on")

logger = logging.getLogger("memfit")
if not logging.getLogger().hasHandlers():  # an application without logging set up still sees the plan
    logger.addHandler(logging.StreamHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False

_warned: set[str] = set()  # keys warned in this process, for callers that hold no set of their own


def rank() -> int:
    """This process's global rank: from ``torch.distributed`` when initialised, else ``RANK`` / ``LOCAL_RANK``
    (set by torchrun and Lightning before the process group exists), else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def is_rank_zero() -> bool:
    return rank() == 0


def is_strict() -> bool:
    """Whether ``MEMFIT_STRICT`` is on now (read at each call, never cached)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in _TRUE


def info(message: str) -> None:
    """Log ``message`` at INFO on the ``memfit`` logger, on rank 0 only (every rank would repeat it)."""
    if is_rank_zero():
        logger.info(message)


def warn_once(
    key: str, message: str, *, seen: set[str] | None = None, all_ranks: bool = False, stacklevel: int = 2
) -> bool:
    """Issue ``message`` as a ``UserWarning`` the first time ``key`` comes up; return whether it was issued.

    ``seen`` is the set of keys already warned, held by the object whose run it is (a callback, a
    recovery) so that a second run warns again; without one, the keys are remembered for the
    process. Only rank 0 warns unless ``all_ranks`` (for a problem that may hit one rank alone).
    ``stacklevel`` counts as for :func:`warnings.warn` called where ``warn_once`` is called.
    """
    registry = _warned if seen is None else seen
    if key in registry or not (all_ranks or is_rank_zero()):
        return False
    registry.add(key)
    warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)
    return True


def degrade(
    message: str,
    error: BaseException,
    *,
    key: str | None = None,
    seen: set[str] | None = None,
    quiet: bool = False,
    all_ranks: bool = False,
    stacklevel: int = 2,
) -> None:
    """The one way memfit goes on after ``error``: say ``message`` once, or raise under ``MEMFIT_STRICT``.

    Call it in the ``except`` block, then take the fallback. Strict: raises
    :class:`~memfit.errors.StrictModeError` with ``message``, chained to ``error``, on every rank.
    Otherwise: a ``UserWarning`` once per ``key`` (default: the message, see :func:`warn_once`), or an
    info line when ``quiet`` (only a check is lost, the run is as the user configured it); the
    traceback goes to the ``memfit`` logger at DEBUG.
    """
    if is_strict():
        raise StrictModeError(f"{message} [raised because {STRICT_ENV}=1; unset it to warn and go on]") from error
    logger.debug(message, exc_info=error)
    if quiet:
        info(message)
    else:
        warn_once(key or message, message, seen=seen, all_ranks=all_ranks, stacklevel=stacklevel + 1)


def raise_if_strict(message: str, error: BaseException) -> None:
    """Under ``MEMFIT_STRICT`` raise as :func:`degrade` does; otherwise nothing (the caller reports the
    failure once, itself, e.g. after every rank has learned of it)."""
    if is_strict():
        raise StrictModeError(f"{message} [raised because {STRICT_ENV}=1; unset it to warn and go on]") from error


def forget_warnings() -> None:
    """Forget the process-wide keys :func:`warn_once` remembers (tests that expect a warning again)."""
    _warned.clear()
