"""memfit in a custom Hugging Face accelerate loop, on CPU: a tiny GPT-2 with random weights on random tokens.

    python examples/accelerate_quickstart.py

The planner plans before ``accelerator.prepare`` (here for an H100's memory, on a 4 MiB budget so the plan has
something to do), hands back the dataloader at the planned micro batch and sets the accumulation that keeps the
effective batch; after each optimizer step it measures, and at the end prints the drift line.
"""

from __future__ import annotations

import logging

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from memfit.accelerate import MemoryPlanner


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=32, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, 1000, (256, 32))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    accelerator = Accelerator(cpu=True)
    planner = MemoryPlanner(accelerator, budget="4MiB", target="cpu", log_every_n_steps=2)
    loader = planner.plan(model, optimizer, loader)  # before prepare: the planned micro batch and accumulation
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, batch in enumerate(loader):
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            planner.step_end()
        if step == 31:
            break
    planner.end()


if __name__ == "__main__":
    main()
