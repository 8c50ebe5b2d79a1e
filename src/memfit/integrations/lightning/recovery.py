"""The training step Lightning's loop runs while memfit recovers from out-of-memory errors.

``MemoryPlannerBase`` installs it in place of the loop's closure step (``LightningInternals.install_step``): the
batch runs through ``OOMRecovery`` in chunks, so a batch that runs out of memory is run again in smaller ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memfit.integrations.lightning.internals import LightningInternals
from memfit.monitoring.controller import RunController

__all__ = ["RecoveringStep"]


class RecoveringStep:
    """Zero grad (first micro batch of a window), then forward and backward of each chunk of the batch.

    ``closure_finished`` says whether the last step's closure ran to its end: an out-of-memory error after it
    came from the optimizer step, which no chunking helps."""

    def __init__(self, trainer: Any, pl_module: Any, internals: LightningInternals, controller: RunController) -> None:
        self.trainer = trainer
        self.pl_module = pl_module
        self.internals = internals
        self.controller = controller
        self.closure_finished = False

    def __call__(self, kwargs: Any, optimizer: Any, batch_idx: int) -> Any:
        trainer, internals, recovery = self.trainer, self.internals, self.controller.recovery
        self.closure_finished = False
        if batch_idx % trainer.accumulate_grad_batches == 0:
            recovery.start_window()
        zero_grad, backward = internals.zero_grad_and_backward(trainer, batch_idx, optimizer)
        if zero_grad is not None:
            zero_grad()
        strategy = trainer.strategy
        wrapper = strategy.model if strategy.model is not self.pl_module else None
        run_chunk = RunController.chunk_runner(wrapper, through_wrapper=self._chunk_step(kwargs, backward, True),
                                               bare=self._chunk_step(kwargs, backward, False))  # fmt: skip
        sync = not internals.should_accumulate(trainer)
        done = [r for r in recovery.run_batch(kwargs["batch"], run_chunk, step=trainer.global_step, sync=sync) if r]
        self.closure_finished = True
        if not done:
            return internals.closure_result()
        return internals.closure_result(sum(loss for loss, _ in done), extra=done[-1][1])

    def _chunk_step(
        self, kwargs: Any, backward: Callable[[Any], Any] | None, through_wrapper: bool
    ) -> Callable[[Any, float], Any]:
        """``run(chunk, weight)``: the training step on one chunk, its loss weighted, and its backward; through the
        strategy's wrapper (DDP's, with its all-reduce) or on the bare module."""
        trainer, internals, recovery = self.trainer, self.internals, self.controller.recovery

        def run(chunk: Any, weight: float) -> Any:
            step_kwargs = kwargs.copy()
            step_kwargs["batch"] = chunk
            if through_wrapper:  # the strategy (the DDP wrapper): its all-reduce
                result = internals.loop_training_step(trainer, step_kwargs)
            else:
                result = internals.bare_training_step(trainer, self.pl_module, step_kwargs)
            if result.closure_loss is None:
                return None
            loss = result.closure_loss * weight if weight != 1.0 else result.closure_loss
            recovery.backward_started()
            if backward is not None:
                backward(loss)
            return loss.detach(), result.extra

        return run
