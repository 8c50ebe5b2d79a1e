"""memfit in a real custom ``accelerate`` loop on CPU: the plan applied before ``prepare``, drift to its trackers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from transformers import GPT2Config, GPT2LMHeadModel

import memfit
from memfit.accelerate import MemoryPlanner

SEQ, VOCAB = 32, 500


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def token_loader(batch_size: int = 12) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (96, SEQ), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in ids]
    return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True,
                                       generator=torch.Generator().manual_seed(1))  # fmt: skip


def test_the_plan_runs_in_an_accelerate_loop_with_the_same_samples_and_logs_to_its_trackers(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("memfit")
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    original = token_loader()
    planner = MemoryPlanner(accelerator, budget="1GiB", max_batch_size=3, log_every_n_steps=2, verbose=False)
    loader = planner.plan(model, optimizer, token_loader())
    plan = planner.planned
    assert (plan.micro_batch_size, plan.accumulate_grad_batches, plan.effective_batch_size) == (3, 4, 12)
    assert loader.batch_size == 3 and accelerator.gradient_accumulation_steps == 4

    # the same samples in the same order: 3-sample batches regroup the 12-sample ones
    planned_ids = torch.cat([b["input_ids"] for b in loader])
    assert torch.equal(planned_ids, torch.cat([b["input_ids"] for b in original]))

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen, steps = [], 0
    for batch in loader:
        with accelerator.accumulate(model):
            seen.append(batch["input_ids"].shape[0])
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            steps += 1
            planner.step_end()
        if steps == 4:
            break
    planner.end()
    accelerator.end_training()
    assert set(seen) == {3} and len(seen) == 16  # 4 optimizer steps of 4 micro batches
    assert [window.step for window in planner.monitor.history] == [2, 4]
    assert {w.predicted_allocated_bytes for w in planner.monitor.history} == {plan.predicted_allocated_bytes}

    (event_file,) = tmp_path.rglob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file.parent))
    events.Reload()
    assert [e.step for e in events.Scalars("memfit/measured_peak_rss_bytes")] == [2, 4]
    assert "memfit/predicted_peak_allocated_bytes" in events.Tags()["scalars"]


def test_the_plan_is_saved_with_the_run_and_a_resumed_run_keeps_it(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    planner = MemoryPlanner(accelerator, budget="1GiB", max_batch_size=3, verbose=False)
    model = tiny_gpt2()
    planner.plan(model, torch.optim.AdamW(model.parameters()), token_loader())
    resumed = MemoryPlanner(accelerator, budget="1GiB", verbose=False)  # a fresh plan would take all 12
    resumed.load_state_dict(planner.state_dict())
    loader = resumed.plan(model, torch.optim.AdamW(model.parameters()), token_loader())
    assert loader.batch_size == 3 and resumed.planned.reasons[-1] == "restored from the checkpoint"


def test_a_plan_restored_after_plan_is_kept_out_with_one_warning() -> None:
    """accelerate's usual order restores state after prepare, when the dataloader is batched already."""
    accelerator, model, first = _planned_at_three()
    late = MemoryPlanner(accelerator, budget="1GiB", verbose=False)
    loader = late.plan(model, torch.optim.AdamW(model.parameters()), token_loader())
    with pytest.warns(UserWarning, match=r"arrived after plan\(\) chose another .* call accelerator.load_state"):
        late.load_state_dict(first.state_dict())
    assert loader.batch_size == late.planned.micro_batch_size != 3


def test_bad_input_is_one_clear_line() -> None:
    with pytest.raises(memfit.InvalidInputError, match=r"takes an accelerate\.Accelerator"):
        MemoryPlanner(object())
    accelerator = Accelerator(cpu=True)
    with pytest.raises(memfit.InvalidInputError, match="margin"):
        MemoryPlanner(accelerator, margin=2)
    planner = MemoryPlanner(accelerator, budget="1GiB", verbose=False)
    model = tiny_gpt2()
    with pytest.raises(memfit.InvalidInputError, match="DataLoader the loop iterates"):
        planner.plan(model, torch.optim.AdamW(model.parameters()), [1, 2, 3])


def test_a_restored_plan_over_the_budget_given_now_is_kept_with_one_warning() -> None:
    accelerator, model, first = _planned_at_three()
    resumed = MemoryPlanner(accelerator, budget="1MiB", verbose=False)
    resumed.load_state_dict(first.state_dict())
    with pytest.warns(UserWarning, match=r"restored from the checkpoint \(micro batch 3 x 4\) is predicted at .*, "
                                         r"over the 1.00 MiB budget given now"):  # fmt: skip
        loader = resumed.plan(model, torch.optim.AdamW(model.parameters()), token_loader())
    assert loader.batch_size == 3 and resumed.planned.reasons[-1] == "restored from the checkpoint"


def _planned_at_three() -> tuple[Accelerator, torch.nn.Module, MemoryPlanner]:
    """A first run's planner, its plan held to micro batch 3 (3 x 4 for the loader's 12)."""
    accelerator, model = Accelerator(cpu=True), tiny_gpt2()
    first = MemoryPlanner(accelerator, budget="1GiB", max_batch_size=3, verbose=False)
    first.plan(model, torch.optim.AdamW(model.parameters()), token_loader())
    return accelerator, model, first


def test_with_drop_last_the_planned_loader_sees_the_samples_the_configured_one_saw() -> None:
    """90 samples in batches of 12 with drop_last: the run as configured sees 84 of them; planned at micro batch 3
    it sees the same 84 in the same order (not all 90, which batches of 3 would leave whole), in 28 batches, and so
    in every epoch after (the shuffling sampler's generator is drawn as the configured loader draws it)."""
    accelerator = Accelerator(cpu=True)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": row, "labels": row} for row in torch.randint(0, VOCAB, (90, SEQ), generator=generator)]

    def loader() -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(data, batch_size=12, shuffle=True, drop_last=True,
                                           generator=torch.Generator().manual_seed(1))  # fmt: skip

    configured_loader = loader()
    configured = [torch.cat([b["input_ids"] for b in configured_loader]) for _ in range(3)]
    model = tiny_gpt2()
    planner = MemoryPlanner(accelerator, budget="1GiB", max_batch_size=3, verbose=False)
    planned = planner.plan(model, torch.optim.AdamW(model.parameters()), loader())
    assert planner.planned.micro_batch_size == 3 and len(planned) == 28
    _, _, prepared = accelerator.prepare(model, torch.optim.AdamW(model.parameters()), planned)
    for epoch, seen in enumerate(configured):
        batches = [b["input_ids"] for b in prepared]
        assert len(seen) == 84 and torch.equal(torch.cat(batches), seen), epoch
        assert {len(b) for b in batches} == {3}
    assert not torch.equal(configured[0], configured[1])  # the epochs are shuffled apart


@pytest.mark.parametrize("budget", ["abc", "-1GiB", 0, "a100"])
def test_a_bad_budget_is_named_when_the_planner_is_built(budget: object) -> None:
    with pytest.raises(memfit.InvalidInputError):
        MemoryPlanner(Accelerator(cpu=True), budget=budget)


def test_a_flag_that_is_not_true_or_false_is_refused() -> None:
    with pytest.raises(memfit.InvalidInputError, match="`allow_checkpointing` must be True or False, got 'no'"):
        MemoryPlanner(Accelerator(cpu=True), allow_checkpointing="no")
    with pytest.raises(memfit.InvalidInputError, match="`verbose` must be True or False"):
        MemoryPlanner(Accelerator(cpu=True), verbose="yes")


def _last_update(
    samples: int, batch_size: int, accumulation: int, planned_to: tuple[int, int] | None
) -> tuple[float, list[str]]:
    """A real accelerate loop over identical samples: the last update's gradient norm over the first's, and the
    warnings planning gave (``planned_to``: the (micro batch, accumulation) the planner must choose; ``None``: the
    loop as configured, unplanned)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = torch.nn.Linear(4, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = torch.utils.data.DataLoader([{"x": torch.ones(4)} for _ in range(samples)], batch_size=batch_size)
    messages: list[str] = []
    if planned_to is not None:
        planner = MemoryPlanner(accelerator, budget="1GiB", max_batch_size=planned_to[0], verbose=False)
        with pytest.warns(UserWarning) as caught:
            loader = planner.plan(model, optimizer, loader, loss_fn=lambda out, batch: out.mean(),
                                  forward_fn=lambda m, batch: m(batch["x"]))  # fmt: skip
        messages = [str(w.message) for w in caught]
        assert (planner.planned.micro_batch_size, planner.planned.accumulate_grad_batches) == planned_to
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    norms = []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch["x"]).mean())
            if accelerator.sync_gradients:
                norms.append(model.weight.grad.norm().item())
            optimizer.step()
            optimizer.zero_grad()
    return norms[-1] / norms[0], messages


def test_the_warning_on_an_epochs_last_window_gives_the_update_a_real_loop_makes() -> None:
    """36 samples in batches of 8 with 2 accumulation steps end each epoch with a window of 4 samples in one micro
    batch; planned at 2 x 8 that window is 2 micro batches of 8 steps. accelerate divides every loss by the full
    steps, so with every sample's gradient the same, the last update is half the configured one: what the warning
    says, and what the loop does."""
    configured, _ = _last_update(36, 8, 2, None)
    planned, messages = _last_update(36, 8, 2, (2, 8))
    (warning,) = [m for m in messages if "incomplete accumulation window" in m]
    assert "window of 4 samples" in warning and "update is 0.50 x" in warning
    assert planned / configured == pytest.approx(0.5)


def test_a_last_window_only_the_plan_makes_incomplete_is_named_with_the_update_the_loop_makes() -> None:
    """39 samples in batches of 13 are three whole windows; micro batches of at most 5 cannot hit 13 (a prime), so the
    plan runs 5 x 3 = 15 and each epoch ends with 9 samples, two micro batches of a three-step window: accelerate
    divides each loss by 3, so that update is 0.67 x a full one. The warning says so, and the loop does it."""
    configured, _ = _last_update(39, 13, 1, None)
    planned, messages = _last_update(39, 13, 1, (5, 3))
    (warning,) = [m for m in messages if "incomplete accumulation window" in m]
    assert "window of 9 samples, which the run as configured (13 x 1) does not have" in warning
    assert "update is 0.67 x a full one" in warning
    assert configured == pytest.approx(1.0) and planned == pytest.approx(2 / 3)


def test_a_stream_is_rebatched_with_the_same_samples_in_the_same_order() -> None:
    """An IterableDataset has no sampler to hand on: the planned loader iterates the same stream, regrouped."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            generator = torch.Generator().manual_seed(0)
            for _ in range(48):
                row = torch.randint(0, VOCAB, (SEQ,), generator=generator)
                yield {"input_ids": row, "labels": row}

    accelerator, model = Accelerator(cpu=True), tiny_gpt2()
    planner = MemoryPlanner(accelerator, budget="1GiB", max_batch_size=3, verbose=False)
    configured = torch.utils.data.DataLoader(Stream(), batch_size=12)
    planned = planner.plan(model, torch.optim.AdamW(model.parameters()), configured)
    assert (planner.planned.micro_batch_size, accelerator.gradient_accumulation_steps) == (3, 4)
    ids = [batch["input_ids"] for batch in planned]
    assert {len(b) for b in ids} == {3}
    assert torch.equal(torch.cat(ids), torch.cat([b["input_ids"] for b in configured]))


def test_a_loader_plan_cannot_rebatch_is_named_with_what_to_pass() -> None:
    accelerator, model = Accelerator(cpu=True), tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    planner = MemoryPlanner(accelerator, budget="1GiB", verbose=False)
    data = token_loader().dataset
    sampled = torch.utils.data.DataLoader(data, batch_sampler=torch.utils.data.BatchSampler(range(len(data)), 4, False))
    with pytest.raises(memfit.InvalidInputError, match="built with batch_sampler=: build it with batch_size="):
        planner.plan(model, optimizer, sampled)
    _, _, prepared = accelerator.prepare(model, optimizer, token_loader())
    with pytest.raises(memfit.InvalidInputError, match=r"before accelerator\.prepare"):
        planner.plan(model, optimizer, prepared)
