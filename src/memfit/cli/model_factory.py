"""``--loss MODULE:FUNCTION``: the loss of a ``--model`` factory's module whose forward returns logits.

The library takes ``loss_fn(output, batch) -> scalar loss``; the command line names such a function in the
user's code, loads it as ``--model`` loads its factory, and has every factory the plan loads return that loss
(``memfit.presets.factory_loss``). The trace's advice to pass ``loss_fn=`` is said as ``--loss`` here.
"""

from __future__ import annotations

import argparse
import functools
import inspect
from collections.abc import Callable
from typing import Any

from memfit.errors import InvalidInputError
from memfit.presets import LossFn, factory_loss, load_attribute

__all__ = ["LOSS_ADVICE", "add_loss_option", "cli_advice", "load_loss", "with_loss"]

LOSS_ADVICE = "--loss MODULE:FUNCTION (a function(output, batch) that returns the scalar loss)"

# The library's advice, as the trace errors word it, and the command line's for the same thing.
_LIBRARY_ADVICE = {
    "loss_fn=lambda output, batch: <scalar loss>": LOSS_ADVICE,
    "a forward_fn/loss_fn that avoids it": "a --loss function that avoids it",
}


def add_loss_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--loss", metavar="MODULE:FUNCTION", help="with --model: the loss of a module whose forward "
                        "does not return one; function(output, batch) -> scalar loss, called with what the module "
                        "returned and its batch")  # fmt: skip


def with_loss(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``handler`` run with the loss ``--loss`` names set for every ``--model`` factory it loads."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        target = getattr(args, "loss", None)
        if not target:
            return handler(args)
        if not getattr(args, "model", None):
            raise InvalidInputError(
                f"--loss {target} goes with --model; a --hf-config model computes its own loss from the labels in "
                "its sample"
            )
        with factory_loss(load_loss(target), target):
            return handler(args)

    return run


def load_loss(target: str) -> LossFn:
    """The function ``module.path:function`` names, checked to take ``(output, batch)``; each way it can be
    wrong said in one line naming ``target``."""
    function = load_attribute(target, "--loss", "function")
    if not callable(function):
        raise InvalidInputError(
            f"--loss {target} is {type(function).__name__}, not a function: --loss names a function(output, batch) "
            "that returns the scalar loss"
        )
    _check_takes_output_and_batch(function, target)
    return function  # type: ignore[no-any-return]


def cli_advice(message: str) -> str:
    """A trace error's advice to pass ``loss_fn=``, said as the command line's ``--loss``."""
    for library, cli in _LIBRARY_ADVICE.items():
        message = message.replace(library, cli)
    return message


def _check_takes_output_and_batch(function: Callable[..., Any], target: str) -> None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to read (a builtin): calling it tells
        return
    try:
        signature.bind(None, None)
    except TypeError:
        parameters = ", ".join(signature.parameters) or "nothing"
        raise InvalidInputError(
            f"--loss {target} takes ({parameters}), but memfit calls it with two arguments, (output, batch): what "
            "the module returned and the batch it was called with"
        ) from None


def _said(error: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    detail = " ".join(str(error).split())
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__
