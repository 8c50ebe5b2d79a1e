"""Lightning strategies read into one rank's ShardingConfig, and a real 2-process sharded fit that plans."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from torch.distributed.fsdp import CPUOffload, MixedPrecision
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from memfit import ShardingConfig
from memfit.errors import ShardingNotModelledError
from memfit.integrations.lightning.internals import LightningInternals
from memfit.integrations.lightning.sharding import strategy_layout
from test_lightning_ddp import run_ddp_script

INTERNALS = LightningInternals(L.pytorch)


def layout_of(strategy: object, world_size: int = 8, devices: int = 4):
    # Lightning refuses FSDP and DeepSpeed on CPU, so the strategy objects are real and the trainer is reduced
    # to the three attributes strategy_layout reads
    return strategy_layout(SimpleNamespace(strategy=strategy, world_size=world_size, num_devices=devices), INTERNALS)


def test_fsdp_strategy_options_become_the_sharding_config() -> None:
    strategy = FSDPStrategy(
        sharding_strategy="SHARD_GRAD_OP",
        cpu_offload=CPUOffload(offload_params=True),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        auto_wrap_policy={GPT2Block},
        activation_checkpointing_policy={GPT2Block},
    )
    layout = layout_of(strategy)
    assert layout.sharding == ShardingConfig(
        "fsdp-grad-op", world_size=8, gpus_per_node=4, offload_optimizer=True, offload_params=True,
        reshard_after_forward=False, mixed_precision_param_dtype="bfloat16",
    )  # fmt: skip
    assert layout.data_parallel_size == 8
    assert (layout.checkpointing, layout.checkpoint_modules) == (True, (GPT2Block,))
    assert layout.notes == ()  # blocks are FSDP units


def test_fsdp_hybrid_shards_within_a_node_and_notes_a_missing_wrap_policy() -> None:
    layout = layout_of(FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 4)))
    assert layout.sharding.strategy == "fsdp-hybrid"
    assert layout.sharding.shard_group_size == 4 and layout.sharding.nodes == 2
    assert any("no auto_wrap_policy" in note for note in layout.notes)
    assert not layout.checkpointing
    plain = layout_of(FSDPStrategy(auto_wrap_policy={GPT2Block}))
    assert plain.sharding == ShardingConfig("fsdp", world_size=8, gpus_per_node=4)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_strategy_stage_offload_and_buckets(stage: int) -> None:
    strategy = DeepSpeedStrategy(stage=stage, offload_optimizer=True, offload_parameters=stage == 3,
                                 reduce_bucket_size=5e7, allgather_bucket_size=2e8)  # fmt: skip
    sharding = layout_of(strategy).sharding
    assert sharding.strategy == f"zero{stage}"
    assert (sharding.world_size, sharding.gpus_per_node) == (8, 4)
    assert sharding.offload_optimizer and sharding.offload_params == (stage == 3)
    assert (sharding.reduce_bucket_size, sharding.allgather_bucket_size) == (50_000_000, 200_000_000)


def test_deepspeed_strategy_config_dict_and_what_it_cannot_model(tmp_path: Path) -> None:
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "stage3_prefetch_bucket_size": 1e6,
            "stage3_max_live_parameters": 3e8, "stage3_param_persistence_threshold": 1000}  # fmt: skip
    config = {"zero_optimization": zero}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    sharding = layout_of(DeepSpeedStrategy(config=str(path))).sharding
    assert (sharding.strategy, sharding.offload_params, sharding.offload_optimizer) == ("zero3", True, False)
    assert (sharding.stage3_prefetch_bucket_size, sharding.stage3_max_live_parameters) == (1_000_000, 300_000_000)
    assert sharding.stage3_param_persistence_threshold == 1000
    config["zero_optimization"]["zero_quantized_weights"] = True
    with pytest.raises(ShardingNotModelledError, match="ZeRO\\+\\+ \\(zero_quantized_weights\\) in DeepSpeedStrategy"):
        layout_of(DeepSpeedStrategy(config=config))


def test_ddp_shards_nothing() -> None:
    layout = layout_of(DDPStrategy())
    assert layout.sharding is None and layout.data_parallel_size == 8


def _fit(tmp_path: Path, strategy: str, budgets: tuple[int, int] = (2 * 2**30, 2 * 2**30)) -> list[dict]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    result = run_ddp_script("ddp_fit.py", str(tmp_path), str(budgets[0]), str(budgets[1]), strategy)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _logged(tmp_path: Path) -> list[dict[str, str]]:
    metrics = list((tmp_path / "logs").rglob("metrics.csv"))
    assert len(metrics) == 1  # only rank 0 writes
    with open(metrics[0]) as handle:
        return [row for row in csv.DictReader(handle) if row.get("memfit/measured_peak_rss_bytes")]


def test_model_parallel_strategy_fsdp2_ranks_apply_one_plan_and_log_per_rank(tmp_path: Path) -> None:
    reports = _fit(tmp_path, "fsdp2")
    plan = reports[0]["plan"]
    assert plan is not None and plan["world_size"] == 2  # both ranks split the batch: data parallel
    assert plan["effective_batch_size"] == plan["micro_batch_size"] * plan["accumulate_grad_batches"] * 2 == 24
    for report in reports:
        assert report["batch_size"] == plan["micro_batch_size"]
        assert report["accumulate_grad_batches"] == plan["accumulate_grad_batches"]
        assert report["seen_batch_sizes"] == [plan["micro_batch_size"]]
    assert any("fully_shard over the data-parallel dimension (2 ranks)" in n for n in reports[0]["estimate"]["notes"])
    traced = reports[0]["estimate"]  # the plan's own trace: one rank of two under fully_shard
    assert traced["sharding"] == dataclasses.asdict(ShardingConfig("fsdp", world_size=2, gpus_per_node=2))
    full = reports[0]["trainable_bytes"]
    assert full / 2 <= traced["rank_terms_bytes"]["parameters"] < 0.6 * full  # each rank holds half, padded
    (recovery_off,) = reports[0]["warnings"]
    assert "under ModelParallelStrategy every forward gathers parameters with the other ranks" in recovery_off
    rows = _logged(tmp_path)
    assert [int(row["step"]) for row in rows] == [1, 3]
    for row in rows:
        for rank in (0, 1):
            assert float(row[f"memfit/rank{rank}/measured_peak_rss_bytes"]) > 0
            assert float(row[f"memfit/rank{rank}/predicted_peak_allocated_bytes"]) == plan["predicted_allocated_bytes"]


def test_tensor_parallel_is_named_and_only_measured(tmp_path: Path) -> None:
    reports = _fit(tmp_path, "tp")
    assert reports[0]["plan"] is None and reports[0]["estimate"] is None
    (message,) = [warning for warning in reports[0]["warnings"] if "cannot predict" in warning]
    assert "tensor parallelism (ModelParallelStrategy with tensor_parallel_size=2" in message
    assert "plans nothing" in message and "upper bound" not in message
    for report in reports:
        assert report["batch_size"] == 12 and report["accumulate_grad_batches"] == 1
    rows = _logged(tmp_path)
    assert rows and all(not row.get("memfit/predicted_peak_allocated_bytes") for row in rows)
    assert all(float(row["memfit/rank1/measured_peak_rss_bytes"]) > 0 for row in rows)
