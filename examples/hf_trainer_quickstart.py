"""Fine-tune a small GPT-2 with the Hugging Face Trainer, memory-planned by memfit, on synthetic data.

    python examples/hf_trainer_quickstart.py [--budget 40MiB] [--steps 20] [--report-to tensorboard]

``plan_training_arguments`` picks per_device_train_batch_size, gradient_accumulation_steps and
activation_checkpointing for the budget while keeping the effective batch (32); the Trainer is
built from the planned arguments; ``attach`` puts memfit's callback first, so it logs predicted and
measured memory to every ``report_to`` tracker (on a CPU the process's resident memory, not
compared with the prediction), and lets it recover from out-of-memory errors. On a
GPU, drop --budget to plan for the device's free memory.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from memfit.huggingface import attach, plan_training_arguments


class SyntheticTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def model_config(layers: int = 4, width: int = 128, seq_len: int = 128, vocab: int = 2048) -> GPT2Config:
    """A small GPT-2 whose end-of-text token (GPT-2's 50256) is the last id of its own small vocabulary."""
    return GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=seq_len,
                      bos_token_id=vocab - 1, eos_token_id=vocab - 1, loss_type="ForCausalLM")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="40MiB", help="memory budget per device (default: 40MiB; '' to measure)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--report-to", default="none", help="a report_to tracker, e.g. tensorboard or mlflow")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default="hf_trainer_memfit")
    options = parser.parse_args()

    torch.manual_seed(0)
    config = model_config(options.layers, options.width, options.seq_len)
    model = GPT2LMHeadModel(config)  # random weights: nothing is downloaded
    data = SyntheticTokens(4096, options.seq_len, config.vocab_size)
    args = TrainingArguments(
        output_dir=options.out,
        per_device_train_batch_size=32,
        max_steps=options.steps,
        logging_steps=5,
        learning_rate=3e-4,
        report_to=[] if options.report_to == "none" else [options.report_to],
        save_strategy="no",
        disable_tqdm=True,
    )
    planned = plan_training_arguments(model, args, data, budget=options.budget or None)
    print(f"memfit plan: {planned.plan.summary()}")
    for reason in planned.plan.reasons:
        print(f"  - {reason}")
    trainer = Trainer(model=model, args=planned.args, train_dataset=data)
    callback = attach(trainer, plan=planned.plan)
    trainer.train()
    last = callback.monitor.history[-1] if callback.monitor and callback.monitor.history else None
    if last is not None:
        # the callback printed its final line: drift on a GPU, the process's resident memory on a CPU
        print(f"last window (step {last.step}): {last.metrics()}")


if __name__ == "__main__":
    main()
