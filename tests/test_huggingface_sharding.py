"""TrainingArguments' FSDP and DeepSpeed settings become one rank's ShardingConfig, as the Trainer would run them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from transformers import Trainer, TrainerCallback

from memfit import ShardingConfig
from memfit.errors import ShardingNotModelledError
from memfit.huggingface import MemoryPlannerCallback, attach, plan_training_arguments
from memfit.integrations.huggingface.arguments import checkpointing_switch
from test_huggingface import Tokens, tiny_gpt2, training_args

ZERO3_AUTO = {
    "stage": 3,
    "offload_optimizer": {"device": "cpu"},
    "offload_param": {"device": "cpu"},
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "allgather_bucket_size": 5e8,
}


@pytest.fixture(autouse=True)
def _accelerate_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainingArguments sets ACCELERATE_USE_DEEPSPEED for deepspeed= runs off the CPU: restore it after each test."""
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.setenv(name, "false")


class Logs(TrainerCallback):
    """What the trackers receive: each training log after memfit's callback (attached first) added its keys."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def plan_for_gpus(tmp_path: Path, **arguments):
    """Plan for H100s from this CPU machine: the FSDP or DeepSpeed the arguments ask for runs there."""
    return plan_training_arguments(tiny_gpt2(), training_args(tmp_path, **arguments), Tokens(), budget="h100")


def test_fsdp2_full_shard_with_offload_and_bf16(tmp_path: Path) -> None:
    planned = plan_for_gpus(tmp_path, fsdp="full_shard offload", bf16=True,
                            fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]})  # fmt: skip
    assert planned.sharding == ShardingConfig(
        "fsdp", world_size=1, gpus_per_node=1, offload_optimizer=True, offload_params=True,
        reshard_after_forward=True, mixed_precision_param_dtype="bfloat16",
    )  # fmt: skip
    assert not any("gathers every parameter at once" in note for note in planned.estimate.notes)  # blocks wrapped
    assert planned.estimate.sharding == planned.sharding  # the prediction is one rank's
    from memfit.integrations.huggingface.sharding import run_layout

    layout = run_layout(planned.args, tiny_gpt2(), precision="bf16-mixed", elsewhere_on_gpus=True)
    assert layout.units == ("GPT2Block",)  # the estimate's FSDP units: the layers accelerate wraps


def test_fsdp_checkpointing_is_the_strategys_own(tmp_path: Path) -> None:
    planned = plan_for_gpus(tmp_path, fsdp="shard_grad_op",
                            fsdp_config={"activation_checkpointing": True, "auto_wrap_policy": "NO_WRAP"})  # fmt: skip
    assert planned.sharding == ShardingConfig("fsdp-grad-op", world_size=1, gpus_per_node=1,
                                              reshard_after_forward=False)  # fmt: skip
    assert planned.plan.gradient_checkpointing and planned.estimate.gradient_checkpointing
    assert not getattr(planned.args, checkpointing_switch(planned.args))  # the Trainer refuses FSDP's and its own
    assert any("NO_WRAP gathers every parameter at once" in note for note in planned.estimate.notes)


def test_fsdp1_hybrid_shard(tmp_path: Path) -> None:
    planned = plan_for_gpus(tmp_path, fsdp="hybrid_shard", fsdp_config={"version": 1})
    assert planned.sharding.strategy == "fsdp-hybrid" and planned.sharding.reshard_after_forward


def test_deepspeed_dict_with_auto_buckets_resolved_as_the_trainer_resolves_them(tmp_path: Path) -> None:
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = {"zero_optimization": dict(ZERO3_AUTO), "train_micro_batch_size_per_gpu": "auto"}
    planned = plan_for_gpus(tmp_path, deepspeed=copy.deepcopy(config))
    model = tiny_gpt2()
    hf = HfTrainerDeepSpeedConfig(copy.deepcopy(config))  # what the Trainer fills in when it starts DeepSpeed
    hf.trainer_config_process(training_args(tmp_path))
    hf.trainer_config_finalize(training_args(tmp_path), model, num_training_steps=6)
    zero = hf.config["zero_optimization"]
    assert planned.sharding == ShardingConfig(
        "zero3", world_size=1, gpus_per_node=1, offload_optimizer=True, offload_params=True,
        reduce_bucket_size=zero["reduce_bucket_size"], allgather_bucket_size=500_000_000,
        stage3_prefetch_bucket_size=zero["stage3_prefetch_bucket_size"],
        stage3_param_persistence_threshold=zero["stage3_param_persistence_threshold"],
    )  # fmt: skip
    assert planned.sharding.reduce_bucket_size == model.config.hidden_size**2


def test_deepspeed_json_file_stage2(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"},
                                                      "reduce_bucket_size": 2e8}}))  # fmt: skip
    planned = plan_for_gpus(tmp_path, deepspeed=str(path))
    assert planned.sharding == ShardingConfig("zero2", world_size=1, gpus_per_node=1, reduce_bucket_size=200_000_000)


def test_zero_plus_plus_is_named_not_planned(tmp_path: Path) -> None:
    config = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 8}}
    with pytest.raises(ShardingNotModelledError, match=r"ZeRO\+\+ \(zero_quantized_weights, zero_hpz_partition_size=8"):
        plan_for_gpus(tmp_path, deepspeed=config)


def test_what_runs_here_is_planned_not_what_was_asked(tmp_path: Path) -> None:
    """On CPU accelerate applies neither FSDP nor DeepSpeed: the run is planned as what it will be, with a note."""
    model, data = tiny_gpt2(), Tokens()
    fsdp = plan_training_arguments(model, training_args(tmp_path, fsdp="full_shard"), data, budget="1GiB")
    assert fsdp.sharding is None
    assert any("accelerate applies FSDP only across several GPU processes" in n for n in fsdp.estimate.notes)
    deepspeed = training_args(tmp_path, deepspeed={"zero_optimization": {"stage": 3}})
    planned = plan_training_arguments(model, deepspeed, data, budget="1GiB")
    assert planned.sharding is None
    assert any("planned without DeepSpeed" in note for note in planned.estimate.notes)


def test_callback_measures_a_sharded_run_against_the_plans_prediction(tmp_path: Path, monkeypatch) -> None:
    """The Trainer hands callbacks an already sharded model: the callback takes the plan's per-rank figures.
    FSDP needs GPU processes, so the layout is the one a GPU run would read; the Trainer run is real."""
    import memfit.integrations.huggingface.callback as hf_callback
    from memfit.integrations.huggingface.sharding import RunLayout

    planned = plan_for_gpus(tmp_path, fsdp="full_shard")
    monkeypatch.setattr(hf_callback, "run_layout", lambda *a, **k: RunLayout(planned.sharding))
    args = training_args(tmp_path, per_device_train_batch_size=planned.plan.micro_batch_size)
    seen = Logs()
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=[seen])
    callback = attach(trainer, plan=planned.plan, verbose=False)
    with pytest.warns(UserWarning, match="out-of-memory recovery .* stays off"):
        trainer.train()
    assert callback.estimate is None and callback.recovery is None  # nothing traced, nothing wrapped
    assert callback.monitor.drift.predicted_allocated_bytes == planned.plan.predicted_allocated_bytes
    logged = [entry for entry in seen.logs if "memfit/predicted_peak_allocated_bytes" in entry]
    assert logged and all(e["memfit/predicted_peak_allocated_bytes"] == planned.plan.predicted_allocated_bytes
                          for e in logged)  # fmt: skip


def test_callback_names_what_it_cannot_model(tmp_path: Path, monkeypatch) -> None:
    import memfit.integrations.huggingface.callback as hf_callback

    def unmodelled(*args, **kwargs):
        raise ShardingNotModelledError("DeepSpeed tensor parallelism (tensor_parallel.autotp_size=2)")

    monkeypatch.setattr(hf_callback, "run_layout", unmodelled)
    seen = Logs()
    trainer = Trainer(model=tiny_gpt2(), args=training_args(tmp_path), train_dataset=Tokens(), callbacks=[seen])
    callback = attach(trainer, verbose=False)
    with pytest.warns(UserWarning, match="cannot predict one rank's memory under DeepSpeed tensor parallelism"):
        trainer.train()
    logged = [entry for entry in seen.logs if "memfit/measured_peak_rss_bytes" in entry]
    assert logged and not any("memfit/predicted_peak_allocated_bytes" in entry for entry in logged)
    assert isinstance(callback, MemoryPlannerCallback) and callback.estimate is None


def torchrun(tmp_path: Path, mode: str, budgets: tuple[str, str]) -> list[dict]:
    """Two real processes (gloo) running ``hf_fit.py``; each rank's report."""
    import os
    import signal
    import subprocess
    import sys

    import torch

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), str(here / "hf_fit.py"), str(tmp_path), mode, *budgets]  # fmt: skip
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:  # fmt: skip
        try:
            _, stderr = process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers: none outlives the test
            raise
    assert process.returncode == 0, stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _free_port() -> int:
    """A port no other test's processes hold (tests may run in parallel workers)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def assert_one_plan_and_every_rank_logged(reports: list[dict]) -> dict:
    assert reports[0]["plan"] == reports[1]["plan"]  # rank 1's tight budget, on both ranks
    plan = reports[0]["plan"]
    micro, accumulation = plan["micro_batch_size"], plan["accumulate_grad_batches"]
    assert plan["largest_micro_batch"] <= 5 and plan["world_size"] == 2  # rank 1's budget holds at most 5
    assert plan["effective_batch_size"] == micro * accumulation * 2 >= 24
    for report in reports:
        assert (report["ran_batch_size"], report["ran_accumulation"]) == (micro, accumulation)
    logged = [entry for entry in reports[0]["logs"] if "memfit/rank1/measured_peak_rss_bytes" in entry]
    assert len(logged) == 2
    for entry in logged:
        for rank in (0, 1):
            assert entry[f"memfit/rank{rank}/predicted_peak_allocated_bytes"] == plan["predicted_allocated_bytes"]
            assert entry[f"memfit/rank{rank}/measured_peak_rss_bytes"] > 0
    return plan


def test_torchrun_on_cpu_with_fsdp_plans_the_ddp_that_runs_and_logs_every_rank(tmp_path: Path) -> None:
    """fsdp= is asked for, accelerate runs DDP on CPU: memfit plans the DDP that runs."""
    reports = torchrun(tmp_path, "fsdp", ("8000000000", "tight"))
    assert_one_plan_and_every_rank_logged(reports)
    for report in reports:
        assert report["sharding"] is None and report["ddp"] is not None  # planned as the DDP that runs
        assert report["wrapped_in"] == "DistributedDataParallel"
        assert any("this run (MULTI_CPU) runs DDP" in note for note in report["notes"])


def test_torchrun_deepspeed_zero3_on_cpu_plans_one_rank(tmp_path: Path) -> None:
    """A real ZeRO-3 run (DeepSpeed's CPU accelerator): the plan is one rank of two, "auto" buckets as the
    Trainer fills them (hidden size 64), both ranks run the plan of the smaller budget and are measured."""
    import dataclasses

    reports = torchrun(tmp_path, "zero3", ("8000000000", "tight"))
    assert_one_plan_and_every_rank_logged(reports)
    hidden = tiny_gpt2().config.hidden_size
    expected = dataclasses.asdict(ShardingConfig(
        "zero3", world_size=2, gpus_per_node=2, reduce_bucket_size=hidden * hidden,
        stage3_prefetch_bucket_size=int(0.9 * hidden * hidden), stage3_param_persistence_threshold=10 * hidden,
    ))  # fmt: skip
    for report in reports:
        assert report["wrapped_in"] == "DeepSpeedEngine"
        assert report["sharding"] == report["estimate_sharding"] == expected
