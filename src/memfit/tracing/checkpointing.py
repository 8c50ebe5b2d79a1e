"""Turn on activation (gradient) checkpointing for the trace, the way the user's stack would."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.errors import CheckpointingUnavailableError, InvalidInputError

__all__ = ["CheckpointTarget", "enable_checkpointing", "find_blocks"]

CheckpointTarget = Sequence[type | str]


def enable_checkpointing(
    model: nn.Module,
    modules: CheckpointTarget | None = None,
    *,
    recompute_context: Callable[[], AbstractContextManager[Any]] | None = None,
) -> str:
    """Enable checkpointing on ``model`` in place and say how. Inside a trace, call it within
    ``preserved_module_state``; in a real run it stays on.

    Hugging Face models, also when nested in another module (a LightningModule), use their own switch
    (``activation_checkpointing_enable`` in recent transformers, ``gradient_checkpointing_enable``
    in older ones), non-reentrant as transformers defaults to. Other modules get ``torch.utils.checkpoint``
    around each block: the classes or qualified names in ``modules``, or by default the children
    of the longest list of identical blocks. ``recompute_context`` makes a context the
    recomputation in backward runs under (the autograd engine does not carry torch-function modes
    into it).
    """
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if recompute_context is not None:
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), recompute_context())
    hf_models = _outermost(_supports_hf_checkpointing(m) for m in model.modules()) if modules is None else []
    if hf_models:
        for hf_model in hf_models:
            enable = getattr(hf_model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs=kwargs)
            else:
                hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        names = ", ".join(sorted({type(m).__name__ for m in hf_models}))
        return f"{names}'s own checkpointing (non-reentrant)"
    blocks = find_blocks(model, modules)
    for block in blocks:
        if _is_checkpointed(block):
            continue  # asked twice (a plan, then an out-of-memory recovery): wrap once
        block.forward = functools.partial(_checkpointed, block.forward, kwargs)  # type: ignore[method-assign]
    kinds = Counter(type(b).__name__ for b in blocks)
    return "torch.utils.checkpoint around " + ", ".join(f"{n} x {k}" for k, n in kinds.items())


def _is_checkpointed(block: nn.Module) -> bool:
    forward = vars(block).get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed


def _checkpointed(forward: Any, options: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, **options, **kwargs)


def find_blocks(model: nn.Module, modules: CheckpointTarget | None = None) -> list[nn.Module]:
    """The submodules to checkpoint: outermost matches only, so no block is checkpointed twice."""
    if modules is not None:
        types = tuple(m for m in modules if isinstance(m, type))
        names = {m for m in modules if isinstance(m, str)}
        chosen = [
            module
            for name, module in model.named_modules()
            if name and (isinstance(module, types) or name in names or type(module).__name__ in names)
        ]
        if not chosen:
            raise InvalidInputError(
                f"checkpoint_modules={list(modules)!r} matches no submodule of {type(model).__name__}; "
                "give block classes, class names or qualified names from model.named_modules()"
            )
    else:
        chosen = _longest_repeated_blocks(model)
        if not chosen:
            raise CheckpointingUnavailableError(
                f"found no repeated blocks to checkpoint in {type(model).__name__}; "
                "pass checkpoint_modules=[YourBlockClass]"
            )
    return _outermost(chosen)


def _supports_hf_checkpointing(module: nn.Module) -> nn.Module | None:
    """A Hugging Face model (at any depth, e.g. inside a LightningModule) with its own switch."""
    supported = getattr(module, "supports_gradient_checkpointing", False) is True
    has_switch = hasattr(module, "activation_checkpointing_enable") or hasattr(module, "gradient_checkpointing_enable")
    return module if supported and has_switch else None


def _outermost(modules: Any) -> list[nn.Module]:
    """Drop modules that sit inside an earlier one (``model.modules()`` order is parents first)."""
    outermost: list[nn.Module] = []
    inside: set[int] = set()
    for module in modules:
        if module is None or id(module) in inside:
            continue
        outermost.append(module)
        inside.update(id(sub) for sub in module.modules())
    return outermost


def _longest_repeated_blocks(model: nn.Module) -> list[nn.Module]:
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            repeated = len(children) >= 2 and len({type(c) for c in children}) == 1
            if repeated and len(children) > len(best) and any(True for _ in children[0].parameters()):
                best = children
    return best
