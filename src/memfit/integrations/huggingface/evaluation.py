"""The Trainer's evaluation and prediction passes: the forward and the outputs collected for ``compute_metrics``."""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch

try:
    from transformers import TrainingArguments
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("memfit.huggingface needs transformers and accelerate: pip install 'memfit[hf]'") from error

from memfit.diagnostics import degrade
from memfit.errors import InvalidInputError
from memfit.integrations.huggingface.arguments import (
    collated_sample,
    label_names,
    run_device,
    run_precision,
)
from memfit.prediction.estimator import MemoryEstimate, trace
from memfit.prediction.evaluation import (
    CollectedOutputs,
    EvaluationPeak,
    evaluation_peak,
    fitted_evaluation,
    nested_tensor_bytes,  # fmt: skip
)
from memfit.tracing.config import Target, TrainingLoop
from memfit.tracing.trace_cache import Uncacheable
from memfit.units import format_bytes


def planned_evaluation(
    model: torch.nn.Module,
    args: TrainingArguments,
    eval_dataset: Any,
    training: MemoryEstimate,
    device: torch.device,
    budget_bytes: int,
    *,
    include_context: bool,
    **trainer_inputs: Any,
) -> tuple[EvaluationPeak | None, int | None]:
    """The predicted evaluation pass and, when it does not fit and the user left it unset, the
    ``eval_accumulation_steps`` that makes it fit. The training plan stands whatever happens here."""
    try:
        evaluation = predict_evaluation(model, args, eval_dataset, training, device=device, **trainer_inputs)
    except Exception as error:  # the training plan stands; only this check is lost
        degrade(f"memfit could not check the evaluation pass ({type(error).__name__}: {error})", error, quiet=True)
        return None, None
    fitted, flush, fits = fitted_evaluation(evaluation, training, budget_bytes, include_context=include_context)
    if not fits:
        warnings.warn(evaluation_warning(evaluation, budget_bytes), UserWarning, stacklevel=3)
    return fitted, flush if fits else None


def predict_evaluation(
    model: torch.nn.Module,
    args: TrainingArguments,
    eval_dataset: Any,
    training: MemoryEstimate | None,
    *,
    loop: Literal["evaluate", "predict"] = "evaluate",
    during_training: bool = True,
    device: torch.device | None = None,
    data_collator: Any = None,
    processing_class: Any = None,
    compute_metrics: Any = None,
    preprocess_logits_for_metrics: Any = None,
) -> EvaluationPeak:
    """The Trainer's evaluation pass beside what ``training`` (its training estimate) leaves on the device.

    The forward is ``prediction_step``'s: eval mode, no gradients, the loss computed when the batch
    has labels. Every batch's predictions (the outputs but the loss and
    ``config.keys_to_ignore_at_inference``, after ``preprocess_logits_for_metrics``) and labels stay
    on the device, concatenated, until ``eval_accumulation_steps`` batches have run or the pass
    ends; the losses always do. ``Trainer.evaluate`` keeps predictions only with
    ``compute_metrics``; ``Trainer.predict`` (``loop="predict"``) always does, unless
    ``prediction_loss_only``. A dict of evaluation sets is predicted set by set; the largest pass
    is returned.

    Args:
        training: the training step's estimate, whose optimizer state stays on the device (after
            ``train()`` returns too: the Trainer keeps its optimizer); ``None`` when the Trainer has
            not trained.
        during_training: the pass runs inside ``train()`` (``eval_strategy``), where the window's
            training batches stay alive; outside it, ``fp16_full_eval``/``bf16_full_eval`` cast the
            model to half precision first (and leave it so).
    """
    if loop not in ("evaluate", "predict"):
        raise InvalidInputError(f"loop must be 'evaluate' or 'predict', got {loop!r}")
    if device is None:
        device = run_device(args)
    if isinstance(eval_dataset, dict):
        if not eval_dataset:
            raise InvalidInputError("eval_dataset is an empty dict")
        passes = [
            predict_evaluation(
                model, args, one, training, loop=loop, during_training=during_training, device=device,
                data_collator=data_collator, processing_class=processing_class, compute_metrics=compute_metrics,
                preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            )
            for one in eval_dataset.values()
        ]  # fmt: skip
        return max(passes, key=lambda peak: peak.allocated_bytes)
    try:
        samples = len(eval_dataset)
    except TypeError:
        raise InvalidInputError("eval_dataset has no length: memfit cannot tell how many batches it collects") from None
    batch = args.per_device_eval_batch_size
    sample = collated_sample(model, args, eval_dataset, batch, data_collator, processing_class)
    wants_predictions = loop == "predict" or compute_metrics is not None  # evaluate() is loss-only without metrics
    step = _PredictionStep(
        model, args, collect_predictions=wants_predictions and not args.prediction_loss_only,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
    )  # fmt: skip
    precision = run_precision(args) if during_training else _evaluation_precision(args)
    forward = trace(
        model, sample, batch_size=batch, inference=True, precision=precision, target=Target(device.type),
        forward_fn=step,
        loop=TrainingLoop(extra_batches=1 if device.type == "cpu" else 0),  # the loader reads one batch ahead
    )  # fmt: skip
    collected = None
    if step.bytes_per_sample and not args.batch_eval_metrics:
        collected = CollectedOutputs(
            bytes_per_sample=step.bytes_per_sample,
            samples=samples,
            samples_per_batch=batch * args.world_size,  # every process gathers every process's outputs
            # On the CPU the collection moves nowhere: eval_accumulation_steps only turns it into numpy arrays.
            flush_every=args.eval_accumulation_steps if device.type == "cuda" else None,
            concatenated=bool(getattr(args, "eval_do_concat_batches", True)),
            # The float32 copies are made in host memory: the device's own only on the CPU.
            end_copy_bytes_per_sample=step.numpy_copy_bytes_per_sample if device.type == "cpu" else {},
        )
    return evaluation_peak(training, forward, collected=collected, keeps_training_batches=during_training)


def predict_trainer_pass(
    trainer: Any,
    dataset: Any = None,
    *,
    loop: Literal["evaluate", "predict"] = "evaluate",
    training: MemoryEstimate | None = None,
) -> EvaluationPeak:
    """Predict ``trainer.evaluate(dataset)`` (or ``trainer.predict(dataset)``) before running it.

    Everything is read from the Trainer: model, arguments, collator, ``compute_metrics``, whether it
    is inside ``train()``. What training leaves on the device is the optimizer state: ``training``
    (a training estimate) if given, else, once the Trainer's optimizer has stepped, the estimate of
    the ``MemoryPlannerCallback`` in the Trainer. ``dataset`` defaults to ``trainer.eval_dataset``.
    """
    if dataset is None:
        if loop == "predict":
            raise InvalidInputError("trainer.predict needs a dataset: pass the one you will predict on")
        dataset = trainer.eval_dataset
        if dataset is None:
            raise InvalidInputError("the Trainer has no eval_dataset: pass the dataset you will evaluate on")
    optimizer = getattr(trainer, "optimizer", None)
    has_state = optimizer is not None and any(len(state) for state in optimizer.state.values())
    if training is None and has_state:
        from memfit.integrations.huggingface.callback import MemoryPlannerCallback  # it imports this module

        training = next(
            (c.estimate for c in trainer.callback_handler.callbacks if isinstance(c, MemoryPlannerCallback)), None
        )
        if training is None:
            raise InvalidInputError(
                "the Trainer's optimizer holds state from training, and memfit has no estimate of it: add "
                "MemoryPlannerCallback to the Trainer before train(), or pass training=memfit.estimate(...)"
            )
    model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    return predict_evaluation(
        model, trainer.args, dataset, training, loop=loop,
        during_training=bool(getattr(trainer, "is_in_train", False)), data_collator=trainer.data_collator,
        compute_metrics=trainer.compute_metrics, preprocess_logits_for_metrics=trainer.preprocess_logits_for_metrics,
    )  # fmt: skip


def _evaluation_precision(args: TrainingArguments) -> str:
    """The precision of an evaluation outside ``train()``: ``*_full_eval`` casts the whole model."""
    if args.fp16_full_eval:
        return "16-true"
    if args.bf16_full_eval:
        return "bf16-true"
    return run_precision(args)


class _PredictionStep:
    """The forward of ``Trainer.prediction_step``, noting the bytes each batch leaves collected."""

    def __init__(self, model: torch.nn.Module, args: TrainingArguments, *, collect_predictions: bool,
                 preprocess_logits_for_metrics: Any) -> None:  # fmt: skip
        from transformers.utils import can_return_loss

        self.label_names = label_names(model, args)
        self.returns_loss = can_return_loss(type(model))
        config = getattr(model, "config", None)
        self.ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", ["past_key_values"])) if config else []
        self.collect_predictions = collect_predictions
        self.preprocess = preprocess_logits_for_metrics
        self.eval_batch_size = args.eval_batch_size
        self.per_device_eval_batch_size = args.per_device_eval_batch_size
        self.collect_inputs = "inputs" in (getattr(args, "include_for_metrics", None) or [])
        self.main_input_name = getattr(model, "main_input_name", "input_ids")
        self.bytes_per_sample: dict[str, float] = {}
        self.numpy_copy_bytes_per_sample: dict[str, float] = {}

    def memfit_cache_key(self) -> Any:
        """Never kept: the step notes what each traced batch collects, and a kept trace would skip the call."""
        raise Uncacheable("the evaluation step notes what each traced batch collects")

    def __call__(self, module: torch.nn.Module, batch: Any) -> Any:
        if not isinstance(batch, dict):
            raise InvalidInputError(f"the Trainer passes dict batches; the evaluation batch is {type(batch).__name__}")
        outputs = module(**batch)
        has_labels = bool(self.label_names) and all(batch.get(name) is not None for name in self.label_names)
        with_loss = has_labels or (not self.label_names and self.returns_loss)
        samples = _leading_dim(batch)  # the trace runs this at more than one batch size
        kept: dict[str, Any] = {}
        collected: dict[str, float] = {}
        if with_loss:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            kept["losses"] = loss
            # loss.repeat(eval_batch_size): per batch, not per sample; a batch holds per_device_eval_batch_size
            collected["losses"] = loss.element_size() * self.eval_batch_size / self.per_device_eval_batch_size
        if self.collect_predictions:
            ignored = [*self.ignore_keys, "loss"] if with_loss else self.ignore_keys
            if isinstance(outputs, dict):
                predictions: Any = tuple(v for k, v in outputs.items() if k not in ignored)
            else:
                predictions = outputs[1:] if with_loss else outputs
            if isinstance(predictions, tuple) and len(predictions) == 1:
                predictions = predictions[0]
            labels: Any = None
            if with_loss and has_labels:
                labels = tuple(batch.get(name) for name in self.label_names)
                labels = labels[0] if len(labels) == 1 else labels
            if self.preprocess is not None:
                try:
                    predictions = self.preprocess(predictions, labels)
                except Exception as error:
                    raise InvalidInputError(
                        f"preprocess_logits_for_metrics failed on shape-only tensors ({type(error).__name__}: "
                        f"{error}); memfit cannot size what it keeps"
                    ) from error
            kept["predictions"] = predictions
            collected["predictions"] = nested_tensor_bytes(predictions) / samples
            if labels is not None:
                kept["labels"] = labels
                collected["labels"] = nested_tensor_bytes(labels) / samples
            if self.collect_inputs and isinstance(batch.get(self.main_input_name), torch.Tensor):
                kept["inputs"] = batch[self.main_input_name]
                collected["inputs"] = nested_tensor_bytes(batch[self.main_input_name]) / samples
        self.bytes_per_sample = collected
        # numpy has no bfloat16: the Trainer hands such collections to compute_metrics as float32 copies
        copies = {name: nested_tensor_bytes(value, only=torch.bfloat16) * 2 for name, value in kept.items()}
        self.numpy_copy_bytes_per_sample = {
            name: copy * (collected[name] / nested_tensor_bytes(kept[name])) for name, copy in copies.items() if copy
        }
        return outputs


def _leading_dim(batch: dict[str, Any]) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise InvalidInputError("the evaluation batch holds no tensor with a batch dimension")


def evaluation_warning(evaluation: EvaluationPeak, budget_bytes: int, flush_every: int | None = None) -> str:
    advice = ["lower per_device_eval_batch_size"]
    if flush_every is not None:
        advice.insert(0, f"set eval_accumulation_steps={flush_every} (the most batches of outputs that fit)")
    if evaluation.collected is not None and evaluation.collected.bytes_per_sample.get("predictions"):
        advice.append("pass preprocess_logits_for_metrics that keeps less than the logits (their argmax, say)")
    return (
        f"memfit: evaluation may run out of memory where training fits: {evaluation.summary()}, over the "
        f"{format_bytes(budget_bytes)} budget. To fit: {'; or '.join(advice)}."
    )
