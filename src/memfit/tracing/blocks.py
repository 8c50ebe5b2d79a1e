"""Know which of a model's repeated blocks each event of a trace happened in.

A deep model's step repeats one block's work at every depth: in forward (block after block), in backward
(in reverse) and in the optimizer step (parameter by parameter, in the blocks' order). Recording which block
each allocation and free belongs to lets ``memfit.tracing.depth`` build the log of a deeper model from a
shallow one's, by repeating one block's events, instead of tracing every block.

Forward: hooks on each block set the running block; what happens after a block until the next one starts,
or the model's call returns, is the block's too. Backward: a hook on a block's output gradient marks
where its backward starts, one on its input gradient where it ends (the autograd engine runs the blocks'
backward one after another, last block first; a checkpointed block recomputes inside its own). The
optimizer step runs no module: a storage made there belongs to the block of the tensor it was made from
(``StorageRecorder.derived_from``), and a parameter's state to its parameter's block
(``StorageRecorder.claim``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memfit.categories import Phase
from memfit.tracing.recorder import StorageRecorder

__all__ = ["BlockContext", "storage_blocks", "tensor_blocks"]


def tensor_blocks(blocks: Sequence[nn.Module]) -> dict[int, int]:
    """``id(tensor) -> block number`` (from 1) for the parameters and buffers of each block."""
    owner: dict[int, int] = {}
    for number, block in enumerate(blocks, start=1):
        for tensor in [*block.parameters(), *block.buffers()]:
            owner.setdefault(id(tensor), number)
    return owner


class BlockContext:
    """Set ``recorder.current_block`` to the block running, in forward and backward."""

    def __init__(self, blocks: Sequence[nn.Module], recorder: StorageRecorder) -> None:
        self._blocks, self._recorder = list(blocks), recorder
        self._stack: list[int | None] = []  # the block each running block was entered from (None: none)
        self._inside: int | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> BlockContext:
        for number, block in enumerate(self._blocks, start=1):
            self._handles.append(
                block.register_forward_pre_hook(functools.partial(self._enter, number), with_kwargs=True)
            )
            self._handles.append(block.register_forward_hook(functools.partial(self._leave, number), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._recorder.current_block = None

    def _in_forward(self) -> bool:
        # a checkpointed block recomputes its forward inside backward: no hooks for a backward that never comes
        return torch.is_grad_enabled() and self._recorder.current_phase is Phase.FORWARD

    def _recomputing(self, number: int) -> bool:
        # A checkpointed block recomputing its forward inside its own backward: that backward is the block
        # running. The recomputation may stop early (non-reentrant checkpointing stops once it has what backward
        # needs), so the block's forward hook may never come: nothing is pushed that its pop would have to undo.
        if self._recorder.current_phase is Phase.FORWARD:
            return False
        self._recorder.current_block = number
        return True

    def _enter(self, number: int, _module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._recomputing(number):
            return
        self._stack.append(self._inside)
        self._inside = self._recorder.current_block = number
        if self._in_forward():
            tensor = _first_needing_grad((args, kwargs))
            if tensor is not None:
                tensor.register_hook(functools.partial(self._input_gradient, number))

    def _leave(self, number: int, _module: nn.Module, _args: Any, _kwargs: Any, output: Any) -> None:
        # What happens between this block and the next (the block before's output freed once this one's
        # replaces it, under no_grad) is this block's doing; the tracer ends it when the model's call returns.
        if self._recomputing(number):
            return
        self._inside = self._stack.pop() if self._stack else None
        self._recorder.current_block = self._inside if self._inside is not None else number
        if self._in_forward():
            tensor = _first_needing_grad(output)
            if tensor is not None:
                tensor.register_hook(functools.partial(self._output_gradient, number))

    def _output_gradient(self, number: int, _grad: torch.Tensor) -> None:
        self._recorder.current_block = number  # the block's backward starts

    def _input_gradient(self, number: int, _grad: torch.Tensor) -> None:
        # The block's backward is done. Its input is the block before's output, whose own hook (registered
        # first, so run first) may already have started that block's backward: leave it running.
        if self._recorder.current_block == number:
            self._recorder.current_block = None


def _first_needing_grad(values: Any) -> torch.Tensor | None:
    if hasattr(values, "to_tuple") and callable(values.to_tuple):  # a transformers ModelOutput
        values = values.to_tuple()
    for item in tree_flatten(values)[0]:
        if isinstance(item, torch.Tensor) and item.requires_grad and item.is_floating_point():
            return item
    return None


def storage_blocks(recorder: StorageRecorder) -> dict[int, int | None]:
    """``storage id -> block`` (``None``: outside every block) for every storage of a trace that recorded blocks:
    the block running when it was allocated, else the block of the storage it was claimed by or made from."""
    if recorder.event_blocks is None:
        raise ValueError("the trace did not record blocks")
    at_allocation: dict[int, int | None] = {}
    for event, block in zip(recorder.events, recorder.event_blocks, strict=True):
        if event > 0:
            at_allocation[event] = block
    resolved: dict[int, int | None] = {}

    def block_of(sid: int) -> int | None:
        seen = []
        while sid not in resolved:
            seen.append(sid)
            block = at_allocation.get(sid)
            if block is not None:
                resolved[sid] = block
                break
            source = recorder.claimed_by.get(sid, recorder.derived_from.get(sid))
            if source is None or source in seen:
                resolved[sid] = None
                break
            sid = source
        result = resolved[sid]
        for visited in seen:
            resolved[visited] = result
        return result

    return {sid: block_of(sid) for sid in at_allocation}
