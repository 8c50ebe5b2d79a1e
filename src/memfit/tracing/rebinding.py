"""Replace a library function for the length of a trace in every module that imported it by name.

``from transformers.utils import is_torchdynamo_compiling`` copies the function into the importing module, so
replacing it where it is defined changes nothing for the callers; each module that holds it is rebound, and
restored afterwards.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["rebound"]


@contextlib.contextmanager
def rebound(name: str, original: Callable[..., Any], replacement: Callable[..., Any]) -> Iterator[None]:
    """``replacement`` for ``original`` under ``name`` in every loaded module that holds it, restored on exit."""
    # a module's own namespace only: getattr on transformers' lazy modules would import their submodules
    bound = [
        module
        for module in list(sys.modules.values())
        if isinstance(getattr(module, "__dict__", None), dict) and module.__dict__.get(name) is original
    ]
    for module in bound:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module in bound:
            setattr(module, name, original)
