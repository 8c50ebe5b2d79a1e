"""plan_training_arguments and MemoryPlannerCallback with a real transformers.Trainer on CPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerControl, TrainerState, TrainingArguments

import memfit
from memfit.huggingface import PLAN_FILE, MemoryPlannerCallback, attach, plan_training_arguments
from memfit.integrations.huggingface.arguments import checkpointing_switch, model_checkpointing

SEQ = 32
VOCAB = 500
MARGIN = 0.05
# On CPU: the prediction and the process's resident memory, never a drift between the two
DRIFT_KEYS = {"memfit/predicted_peak_allocated_bytes", "memfit/measured_peak_rss_bytes"}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 240) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index], "note": "not a model input"}


def tiny_gpt2(layers: int = 2) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, loss_type="ForCausalLM")
    return GPT2LMHeadModel(config)


def training_args(tmp_path: Path, **kwargs) -> TrainingArguments:
    defaults = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 12,
        "max_steps": 6,
        "logging_steps": 2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    return TrainingArguments(**{**defaults, **kwargs})


def budget_between(traced: memfit.StepCurve, micro: int) -> int:
    low, high = traced.at(micro).device_bytes, traced.at(micro + 1).device_bytes
    return math.ceil((low + high) / 2 / (1 - MARGIN))


def accumulating_estimate(model: torch.nn.Module, args: TrainingArguments, data: Any) -> memfit.StepCurve:
    """The step as the Trainer runs it with accumulation: later micro batches keep the gradients."""
    accumulating = dataclasses.replace(args, gradient_accumulation_steps=4)
    planned = plan_training_arguments(model, accumulating, data, budget="1GiB", max_batch_size=12)
    assert (planned.plan.micro_batch_size, planned.plan.accumulate_grad_batches) == (12, 4)
    assert planned.traced is not None and planned.traced.estimate == planned.estimate
    return planned.traced


class BatchSizes:
    """Record the batch size of every real forward (memfit's trace runs on fake tensors)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[int] = []
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        if ids is not None and not torch._subclasses.fake_tensor.is_fake(ids):
            self.seen.append(ids.shape[0])


def test_planned_arguments_take_effect_in_a_real_trainer(tmp_path: Path) -> None:
    model, data = tiny_gpt2(), Tokens()
    args = training_args(tmp_path)
    roomy = plan_training_arguments(model, args, data, budget="1GiB")
    assert roomy.plan.micro_batch_size == 12 and roomy.args.gradient_accumulation_steps == 1
    budget = budget_between(accumulating_estimate(model, args, data), 3)  # the plan will be 3 x 4
    planned = plan_training_arguments(model, args, data, budget=budget, margin=MARGIN)
    assert args.per_device_train_batch_size == 12  # the input is left alone
    assert (planned.args.per_device_train_batch_size, planned.args.gradient_accumulation_steps) == (3, 4)
    assert planned.plan.effective_batch_size == 12

    sizes = BatchSizes(model)
    trainer = Trainer(model=model, args=planned.args, train_dataset=data)
    attach(trainer, plan=planned.plan)
    trainer.train()
    assert trainer.state.train_batch_size == 3
    assert trainer.state.global_step == 6
    assert set(sizes.seen) == {3} and len(sizes.seen) == 24  # 6 steps x 4 micro batches


def test_precision_is_the_one_accelerate_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``accelerate launch --mixed_precision bf16`` sets ACCELERATE_MIXED_PRECISION; the Trainer's flags stay off."""
    model, data = tiny_gpt2(), Tokens()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    callback = MemoryPlannerCallback(verbose=False)
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=1), train_dataset=data, callbacks=[callback])
    trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16" and not trainer.args.bf16
    assert callback.estimate.precision is memfit.Precision.BF16_MIXED
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    plain = plan_training_arguments(model, training_args(tmp_path), data, budget="1GiB")
    assert plain.estimate.precision is memfit.Precision.FP32


def test_tight_budget_turns_on_checkpointing_in_the_trainer(tmp_path: Path) -> None:
    model, data = tiny_gpt2(layers=4), Tokens()
    args = training_args(tmp_path, max_steps=1)
    plain = accumulating_estimate(model, args, data)  # micro batch 1 or 2 of 12: accumulation either way
    sample = {"input_ids": data.ids[:12], "labels": data.ids[:12]}
    checkpointed_curve = memfit.trace(
        model,
        sample,
        target=memfit.Target("cpu"),
        gradient_checkpointing=True,
        loop=memfit.TrainingLoop(accumulation_steps=4),
    )
    budget = math.ceil((plain.at(1).device_bytes + checkpointed_curve.at(1).device_bytes) / 2 / (1 - MARGIN))
    planned = plan_training_arguments(model, args, data, budget=budget, margin=MARGIN)
    assert planned.plan.gradient_checkpointing and getattr(planned.args, checkpointing_switch(args))
    trainer = Trainer(model=model, args=planned.args, train_dataset=data)
    trainer.train()
    assert model_checkpointing(model)


def test_every_report_to_tracker_receives_the_memfit_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)  # HF keeps a process-wide URI if one is set (Lightning's MLFlowLogger sets it)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "memfit-hf")
    mlflow.create_experiment("memfit-hf", artifact_location=str(tmp_path / "art"))  # artifacts stay in tmp_path
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    model, data = tiny_gpt2(), Tokens()
    # transformers 5 reads the TensorBoard folder from the environment; 4.x from logging_dir
    older = {"logging_dir": str(tmp_path / "tb")} if "logging_dir" in TrainingArguments.__dataclass_fields__ else {}
    args = training_args(tmp_path, report_to=["tensorboard", "mlflow"], **older)
    planned = plan_training_arguments(model, args, data, budget="1GiB")
    trainer = Trainer(model=model, args=planned.args, train_dataset=data)
    callback = attach(trainer, plan=planned.plan)
    assert trainer.callback_handler.callbacks[0] is callback  # before the trackers
    trainer.train()

    # the Trainer's own history (``trainer_state.json``) holds them too, though it copies the logs before callbacks
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged if set(entry) >= DRIFT_KEYS] == [2, 4, 6]
    assert logged[0]["memfit/micro_batch_size"] == 12 and "memfit/micro_batch_size" not in logged[1]

    event_files = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert event_files
    events = EventAccumulator(str(event_files[0].parent))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {f"train/{key}" for key in DRIFT_KEYS} <= scalars  # HF's TensorBoard callback prefixes train/
    assert [e.step for e in events.Scalars("train/memfit/measured_peak_rss_bytes")] == [2, 4, 6]
    assert not [key for key in scalars if "drift_" in key or "from_rss" in key]

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("memfit-hf")
    (run,) = client.search_runs([experiment.experiment_id])
    assert set(run.data.metrics) >= DRIFT_KEYS  # "/" is kept by HF's MLflow key sanitiser
    assert run.data.metrics["memfit/micro_batch_size"] == 12
    history = client.get_metric_history(run.info.run_id, "memfit/measured_peak_rss_bytes")
    assert [m.step for m in history] == [2, 4, 6]
    if importlib.util.find_spec("matplotlib"):  # the pictures: MLflow artifacts, TensorBoard images, output_dir
        assert {a.path for a in client.list_artifacts(run.info.run_id, "memfit")} == {
            "memfit/timeline.png",
            "memfit/drift.png",
        }
        images = EventAccumulator(str(event_files[0].parent), size_guidance={"images": 0})
        images.Reload()
        assert {"memfit/timeline", "memfit/drift"} <= set(images.Tags()["images"])
        assert (Path(args.output_dir) / "memfit_timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_keeps_the_plan_saved_in_the_checkpoint(tmp_path: Path) -> None:
    model, data = tiny_gpt2(), Tokens()
    args = training_args(tmp_path, save_strategy="steps", save_steps=2, max_steps=2)
    budget = budget_between(accumulating_estimate(model, args, data), 3)  # the plan will be 3 x 4
    first = plan_training_arguments(model, args, data, budget=budget, margin=MARGIN)
    trainer = Trainer(model=model, args=first.args, train_dataset=data)
    attach(trainer, plan=first.plan)
    trainer.train()
    saved = Path(args.output_dir) / "checkpoint-2" / PLAN_FILE
    assert json.loads(saved.read_text())["micro_batch_size"] == 3

    resumed = plan_training_arguments(model, args, data, budget="1GiB", resume_from_checkpoint=True)
    assert (resumed.args.per_device_train_batch_size, resumed.args.gradient_accumulation_steps) == (3, 4)
    assert "restored from the checkpoint" in resumed.plan.reasons


def test_callback_without_a_plan_observes_and_warns_on_mismatch(tmp_path: Path) -> None:
    model, data = tiny_gpt2(), Tokens()
    args = training_args(tmp_path, max_steps=2)
    other_plan = plan_training_arguments(model, args, data, budget="1GiB").plan
    mismatched = dataclasses.replace(other_plan, micro_batch_size=5, reasons=())
    with pytest.warns(UserWarning, match="not the planned 5"):
        Trainer(model=model, args=args, train_dataset=data, callbacks=[MemoryPlannerCallback(plan=mismatched)])
    callback = MemoryPlannerCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    assert callback.estimate is not None and callback.estimate.batch_size == 12
    assert [d.step for d in callback.monitor.history] == [2]


def test_bad_input() -> None:
    with pytest.raises(memfit.InvalidInputError, match="TrainingArguments"):
        plan_training_arguments(tiny_gpt2(), {"per_device_train_batch_size": 8}, Tokens())
    with pytest.raises(memfit.InvalidInputError, match="train_dataset is None"):
        plan_training_arguments(tiny_gpt2(), training_args(Path("unused")), None)
    with pytest.raises(memfit.InvalidInputError, match="the dataset is empty"):
        plan_training_arguments(tiny_gpt2(), training_args(Path("unused")), [])
    with pytest.raises(memfit.InvalidInputError, match="one-shot iterator"):
        plan_training_arguments(tiny_gpt2(), training_args(Path("unused")), iter(Tokens()))
    with pytest.raises(memfit.InvalidInputError, match="`margin`"):
        MemoryPlannerCallback(margin=2)
    with pytest.raises(memfit.InvalidInputError, match="`on_oom` must be 'replan' or 'raise'"):
        MemoryPlannerCallback(on_oom=True)


def test_ddp_options_are_the_ones_the_trainer_passes_to_accelerate() -> None:
    """``Trainer._build_accelerator_args`` decides find_unused_parameters from the model; memfit follows it."""
    import types

    from memfit import DDPConfig
    from memfit.integrations.huggingface.arguments import ddp_config

    def args(**overrides: Any) -> Any:
        fields = {"world_size": 2, "fsdp": None, "deepspeed": None, "ddp_find_unused_parameters": None,
                  "ddp_bucket_cap_mb": None, "ddp_static_graph": None, "gradient_checkpointing": False}  # fmt: skip
        return types.SimpleNamespace(**{**fields, **overrides})

    model = tiny_gpt2()
    assert ddp_config(args(world_size=1), model) is None
    assert ddp_config(args(), model, sharded=True) is None  # FSDP or DeepSpeed runs: not DDP
    assert ddp_config(args(), model) == DDPConfig(find_unused_parameters=True)
    assert ddp_config(args(gradient_checkpointing=True), model) == DDPConfig(find_unused_parameters=False)
    renamed = args(activation_checkpointing=True)  # the newer name wins where both exist
    assert ddp_config(renamed, model) == DDPConfig(find_unused_parameters=False)
    assert ddp_config(args(ddp_bucket_cap_mb=50, ddp_static_graph=True, ddp_find_unused_parameters=False), model) == (
        DDPConfig(bucket_cap_mb=50, static_graph=True)
    )
    assert ddp_config(args(), torch.nn.Linear(2, 2)) == DDPConfig(find_unused_parameters=True)  # not a PreTrainedModel


def test_variable_lengths_are_planned_at_the_longest_batch(tmp_path: Path) -> None:
    """With dynamic padding the longest batch makes the peak, wherever it falls in the epoch."""
    from harness.accuracy.loops import hf_train_variable_lengths, pad_to_longest
    from harness.accuracy.reference import profiled_cpu_peak

    train, callback, first_batch = hf_train_variable_lengths(tmp_path)
    measured = profiled_cpu_peak(train)
    predicted = callback.estimate.peak_allocated_bytes
    assert first_batch().peak_allocated_bytes < 0.5 * measured  # the first batch alone would under-predict
    assert measured <= predicted <= 1.02 * measured  # read-ahead batches are costed at the longest too

    def planned_peak(lengths: list[int]) -> int:
        rows = [{"input_ids": [1] * n} for n in lengths]
        args = training_args(tmp_path, per_device_train_batch_size=8)
        return plan_training_arguments(
            tiny_gpt2(), args, rows, budget="1GiB", data_collator=pad_to_longest
        ).estimate.peak_allocated_bytes

    # the plan's batch pads to the one long example, as a batch of long examples would be
    assert planned_peak([8] * 40 + [SEQ]) == planned_peak([SEQ] * 8) > planned_peak([8] * 8)


def word_tokenizer(words: list[str]) -> Any:
    """A real fast tokenizer built in code (no download): one id per word, [PAD] = 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{word: i + 2 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")


def test_text_columns_are_dropped_before_the_tokenizers_padding_collator(tmp_path: Path) -> None:
    """With a tokenizer as processing_class the Trainer pads with DataCollatorWithPadding, which
    cannot collate a text column: the Trainer drops unused columns first, and so must the plan."""
    from transformers import GPT2ForSequenceClassification

    words = [f"w{i}" for i in range(40)]
    tokenizer = word_tokenizer(words)
    texts = [" ".join(words[: 4 + i % 20]) for i in range(48)]
    rows = [{"text": text, "label": i % 3, **tokenizer(text)} for i, text in enumerate(texts)]
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(words) + 2, n_positions=SEQ, num_labels=3,
                        pad_token_id=0)  # fmt: skip
    args = training_args(tmp_path, per_device_train_batch_size=8)
    planned = plan_training_arguments(
        GPT2ForSequenceClassification(config), args, rows, budget="1GiB", processing_class=tokenizer
    )
    callback = MemoryPlannerCallback(verbose=False)
    Trainer(model=GPT2ForSequenceClassification(config), args=planned.args, train_dataset=rows,
            processing_class=tokenizer, callbacks=[callback]).train()  # fmt: skip
    # the plan traced the batch the Trainer collates: its longest examples, padded by the tokenizer
    assert planned.estimate.peak_allocated_bytes == callback.estimate.peak_allocated_bytes
    with pytest.raises(
        memfit.InvalidInputError, match=r"data collator cannot batch 12 examples.*remove_unused_columns"
    ):
        plan_training_arguments(GPT2ForSequenceClassification(config), training_args(
            tmp_path, remove_unused_columns=False), rows, budget="1GiB", processing_class=tokenizer)  # fmt: skip


class TokenStream(torch.utils.data.IterableDataset):
    """A stream (no length, no index), as ``datasets`` streaming or a web dataset gives."""

    def __iter__(self) -> Any:
        generator = torch.Generator().manual_seed(0)
        for _ in range(100):
            ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
            yield {"input_ids": ids, "labels": ids}


def test_a_streaming_dataset_is_planned_on_its_first_examples(tmp_path: Path) -> None:
    args = training_args(tmp_path, per_device_train_batch_size=4, max_steps=3)
    planned = plan_training_arguments(tiny_gpt2(), args, TokenStream(), budget="1GiB")
    callback = MemoryPlannerCallback(verbose=False)
    Trainer(model=tiny_gpt2(), args=planned.args, train_dataset=TokenStream(), callbacks=[callback]).train()
    assert callback.estimate is not None  # the callback predicted the streamed run
    assert planned.estimate.peak_allocated_bytes == callback.estimate.peak_allocated_bytes
    assert planned.estimate.batch_size == 4


class ShortFirstStream(torch.utils.data.IterableDataset):
    """A stream whose first examples are short and whose later ones reach the model's positions."""

    def __iter__(self) -> Any:
        generator = torch.Generator().manual_seed(0)
        for index in range(64):
            ids = torch.randint(0, VOCAB, (4 if index < 16 else SEQ,), generator=generator)
            yield {"input_ids": ids, "labels": ids}


def pad_to_longest(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.stack([torch.nn.functional.pad(e["input_ids"], (0, length - len(e["input_ids"]))) for e in examples])
    return {"input_ids": ids, "labels": ids}


def test_a_stream_is_planned_at_the_longest_batch_it_can_produce_and_says_from_what(tmp_path: Path) -> None:
    """A stream's lengths cannot be read ahead: its first examples (4 tokens here) are planned stretched to the
    model's positions (32), the peak of a batch that long, and the plan says so where the user reads it."""
    model = tiny_gpt2()
    args = training_args(tmp_path, per_device_train_batch_size=4, max_steps=3)
    streamed = plan_training_arguments(model, args, ShortFirstStream(), data_collator=pad_to_longest, budget="1GiB")
    longest = plan_training_arguments(model, args, Tokens(), budget="1GiB")  # every example 32 tokens long
    assert streamed.estimate.peak_allocated_bytes == longest.estimate.peak_allocated_bytes
    (note,) = [r for r in streamed.plan.reasons if "stream" in r]
    assert (
        "first examples (4 tokens)" in note
        and "stretched to 32 tokens, the model's 32 positions (transformer.wpe)" in note
    )
    bounded = plan_training_arguments(model, args, ShortFirstStream(), data_collator=pad_to_longest, budget="1GiB",
                                      max_length=16)  # fmt: skip
    assert "stretched to 16 tokens, max_length=16" in " ".join(bounded.plan.reasons)
    assert bounded.estimate.peak_allocated_bytes < streamed.estimate.peak_allocated_bytes

    callback = MemoryPlannerCallback(verbose=False)
    Trainer(model=model, args=args, train_dataset=ShortFirstStream(), data_collator=pad_to_longest,
            callbacks=[callback]).train()  # fmt: skip
    assert callback.estimate.peak_allocated_bytes == longest.estimate.peak_allocated_bytes


def test_a_tokenized_datasets_dataset_is_planned_as_the_trainer_batches_it(tmp_path: Path) -> None:
    """The common path: ``datasets.Dataset.map(tokenizer)`` (text column kept, a length column) and the
    language-modeling collator, which pads to the longest in the batch."""
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling

    from memfit.tracing.batch import longest_examples

    words = [f"w{i}" for i in range(40)]
    tokenizer = word_tokenizer(words)
    texts = [" ".join(words[: 4 + (5 * i) % 28]) for i in range(64)]
    dataset = Dataset.from_dict({"text": texts}).map(lambda batch: tokenizer(batch["text"]), batched=True)
    dataset = dataset.map(lambda example: {"length": len(example["input_ids"])})
    # the length column and a scan of the examples find the same longest ones
    assert longest_examples(dataset, 8) == longest_examples(dataset.remove_columns("length"), 8)
    chosen = sorted(len(dataset[i]["input_ids"]) for i in longest_examples(dataset, 8))
    assert chosen == sorted(dataset["length"])[-8:]

    def model() -> GPT2LMHeadModel:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(words) + 2, n_positions=SEQ,
                                          pad_token_id=0))  # fmt: skip

    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    args = training_args(tmp_path, per_device_train_batch_size=8, max_steps=4)
    planned = plan_training_arguments(model(), args, dataset, budget="1GiB", data_collator=collator,
                                      processing_class=tokenizer)  # fmt: skip
    callback = MemoryPlannerCallback(verbose=False)
    Trainer(model=model(), args=planned.args, train_dataset=dataset, data_collator=collator,
            processing_class=tokenizer, callbacks=[callback]).train()  # fmt: skip
    # the callback sees the dataset the Trainer stripped of `text` and `length`, and finds the same batch
    assert planned.estimate.peak_allocated_bytes == callback.estimate.peak_allocated_bytes


def test_attach_puts_the_trainers_callback_first_and_holds_the_trainer(tmp_path: Path) -> None:
    """Passed in ``callbacks=[...]``, the callback attaches itself when the Trainer is built: first, before the
    ``report_to`` trackers HF puts ahead of user callbacks, and holding the Trainer; ``attach`` then uses it."""
    model, data = tiny_gpt2(), Tokens()
    callback = MemoryPlannerCallback(verbose=False)
    trainer = Trainer(model=model, args=training_args(tmp_path, report_to=["tensorboard"]), train_dataset=data,
                      callbacks=[callback])  # fmt: skip
    assert trainer.callback_handler.callbacks[0] is callback and callback._trainer is trainer
    assert attach(trainer) is callback
    assert trainer.callback_handler.callbacks[0] is callback
    assert sum(isinstance(c, MemoryPlannerCallback) for c in trainer.callback_handler.callbacks) == 1
    with pytest.raises(memfit.InvalidInputError, match="already has a MemoryPlannerCallback"):
        attach(trainer, margin=0.1)
    with pytest.raises(memfit.InvalidInputError, match=r"takes a transformers\.Trainer"):
        attach(model)
    trainer.train()
    assert callback.recovery is not None and callback.monitor is not None
    assert "training_step" not in vars(trainer)  # the wrapped step is undone when training ends


def test_a_callback_in_the_trainers_list_alone_reaches_the_trackers_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``attach``, ``Trainer(callbacks=[MemoryPlannerCallback()])`` (or ``add_callback``) works the same:
    the memfit keys reach TensorBoard and out-of-memory recovery is on, with no warning about attaching."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, data = tiny_gpt2(), Tokens()
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # transformers 5; 4.x: logging_dir
    older = {"logging_dir": str(tmp_path / "tb")} if "logging_dir" in TrainingArguments.__dataclass_fields__ else {}
    args = training_args(tmp_path, max_steps=2, report_to=["tensorboard"], **older)
    callback = MemoryPlannerCallback(verbose=False)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "attach" in str(w.message)]
    assert callback.recovery is not None and [d.step for d in callback.monitor.history] == [2]
    (event_file,) = (tmp_path / "tb").rglob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file.parent))
    events.Reload()
    assert {f"train/{key}" for key in DRIFT_KEYS} <= set(events.Tags()["scalars"])

    added = MemoryPlannerCallback(verbose=False)
    later = Trainer(model=model, args=training_args(tmp_path, max_steps=2), train_dataset=data)
    later.add_callback(added)
    later.train()
    assert later.callback_handler.callbacks[0] is added and added.recovery is not None


def test_a_callback_called_outside_a_trainer_measures_but_says_what_it_cannot_do(tmp_path: Path) -> None:
    """Events that do not come from a Trainer (a loop of one's own calling the callback) leave it unattached: it
    predicts and measures, and warns once that recovery and the trackers need ``attach``."""
    model, data = tiny_gpt2(), Tokens()
    args = training_args(tmp_path, max_steps=2)
    callback = MemoryPlannerCallback(verbose=False)
    loader = torch.utils.data.DataLoader(data, batch_size=12, collate_fn=_model_inputs)
    state, control = TrainerState(), TrainerControl()
    with pytest.warns(UserWarning, match="not attached.*attach\\(trainer") as caught:
        callback.on_train_begin(args, state, control, model=model, train_dataloader=loader)
    assert sum("not attached" in str(w.message) for w in caught) == 1
    assert callback.estimate is not None and callback.recovery is None


def _model_inputs(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([e[key] for e in examples]) for key in ("input_ids", "labels")}


def test_attach_plans_a_built_trainer_in_one_line(tmp_path: Path) -> None:
    """``attach(trainer, budget=...)`` plans on what the Trainer was built with and applies it to the built
    Trainer: its dataloader, accumulation and logs run the plan; the arguments it was built with are untouched."""
    model, data = tiny_gpt2(), Tokens()
    args = training_args(tmp_path)
    budget = budget_between(accumulating_estimate(model, args, data), 3)  # the plan will be 3 x 4
    sizes = BatchSizes(model)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    callback = attach(trainer, budget=budget, margin=MARGIN)
    assert (callback.plan.micro_batch_size, callback.plan.accumulate_grad_batches) == (3, 4)
    assert args.per_device_train_batch_size == 12 and trainer.args.per_device_train_batch_size == 3
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()
    assert trainer.state.train_batch_size == 3 and trainer.state.global_step == 6
    assert set(sizes.seen) == {3} and len(sizes.seen) == 24  # 6 steps x 4 micro batches: the effective batch kept
    first = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert (first["memfit/micro_batch_size"], first["memfit/accumulate_grad_batches"]) == (3, 4)

    with pytest.raises(memfit.InvalidInputError, match=r"either plan= .* or budget="):
        attach(Trainer(model=model, args=args, train_dataset=data), plan=callback.plan, budget="1GiB")
    with pytest.raises(memfit.InvalidInputError, match="no train_dataset"):
        attach(Trainer(model=model, args=args), budget="1GiB")
    finder = training_args(tmp_path, auto_find_batch_size=True)
    with pytest.raises(memfit.InvalidInputError, match="auto_find_batch_size"):
        attach(Trainer(model=model, args=finder, train_dataset=data), budget="1GiB")


def test_the_plan_and_the_callback_quote_one_peak_and_cpu_logs_no_drift(tmp_path: Path) -> None:
    """The callback measures against the figure the plan quotes (``at`` the micro batch), not a second one."""
    model, data = tiny_gpt2(), Tokens()
    planned = plan_training_arguments(model, training_args(tmp_path, max_steps=4, logging_steps=1), data, budget="1GiB")
    trainer = Trainer(model=model, args=planned.args, train_dataset=data)
    callback = attach(trainer, plan=planned.plan)
    trainer.train()
    windows = callback.monitor.history
    assert len(windows) == 4 and not [kind for window in windows for kind in window.alarm_kinds]  # no leak in 4 steps
    assert {w.predicted_reserved_bytes for w in windows} == {planned.plan.predicted_reserved_bytes}
    assert {w.predicted_allocated_bytes for w in windows} == {planned.plan.predicted_allocated_bytes}
    assert memfit.format_bytes(planned.plan.predicted_peak_bytes) in callback.monitor.final_line()
    assert all(w.drift_pct is None and "memfit/drift_rss_pct" not in w.metrics() for w in windows)


def test_a_cpu_run_planned_for_a_gpu_quotes_its_own_tensors_first_and_last(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """budget="h100" on a laptop: the plan is the H100's, the run the CPU's. The run is said and measured against its
    own trace's tensors, at the start and in the final line, not the H100's reserved figure called "tensors"."""
    trainer = Trainer(model=tiny_gpt2(), args=training_args(tmp_path, max_steps=2, logging_steps=1),
                      train_dataset=Tokens(48))  # fmt: skip
    callback = attach(trainer, budget="h100", max_batch_size=8)
    with caplog.at_level(logging.INFO, logger="memfit"):
        trainer.train()
    own = callback.traced.at(callback.plan.micro_batch_size)
    assert own.reserved_bytes == own.allocated_bytes  # a CPU trace: tensor bytes
    assert callback.plan.predicted_reserved_bytes != own.reserved_bytes  # the H100's allocator figure
    first = next(record.message for record in caplog.records if "predicted peak of this CPU run" in record.message)
    assert f"{memfit.format_bytes(own.allocated_bytes)} of tensors" in first
    assert f"predicted peak {memfit.format_bytes(own.reserved_bytes)} of tensors" in callback.monitor.final_line()


def test_accumulation_the_plan_adds_keeps_the_loss_and_gradients_of_the_configured_batch(tmp_path: Path) -> None:
    """BERT's classification loss ignores ``num_items_in_batch`` while its forward takes ``**kwargs``, so the
    Trainer would add up the micro batches' mean losses: a plan of 4 x 4 would log (and step on) four times the
    loss of the configured 16. ``attach`` makes the Trainer average them, and says so."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=generator), "labels": i % 3} for i in range(64)]

    def first_log(**planning: Any) -> tuple[dict[str, float], Trainer]:
        torch.manual_seed(0)
        args = training_args(tmp_path, per_device_train_batch_size=16, max_steps=1, logging_steps=1)
        trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=data)
        if planning:
            attach(trainer, verbose=False, **planning)
        trainer.train()
        return next(entry for entry in trainer.state.log_history if "loss" in entry), trainer

    configured, _ = first_log()
    planned, trainer = first_log(budget="1GiB", max_batch_size=4)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 4)
    assert planned["loss"] == pytest.approx(configured["loss"], rel=1e-4)
    assert planned["grad_norm"] == pytest.approx(configured["grad_norm"], rel=1e-3)
    callback = trainer.callback_handler.callbacks[0]
    assert any("model_accepts_loss_kwargs = False" in reason for reason in callback.plan.reasons)


def test_the_loss_line_says_so_where_the_plan_runs_another_effective_batch(tmp_path: Path) -> None:
    """13 samples a step with micro batches of at most 7: no split that fits hits 13 (a prime), so the plan runs
    7 x 2 = 14. The line on the loss must not claim the configured batch's loss: it names the 14 and the 13."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, num_labels=3)  # fmt: skip
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,)), "labels": i % 3} for i in range(32)]
    args = training_args(tmp_path, per_device_train_batch_size=13, max_steps=1, logging_steps=1)
    trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=data)
    callback = attach(trainer, budget="1GiB", max_batch_size=7, verbose=False)
    trainer.train()
    plan = callback.plan
    assert (plan.micro_batch_size, plan.accumulate_grad_batches, plan.effective_batch_size) == (7, 2, 14)
    line = next(reason for reason in plan.reasons if "model_accepts_loss_kwargs = False" in reason)
    assert "each optimizer step now takes 14 samples, not the configured 13" in line
    assert "those of the configured batch" not in line


@pytest.mark.parametrize("path", ["attach", "plan_training_arguments"])
def test_a_configured_accumulation_keeps_its_summed_loss_when_the_plan_changes_it(tmp_path: Path, path: str) -> None:
    """Configured with 2 accumulation steps, BERT's Trainer adds up 2 micro batches' mean losses. A plan of 4 x 8
    (by attach, or by plan_training_arguments and attach(plan=...)) keeps that sum: the same loss and gradients."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=generator), "labels": i % 3} for i in range(64)]

    def first_log(plan: bool) -> tuple[dict[str, float], Trainer]:
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
        args = training_args(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=2, max_steps=1,
                             logging_steps=1)  # fmt: skip
        if plan and path == "plan_training_arguments":
            planned = plan_training_arguments(model, args, data, budget="1GiB", max_batch_size=4)
            trainer = Trainer(model=model, args=planned.args, train_dataset=data)
            attach(trainer, plan=planned.plan, verbose=False)
        else:
            trainer = Trainer(model=model, args=args, train_dataset=data)
            if plan:
                attach(trainer, budget="1GiB", max_batch_size=4, verbose=False)
        trainer.train()
        return next(entry for entry in trainer.state.log_history if "loss" in entry), trainer

    configured, _ = first_log(plan=False)
    planned, trainer = first_log(plan=True)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 8)
    assert planned["loss"] == pytest.approx(configured["loss"], rel=1e-4)
    assert planned["grad_norm"] == pytest.approx(configured["grad_norm"], rel=1e-3)
    callback = trainer.callback_handler.callbacks[0]
    assert any("multiplies each micro batch's loss by 2" in reason for reason in callback.plan.reasons)


def test_dataloader_drop_last_is_named_when_the_plan_changes_what_it_drops(tmp_path: Path) -> None:
    args = training_args(tmp_path, per_device_train_batch_size=12, dataloader_drop_last=True)
    with pytest.warns(UserWarning, match=r"batches of 12 dropped 10, the planned 4 drop 2, so each epoch trains on 8 "
                                         r"more samples"):  # fmt: skip
        planned = plan_training_arguments(tiny_gpt2(), args, Tokens(250), budget="1GiB", max_batch_size=4)
    assert planned.args.per_device_train_batch_size == 4


def test_the_largest_micro_batch_is_never_more_than_the_training_set(tmp_path: Path) -> None:
    """target_batch_size="max" on a GPU's budget would take tens of thousands of samples a batch; a 40-sample set
    makes batches of 40 at most, and the plan says so in its figures."""
    planned = plan_training_arguments(tiny_gpt2(), training_args(tmp_path), Tokens(40), budget="h100",
                                      target_batch_size="max")  # fmt: skip
    assert planned.plan.micro_batch_size == planned.plan.effective_batch_size == 40
    assert planned.args.per_device_train_batch_size == 40


def test_attach_names_an_option_it_does_not_know_and_a_flag_that_is_not_one(tmp_path: Path) -> None:
    trainer = Trainer(model=tiny_gpt2(), args=training_args(tmp_path), train_dataset=Tokens(24))
    with pytest.raises(memfit.InvalidInputError, match=r"attach\(\) got unknown option\(s\) \['log_every_n_steps'\]"):
        attach(trainer, budget="1GiB", log_every_n_steps=5)
    with pytest.raises(memfit.InvalidInputError, match="`allow_checkpointing` must be True or False, got 'no'"):
        attach(trainer, budget="1GiB", allow_checkpointing="no")


def test_a_plan_the_trainer_does_not_run_changes_nothing_of_its_loss(tmp_path: Path) -> None:
    """attach(plan=...) on a Trainer built with the arguments planned from: one warning, and the loss is left as
    the Trainer computes it (the plan's accumulation is not the run's)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, num_labels=3)  # fmt: skip
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,)), "labels": i % 3} for i in range(32)]
    args = training_args(tmp_path, per_device_train_batch_size=16, max_steps=1)
    model = BertForSequenceClassification(config)
    planned = plan_training_arguments(model, args, data, budget="1GiB", max_batch_size=4)
    trainer = Trainer(model=model, args=args, train_dataset=data)  # not planned.args
    attach(trainer, plan=planned.plan, verbose=False)
    with pytest.warns(UserWarning, match="not the planned 4 x 4"):
        trainer.train()
    assert trainer.model_accepts_loss_kwargs is True


def test_with_rows_of_many_lengths_the_callback_measures_against_the_plans_figure(tmp_path: Path) -> None:
    """The plan is traced on the longest rows (inputs and labels); the loader hands out others. The run's windows
    are measured against the figure the plan quotes, not a second trace of whatever batch came first."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                num_heads=4, decoder_start_token_id=0, pad_token_id=0))  # fmt: skip
    generator = torch.Generator().manual_seed(1)

    def row() -> dict[str, list[int]]:
        inputs, labels = (int(torch.randint(low, high, (1,), generator=generator)) for low, high in ((8, 40), (4, 20)))
        return {"input_ids": torch.randint(2, VOCAB, (inputs,), generator=generator).tolist(),
                "labels": torch.randint(2, VOCAB, (labels,), generator=generator).tolist()}  # fmt: skip

    rows = [row() for _ in range(100)]

    def collate(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        pad = torch.nn.utils.rnn.pad_sequence
        ids = pad([torch.tensor(r["input_ids"]) for r in batch], batch_first=True)
        labels = pad([torch.tensor(r["labels"]) for r in batch], batch_first=True, padding_value=-100)
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}

    args = training_args(tmp_path, per_device_train_batch_size=16, max_steps=2, logging_steps=1,
                         remove_unused_columns=False)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    callback = attach(trainer, budget="1GiB", max_batch_size=4, verbose=False)
    trainer.train()
    windows = callback.monitor.history
    assert windows and {w.predicted_allocated_bytes for w in windows} == {callback.plan.predicted_allocated_bytes}


def test_the_plan_is_the_same_however_the_configured_batch_is_split(tmp_path: Path) -> None:
    """16 x 1 and 4 x 4 ask for the same effective batch. Configured without accumulation, the traces find
    micro batch 1 where the interpolation said 2; checkpointing is weighed on that answer too, so both get the
    checkpointed 4 x 4."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=320, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                pad_token_id=0))  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(100):
        inputs, labels = (int(torch.randint(low, high, (1,), generator=generator)) for low, high in ((8, 40), (4, 20)))
        rows.append({"input_ids": torch.randint(2, 320, (inputs,), generator=generator),
                     "labels": torch.randint(2, 320, (labels,), generator=generator)})  # fmt: skip

    def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        pad = torch.nn.utils.rnn.pad_sequence
        ids = pad([r["input_ids"] for r in batch], batch_first=True)
        return {"input_ids": ids, "attention_mask": (ids != 0).long(),
                "labels": pad([r["labels"] for r in batch], batch_first=True, padding_value=-100)}  # fmt: skip

    plans = {}
    for micro, steps in ((16, 1), (4, 4)):
        args = training_args(tmp_path, per_device_train_batch_size=micro, gradient_accumulation_steps=steps)
        plan = plan_training_arguments(model, args, rows, data_collator=collate, budget="4MiB").plan
        plans[micro, steps] = (plan.micro_batch_size, plan.accumulate_grad_batches, plan.gradient_checkpointing)
    assert set(plans.values()) == {(4, 4, True)}
