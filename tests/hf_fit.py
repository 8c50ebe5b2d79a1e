"""Run by test_huggingface_sharding.py under torchrun: a 2-process CPU Trainer run asked for FSDP.

accelerate applies FSDP only across GPU processes, so on CPU the Trainer runs DDP: memfit plans what
runs. Each rank plans from its own budget (the smallest wins) and reports what it ran.

Usage: python -m torch.distributed.run --nproc_per_node 2 hf_fit.py OUT_DIR BUDGET_RANK0 BUDGET_RANK1
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from transformers import Trainer, TrainerCallback, TrainingArguments

from memfit.huggingface import attach, plan_training_arguments
from test_huggingface import Tokens, tiny_gpt2


class Logs(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    budget = int(sys.argv[2 + rank])
    args = TrainingArguments(
        output_dir=str(out / "run"), fsdp="full_shard", use_cpu=True, per_device_train_batch_size=12, max_steps=4,
        logging_steps=2, report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    model, data = tiny_gpt2(), Tokens()
    planned = plan_training_arguments(model, args, data, budget=budget)
    seen = Logs()
    trainer = Trainer(model=model, args=planned.args, train_dataset=data, callbacks=[seen])
    attach(trainer, plan=planned.plan, verbose=False)
    trainer.train()
    report = {
        "rank": rank,
        "plan": planned.plan.to_dict(),
        "sharding": None if planned.sharding is None else str(planned.sharding),
        "ddp": planned.estimate.to_dict()["ddp"],
        "notes": list(planned.estimate.notes),
        "wrapped_in": type(trainer.model_wrapped).__name__,
        "ran_batch_size": trainer._train_batch_size,
        "logs": seen.logs,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
