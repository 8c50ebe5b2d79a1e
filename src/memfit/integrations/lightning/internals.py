"""Every Lightning private attribute memfit uses, in one place, with the versions it is tested on.

Lightning has no public way to read the train dataloader before ``fit_loop.run`` builds it, to
normalise what ``configure_optimizers`` returns, or to run a training step's forward and backward
in chunks (the out-of-memory recovery: ``RecoveringStep`` replaces the loop's closure step). The
callback reaches those through this module only.

Tested on lightning / pytorch_lightning ``TESTED_VERSIONS`` (``benchmarks/compat.sh`` runs the
oldest and the newest). On any other version ``untested_version`` says so; the callback then warns
once and leaves the out-of-memory recovery off (the step is the part that reaches deepest into the
loop), and each planning read that fails degrades to one warning with the run untouched.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from memfit.run.recovery import OOMRecovery, chunk_runner

__all__ = ["TESTED_VERSIONS", "LightningInternals", "RecoveringStep"]

# (major, minor) releases whose private loop attributes this module was tested against
TESTED_VERSIONS = ((2, 4), (2, 5), (2, 6))
_RECOVERY_NEEDS = ("_make_closure", "_make_backward_fn", "_make_zero_grad_fn", "_training_step")


class LightningInternals:
    """The private reads and writes of one Lightning namespace (``lightning.pytorch`` or ``pytorch_lightning``)."""

    def __init__(self, pl: ModuleType) -> None:
        self.pl = pl

    # ---------------------------------------------------------------- version
    def untested_version(self) -> str | None:
        """A sentence when this Lightning release is not one memfit was tested on, else ``None``."""
        version = str(getattr(self.pl, "__version__", "0"))
        try:
            major, minor = (int(part) for part in version.split(".")[:2])
        except ValueError:
            return f"memfit cannot tell which Lightning release {version!r} is"
        if (major, minor) in TESTED_VERSIONS:
            return None
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED_VERSIONS)
        return f"memfit was tested on Lightning {tested}, not {version}"

    # ------------------------------------------------------------ data, setup
    def train_dataloader(self, trainer: Any) -> Any:
        """The train dataloader, built from its source as ``fit_loop.setup_data`` will build it."""
        return trainer.fit_loop._data_source.dataloader()

    def val_dataloaders(self, trainer: Any) -> Any:
        """The validation dataloader(s), or ``None`` when the fit defines none."""
        source = trainer.fit_loop.epoch_loop.val_loop._data_source
        return source.dataloader() if source.is_defined() else None

    def forget_train_loader(self, trainer: Any) -> None:
        """Make the loop rebuild its loader with the new batch size (something, such as
        ``estimated_stepping_batches``, may have built it already)."""
        if getattr(trainer.fit_loop, "_combined_loader", None) is not None:
            trainer.fit_loop._combined_loader = None

    def ddp_kwargs(self, strategy: Any) -> dict[str, Any] | None:
        """The keyword arguments a ``DDPStrategy`` passes to ``DistributedDataParallel``."""
        return getattr(strategy, "_ddp_kwargs", None)

    def fsdp_checkpointing(self, strategy: Any) -> tuple[bool, tuple[type, ...] | None]:
        """Whether an ``FSDPStrategy`` checkpoints activations itself, and the block classes it wraps
        when its policy names them (a ``{classes}`` set or a ``ModuleWrapPolicy``; ``None`` for a
        ``check_fn`` or another policy, whose blocks cannot be read)."""
        kwargs = getattr(strategy, "_activation_checkpointing_kwargs", None) or {}
        if not kwargs:
            return False, None
        classes = getattr(kwargs.get("auto_wrap_policy"), "_module_classes", None)
        return True, tuple(classes) if classes else None

    def fsdp_wrap_classes(self, strategy: Any) -> tuple[type, ...] | None:
        """The block classes an ``FSDPStrategy``'s ``auto_wrap_policy`` makes units of, when it names them."""
        policy = (getattr(strategy, "kwargs", None) or {}).get("auto_wrap_policy")
        classes = getattr(policy, "_module_classes", None)  # a {classes} set becomes a ModuleWrapPolicy
        return tuple(classes) if classes else None

    def logging_step(self, trainer: Any) -> int:
        """The step Lightning logs the module's own metrics at during fit (its logger connector uses the
        epoch loop's ``_batches_that_stepped``, one behind ``global_step`` in ``on_train_batch_end``), so
        memfit's keys sit on the same steps as the user's ``train_loss``."""
        stepped = getattr(
            getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "_batches_that_stepped", None
        )
        return int(stepped) if isinstance(stepped, int) else int(trainer.global_step)

    def record_initial_hparam(self, trainer: Any, pl_module: Any, name: str, value: Any) -> None:
        """Make the hyperparameters Lightning logs (``hparams_initial``: a copy taken by
        ``save_hyperparameters``, written to ``hparams.yaml`` and the loggers after ``setup``) show ``value`` for
        ``name`` where they hold it, as the module's ``hparams`` already do."""
        datamodule = getattr(trainer, "datamodule", None)
        for holder in (pl_module, datamodule):
            initial = getattr(holder, "_hparams_initial", None)
            if initial is not None and name in initial:
                initial[name] = value

    def optimizers(self, pl_module: Any) -> list[torch.optim.Optimizer]:
        """The torch optimizers ``configure_optimizers`` returns, in whatever form it returns them."""
        optimizers, _schedulers = self.pl.core.optimizer._init_optimizers_and_lr_schedulers(pl_module)
        return [getattr(o, "_optimizer", o) for o in optimizers]  # LightningOptimizer wraps the torch one

    @contextlib.contextmanager
    def device_reported_as(self, module: Any, device: torch.device) -> Iterator[None]:
        """``self.device`` answers the training device (the strategy moves the module only after setup)."""
        had = "_device" in vars(module)
        previous = vars(module).get("_device")
        module._device = device
        try:
            yield
        finally:
            if had:
                module._device = previous
            else:
                vars(module).pop("_device", None)

    # ------------------------------------------------------------- the step
    def recovery_supported(self, trainer: Any) -> str | None:
        """Why the chunked step cannot be installed in this trainer's loop, or ``None`` if it can."""
        untested = self.untested_version()
        if untested is not None:
            return untested
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        missing = [name for name in _RECOVERY_NEEDS if not hasattr(loop, name)]
        return f"this Lightning's training loop has no {', '.join(missing)}" if missing else None

    def install_step(self, trainer: Any, step: Callable[[Any, Any, int], Any]) -> None:
        """Build each training closure around ``step(kwargs, optimizer, batch_idx)``."""
        automatic = self._automatic()
        trainer.fit_loop.epoch_loop.automatic_optimization._make_closure = lambda kwargs, optimizer, batch_idx: (
            automatic.Closure(step_fn=lambda: step(kwargs, optimizer, batch_idx))
        )

    def uninstall_step(self, trainer: Any) -> None:
        """The loop's own closure again."""
        vars(trainer.fit_loop.epoch_loop.automatic_optimization).pop("_make_closure", None)

    def zero_grad_and_backward(self, trainer: Any, batch_idx: int, optimizer: Any) -> tuple[Any, Any]:
        """The loop's ``zero_grad`` for this batch (``None`` inside a window) and its backward function."""
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        return loop._make_zero_grad_fn(batch_idx, optimizer), loop._make_backward_fn(optimizer)

    def loop_training_step(self, trainer: Any, kwargs: Any) -> Any:
        """``training_step`` through the strategy (the DDP wrapper), as the loop runs it."""
        return trainer.fit_loop.epoch_loop.automatic_optimization._training_step(kwargs)

    def bare_training_step(self, trainer: Any, pl_module: Any, kwargs: Any) -> Any:
        """``training_step`` on the bare module (no collective), with ``self.log`` working."""
        previous, pl_module._current_fx_name = pl_module._current_fx_name, "training_step"
        try:
            with trainer.strategy.precision_plugin.train_step_context():
                output = pl_module.training_step(*kwargs.values())
        finally:
            pl_module._current_fx_name = previous
        return self._automatic().ClosureResult.from_training_step_output(output, trainer.accumulate_grad_batches)

    def closure_result(self, loss: Any = None, extra: Any = None) -> Any:
        result = self._automatic().ClosureResult
        return result(None) if loss is None else result(loss, extra=extra or {})

    def should_accumulate(self, trainer: Any) -> bool:
        """Whether this batch's backward skips the gradient all-reduce (not the window's last)."""
        return trainer.fit_loop._should_accumulate()

    def _automatic(self) -> Any:
        return importlib.import_module(f"{self.pl.__name__}.loops.optimization.automatic")


class RecoveringStep:
    """The training step the loop runs while memfit recovers from out-of-memory errors, in place of its closure
    step (``LightningInternals.install_step``): zero grad (first micro batch of a window), then forward and
    backward of each chunk of the batch through ``OOMRecovery``, so a batch that runs out of memory is run again
    in smaller ones. ``closure_finished``: whether the last step's closure ran to its end (an out-of-memory error
    after it came from the optimizer step, which no chunking helps)."""

    def __init__(self, trainer: Any, pl_module: Any, internals: LightningInternals, recovery: OOMRecovery) -> None:
        self.trainer, self.pl_module, self.internals, self.recovery = trainer, pl_module, internals, recovery
        self.closure_finished = False

    def __call__(self, kwargs: Any, optimizer: Any, batch_idx: int) -> Any:
        trainer, internals, recovery = self.trainer, self.internals, self.recovery
        self.closure_finished = False
        if batch_idx % trainer.accumulate_grad_batches == 0:
            recovery.start_window()
        zero_grad, backward = internals.zero_grad_and_backward(trainer, batch_idx, optimizer)
        if zero_grad is not None:
            zero_grad()
        strategy = trainer.strategy
        wrapper = strategy.model if strategy.model is not self.pl_module else None
        run_chunk = chunk_runner(wrapper, through_wrapper=self._chunk_step(kwargs, backward, True),
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
        trainer, internals, recovery = self.trainer, self.internals, self.recovery

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
