"""Run by test_huggingface_sharding.py under torchrun: a 2-process CPU Trainer run, sharded or asked to be.

Usage: python -m torch.distributed.run --nproc_per_node 2 hf_fit.py OUT_DIR MODE BUDGET_RANK0 BUDGET_RANK1

MODE ``fsdp``: ``fsdp="full_shard"`` with ``use_cpu``: accelerate applies FSDP only across GPU processes,
so the Trainer runs DDP, and memfit plans what runs. MODE ``zero3``: a DeepSpeed ZeRO-3 config with
``"auto"`` bucket sizes (DeepSpeed's CPU accelerator trains here). A budget of ``tight`` is one between
the predicted peaks of micro batches 5 and 6 of a first plan with a roomy budget, which every rank makes
(planning is collective under torchrun: each plan agrees on the smallest capacity of all ranks). Every
rank then plans with its budget and reports what it ran.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from memfit.huggingface import attach, plan_training_arguments
from test_huggingface import Tokens, tiny_gpt2

ZERO3 = {
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


class Logs(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    budget = sys.argv[3 + rank]
    sharded = {"fsdp": "full_shard", "use_cpu": True} if mode == "fsdp" else {"deepspeed": ZERO3}
    if mode == "zero3":
        import deepspeed.ops

        # On a machine that has not built it, DeepSpeed compiles its shared-memory all-reduce (ninja: about 90 s on
        # two cores) at its first collective; without it the ranks reduce through gloo, as on platforms that lack
        # the kernel. Host-side communication holds no device memory, so the plan and what is measured stand.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    args = TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=12, max_steps=4, logging_steps=2, report_to=[],
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **sharded,
    )  # fmt: skip
    model, data = tiny_gpt2(), Tokens()
    traced = plan_training_arguments(model, args, data, budget=16 * 2**30).traced
    if budget == "tight":
        low, high = traced.at(5).device_bytes, traced.at(6).device_bytes
        budget = math.ceil((low + high) / 2 / 0.95)
    planned = plan_training_arguments(model, args, data, budget=int(budget))
    seen = Logs()
    trainer = Trainer(model=model, args=planned.args, train_dataset=data, callbacks=[seen])
    attach(trainer, plan=planned.plan, verbose=False)
    trainer.train()
    estimate = planned.estimate.to_dict()
    report = {
        "rank": rank,
        "plan": planned.plan.to_dict(),
        "sharding": None if planned.sharding is None else dataclasses.asdict(planned.sharding),
        "estimate_sharding": estimate["sharding"],
        "ddp": estimate["ddp"],
        "notes": list(planned.estimate.notes),
        "wrapped_in": type(trainer.model_wrapped).__name__,
        "ran_batch_size": trainer._train_batch_size,
        "ran_accumulation": trainer.args.gradient_accumulation_steps,
        "logs": seen.logs,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    # as a torchrun script ends: the Trainer leaves accelerate's process group up, and a rank exiting with gloo's
    # threads alive can abort in teardown ("terminate called without an active exception", seen even after
    # destroying the group): both ranks wait for each other, take the group down, and end without the
    # interpreter's teardown once their reports are on disk
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
