"""The planner's rules, as properties over synthetic estimates (no tracing needed)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import memfit
from memfit import (
    InsufficientMemoryError,
    InvalidInputError,
    MemoryEstimate,
    Phase,
    PhaseModel,
    Precision,
    StepCurve,
    plan,
)
from memfit.units import GiB, MiB


def linear_estimate(
    fixed: int, per_sample: float, *, batch: int = 8, context: int | None = 500 * MiB, ratio: float = 1.0
) -> StepCurve:
    """A step whose peak is ``fixed + per_sample x batch`` (allocated), reserved ``ratio`` x that (read off the
    fit: no trace)."""
    model = PhaseModel(2, Phase.BACKWARD, fixed, per_sample)
    allocated = model.at(batch)
    value = MemoryEstimate(
        batch_size=batch,
        device="cuda",
        precision=Precision.FP32,
        optimizer="adamw",
        gradient_checkpointing=False,
        peak_allocated_bytes=allocated,
        peak_reserved_bytes=math.ceil(allocated * ratio),
        cuda_context_bytes=context,
        peak_step=2,
        peak_phase=Phase.BACKWARD,
        breakdown={},
        fixed_bytes=fixed,
        per_sample_bytes=math.ceil(per_sample),
        phases=(),
        phase_models=(model,),
        trace_seconds=0.0,
        reserved_to_allocated_ratio=ratio,
    )
    return StepCurve(value)


estimates = st.builds(
    linear_estimate,
    fixed=st.integers(100 * MiB, 40 * GiB),
    per_sample=st.floats(1 * MiB, 4 * GiB),
    batch=st.integers(1, 64),
    ratio=st.floats(1.0, 1.3),
)


@settings(max_examples=300, deadline=None)
@given(
    estimate=estimates,
    capacity=st.integers(1 * GiB, 200 * GiB),
    margin=st.floats(0.0, 0.3),
    target=st.integers(1, 4096),
    world=st.integers(1, 8),
    max_batch=st.one_of(st.none(), st.integers(1, 512)),
)
def test_plan_fits_is_maximal_and_keeps_the_effective_batch(estimate, capacity, margin, target, world, max_batch):
    budget = int(capacity * (1 - margin))
    try:
        chosen = plan(
            estimate,
            capacity,
            margin=margin,
            target_batch_size=target,
            world_size=world,
            max_batch_size=max_batch,
        )
    except InsufficientMemoryError as error:
        assert estimate.at(1).device_bytes > budget
        assert "micro batch 1 does not fit" in str(error)
        return
    assert chosen.budget_bytes == budget
    assert estimate.at(chosen.micro_batch_size).device_bytes <= budget
    assert chosen.predicted_peak_bytes == estimate.at(chosen.micro_batch_size).device_bytes
    # the largest fitting micro batch really is the largest, unless a cap stopped it
    cap = min(max_batch or 1 << 31, math.ceil(target / world))
    largest = chosen.largest_micro_batch
    assert largest == cap or estimate.at(largest + 1).device_bytes > budget
    # fewest accumulation steps, or a few more for an exact split; then the smallest micro batch for them
    per_device = math.ceil(target / world)
    fewest = math.ceil(per_device / largest)
    exact = [a for a in range(fewest, 2 * fewest + 1) if per_device % a == 0 and per_device // a >= largest / 2]
    assert chosen.accumulate_grad_batches == (exact[0] if exact else fewest)
    assert chosen.micro_batch_size * chosen.accumulate_grad_batches >= per_device
    assert (chosen.micro_batch_size - 1) * chosen.accumulate_grad_batches < per_device
    if exact and target % world == 0:
        assert chosen.effective_batch_size == target
    assert chosen.effective_batch_size == chosen.micro_batch_size * chosen.accumulate_grad_batches * world
    assert chosen.effective_batch_size >= target
    differs = any("differs from the target" in reason for reason in chosen.reasons)
    assert differs == (chosen.effective_batch_size != target)
    assert not chosen.gradient_checkpointing


@settings(max_examples=200, deadline=None)
@given(
    estimate=estimates,
    capacity=st.integers(1 * GiB, 200 * GiB),
    max_batch=st.one_of(st.none(), st.integers(1, 512)),
)
def test_max_mode_takes_the_largest_micro_batch_without_accumulation(estimate, capacity, max_batch):
    assume(estimate.at(1).device_bytes <= int(capacity * 0.95))
    chosen = plan(estimate, capacity, target_batch_size="max", max_batch_size=max_batch)
    assert chosen.accumulate_grad_batches == 1
    assert chosen.target_batch_size is None
    micro = chosen.micro_batch_size
    assert micro == max_batch or estimate.at(micro + 1).device_bytes > chosen.budget_bytes


def test_default_target_is_the_configured_batch_times_devices() -> None:
    estimate = linear_estimate(2 * GiB, 1 * GiB, batch=32)
    chosen = plan(estimate, 20 * GiB, margin=0.0, world_size=2)
    # 20 GiB - 0.5 GiB context - 2 GiB fixed leaves room for 17 samples per micro batch
    assert chosen.largest_micro_batch == 17
    assert (chosen.micro_batch_size, chosen.accumulate_grad_batches) == (16, 2)
    assert chosen.effective_batch_size == chosen.target_batch_size == 64


def test_checkpointing_only_when_needed_and_traced_only_then() -> None:
    without = linear_estimate(10 * GiB, 3 * GiB)
    with_ckpt = linear_estimate(10 * GiB, 0.5 * GiB)
    calls = []

    def trace_checkpointed() -> StepCurve:
        calls.append(1)
        return with_ckpt

    roomy = plan(without, 80 * GiB, target_batch_size=16, checkpointed=trace_checkpointed)
    assert not roomy.gradient_checkpointing and calls == []

    tight = plan(without, 12 * GiB, target_batch_size=16, checkpointed=trace_checkpointed)
    assert tight.gradient_checkpointing and calls == [1]
    assert tight.micro_batch_size >= 1
    assert any("checkpointing brings it within" in reason for reason in tight.reasons)

    with pytest.raises(InsufficientMemoryError):
        plan(
            without,
            12 * GiB,
            target_batch_size=16,
            checkpointed=trace_checkpointed,
            allow_checkpointing=False,
        )


def test_checkpointing_for_a_markedly_larger_micro_batch() -> None:
    without = linear_estimate(1 * GiB, 6 * GiB)  # 2 samples fit in 15 GiB
    with_ckpt = linear_estimate(1 * GiB, 0.5 * GiB)  # 26 samples fit
    chosen = plan(without, 16 * GiB, target_batch_size=64, checkpointed=with_ckpt)
    assert chosen.gradient_checkpointing
    assert chosen.largest_micro_batch >= 4 * 2


def test_too_small_budget_names_the_numbers() -> None:
    estimate = linear_estimate(30 * GiB, 1 * GiB)
    with pytest.raises(InsufficientMemoryError) as error:
        plan(estimate, 16 * GiB, margin=0.05, checkpointed=linear_estimate(29 * GiB, 0.1 * GiB))
    message = str(error.value)
    assert "even with checkpointing" in message
    assert "15.20 GiB" in message and "16.00 GiB" in message  # budget and capacity


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"margin": 1.0}, "margin must be a fraction"),
        ({"target_batch_size": 0}, "target_batch_size must be a positive integer"),
        ({"target_batch_size": "most"}, "target_batch_size must be a positive integer"),
        ({"world_size": 0}, "world_size"),
        ({"min_batch_size": 4, "max_batch_size": 2}, "at least min_batch_size"),
    ],
)
def test_bad_plan_arguments(kwargs, match) -> None:
    with pytest.raises(InvalidInputError, match=match):
        plan(linear_estimate(GiB, MiB), 10 * GiB, **kwargs)
    with pytest.raises(InvalidInputError, match="capacity_bytes"):
        plan(linear_estimate(GiB, MiB), 0)


def test_an_exact_split_beats_the_fewest_steps() -> None:
    estimate = linear_estimate(1 * GiB, 1 * GiB, context=None)
    chosen = plan(estimate, 8 * GiB, margin=0.0, target_batch_size=32)  # 7 samples fit
    assert chosen.largest_micro_batch == 7
    assert (chosen.micro_batch_size, chosen.accumulate_grad_batches, chosen.effective_batch_size) == (4, 8, 32)
    odd = plan(estimate, 8 * GiB, margin=0.0, target_batch_size=31)  # prime: no exact split under 7
    assert (odd.micro_batch_size, odd.accumulate_grad_batches, odd.effective_batch_size) == (7, 5, 35)
    assert any("differs from the target 31" in reason for reason in odd.reasons)
    exact = next(reason for reason in chosen.reasons if "keep the effective batch of 32" in reason)
    assert "(5 steps of 7 would run 35 samples, not the target)" in exact  # why 4, not the largest 7


def test_the_reasons_of_a_missed_target_say_what_runs_and_never_that_it_keeps_the_target() -> None:
    estimate = linear_estimate(1 * GiB, 1 * GiB, context=None)
    odd = plan(estimate, 8 * GiB, margin=0.0, target_batch_size=13)  # 7 fit; 13 is prime
    assert odd.effective_batch_size != 13
    assert not [reason for reason in odd.reasons if "keep the effective batch" in reason]
    (why,) = [reason for reason in odd.reasons if "target" in reason]
    assert f"effective batch {odd.effective_batch_size} differs from the target 13" in why
    assert "micro batch 1 x 13 steps" in why and "under half the largest that fits" in why
    devices = plan(estimate, 8 * GiB, margin=0.0, target_batch_size=13, world_size=2)
    assert "13 is not a multiple of 2 devices" in " ".join(devices.reasons)
    assert ", not the target 13;" in odd.summary()


def test_confirming_trace_steps_the_micro_batch_down_when_interpolation_was_optimistic() -> None:
    optimistic = linear_estimate(1 * GiB, 1 * GiB, context=None)  # says 9 samples fit in 10 GiB
    calls = []

    def confirm(micro: int, checkpointing: bool, accumulation: int) -> StepCurve:
        calls.append(micro)
        return linear_estimate(2 * GiB, 1 * GiB, batch=micro, context=None)  # the real step is 1 GiB heavier

    chosen = plan(optimistic, 10 * GiB, margin=0.0, target_batch_size="max", confirm=confirm)
    assert calls == [9, 8]
    assert chosen.micro_batch_size == 8 and chosen.predicted_peak_bytes == 10 * GiB
    assert chosen.predicted_allocated_bytes == 10 * GiB
    assert any("a trace at micro batch 9 predicts" in reason for reason in chosen.reasons)

    with pytest.raises(InsufficientMemoryError, match="a trace at that size predicts"):
        plan(linear_estimate(1 * GiB, 1 * GiB, context=None), 2 * GiB, margin=0.0, target_batch_size="max",
             confirm=lambda micro, ckpt, _: linear_estimate(3 * GiB, 1 * GiB, batch=micro, context=None))  # fmt: skip


def test_a_target_that_only_accumulation_misses_says_the_accumulation_is_what_does_not_fit() -> None:
    """Micro batch 8 alone is over 10 GiB; split 1 x 8, the gradients kept across micro batches are too."""

    def confirm(micro: int, checkpointing: bool, accumulation: int) -> StepCurve:
        held = 4 * GiB if accumulation > 1 else 0  # what accumulating holds beside one micro batch
        return linear_estimate(8 * GiB + held, 1 * GiB, batch=micro, context=None)

    with pytest.raises(InsufficientMemoryError) as raised:
        plan(linear_estimate(8 * GiB, 1 * GiB, context=None), 10 * GiB, margin=0.0, target_batch_size=8,
             allow_checkpointing=False, confirm=confirm)  # fmt: skip
    message = str(raised.value)
    assert "micro batch 1 does not fit: a trace at that size, accumulating 8 steps toward the target of 8, " in message
    assert "Without accumulation it needs 9.00 GiB" in message and "Lower the target batch or raise" in message


def test_a_micro_batch_held_by_max_batch_size_is_said_to_be_the_bound_not_what_fits() -> None:
    roomy = linear_estimate(1 * GiB, GiB // 16, context=None)  # 144 samples fit in 10 GiB
    split = plan(roomy, 10 * GiB, margin=0.0, target_batch_size=50, max_batch_size=20)
    assert (split.micro_batch_size, split.accumulate_grad_batches) == (10, 5)
    assert split.reasons[0].startswith("micro batch 20 fits and is the max_batch_size bound (larger ones were not")
    largest = plan(roomy, 10 * GiB, margin=0.0, target_batch_size="max", max_batch_size=20)
    assert largest.micro_batch_size == 20 and "max_batch_size bound" in largest.reasons[0]
    assert "is the largest that fits" in plan(roomy, 10 * GiB, margin=0.0, target_batch_size=200).reasons[0]


def test_plan_on_a_real_trace() -> None:
    import zoo

    case = zoo.gpt2_case(batch=4, seq=128)
    loop = memfit.TrainingLoop(accumulation_steps=4)  # the loop the plan will run
    curve = memfit.trace(case.model, case.batch, loop=loop)
    capacity = curve.at(3).device_bytes + 1
    chosen = plan(curve, capacity, margin=0.0, target_batch_size=12)
    assert chosen.largest_micro_batch == 3
    assert (chosen.micro_batch_size, chosen.accumulate_grad_batches, chosen.effective_batch_size) == (3, 4, 12)
    assert "micro batch 3 x accumulation 4" in chosen.summary()
    assert not any("room is kept" in reason for reason in chosen.reasons)


def test_accumulation_planned_from_a_trace_without_it_keeps_room_for_the_gradients() -> None:
    """Accumulation keeps the gradients through every micro batch: without a trace of that loop, the
    plan must hold them on top, and end up at or above what a trace with accumulation predicts."""
    import zoo

    case = zoo.gpt2_case(batch=4, seq=128)
    plain_curve = memfit.trace(case.model, case.batch)
    plain = plain_curve.estimate
    accumulating_curve = memfit.trace(case.model, case.batch, loop=memfit.TrainingLoop(accumulation_steps=4))
    assert plain.gradient_bytes > 0
    assert accumulating_curve.at(3).allocated_bytes > plain_curve.at(3).allocated_bytes  # what the loop adds
    capacity = accumulating_curve.at(3).device_bytes + 1
    chosen = plan(plain_curve, capacity, margin=0.0, target_batch_size=12)
    assert chosen.accumulate_grad_batches > 1
    assert any("room is kept" in reason for reason in chosen.reasons)
    exact = accumulating_curve.at(chosen.micro_batch_size)
    assert chosen.predicted_allocated_bytes >= exact.allocated_bytes
    assert chosen.predicted_peak_bytes >= exact.device_bytes
    assert chosen.micro_batch_size <= 3

    calls = []

    def confirm(micro: int, checkpointing: bool, accumulation: int) -> StepCurve:
        calls.append((micro, accumulation))
        loop = memfit.TrainingLoop(accumulation_steps=accumulation)
        return memfit.trace(case.model, case.batch, batch_size=micro, loop=loop)

    confirmed = plan(plain_curve, capacity, margin=0.0, target_batch_size=12, confirm=confirm)
    # the plan chosen was confirmed by a trace of its own loop (a larger micro batch may be tried after it)
    assert (confirmed.micro_batch_size, confirmed.accumulate_grad_batches) in calls
    assert confirmed.accumulate_grad_batches > 1
    assert confirmed.predicted_peak_bytes <= capacity
    assert not any("room is kept" in reason for reason in confirmed.reasons)


def test_checkpointing_is_not_traced_when_the_optimizer_step_alone_is_over_budget() -> None:
    from memfit.simulation.replay import PhasePeak

    optimizer_step = PhasePeak(1, Phase.OPTIMIZER, 20 * GiB, 20 * GiB, {})
    estimate = linear_estimate(30 * GiB, 1 * GiB).replaced(phases=(optimizer_step,))
    traced: list[bool] = []
    with pytest.raises(InsufficientMemoryError) as error:
        plan(estimate, 16 * GiB, checkpointed=lambda: traced.append(True))
    assert traced == []  # the checkpointed trace would not have changed the answer
    message = str(error.value)
    assert "checkpointing cannot help" in message and "optimizer step alone holds 20.49 GiB" in message  # + context


def test_a_split_whose_confirmation_does_not_fit_falls_back_to_checkpointing() -> None:
    optimistic = linear_estimate(1 * GiB, 1 * GiB, context=None)  # says micro batch 4 fits in 5.5 GiB
    checkpointed = linear_estimate(1 * GiB, GiB / 4, context=None)

    def confirm(micro: int, checkpointing: bool, accumulation: int) -> StepCurve:
        if checkpointing:
            return linear_estimate(1 * GiB, GiB / 4, batch=micro, context=None)
        return linear_estimate(6 * GiB, 1 * GiB, batch=micro, context=None)  # the real step: nothing fits

    chosen = plan(
        optimistic, 11 * GiB // 2, margin=0.0, target_batch_size=8, checkpointed=checkpointed, confirm=confirm
    )
    assert chosen.gradient_checkpointing and chosen.micro_batch_size == 8
    assert chosen.predicted_peak_bytes == 3 * GiB
    assert any("does not fit once traced at its size; checkpointing" in reason for reason in chosen.reasons)
    with pytest.raises(InsufficientMemoryError, match="a trace at that size predicts"):
        plan(optimistic, 11 * GiB // 2, margin=0.0, target_batch_size=8, allow_checkpointing=False, confirm=confirm)


def test_plan_from_dict_is_the_inverse_of_to_dict() -> None:
    chosen = plan(linear_estimate(4 * GiB, 1 * GiB), 16 * GiB, target_batch_size=24, world_size=2)
    data = chosen.to_dict()
    assert memfit.Plan.from_dict(data) == chosen
    assert memfit.Plan.from_dict(json.loads(json.dumps(data))) == chosen  # as a checkpoint stores it
    assert memfit.Plan.from_dict(data).to_dict() == data
    with pytest.raises(InvalidInputError, match="micro_batch_size"):
        memfit.Plan.from_dict({k: v for k, v in data.items() if k != "micro_batch_size"})
    with pytest.raises(InvalidInputError, match="headroom"):
        memfit.Plan.from_dict({**data, "headroom": 1})


def test_with_reason_adds_one_reason_and_keeps_the_rest() -> None:
    chosen = plan(linear_estimate(4 * GiB, 1 * GiB), 16 * GiB)
    restored = chosen.with_reason("restored from the checkpoint")
    assert restored.reasons == (*chosen.reasons, "restored from the checkpoint")
    assert {**restored.to_dict(), "reasons": None} == {**chosen.to_dict(), "reasons": None}


def test_confirming_traces_step_the_micro_batch_up_when_interpolation_was_pessimistic() -> None:
    pessimistic = linear_estimate(2 * GiB, 1 * GiB, context=None)  # says 8 samples fit in 10 GiB
    calls = []

    def confirm(micro: int, checkpointing: bool, accumulation: int) -> StepCurve:
        calls.append(micro)
        return linear_estimate(1 * GiB, 1 * GiB, batch=micro, context=None)  # the real step: 9 fit

    chosen = plan(pessimistic, 10 * GiB, margin=0.0, target_batch_size="max", confirm=confirm)
    assert chosen.micro_batch_size == chosen.largest_micro_batch == 9
    assert calls == [8, 9, 10]  # the guess, the answer, and the one above it that does not fit
    assert any("micro batch 9 fits once traced" in r and "10 does not" in r and "interpolation said 8" in r
               for r in chosen.reasons)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    fixed=st.integers(1 * GiB, 20 * GiB),
    linear=st.floats(1 * MiB, 2 * GiB),
    curvature=st.floats(0.0, 0.2),
    error=st.floats(0.25, 4.0),
    capacity=st.integers(2 * GiB, 200 * GiB),
    target=st.one_of(st.just("max"), st.integers(1, 4096)),
    max_batch=st.one_of(st.none(), st.integers(1, 512)),
)
def test_the_search_over_confirming_traces_finds_the_largest_that_fits(
    fixed, linear, curvature, error, capacity, target, max_batch
):
    """Against a brute-force scan of a convex "real" step (the interpolation's slope off by ``error``):
    the largest micro batch fits once traced, the next does not unless capped, in a few traces."""

    def real(micro: int) -> StepCurve:  # peak = fixed + linear x b + curvature x linear x b^2
        return linear_estimate(fixed + round(curvature * linear * micro * micro), linear, batch=micro, context=None)

    calls = []

    def confirm(micro: int, checkpointing: bool, accumulation: int) -> StepCurve:
        calls.append((micro, accumulation))
        return real(micro)

    guess = linear_estimate(fixed, linear * error, context=None)
    per_device = None if target == "max" else target
    cap = min(max_batch or 1 << 31, per_device or 1 << 31)
    try:
        chosen = plan(guess, capacity, margin=0.0, target_batch_size=target, max_batch_size=max_batch,
                      allow_checkpointing=False, confirm=confirm)  # fmt: skip
    except InsufficientMemoryError:
        assert guess.at(1).device_bytes > capacity or real(1).estimate.peak_bytes > capacity
        return
    largest = chosen.largest_micro_batch
    assert real(largest).estimate.peak_bytes <= capacity
    assert largest == cap or real(largest + 1).estimate.peak_bytes > capacity
    assert real(chosen.micro_batch_size).estimate.peak_bytes == chosen.predicted_peak_bytes <= capacity
    assert len(calls) == len(set(calls))  # each configuration traced once
    assert len(calls) <= 2 * math.log2(largest + 1) + 6


def test_a_split_over_budget_once_traced_falls_back_to_the_fewest_steps_then_searches_below() -> None:
    estimate = linear_estimate(1 * GiB, 1 * GiB, context=None)

    def confirm_over_at(*over: tuple[int, int]):
        def confirm(micro: int, checkpointing: bool, accumulation: int) -> StepCurve:
            held = 8 * GiB if (micro, accumulation) in over else 0  # as if that window held far more batches
            return linear_estimate(1 * GiB + held, 1 * GiB, batch=micro, context=None)

        return confirm

    # 7 samples fit in 8 GiB: the exact split 4 x 8 is over once traced, the fewest steps 7 x 5 are not
    exact_over = plan(estimate, 8 * GiB, margin=0.0, target_batch_size=32, confirm=confirm_over_at((4, 8)))
    assert (exact_over.micro_batch_size, exact_over.accumulate_grad_batches) == (7, 5)
    assert exact_over.largest_micro_batch == 7
    # 9 samples fit in 10 GiB, but its split 8 x 5 does not: the search goes on below 9
    split_over = plan(estimate, 10 * GiB, margin=0.0, target_batch_size=40, confirm=confirm_over_at((8, 5)))
    assert (split_over.micro_batch_size, split_over.accumulate_grad_batches) == (5, 8)
    assert split_over.largest_micro_batch == 7
    assert any("micro batch 9 fits, but not its split" in reason for reason in split_over.reasons)


def test_a_hopeless_verdict_quotes_the_optimizer_step_at_the_batch_it_judges() -> None:
    """The optimizer step of a trace at a large batch also holds that batch: it cannot stand for batch 1."""
    import re

    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.GELU(), nn.Linear(512, 512))
    traced_curve = memfit.trace(model, torch.randn(1024, 512), optimizer="adamw", target=memfit.Target("cpu"),
                             loss_fn=lambda out, batch: out.pow(2).mean())  # fmt: skip
    with pytest.raises(InsufficientMemoryError) as verdict:
        plan(traced_curve, 40 * MiB, target_batch_size=1024, include_context=False)
    message = str(verdict.value)
    sizes = [memfit.parse_bytes(size.replace(" ", "")) for size in re.findall(r"(\d+\.\d+ [KMG]iB)", message)]
    assert "optimizer step alone holds" in message
    peak, optimizer_step = sizes[0], sizes[1]
    assert optimizer_step <= peak  # a part of the peak at micro batch 1, not the traced batch's figure


def test_a_plan_that_keeps_room_for_accumulated_gradients_names_the_context_it_holds() -> None:
    """Planned without confirm= from a trace without accumulation, the plan keeps room for the gradients and cannot
    replay the accumulating loop at the allocator's limit: its peak is the one with room to spare, so the summary's
    parts are the reserved peak and the CUDA context itself, and what the step needs at the limit is said apart."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=8000, n_positions=512, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    ids = torch.randint(0, 8000, (8, 512))
    curve = memfit.trace(GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids})
    context = curve.estimate.cuda_context_bytes
    chosen = plan(curve, "1100MiB", target_batch_size=64)
    assert chosen.accumulate_grad_batches > 1 and any("room is kept" in reason for reason in chosen.reasons)
    assert chosen.needed_bytes < chosen.predicted_peak_bytes == chosen.predicted_reserved_bytes + context
    assert (
        f"(reserved {memfit.format_bytes(chosen.predicted_reserved_bytes)} + CUDA context "
        f"{memfit.format_bytes(context)}); needs {memfit.format_bytes(chosen.needed_bytes)}" in chosen.summary()
    )
