"""``MemoryPlanner``: a Lightning callback that plans the batch at setup and logs memory drift.

    from lightning.pytorch import Trainer
    from memfit.lightning import MemoryPlanner

    trainer = Trainer(callbacks=[MemoryPlanner()])

For ``pytorch_lightning`` imports use ``memfit.pytorch_lightning.MemoryPlanner``.
"""

from __future__ import annotations

try:
    import lightning.pytorch as _pl
    from lightning.pytorch.callbacks import Callback
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("memfit.lightning needs Lightning: pip install 'memfit[lightning]'") from error

from memfit._lightning_base import MemoryPlannerBase

__all__ = ["MemoryPlanner"]

_DOC = """Plan micro batch, gradient accumulation and checkpointing before the first batch; log drift.

    At ``setup`` (stage ``"fit"``) the callback takes one batch from the train dataloader (or
    ``sample``): where the dataloader's ``collate_fn`` pads batches of a map-style dataset, the
    batch of its longest examples, since the longest batch makes the peak (``memfit.batch.longest_batch``).
    It traces two training steps of the real LightningModule (its ``training_step``, the
    first optimizer from ``configure_optimizers``, the trainer's precision) on fake tensors, and
    plans with ``memfit.plan``: the largest micro batch whose predicted peak fits the budget minus
    the margin, the accumulation that keeps the effective batch, and checkpointing only if needed.
    In ``mode="plan"`` it applies the plan: the micro batch through ``lightning_setattr`` on the
    module, its hparams or the datamodule (attribute ``batch_arg_name``, as ``BatchSizeFinder``),
    ``trainer.accumulate_grad_batches``, and checkpointing (Hugging Face models inside the module
    use their own switch; other modules get ``torch.utils.checkpoint`` around ``checkpoint_modules``
    or the longest list of identical blocks). In ``mode="observe"`` it changes nothing and only
    logs drift. Under DDP, the smallest free memory of all ranks is used, rank 0 decides and every
    rank applies the same plan. Sharding (FSDP, DeepSpeed, ``ModelParallelStrategy``) is not
    modelled yet, so under those strategies the callback warns and only observes.

    The trace follows the loop the step runs in: Lightning's closure zeroes gradients between
    ``training_step`` and ``backward``, so its forward carries the last step's gradients (memfit's
    recovering closure, ``on_oom="replan"``, zeroes them first instead and keeps an accumulation
    window's earlier batches to replay them); accumulation keeps gradients through a window; a
    ``DDPStrategy`` adds DDP's gradient buckets (see ``memfit.ddp``).

    The trace calls ``training_step`` on fake tensors (``torch._subclasses.fake_tensor.is_fake``
    tells them apart), with ``self.log`` silenced; Python side effects of ``training_step``
    (counters, lists) happen for those calls too.

    An out-of-memory error in a training step (``on_oom="replan"``, the default, also in observe
    mode) does not end the run: the failed batch is retried in chunks whose losses are weighted by
    their share of the batch, and later batches run in the same chunks, so the effective batch,
    the samples seen and the optimizer steps stay as configured (see ``memfit.recovery``). Each
    recovery is one warning with the old and new plan and the metrics ``memfit/oom_recoveries`` and
    ``memfit/micro_batch_size``; under DDP every rank takes the smallest chunk any rank needed.

    If the plan cannot be made (a model the trace cannot run, no batch-size attribute, ...), the
    callback warns once and training runs exactly as configured. A budget too small for
    ``min_batch_size`` even with checkpointing raises ``memfit.InsufficientMemoryError`` before
    training starts, with the numbers.

    Args:
        budget: memory per device: bytes, a size (``"20GiB"``) or a GPU name (``"h100"``). Default: the
            device's free memory at setup (CUDA) or the machine's available RAM (CPU).
        margin: fraction of the budget kept free (default 5 %).
        target_batch_size: effective batch to keep (micro x accumulation x devices). Default: the batch
            size configured x ``accumulate_grad_batches`` x world size. ``"max"``: the largest micro
            batch, no accumulation.
        batch_arg_name: attribute holding the batch size on the module, hparams or datamodule.
        allow_checkpointing: whether checkpointing may be turned on.
        checkpoint_modules: block classes or qualified names to checkpoint in plain (non-HF) modules.
        mode: ``"plan"`` to apply the plan, ``"observe"`` to only predict and log drift.
        sample: a batch (or callable ``batch_size -> batch``) to trace instead of the dataloader's.
        min_batch_size, max_batch_size: bounds on the micro batch.
        log_every_n_steps: drift logging cadence in optimizer steps (default: the trainer's).
        on_oom: ``"replan"`` to recover from out-of-memory errors in a step, ``"raise"`` to let them end the run.
        loss_reduction: how ``training_step``'s loss reduces a batch, ``"mean"`` (the usual) or ``"sum"``;
            it decides how chunk losses are weighted after a recovery.
        verbose: print the plan and the final drift line.

    Logged metrics (every ``log_every_n_steps`` and at the end of training, through
    ``trainer.loggers``, rank 0 only; peaks are per window, the counters reset after each read):

    * ``memfit/predicted_peak_allocated_bytes``: predicted ``max_memory_allocated`` (CPU: tensor bytes)
    * ``memfit/predicted_peak_reserved_bytes`` (CUDA): predicted ``max_memory_reserved``
    * ``memfit/measured_peak_allocated_bytes``, ``memfit/measured_peak_reserved_bytes`` (CUDA)
    * ``memfit/drift_allocated_pct``, ``memfit/drift_reserved_pct`` (CUDA): 100 x (measured - predicted) / predicted
    * ``memfit/measured_device_used_bytes`` (CUDA with ``nvidia-ml-py``): NVML used memory of the device
    * ``memfit/measured_peak_rss_bytes`` (CPU): the process's peak resident memory
    * ``memfit/measured_tensor_bytes_from_rss``, ``memfit/drift_rss_pct`` (CPU): RSS growth since training
      started plus the model's bytes, against the predicted tensor bytes (coarse)

    The plan is logged once as hyperparameters ``memfit/micro_batch_size``,
    ``memfit/accumulate_grad_batches``, ``memfit/gradient_checkpointing``, ``memfit/effective_batch_size``,
    ``memfit/target_batch_size``, ``memfit/predicted_peak_bytes``, ``memfit/budget_bytes``, ... Warnings
    (rank 0, once each): measured above predicted by more than the margin; peaks growing over three
    windows in a row (a leak), each with the step range, the figures and a metric
    (``memfit/alarm_over_margin``, ``memfit/alarm_leak``). The plan is saved in checkpoints and
    restored on resume.
    """


class MemoryPlanner(MemoryPlannerBase, Callback):
    __doc__ = _DOC
    _pl = _pl
