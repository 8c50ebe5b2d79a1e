"""What the Trainer will run, read from ``TrainingArguments``: device, precision, optimizer, DDP, one batch."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

try:
    from transformers import PreTrainedModel, TrainingArguments
    from transformers.trainer import Trainer
    from transformers.utils import find_labels
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("memfit.huggingface needs transformers and accelerate: pip install 'memfit[hf]'") from error

from memfit.devices import backend_for
from memfit.diagnostics import degrade
from memfit.errors import InvalidInputError
from memfit.prediction.estimator import COMPILED_NOTE
from memfit.tracing.batch import batch_examples, is_stream, longest_of_a_stream
from memfit.tracing.ddp import DDPConfig
from memfit.tracing.model_limits import check_token_ranges
from memfit.tracing.model_state import preserved_rng_state
from memfit.tracing.optimizers import embeddings_in_32_bits


def run_device(args: TrainingArguments) -> torch.device:
    """Where the Trainer will train: the CUDA GPU if there is one and ``use_cpu`` is off."""
    return torch.device("cuda" if backend_for("cuda").is_available() and not args.use_cpu else "cpu")


def run_precision(args: TrainingArguments) -> str:
    """The mixed precision the Trainer's accelerator will run: the ``bf16``/``fp16`` flags, else
    accelerate's ``ACCELERATE_MIXED_PRECISION`` (``accelerate launch --mixed_precision bf16`` sets it;
    transformers 4.x also sets it for the whole process from any earlier fp16/bf16 arguments)."""
    if args.bf16:
        return "bf16-mixed"
    if args.fp16:
        return "16-mixed"
    mode = getattr(args, "mixed_precision", None) or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(str(mode).lower(), "fp32")


def held_batches(accumulation_steps: int, device: torch.device) -> int:
    """Batches alive on the device besides the step's own.

    The Trainer fetches a whole accumulation window before its first micro batch runs
    (``get_batch_samples``) and keeps it to the optimizer step; memfit's recovery replays those same
    batches, so it holds nothing more (``memfit.run.recovery.batches_held`` counts the same ones).
    accelerate's loader also reads the next batch ahead; that one stays in host memory, which is the
    device's own only when training on the CPU.
    """
    lookahead = 1 if device.type == "cpu" else 0
    return accumulation_steps - 1 + lookahead


def checkpointing_switch(args: Any) -> str:
    """The ``TrainingArguments`` field that turns checkpointing on: ``activation_checkpointing`` in
    recent transformers (5.23), ``gradient_checkpointing`` in older ones (4.x, 5.17)."""
    return "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"


def model_checkpointing(model: Any) -> bool:
    """Whether a ``PreTrainedModel`` has checkpointing on, under either name its transformers uses."""
    names = ("is_activation_checkpointing", "is_gradient_checkpointing")
    return any(bool(getattr(model, name, False)) for name in names)


def ddp_config(args: TrainingArguments, model: torch.nn.Module, *, sharded: bool = False) -> DDPConfig | None:
    """The ``DistributedDataParallel`` options the Trainer (through accelerate) will wrap ``model`` with,
    or ``None`` when it will not (one process; ``sharded``: FSDP or DeepSpeed runs, see ``sharding.run_layout``)."""
    if args.world_size <= 1 or sharded:
        return None
    if args.ddp_find_unused_parameters is not None:
        find_unused = bool(args.ddp_find_unused_parameters)
    elif isinstance(model, PreTrainedModel):  # as Trainer._build_accelerator_args decides it
        find_unused = not (model_checkpointing(model) or getattr(args, checkpointing_switch(args), False))
    else:
        find_unused = True
    return DDPConfig(
        bucket_cap_mb=args.ddp_bucket_cap_mb,
        find_unused_parameters=find_unused,
        static_graph=bool(getattr(args, "ddp_static_graph", None)),
    )


@contextlib.contextmanager
def trainer_model_config(model: torch.nn.Module, args: TrainingArguments) -> Iterator[None]:
    """The model's config as the Trainer will run it, restored afterwards.

    ``Trainer.__init__`` sets ``model.config.use_cache = args.use_cache`` (``False`` by default),
    and a Llama's training step with the cache on keeps different tensors than with it off (on a
    tiny 4-bit Llama, 320 KiB fewer activations at micro batch 2): planning before the Trainer
    exists must trace the step the Trainer will run.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(args, "use_cache") or not hasattr(config, "use_cache"):
        yield
        return
    before = config.use_cache
    config.use_cache = args.use_cache
    try:
        yield
    finally:
        config.use_cache = before


def run_notes(args: TrainingArguments) -> list[str]:
    """What the prediction of this run should say that the traced model cannot show: the Trainer compiles
    the model itself under ``torch_compile`` (the trace runs the model eagerly)."""
    return [COMPILED_NOTE] if getattr(args, "torch_compile", False) else []


def collated_sample(
    model: torch.nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    batch_size: int,
    data_collator: Any = None,
    processing_class: Any = None,
    *,
    notes: list[str] | None = None,
    max_length: int | None = None,
) -> Any:
    """One batch as the Trainer would build it (unused columns dropped, the Trainer's default collator),
    of the longest examples: a collator that pads to the longest in the batch makes its peak there.
    ``notes`` gets a sentence when no length could be found to choose the examples by. A stream's batch is
    stretched to the longest sequence its batches can have (``sequence_limit``), and ``notes`` says from what."""
    if train_dataset is None:
        raise InvalidInputError("train_dataset is None: memfit needs one batch of it to plan")
    if data_collator is None:
        from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase, default_data_collator

        use_padding = isinstance(processing_class, PreTrainedTokenizerBase)
        data_collator = DataCollatorWithPadding(processing_class) if use_padding else default_data_collator
    found: list[str] = []
    with preserved_rng_state():  # random transforms and collators (MLM masking) must not shift the run
        examples = batch_examples(train_dataset, batch_size, args.length_column_name, notes=found)
        if args.remove_unused_columns:  # before collating, as the Trainer does: text columns would not collate
            kept = _signature_columns(model, args)
            examples = [{k: v for k, v in e.items() if k in kept} if isinstance(e, dict) else e for e in examples]
        try:
            batch = data_collator(examples)
        except Exception as error:
            raise InvalidInputError(
                f"the data collator cannot batch {len(examples)} examples of this dataset ({type(error).__name__}: "
                f"{error}); the Trainer would fail the same way. Check the dataset's columns against the collator"
                + ("" if args.remove_unused_columns else ", or leave remove_unused_columns=True")
            ) from error
    if is_stream(train_dataset):
        batch, found = longest_of_a_stream(batch, model, data_collator, processing_class, max_length, found)
    if notes is not None:
        notes.extend(found)
    check_token_ranges(model, batch)
    return dict(batch) if isinstance(batch, Mapping) else batch


def _signature_columns(model: torch.nn.Module, args: TrainingArguments) -> set[str]:
    """The example keys the Trainer keeps under ``remove_unused_columns``: the forward's parameters
    (of the base model under PEFT) and the label names."""
    forward = _base_model(model).forward
    return set(inspect.signature(forward).parameters) | {"label", "label_ids", *label_names(model, args)}


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model the Trainer inspects: under PEFT, the base model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def label_names(model: torch.nn.Module, args: TrainingArguments) -> list[str]:
    """``args.label_names``, else the labels the model's forward takes, as the Trainer decides them."""
    return list(args.label_names) if args.label_names is not None else find_labels(type(_base_model(model)))


# ``args.optim`` values whose update runs inside backward (hooks on each parameter, or the fused
# LOMO step): memfit's trace steps an optimizer after backward, so it refuses them, with what to plan instead.
_STEPS_IN_BACKWARD = {
    "lomo": "sgd",
    "adalomo": "adafactor",
}


def trainer_optimizer(args: TrainingArguments, model: torch.nn.Module) -> Any:
    """The optimizer ``args.optim`` names, built as ``Trainer.create_optimizer`` builds it: weights
    with weight decay in one group, biases and norms without in another (single-tensor optimizers
    step group by group, which changes the step's peak). Nothing is allocated until its first step."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim.endswith("layerwise") or optim in _STEPS_IN_BACKWARD:
        instead = _STEPS_IN_BACKWARD.get(optim) or optim.removesuffix("_layerwise")
        raise InvalidInputError(
            f"memfit cannot trace optim={optim!r}: it updates each parameter inside backward (per-parameter "
            f"hooks), and memfit's trace runs the optimizer step after backward. Plan with optim={instead!r}, "
            "whose memory is an upper bound for it (its state, and every gradient alive at once)"
        )
    try:
        optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    except Exception as error:
        raise InvalidInputError(
            f"cannot build optim={optim!r} to trace it, as transformers cannot here ({type(error).__name__}: "
            f"{error}); install what it needs, or plan with an optimizer that keeps the same state (optim="
            "'adamw_torch' for the AdamW variants), or use memfit.estimate_from_counts() for a formula estimate"
        ) from error
    if "params" in optimizer_kwargs and isinstance(optimizer_cls, type):  # GaLore, APOLLO: groups of their own
        return optimizer_cls(**optimizer_kwargs)
    if not {"params", "model"} & set(optimizer_kwargs) and isinstance(optimizer_cls, type):
        try:
            decay = set(Trainer.get_decay_parameter_names(None, model))  # reads nothing of the Trainer
            trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
            optimizer = optimizer_cls(
                [
                    {"params": [p for name, p in trainable if name in decay], "weight_decay": args.weight_decay},
                    {"params": [p for name, p in trainable if name not in decay], "weight_decay": 0.0},
                ],
                **optimizer_kwargs,
            )
        except Exception as error:  # the class over all parameters, as before; only the grouping is lost
            degrade(f"memfit traces {optim!r} over all parameters in one group ({type(error).__name__}: {error})",
                    error, quiet=True)  # fmt: skip
        else:
            if "bitsandbytes" in str(optimizer_cls) and optimizer_kwargs.get("optim_bits") == 8:
                embeddings_in_32_bits(optimizer, model)
            return optimizer

    def build(params: Any) -> torch.optim.Optimizer:
        return optimizer_cls(params, **optimizer_kwargs)

    build.__name__ = getattr(optimizer_cls, "__name__", optim)
    return build


def running_optimizer(args: TrainingArguments, model: torch.nn.Module, optimizer: Any) -> Any:
    """The optimizer the Trainer created (unwrapped from accelerate), else the one ``args`` names."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) else trainer_optimizer(args, model)
