"""One rank of a sharded run: DeepSpeed's own estimators, real 2-rank FSDP2 runs on gloo (fp32 and with a bf16
``MixedPrecisionPolicy``), FSDP2 itself on a fake process group, and consistency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import memfit
from fsdp2_fit import sample, tiny_gpt2, tiny_llama
from memfit import ShardingConfig, Target, TrainingLoop
from memfit.categories import Category
from memfit.errors import InvalidInputError

HERE = Path(__file__).resolve().parent
SEQ = 64


def _estimate(model: torch.nn.Module, sharding: ShardingConfig | None, **kwargs: object) -> memfit.MemoryEstimate:
    loop = TrainingLoop(sharding=sharding)
    return memfit.estimate(model, sample(2, SEQ), target=Target("cpu"), loop=loop, **kwargs)  # type: ignore[arg-type]


def _states(estimate: memfit.MemoryEstimate) -> int:
    return sum(estimate.rank_terms.values())


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    return tiny_gpt2(2, SEQ)


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    return peft.get_peft_model(tiny_gpt2(2, SEQ), config)


# --------------------------------------------------------------- DeepSpeed's estimators
@pytest.mark.parametrize("world", [2, 8])
def test_zero2_model_states_match_deepspeeds_estimator(gpt2: torch.nn.Module, world: int) -> None:
    stage2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    total = stage2.model_to_params(gpt2)  # what estimate_zero2_model_states_mem_needs_all_live counts
    for offload in (False, True):
        _, expected = stage2.estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=world, cpu_offload=offload)
        sharding = ShardingConfig("zero2", world, offload_optimizer=offload)
        ours = _estimate(gpt2, sharding, precision="bf16-mixed")
        assert ours.precision is memfit.Precision.BF16_TRUE  # DeepSpeed's bf16 converts the module
        assert _states(ours) == pytest.approx(expected, rel=1e-3), (offload, dict(ours.rank_terms))


@pytest.mark.parametrize("world", [2, 8])
def test_zero3_model_states_match_deepspeeds_estimator_but_its_missing_16_bit_partition(
    gpt2: torch.nn.Module, world: int
) -> None:
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    total, largest = stage3.model_to_params(gpt2)  # as estimate_zero3_model_states_mem_needs_all_live
    _, expected, largest_layer = stage3.estimate_zero3_model_states_mem_needs(
        total, largest, num_gpus_per_node=world, cpu_offload=False, cpu_offload_params=False
    )
    # every parameter partitioned, as DeepSpeed's estimator assumes (no small persistent ones)
    sharding = ShardingConfig("zero3", world, stage3_param_persistence_threshold=0)
    ours = _estimate(gpt2, sharding, precision="bf16-mixed")
    # DeepSpeed counts 18 bytes a parameter over the ranks plus 4 x its largest layer; the 16-bit parameter
    # partition each rank keeps (2 bytes a parameter over the ranks) is not among its 18
    assert _states(ours) == pytest.approx(expected - largest_layer + 2 * total // world, rel=1e-3)
    assert ours.rank_terms["parameters"] == pytest.approx(2 * total / world, rel=1e-3)


def test_lora_states_count_only_trainable_parameters_where_deepspeed_counts_all() -> None:
    stage2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    model = _lora(tiny_gpt2(2, SEQ))
    world = 4
    total = stage2.model_to_params(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable < total // 10
    _, deepspeed = stage2.estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=world, cpu_offload=False)
    ours = _estimate(model, ShardingConfig("zero2", world), precision="bf16-mixed")
    # 16-bit weights everywhere; gradients, fp32 master, fp32 gradients and Adam state for the adapters only
    # (peft keeps its adapters in fp32 on a 16-bit base; DeepSpeed's bf16 converts them with the module)
    assert _states(ours) < deepspeed
    assert _states(ours) == pytest.approx(2 * total + 18 * trainable / world, rel=0.02)
    assert ours.rank_terms["optimizer_state"] == pytest.approx(8 * trainable / world, rel=0.05)


# --------------------------------------------------------------- consistency
def test_per_rank_states_shrink_with_the_world_size_and_with_the_stage(gpt2: torch.nn.Module) -> None:
    by_world = {n: _states(_estimate(gpt2, ShardingConfig("zero3", n, stage3_param_persistence_threshold=0)))
                for n in (2, 4, 8)}  # fmt: skip
    assert by_world[2] > by_world[4] > by_world[8]
    fsdp = {n: _estimate(gpt2, ShardingConfig("fsdp", n)) for n in (2, 4, 8)}
    assert fsdp[2].rank_terms["parameters"] > fsdp[4].rank_terms["parameters"] > fsdp[8].rank_terms["parameters"]
    assert fsdp[2].peak_allocated_bytes > fsdp[4].peak_allocated_bytes > fsdp[8].peak_allocated_bytes
    ddp = {n: _states(_estimate(gpt2, ShardingConfig("ddp", n))) for n in (2, 8)}
    assert ddp[2] == ddp[8]
    stages = {s: _states(_estimate(gpt2, ShardingConfig(s, 8))) for s in ("ddp", "zero1", "zero2")}
    # this model's matrices are all under ZeRO-3's default persistence threshold (1e5 elements): kept whole
    stages["zero3"] = _states(_estimate(gpt2, ShardingConfig("zero3", 8, stage3_param_persistence_threshold=0)))
    persistent = _states(_estimate(gpt2, ShardingConfig("zero3", 8)))
    assert stages["zero3"] < stages["zero2"] < stages["zero1"] < stages["ddp"]
    # kept whole, with their partitions as well (DeepSpeed's ds_tensor of a persistent parameter)
    assert persistent > stages["zero2"]


def test_offload_moves_state_to_the_host_of_each_node(gpt2: torch.nn.Module) -> None:
    on_device = _estimate(gpt2, ShardingConfig("zero3", 4, gpus_per_node=2))
    offloaded = _estimate(gpt2, ShardingConfig("zero3", 4, gpus_per_node=2, offload_optimizer=True))
    assert offloaded.rank_terms["optimizer_state"] == 0 < on_device.rank_terms["optimizer_state"]
    assert offloaded.peak_allocated_bytes < on_device.peak_allocated_bytes
    moved = on_device.rank_terms["optimizer_state"] + on_device.rank_terms["fp32_master_weights"]
    assert offloaded.host_bytes_per_node is not None and offloaded.host_bytes_per_node >= 2 * moved
    assert on_device.host_bytes_per_node == 0


def test_frozen_parameters_have_no_gradients_or_state_under_fsdp() -> None:
    model = _lora(tiny_gpt2(2, SEQ))
    ours = _estimate(model, ShardingConfig("fsdp", 2))
    full = _estimate(tiny_gpt2(2, SEQ), ShardingConfig("fsdp", 2))
    assert ours.rank_terms["optimizer_state"] < full.rank_terms["optimizer_state"] / 10
    assert ours.rank_terms["gradients"] < full.rank_terms["gradients"] / 10


def test_fp32_adapters_on_a_16_bit_base_keep_fp32_gradients_and_state_under_fsdp() -> None:
    """peft keeps its adapters in fp32 on a bf16 base: FSDP shards each parameter in its own dtype, so the adapters'
    gradients and Adam state are fp32 shards, whatever the base's dtype (which the model's most common one is)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(tiny_gpt2(2, SEQ).to(torch.bfloat16), config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32}
    count, world = sum(p.numel() for p in trainable), 4
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    # cast to bf16 for compute (the trace's parameters) or not: the shards are stored as the parameters are
    for param_dtype in ("bfloat16", None):
        sharding = ShardingConfig("fsdp", world, mixed_precision_param_dtype=param_dtype)
        ours = _estimate(model, sharding, precision="bf16-mixed", optimizer="adamw")
        assert ours.rank_terms["optimizer_state"] == pytest.approx(8 * count / world, rel=0.05), param_dtype
        assert ours.rank_terms["gradients"] == pytest.approx(4 * count / world, rel=0.05), param_dtype
        # the bf16 base in 2-byte shards, the adapters in 4-byte ones, in the terms and in the rank's log
        parameters = ours.rank_terms["parameters"]
        assert parameters == pytest.approx((2 * frozen + 4 * count) / world, rel=0.01), param_dtype
        assert ours.breakdown[Category.PARAMETERS] == pytest.approx(parameters, rel=0.01), param_dtype


def test_checkpointing_composes_with_sharding(gpt2: torch.nn.Module) -> None:
    plain = _estimate(gpt2, ShardingConfig("fsdp", 4))
    checkpointed = _estimate(gpt2, ShardingConfig("fsdp", 4), gradient_checkpointing=True)
    assert checkpointed.gradient_checkpointing
    assert checkpointed.breakdown.get(Category.ACTIVATIONS, 0) < plain.breakdown.get(Category.ACTIVATIONS, 0)
    assert checkpointed.rank_terms == plain.rank_terms


def test_notes_say_which_rank_and_which_model(gpt2: torch.nn.Module) -> None:
    estimate = _estimate(gpt2, ShardingConfig("fsdp", 4))
    assert "per rank of 4, fsdp" in estimate.notes
    assert any("memfit.tracing.fsdp" in note for note in estimate.notes)
    assert estimate.loop.sharding == ShardingConfig("fsdp", 4)
    assert estimate.to_dict()["sharding"]["world_size"] == 4


def test_ddp_and_a_sharded_strategy_together_are_refused(gpt2: torch.nn.Module) -> None:
    with pytest.raises(InvalidInputError, match="not both"):
        memfit.estimate(gpt2, sample(2, SEQ), target=Target("cpu"),
                        loop=TrainingLoop(ddp=True, sharding=ShardingConfig("zero2", 2)))  # fmt: skip


# --------------------------------------------------------------- FSDP mixed precision
@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return tiny_llama(8, SEQ)


def _fsdp_mixed(model: torch.nn.Module, world: int, **kwargs: object) -> memfit.MemoryEstimate:
    """One rank of FSDP with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` in bf16-mixed, on a CUDA target."""
    sharding = ShardingConfig("fsdp", world, mixed_precision_param_dtype="bfloat16")
    return memfit.estimate(model, sample(2, SEQ), precision="bf16-mixed", loop=TrainingLoop(sharding=sharding),
                           **kwargs)  # type: ignore[arg-type]  # fmt: skip


def test_fsdp_in_mixed_precision_holds_fp32_shards_and_no_whole_model_bf16_copies(llama: torch.nn.Module) -> None:
    world = 8
    rank = _fsdp_mixed(llama, world)
    params = [p for p in llama.parameters()]
    total = sum(p.numel() for p in params)
    blocks = list(llama.model.layers)
    unit = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    root = total - sum(sum(p.numel() for p in b.parameters()) for b in blocks)
    assert rank.precision is memfit.Precision.BF16_MIXED  # autocast stays, as Lightning and accelerate run it
    # what the rank keeps whatever the batch: the fp32 shards of parameters, gradients and Adam's state, the root
    # and two blocks gathered in bf16, a block's whole bf16 gradients and its reduce-scatter input, the root's
    # whole bf16 gradients (reduced at the end of backward); autocast's bf16 copies of every fp32 weight, which a
    # trace of fp32 parameters holds from forward to backward, would add 2 bytes for each of the model's elements
    workspace = rank.breakdown.get(Category.WORKSPACE, 0)
    shards = 16 * total // world
    allowed = shards + 2 * (root + 2 * unit) + 2 * 2 * unit + 2 * root
    assert rank.fixed_bytes - workspace <= allowed < shards + 2 * total, (rank.fixed_bytes, allowed, total)
    # parameter-like bytes at the peak: the fp32 shard and the gathered bf16 root and units, nothing whole
    at_peak = rank.breakdown.get(Category.PARAMETERS, 0) + rank.breakdown.get(Category.SHARDING_BUFFERS, 0)
    assert at_peak <= 4 * total // world + 2 * (root + 2 * unit) + 2 * unit + 4096, rank.breakdown


def test_fsdp_in_mixed_precision_model_states_fall_as_one_over_the_ranks(llama: torch.nn.Module) -> None:
    total = sum(p.numel() for p in llama.parameters())
    ranks = {n: _fsdp_mixed(llama, n) for n in (2, 4, 8)}
    for n, rank in ranks.items():
        terms = rank.rank_terms
        # fp32 shards of the parameters and gradients, fp32 Adam state (two moments), whatever FSDP computes in
        assert terms["parameters"] == pytest.approx(4 * total / n, rel=0.01), (n, dict(terms))
        assert terms["gradients"] == pytest.approx(4 * total / n, rel=0.01), (n, dict(terms))
        assert terms["optimizer_state"] == pytest.approx(8 * total / n, rel=0.01), (n, dict(terms))
        assert terms["gathered_parameters"] == ranks[2].rank_terms["gathered_parameters"]
    peaks = [ranks[n].peak_allocated_bytes for n in (2, 4, 8)]
    assert peaks[0] > peaks[1] > peaks[2], peaks


@pytest.mark.parametrize("param_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_the_documented_fsdp_model_matches_fully_shard_on_a_fake_process_group(
    build: object, param_dtype: str | None
) -> None:
    model = build(2, SEQ)  # type: ignore[operator]
    sharding = ShardingConfig("fsdp", 2, mixed_precision_param_dtype=param_dtype)
    traced = _estimate(model, sharding)  # real fully_shard on fake tensors (fp32 loop, optimizer by name)
    assert any("fake process group" in note for note in traced.notes), traced.notes
    modelled = _estimate(model, sharding, optimizer=torch.optim.AdamW)
    assert any("documented model answers" in note for note in modelled.notes), modelled.notes
    # the root and two blocks gathered while blocks run, each unit's gradients whole until its reduce-scatter:
    # the documented model's peak is FSDP2's own (a tied and an untied output projection, fp32 and bf16 compute)
    assert modelled.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.005)


def _fully_shard_peak(build: object, world: int, param_dtype: str, loop: TrainingLoop) -> int:
    """Rank 0's peak tensor bytes of two optimizer steps of real ``fully_shard`` (each block, then the root) on a
    fake process group, micro batches and ``zero_grad`` as ``loop`` says (``memfit.tracing.fsdp2_fake``'s way)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with torch.device("meta"):
        model = build(2, SEQ)  # type: ignore[operator]
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype))
        for block in model.model.layers if hasattr(model, "model") else model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
            with tracker:
                batch = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sample(2, SEQ).items()}
                for _ in range(2):
                    for _ in range(loop.accumulation_steps):
                        model(**batch).loss.backward()
                        tracker.reset_mod_stats()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=loop.zero_grad != "in_place")
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    return int(next(v for d, v in peak.items() if torch.device(d).type == "cpu")["Total"])


@pytest.mark.parametrize("loop", [TrainingLoop(accumulation_steps=2), TrainingLoop(zero_grad="in_place")],
                         ids=["accumulation", "zero_grad-in-place"])  # fmt: skip
def test_kept_gradients_are_reduced_unit_by_unit_as_fully_shard_does(loop: TrainingLoop) -> None:
    """A backward whose gradients already exist gives birth to none: autograd's fresh ones are placed where the
    first backward's were born, whole until their unit's reduce-scatter, then added into the kept shards."""
    sharding = ShardingConfig("fsdp", 2, mixed_precision_param_dtype="bfloat16")
    modelled = memfit.estimate(
        tiny_llama(2, SEQ), sample(2, SEQ), target=Target("cpu"), optimizer=torch.optim.AdamW,
        loop=TrainingLoop(loop.zero_grad, loop.accumulation_steps, sharding=sharding),
    )  # fmt: skip
    measured = _fully_shard_peak(tiny_llama, 2, "bfloat16", loop)
    assert modelled.peak_allocated_bytes == pytest.approx(measured, rel=0.005), (
        modelled.peak_allocated_bytes,
        measured,
    )
    assert not torch.distributed.is_initialized()


def test_a_rank_log_built_from_shallow_traces_is_the_whole_models() -> None:
    """``memfit plan`` builds a deep model's log from traces at 3 and 4 blocks (``memfit.tracing.depth``); the built
    log says which block runs each event, so FSDP's units are placed in it as in a trace of the whole model."""
    from memfit.prediction.estimator import trace_for_runtimes

    sharding = ShardingConfig("fsdp", 4, mixed_precision_param_dtype="bfloat16")
    step = {"precision": "bf16-mixed", "loop": TrainingLoop(sharding=sharding)}
    whole = trace_for_runtimes(tiny_llama(6, SEQ), sample(2, SEQ), **step)[0].estimate  # type: ignore[arg-type]
    built = trace_for_runtimes(tiny_llama(6, SEQ), sample(2, SEQ), repeated=[tiny_llama(3, SEQ), tiny_llama(4, SEQ)],
                               **step)[0].estimate  # type: ignore[arg-type]  # fmt: skip
    assert any("built from traces at 3 and 4 blocks" in note for note in built.notes), built.notes
    assert [p.allocated_bytes for p in built.phases] == [p.allocated_bytes for p in whole.phases]
    assert built.rank_terms == whole.rank_terms


# --------------------------------------------------------------- real FSDP2 runs
def _gloo_run(tmp_path: Path, world: int, *args: str) -> list[int]:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "fsdp2.json"
    result = subprocess.run(
        [sys.executable, str(HERE / "fsdp2_fit.py"), str(world), str(out), *args], env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [rank["peak_bytes"] for rank in json.loads(out.read_text())]


def test_fsdp2_prediction_against_a_real_two_rank_gloo_run(tmp_path: Path, gpt2: torch.nn.Module) -> None:
    measured = _gloo_run(tmp_path, 2)
    traced = _estimate(gpt2, ShardingConfig("fsdp", 2))
    assert any("fake process group" in note for note in traced.notes), traced.notes
    # the documented model answers where the fake-process-group trace does not (an optimizer given as a class)
    modelled = _estimate(gpt2, ShardingConfig("fsdp", 2), optimizer=torch.optim.AdamW)
    assert any("documented model answers" in note for note in modelled.notes), modelled.notes
    single = _estimate(gpt2, None).peak_allocated_bytes
    for peak in measured:
        # FSDP2's own buffers, traced on fake tensors as rank 0 of 2: what each real rank holds
        assert traced.peak_allocated_bytes == pytest.approx(peak, rel=0.02), (traced.peak_allocated_bytes, measured)
        # and the documented model's: the last block's backward peaks before any reduce-scatter buffer exists
        assert modelled.peak_allocated_bytes == pytest.approx(peak, rel=0.01), (modelled.peak_allocated_bytes, measured)
    assert max(measured) < single  # sharding does save memory on each rank
    assert not torch.distributed.is_initialized()  # the fake process group is gone


def test_fsdp2_mixed_precision_against_a_real_two_rank_gloo_run(tmp_path: Path, gpt2: torch.nn.Module) -> None:
    """``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))``, no autocast: fp32 shards,
    bf16 gathered parameters, activations and gradients."""
    measured = _gloo_run(tmp_path, 2, "2", "2", str(SEQ), "bfloat16")
    sharding = ShardingConfig("fsdp", 2, mixed_precision_param_dtype="bfloat16")
    modelled = _estimate(gpt2, sharding, optimizer=torch.optim.AdamW)  # the documented model
    assert any("documented model answers" in note for note in modelled.notes), modelled.notes
    traced = _estimate(gpt2, sharding)
    fp32 = _estimate(gpt2, ShardingConfig("fsdp", 2), optimizer=torch.optim.AdamW)
    for peak in measured:
        assert modelled.peak_allocated_bytes == pytest.approx(peak, rel=0.01), (modelled.peak_allocated_bytes, measured)
        assert traced.peak_allocated_bytes == pytest.approx(peak, rel=0.02), (traced.peak_allocated_bytes, measured)
        assert peak < 0.8 * fp32.peak_allocated_bytes  # bf16 compute: the gathered units and activations halve
    # the same fp32 shards (Adam's scalar step counts, traced fp32, are scaled with the moments: a few bytes)
    expected = fp32.rank_terms | {"gathered_parameters": fp32.rank_terms["gathered_parameters"] // 2}
    assert modelled.rank_terms == pytest.approx(expected, rel=1e-3)


# --------------------------------------------------------------- depth extrapolation (the CLI's large models)
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sharded_traces_extrapolate_in_depth_like_a_whole_trace(strategy: str) -> None:
    from memfit.prediction.estimator import extrapolate_depth

    sharding = ShardingConfig(strategy, 4, stage3_param_persistence_threshold=0, reduce_bucket_size=100_000)
    loop = TrainingLoop(sharding=sharding)

    def at(depth: int) -> memfit.StepCurve:
        return memfit.trace(tiny_gpt2(depth, SEQ), sample(2, SEQ), loop=loop, precision="bf16-mixed")

    whole = at(6).estimate
    # from three blocks on (as memfit plan traces a sharded search): under FSDP two blocks have no middle one,
    # reduced while the next runs backward with a third prefetched, and one rank's step is affine in depth after
    extrapolated = extrapolate_depth(at(3), at(4), 3, 4, 6).estimate
    for name, size in whole.rank_terms.items():
        assert extrapolated.rank_terms[name] == pytest.approx(size, rel=0.01), name
    assert extrapolated.peak_allocated_bytes == pytest.approx(whole.peak_allocated_bytes, rel=0.03)
    assert extrapolated.sharding == sharding


def test_the_fake_process_group_trace_leaves_the_model_and_an_existing_group_alone(tmp_path: Path) -> None:
    model = tiny_gpt2(2, SEQ)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    traced = _estimate(model, ShardingConfig("fsdp", 2))
    assert any("fake process group" in note for note in traced.notes)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert all(not isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    assert not torch.distributed.is_initialized()
    # a process that already runs a default group: untouched, the documented model answers
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        modelled = _estimate(model, ShardingConfig("fsdp", 2))
        assert torch.distributed.get_world_size() == 1
    finally:
        torch.distributed.destroy_process_group()
    assert any("documented model answers" in note for note in modelled.notes)
