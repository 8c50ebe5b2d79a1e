"""The HF Trainer's evaluation pass: a forward beside the optimizer state, plus the outputs it collects.

With ``compute_metrics`` the Trainer keeps every evaluation batch's logits and labels on the
device, concatenated, until ``eval_accumulation_steps`` batches have run (by default to the end of
the evaluation set). The predictions are checked against real ``Trainer.train`` runs on CPU whose
peak comes from the CPU allocator's reports to ``torch.profiler``.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import memfit
import memfit.huggingface as hf
from harness.accuracy.loops import EVAL_BATCH, WIDTH, _Classifier, hf_predict, hf_train_with_evaluation
from harness.accuracy.reference import profiled_cpu_peak
from memfit import InvalidInputError
from memfit.prediction.evaluation import CollectedOutputs, evaluation_peak, largest_flush_every

# The labels the Trainer collects are views of each batch's own inputs, which the model counts once
# more for the batch being concatenated: a few KiB high at most.
CLOSE = 4096


@pytest.mark.parametrize(("batches", "concatenated"), [(32, True), (64, False)])
def test_evaluation_with_collected_logits_peaks_where_predicted(
    tmp_path: Path, batches: int, concatenated: bool
) -> None:
    run, callback = hf_train_with_evaluation(tmp_path, batches, concatenated=concatenated)
    measured = profiled_cpu_peak(run)
    evaluation, training = callback.evaluation, callback.estimate
    assert evaluation.allocated_bytes > training.peak_allocated_bytes  # the run's peak is the evaluation pass
    assert abs(evaluation.allocated_bytes - measured) <= CLOSE
    # without the collected outputs the prediction would miss most of what the pass adds
    assert measured - (evaluation.allocated_bytes - evaluation.collected_bytes) > 0.9 * evaluation.collected_bytes
    logits_per_sample = WIDTH * 4
    assert evaluation.collected.bytes_per_sample["predictions"] == logits_per_sample
    assert evaluation.collected.batches == batches
    assert evaluation.collected.concatenated is concatenated


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=96, n_positions=32))


def token_rows(n: int, sequence: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 96, (n, sequence), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def test_what_is_collected_is_what_the_trainers_prediction_step_returns(tmp_path: Path) -> None:
    """Logits but the KV cache (``keys_to_ignore_at_inference``), labels and losses, as the real step keeps them."""
    model, rows = tiny_gpt2(), token_rows(24)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=8, use_cpu=True, report_to=[])
    training = memfit.estimate(model, {"input_ids": torch.zeros(4, 16, dtype=torch.long)}, optimizer="adamw",
                               target=memfit.Target("cpu"), loss_fn=lambda out, _b: out.logits.mean())  # fmt: skip

    def metrics(prediction: object) -> dict[str, float]:
        return {}

    with_metrics = hf.predict_evaluation(model, args, rows, training, compute_metrics=metrics)
    trainer = Trainer(model=model, args=args, eval_dataset=rows, compute_metrics=metrics)
    batch = next(iter(trainer.get_eval_dataloader()))
    loss, logits, labels = trainer.prediction_step(trainer.model, batch, prediction_loss_only=False)
    per_sample = with_metrics.collected.bytes_per_sample
    assert per_sample["predictions"] == logits.numel() * logits.element_size() / 8
    assert per_sample["labels"] == labels.numel() * labels.element_size() / 8
    assert per_sample["losses"] == loss.element_size()  # loss.repeat(batch_size)
    assert (with_metrics.collected.samples, with_metrics.collected.samples_per_batch) == (24, 8)

    argmax = hf.predict_evaluation(model, args, rows, training, compute_metrics=metrics,
                                   preprocess_logits_for_metrics=lambda logits, _labels: logits.argmax(-1))  # fmt: skip
    assert argmax.collected.bytes_per_sample["predictions"] == 16 * 8  # one int64 per token
    assert argmax.allocated_bytes < with_metrics.allocated_bytes

    losses_only = hf.predict_evaluation(model, args, rows, training)  # evaluate() without compute_metrics
    assert set(losses_only.collected.bytes_per_sample) == {"losses"}
    per_batch = dataclasses.replace(args, batch_eval_metrics=True)
    assert hf.predict_evaluation(model, per_batch, rows, training, compute_metrics=metrics).collected is None


def classifier_args(tmp_path: Path, **changes: object) -> TrainingArguments:
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=64, per_device_eval_batch_size=EVAL_BATCH,
        optim="adamw_torch", use_cpu=True, report_to=[], eval_strategy="steps", eval_steps=2,
    )  # fmt: skip
    return TrainingArguments(**{**settings, **changes})


def classifier_rows(n: int) -> list[dict[str, torch.Tensor]]:
    rows = torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(0))
    return [{"x": row, "labels": torch.tensor(i % WIDTH)} for i, row in enumerate(rows)]


def accuracy(prediction: object) -> dict[str, float]:
    return {}


def test_plan_warns_when_evaluation_would_not_fit_on_the_cpu(tmp_path: Path) -> None:
    """On the CPU the collection moves nowhere, so eval_accumulation_steps would not help: only a warning."""
    model, train, evaluation = _Classifier(), classifier_rows(512), classifier_rows(EVAL_BATCH * 32)
    args = classifier_args(tmp_path)
    fits = hf.plan_training_arguments(model, args, train, budget="1GiB", eval_dataset=evaluation,
                                      compute_metrics=accuracy)  # fmt: skip
    needed = fits.evaluation.reserved_bytes
    assert fits.plan.predicted_peak_bytes < needed  # evaluation, not training, sets the limit here
    budget = (fits.plan.predicted_peak_bytes + needed) // 2
    with pytest.warns(UserWarning, match=r"evaluation may run out of memory where training fits.*per_device_eval"):
        planned = hf.plan_training_arguments(model, args, train, budget=budget, margin=0.0, eval_dataset=evaluation,
                                             compute_metrics=accuracy)  # fmt: skip
    assert planned.args.eval_accumulation_steps is None
    assert planned.args.per_device_train_batch_size == fits.args.per_device_train_batch_size


def test_on_a_gpu_the_plan_moves_the_collection_off_the_device_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned for a CUDA GPU (traced with CUDA's semantics on this CPU): the most batches that fit."""
    import memfit.integrations.huggingface.planning as hf_planning

    monkeypatch.setattr(hf_planning, "run_device", lambda args: torch.device("cuda"))
    model, train, evaluation = _Classifier(), classifier_rows(512), classifier_rows(EVAL_BATCH * 128)
    args = classifier_args(tmp_path)
    roomy = hf.plan_training_arguments(model, args, train, budget="80GiB", eval_dataset=evaluation,
                                       compute_metrics=accuracy)  # fmt: skip
    assert roomy.args.eval_accumulation_steps is None
    all_batches = roomy.evaluation.device_bytes
    budget = (roomy.plan.predicted_peak_bytes + all_batches) // 2
    planned = hf.plan_training_arguments(model, args, train, budget=budget, margin=0.0, eval_dataset=evaluation,
                                         compute_metrics=accuracy)  # fmt: skip
    steps = planned.args.eval_accumulation_steps
    assert roomy.evaluation.device_bytes > roomy.plan.predicted_peak_bytes  # evaluation sets the limit
    assert steps is not None and 1 <= steps < 128
    assert planned.evaluation.collected.flush_every == steps
    assert planned.evaluation.device_bytes <= budget
    more = evaluation_peak(planned.estimate, planned.evaluation.traced, keeps_training_batches=True,
                           collected=planned.evaluation.collected.flushed_every(steps + 1))  # fmt: skip
    assert more.device_bytes > budget  # the most batches that fit, not merely some
    assert any("eval_accumulation_steps" in reason for reason in planned.plan.reasons)

    user_set = classifier_args(tmp_path, eval_accumulation_steps=120)
    with pytest.warns(UserWarning, match="evaluation may run out of memory"):
        kept = hf.plan_training_arguments(model, user_set, train, budget=budget, margin=0.0,
                                          eval_dataset=evaluation, compute_metrics=accuracy)  # fmt: skip
    assert kept.args.eval_accumulation_steps == 120  # the user's setting is theirs; the warning says what fits


@pytest.mark.usefixtures("lenient")
def test_callback_warns_at_train_begin_and_a_failed_check_does_not_stop_training(tmp_path: Path) -> None:
    model, train, evaluation = _Classifier(), classifier_rows(256), classifier_rows(EVAL_BATCH * 32)
    args = classifier_args(tmp_path, max_steps=1, save_strategy="no", eval_strategy="no")
    fits = hf.plan_training_arguments(model, args, train, budget="1GiB", eval_dataset=evaluation,
                                      compute_metrics=accuracy)  # fmt: skip
    tight = hf.plan_training_arguments(model, args, train, budget=(fits.plan.predicted_peak_bytes
                                       + fits.evaluation.reserved_bytes) // 2, margin=0.0)  # fmt: skip
    callback = hf.MemoryPlannerCallback(plan=tight.plan, verbose=False)
    trainer = Trainer(model=model, args=tight.args, train_dataset=train, eval_dataset=evaluation,
                      compute_metrics=accuracy)  # fmt: skip
    hf.attach(trainer, callback)
    with pytest.warns(UserWarning, match="evaluation may run out of memory where training fits"):
        trainer.train()
    assert callback.evaluation is not None and callback.evaluation.reserved_bytes > tight.plan.budget_bytes

    class NoLength(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(evaluation)

    quiet = hf.MemoryPlannerCallback(verbose=False)
    trainer = Trainer(model=model, args=tight.args, train_dataset=train, eval_dataset=NoLength(),
                      compute_metrics=accuracy)  # fmt: skip
    hf.attach(trainer, quiet)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # neither a warning nor an error: the check is skipped
        trainer.train()
    assert quiet.evaluation is None and quiet.estimate is not None


def test_evaluation_input_errors(tmp_path: Path) -> None:
    model, rows = tiny_gpt2(), token_rows(8)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, use_cpu=True, report_to=[])
    training = memfit.estimate(model, {"input_ids": torch.zeros(4, 16, dtype=torch.long)}, optimizer="sgd",
                               target=memfit.Target("cpu"), loss_fn=lambda out, _b: out.logits.mean())  # fmt: skip

    def needs_values(logits: torch.Tensor, _labels: object) -> object:
        return logits.cpu().numpy()

    with pytest.raises(InvalidInputError, match="preprocess_logits_for_metrics failed on shape-only tensors"):
        hf.predict_evaluation(model, args, rows, training, compute_metrics=accuracy,
                              preprocess_logits_for_metrics=needs_values)  # fmt: skip
    with pytest.raises(InvalidInputError, match="eval_dataset has no length"):
        hf.predict_evaluation(model, args, iter(rows), training)
    with pytest.raises(InvalidInputError, match="eval_dataset is an empty dict"):
        hf.predict_evaluation(model, args, {}, training)
    two_sets = hf.predict_evaluation(model, args, {"short": rows[:4], "long": rows}, training,
                                     compute_metrics=accuracy)  # fmt: skip
    assert two_sets.collected.samples == 8  # the larger pass
    half = hf.predict_evaluation(model, args, rows[:2], training, compute_metrics=accuracy)
    full = hf.predict_evaluation(model, args, rows[:4], training, compute_metrics=accuracy)
    assert half.forward.batch_size == 4 and half.allocated_bytes < full.allocated_bytes  # one batch, half full


def test_collection_arithmetic_and_the_largest_window() -> None:
    """Concatenation holds twice the grown collection; the window found is the largest that fits."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    training = memfit.estimate(model, torch.randn(8, 64), optimizer="adamw", target=memfit.Target("cpu"),
                               loss_fn=lambda out, _b: out.mean())  # fmt: skip
    forward = memfit.estimate(model, torch.randn(8, 64), inference=True, target=memfit.Target("cpu"))
    collected = CollectedOutputs({"predictions": 256.0}, samples=80, samples_per_batch=8)
    concatenated = evaluation_peak(training, forward, collected=collected)
    listed = evaluation_peak(training, forward, collected=CollectedOutputs({"predictions": 256.0}, 80, 8,
                                                                             concatenated=False))  # fmt: skip
    fixed = sum(forward.breakdown.get(c, 0) for c in (memfit.Category.PARAMETERS, memfit.Category.INPUTS))
    assert concatenated.collected_bytes == 2 * 80 * 256
    assert concatenated.allocated_bytes == concatenated.carried_bytes + fixed + 2 * 80 * 256
    assert listed.collected_bytes == 9 * 8 * 256  # nine batches held while the tenth runs its forward
    budget = concatenated.reserved_bytes - 10 * 8 * 256
    found = largest_flush_every(training, forward, collected, budget)
    fitting = [
        window
        for window in range(1, 11)
        if evaluation_peak(training, forward, collected=collected.flushed_every(window)).reserved_bytes <= budget
    ]
    assert found == max(fitting)
    assert largest_flush_every(training, forward, collected, 1) is None
    for bad in ({"samples": 0}, {"samples_per_batch": True}, {"flush_every": 0}):
        with pytest.raises(InvalidInputError):
            CollectedOutputs(**{"bytes_per_sample": {"p": 1.0}, "samples": 8, "samples_per_batch": 8, **bad})
    with pytest.raises(InvalidInputError, match="must not be negative"):
        CollectedOutputs({"p": -1.0}, samples=8, samples_per_batch=8)
    with pytest.raises(InvalidInputError, match="names collections not collected"):
        CollectedOutputs({"p": 1.0}, samples=8, samples_per_batch=8, end_copy_bytes_per_sample={"q": 2.0})


def test_end_of_pass_copies_are_made_one_collection_at_a_time() -> None:
    """bf16 predictions get a float32 copy for numpy while still held; the labels, already int64, none."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    forward = memfit.estimate(model, torch.randn(8, 64), inference=True, target=memfit.Target("cpu"))
    fixed = sum(forward.breakdown.get(c, 0) for c in (memfit.Category.PARAMETERS, memfit.Category.BUFFERS))
    one_input = forward.breakdown[memfit.Category.INPUTS]
    sizes = {"predictions": 1024.0, "labels": 8.0}
    kept = CollectedOutputs(sizes, samples=80, samples_per_batch=8, end_copy_bytes_per_sample={"predictions": 2048.0})
    plain = evaluation_peak(None, forward, collected=CollectedOutputs(sizes, samples=80, samples_per_batch=8))
    copied = evaluation_peak(None, forward, collected=kept)
    # the last concatenation: old + new + grown collection of the largest (predictions), beside the labels'
    assert plain.collected_bytes == 80 * (1024 + 8) + 80 * 1024
    # at the end: the collection (80 samples), its predictions' copy (twice as wide), and the last batch's
    # outputs the loop still binds apart from the collection
    assert copied.collected_bytes == 80 * (1024 + 8) + 80 * 2048
    assert copied.allocated_bytes == fixed + one_input + copied.collected_bytes + 8 * (1024 + 8)
    assert copied.carried_bytes == 0  # nothing kept from training


@pytest.mark.parametrize(("after_training", "full_eval"), [(False, None), (True, None), (True, "bf16")])
def test_trainer_predict_peaks_where_predicted(tmp_path: Path, after_training: bool, full_eval: str | None) -> None:
    """A real ``Trainer.predict``: every batch's logits kept without compute_metrics, beside the optimizer
    state of the training before it; with bf16_full_eval in a cast model, and converted to float32 at the end."""
    run, predicted = hf_predict(tmp_path, after_training=after_training, full_eval=full_eval)
    measured = profiled_cpu_peak(run)
    peak = predicted["peak"]
    assert abs(peak.allocated_bytes - measured) <= CLOSE
    assert (peak.carried_bytes > 0) is after_training  # the Trainer keeps its optimizer after train()
    logits_per_sample = 32 * 512 * (2 if full_eval else 4)
    assert peak.collected.bytes_per_sample["predictions"] == logits_per_sample
    assert bool(peak.collected.end_copy_bytes_per_sample) is (full_eval == "bf16")
    assert measured - (peak.allocated_bytes - peak.collected_bytes) > 0.9 * peak.collected_bytes


def test_trainer_pass_reads_the_trainer_and_says_what_it_lacks(tmp_path: Path) -> None:
    model, rows = tiny_gpt2(), token_rows(32)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, per_device_eval_batch_size=8,
                             max_steps=1, use_cpu=True, report_to=[], save_strategy="no")  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows)
    evaluate = hf.predict_trainer_pass(trainer)  # evaluate() without compute_metrics keeps only the losses
    predict = hf.predict_trainer_pass(trainer, rows, loop="predict")
    assert set(evaluate.collected.bytes_per_sample) == {"losses"}
    assert {"losses", "predictions", "labels"} <= set(predict.collected.bytes_per_sample)
    assert predict.allocated_bytes > evaluate.allocated_bytes and evaluate.carried_bytes == 0
    loss_only = dataclasses.replace(args, prediction_loss_only=True)
    assert set(hf.predict_trainer_pass(Trainer(model=model, args=loss_only), rows, loop="predict")
               .collected.bytes_per_sample) == {"losses"}  # fmt: skip
    half = dataclasses.replace(args, fp16_full_eval=True)
    cast = hf.predict_trainer_pass(Trainer(model=model, args=half), rows, loop="predict")
    parameters = memfit.Category.PARAMETERS
    assert 2 * cast.forward.breakdown[parameters] == predict.forward.breakdown[parameters]

    with pytest.raises(InvalidInputError, match=r"trainer\.predict needs a dataset"):
        hf.predict_trainer_pass(trainer, loop="predict")
    with pytest.raises(InvalidInputError, match="loop must be 'evaluate' or 'predict'"):
        hf.predict_trainer_pass(trainer, rows, loop="test")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="no eval_dataset"):
        hf.predict_trainer_pass(Trainer(model=model, args=args))
    trainer.train()  # without memfit's callback: the optimizer state it left is unknown
    with pytest.raises(InvalidInputError, match="add MemoryPlannerCallback"):
        hf.predict_trainer_pass(trainer, rows, loop="predict")
    training = memfit.estimate(model, {"input_ids": rows[0]["input_ids"][None].repeat(8, 1)}, optimizer="adamw",
                               target=memfit.Target("cpu"), loss_fn=lambda out, _b: out.logits.mean())  # fmt: skip
    assert hf.predict_trainer_pass(trainer, rows, loop="predict", training=training).carried_bytes > 0


def test_an_evaluation_asked_again_with_the_cache_on_collects_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The evaluation step notes what each batch collects while it is traced; a kept trace would skip that call and
    lose the logits kept for compute_metrics, so that step is never kept."""
    from memfit.prediction.exact import clear_sessions

    monkeypatch.setenv("MEMFIT_CACHE", "on")
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    model, rows = tiny_gpt2(), token_rows(24)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=8, use_cpu=True, report_to=[])
    ids = torch.zeros(4, 16, dtype=torch.long)
    training = memfit.estimate(model, {"input_ids": ids, "labels": ids}, optimizer="adamw",
                               target=memfit.Target("cpu"))  # fmt: skip

    def metrics(prediction: object) -> dict[str, float]:
        return {}

    passes = []
    for _ in range(2):
        clear_sessions()  # only the disk may answer the second time
        passes.append(hf.predict_evaluation(model, args, rows, training, compute_metrics=metrics))
    first, again = passes
    assert first.collected is not None and first.collected.bytes_per_sample["predictions"] > 0
    assert again.collected == first.collected
    assert again.allocated_bytes == first.allocated_bytes
