"""memfit in a custom Hugging Face ``accelerate`` loop: plan before ``prepare``, measure while it trains.

A custom loop has no callbacks, so the port is the loop's own calls: ``planner.plan(...)`` on the model,
optimizer and dataloader before ``accelerator.prepare`` (it returns the dataloader at the planned micro batch,
with the same sampler, so the samples and their order stay the run's, and sets the accelerator's
accumulation), ``planner.step_end(step)`` after each optimizer step, ``planner.end()`` after training. The
controller (``memfit.run.controller.RunController``) measures, logs through ``accelerator.log`` and
warns; this module only reads the accelerator.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch.utils.data import DataLoader, Sampler

from memfit.errors import InvalidInputError
from memfit.planning.capacity import parse_budget
from memfit.planning.gpus import PlanningTarget, check_target, planning_target
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.planning.planner import Plan
from memfit.planning.run_options import RunOptions, check_flag, check_positive, last_window_warning
from memfit.precision import Precision
from memfit.reporting.figures import log_figure
from memfit.run.controller import ControlledRun, RunController
from memfit.run.port import RankZeroSpeaker, RunLayout, TrainingStep
from memfit.tracing.batch import dataset_length, is_stream, planning_batch
from memfit.tracing.checkpointing import CheckpointTarget, enable_checkpointing
from memfit.tracing.config import Target

__all__ = ["MemoryPlanner"]

# accelerate's ``mixed_precision`` names, as memfit's precisions
_PRECISIONS = {"no": Precision.FP32, "bf16": Precision.BF16_MIXED, "fp16": Precision.FP16_MIXED}
Value = TypeVar("Value")


class MemoryPlanner(ControlledRun):
    """Plan micro batch, accumulation and checkpointing for an ``accelerate`` loop, and log drift while it trains.

        accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
        planner = MemoryPlanner(accelerator, budget="h100")
        loader = planner.plan(model, optimizer, loader)  # before prepare
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for step, batch in enumerate(loader):
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                planner.step_end()
        planner.end()

    Args:
        accelerator: the loop's ``accelerate.Accelerator`` (its device, mixed precision, accumulation, trackers).
        budget, target, margin, target_batch_size, min_batch_size, max_batch_size, allow_checkpointing: as for
            the Lightning callback: memory per device (bytes, ``"20GiB"``, a GPU name; default the device's free
            memory), the device planned for, the margin, the effective batch to keep (default the loader's batch
            x the accelerator's accumulation x processes; ``"max"``), bounds on the micro batch, and whether
            checkpointing may be turned on.
        checkpoint_modules: block classes or qualified names to checkpoint, for a model whose repeated blocks
            memfit cannot find (Hugging Face models use their own switch).
        log_every_n_steps: optimizer steps per measured window.
        verbose: print the plan and the final drift line.
    """

    def __init__(
        self,
        accelerator: Any,
        *,
        budget: int | str | None = None,
        target: str | None = None,
        margin: float = DEFAULT_MARGIN,
        target_batch_size: int | Literal["max"] | None = None,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        allow_checkpointing: bool = True,
        checkpoint_modules: CheckpointTarget | None = None,
        log_every_n_steps: int = 10,
        verbose: bool = True,
    ) -> None:
        if not hasattr(accelerator, "gradient_accumulation_steps") or not hasattr(accelerator, "device"):
            raise InvalidInputError(f"MemoryPlanner takes an accelerate.Accelerator, got {type(accelerator).__name__}")
        options = RunOptions(margin, target_batch_size, min_batch_size, max_batch_size, allow_checkpointing)
        check_positive("log_every_n_steps", log_every_n_steps)
        check_flag("verbose", verbose)
        parse_budget(budget)  # a bad budget is named now, not when plan() runs
        self.accelerator, self.log_every_n_steps = accelerator, log_every_n_steps
        self.port = _AcceleratorPort(accelerator, budget, check_target(target, budget), checkpoint_modules)
        self.controller = self.port.controller = RunController(self.port, options=options, on_oom="raise",
                                                               verbose=verbose)  # fmt: skip
        self._steps = 0

    @property
    def planned(self) -> Plan | None:
        """The plan ``plan()`` applied."""
        return self.controller.plan

    def plan(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataloader: DataLoader,
        *,
        loss_fn: Any = None,
        forward_fn: Any = None,
        max_length: int | None = None,
    ) -> DataLoader:
        """Plan on the dataloader's longest batch and apply: returns the dataloader at the planned micro batch (same
        dataset, sampler and collate function), sets ``accelerator.gradient_accumulation_steps`` and turns on
        checkpointing in the model when needed. Call it before ``accelerator.prepare``. ``loss_fn(output, batch)``
        and ``forward_fn(model, batch)`` as for ``memfit.estimate``, for a model that does not return its loss; a
        stream is planned at the longest batch it can produce (``max_length``, the collator's, or the model's
        positions)."""
        _check_loader(dataloader)
        port = self.port
        port.model, port.optimizer, port.loader, port.loss_fn, port.forward_fn = (model, optimizer, dataloader,
                                                                                   loss_fn, forward_fn)  # fmt: skip
        port.max_length = max_length
        self.controller.plan_run(raise_errors=True)
        decision = self.controller.decision
        self.controller.start_measuring(predicted_allocated_bytes=decision.predicted_allocated_bytes,
                                        predicted_reserved_bytes=decision.predicted_reserved_bytes,
                                        traced=self.controller.traced)  # fmt: skip
        return port.loader

    def step_end(self, step: int | None = None) -> None:
        """After an optimizer step (``accelerator.sync_gradients``), on every process: every ``log_every_n_steps``
        the window's peaks go to the accelerator's trackers (``accelerator.log``)."""
        self._steps = self._steps + 1 if step is None else step
        self.controller.optimizer_step_ended(self._steps, every=self.log_every_n_steps)

    def end(self) -> None:
        """After training: the last window, the drift picture and the final line."""
        self.controller.training_ended(self._steps, speaker=self.accelerator.is_main_process)

    # ``accelerator.register_for_checkpointing(planner)`` saves the plan with the run; ``load_state`` before
    # ``plan()`` makes a resumed run keep it.
    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restored, planned = state.get("plan"), self.planned
        if planned is None:
            self.controller.restored = restored
            return
        keys = ("micro_batch_size", "accumulate_grad_batches", "gradient_checkpointing")
        if restored and any(planned.to_dict()[k] != restored[k] for k in keys):
            saved, chosen = Plan.from_dict(restored).summary(), planned.summary()
            self.controller.warn("late-restore", (
                f"memfit: the checkpoint's plan ({saved}) arrived after plan() chose another ({chosen}), which this "
                "run keeps: the dataloader is already batched. To resume with the saved plan, call "
                "accelerator.load_state(...) before planner.plan(...) too (it then restores the plan; the call after "
                "prepare restores the model and optimizer)."
            ))  # fmt: skip


class _AcceleratorPort(RankZeroSpeaker):
    """The accelerator's side of the run for ``RunController``: the loop's model, optimizer and dataloader."""

    loop_name = "accelerate"
    every_rank_decides = False

    def __init__(self, accelerator: Any, budget: Any, target: str | None, checkpoint_modules: Any) -> None:
        self.accelerator, self.budget, self.target, self.checkpoint_modules = accelerator, budget, target, \
            checkpoint_modules  # fmt: skip
        self.model: Any = None  # the loop's, given to plan()
        self.optimizer: Any = None
        self.loader: Any = None  # the loop's dataloader, then the planned one
        self.loss_fn: Any = None
        self.forward_fn: Any = None
        self.max_length: int | None = None
        self.controller: RunController | None = None

    def device(self) -> torch.device:
        return self.accelerator.device

    def world_size(self) -> int:
        return int(self.accelerator.num_processes)

    def rank(self) -> int:
        return int(self.accelerator.process_index)

    def accumulation(self) -> int:
        return int(self.accelerator.gradient_accumulation_steps)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(tensor)

    def broadcast(self, value: Value) -> Value:
        if self.world_size() <= 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]

    def planning_target(self) -> PlanningTarget:
        return planning_target(self.target, self.budget, self.device())

    def precision(self) -> Precision:
        return _PRECISIONS.get(str(self.accelerator.mixed_precision), Precision.FP32)

    def layout(self) -> RunLayout:
        return RunLayout(name="accelerate", data_parallel_size=self.world_size())

    def unplannable(self) -> str | None:
        return None

    def sample_batch(self, notes: list[str]) -> Any:
        return planning_batch(self.loader, self.model, notes, max_length=self.max_length)

    def configured_batch(self, sample: Any) -> int:
        return int(self.loader.batch_size)

    def training_samples(self) -> int | None:
        return dataset_length(self.loader.dataset)

    def training_step(self, sample: Any, target: Target, layout: RunLayout, notes: Sequence[str]) -> TrainingStep:
        return TrainingStep(self.model, sample, self.optimizer, self.precision(), target, forward_fn=self.forward_fn,
                            loss_fn=self.loss_fn, checkpoint_modules=self.checkpoint_modules, notes=notes)  # fmt: skip

    def evaluation(self, training: Any) -> None:
        return None  # the loop's evaluation is the user's own code

    def apply(self, plan: Plan) -> bool:
        """The accelerator's accumulation, checkpointing in the model, and the loader at the planned micro batch."""
        loader, ranks = self.loader, self.world_size()
        configured = (loader.batch_size, self.accelerator.gradient_accumulation_steps)
        self.accelerator.gradient_accumulation_steps = plan.accumulate_grad_batches
        samples = dataset_length(loader.dataset)
        if samples is not None and loader.drop_last:  # what the run as configured trains on
            samples = samples // (configured[0] * ranks) * configured[0] * ranks
        warning = last_window_warning("accelerate", samples, ranks, configured,
                                      (plan.micro_batch_size, plan.accumulate_grad_batches))  # fmt: skip
        if warning is not None and self.controller is not None:
            self.controller.warn("last-window", warning)
        if plan.gradient_checkpointing:
            enable_checkpointing(self.model, self.checkpoint_modules)
        if loader.drop_last and is_stream(loader.dataset) and plan.micro_batch_size != configured[0]:
            self.controller.warn("drop-last", (
                f"memfit: drop_last=True on a stream drops its last incomplete batch, whose length memfit cannot read "
                f"ahead: at the planned {plan.micro_batch_size} samples a batch an epoch may train on up to "
                f"{configured[0] - 1} samples the run as configured ({configured[0]} a batch) dropped"
            ))  # fmt: skip
        self.loader = _rebatched(loader, plan.micro_batch_size)
        return True

    def recovery_unsupported(self) -> str | None:
        return "the loop body is the user's own code"

    def install_step(self, recovery: Any) -> None:
        raise NotImplementedError("an accelerate loop's step is the user's own code")

    def uninstall_step(self) -> None:
        return None

    def trained_module(self) -> torch.nn.Module:
        return self.model

    def log_scalars(self, metrics: dict[str, float], step: int | None) -> None:
        self.accelerator.log(metrics, step=step)  # the main process writes to the trackers

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        """To a TensorBoard tracker and the project folder."""
        writer = next((getattr(t, "writer", None) for t in self.accelerator.trackers if t.name == "tensorboard"), None)
        folder = getattr(self.accelerator, "project_dir", None)
        log_figure(figure, name, tensorboard=writer, folder=folder, step=step)

    def log_plan(self, params: dict[str, Any]) -> None:
        return None  # accelerate takes a run's hyperparameters in init_trackers, before memfit plans


def _check_loader(loader: Any) -> None:
    """Refuse what ``plan()`` cannot re-batch, each in one line that says what to pass instead."""
    if not isinstance(loader, DataLoader):
        raise InvalidInputError(f"plan() takes the torch DataLoader the loop iterates, got {type(loader).__name__}")
    if type(loader).__module__.startswith("accelerate"):
        raise InvalidInputError(
            f"plan() got a {type(loader).__name__} that accelerator.prepare() made: call planner.plan(model, "
            "optimizer, dataloader) before accelerator.prepare(...), with the DataLoader you built"
        )
    if loader.batch_size is None:
        how = "batch_sampler=" if loader.batch_sampler is not None else "batch_size=None"
        raise InvalidInputError(
            f"plan() re-batches the DataLoader at the planned micro batch, and this one is built with {how}: build "
            "it with batch_size= (and sampler=, shuffle=, drop_last= as you need)"
        )


def _rebatched(loader: DataLoader, batch_size: int) -> DataLoader:
    """``loader`` with ``batch_size`` examples a batch: the same dataset, sampler (so the same samples in the same
    order), collate function and worker settings. With ``drop_last`` the last incomplete batch of the loader's own
    size is dropped, as the run configured did, so every epoch sees the same samples."""
    if batch_size == loader.batch_size:
        return loader
    batching: dict[str, Any] = {"batch_size": batch_size, "drop_last": loader.drop_last}
    if not is_stream(loader.dataset):  # a stream has no sampler: the same stream, in the same order, regrouped
        samples = len(loader.sampler)
        drops_other_samples = loader.drop_last and samples % loader.batch_size != samples % batch_size
        batching = (
            {"batch_sampler": _Rebatched(loader.sampler, loader.batch_size, batch_size)}
            if drops_other_samples
            else {**batching, "sampler": loader.sampler}
        )
    return DataLoader(
        loader.dataset,
        **batching,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
        **({"prefetch_factor": loader.prefetch_factor} if loader.num_workers > 0 else {}),
    )


class _Rebatched(Sampler[list[int]]):
    """The sampler's indices in batches of ``batch_size``, without the last incomplete batch of ``configured`` (what
    ``drop_last`` drops in the run as configured): every epoch sees the same samples. Its last batch may be short."""

    drop_last = False

    def __init__(self, sampler: Any, configured: int, batch_size: int) -> None:
        self.sampler, self.configured, self.batch_size = sampler, configured, batch_size

    def __iter__(self) -> Iterator[list[int]]:
        indices = iter(self.sampler)
        kept = itertools.islice(indices, self._kept())
        while batch := list(itertools.islice(kept, self.batch_size)):
            yield batch
        # Drawn to the end, as the configured loader's batch sampler draws it even where it drops the last batch: a
        # shuffling sampler's generator then stands where the configured run's does, so the next epoch's order is its.
        for _ in indices:
            pass

    def __len__(self) -> int:
        return math.ceil(self._kept() / self.batch_size)

    def _kept(self) -> int:
        return len(self.sampler) // self.configured * self.configured
