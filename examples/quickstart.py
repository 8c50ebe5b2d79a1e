"""Plan a GPT-2 (124M) fine-tune for an 80 GiB GPU, from a laptop with no GPU.

Runs two training steps of the real model on fake tensors, prints where the memory goes, then
picks the largest micro batch that fits with a safety margin and the gradient accumulation that
keeps an effective batch of 64. Run: ``python examples/quickstart.py``.
"""

from __future__ import annotations

import torch
from rich.console import Console
from transformers import GPT2Config, GPT2LMHeadModel

import memfit
from memfit.reporting.tables import estimate_table, phases_table

CAPACITY = memfit.parse_bytes("80GiB")  # an H100 80GB
MARGIN = 0.05  # keep 5 % free
TARGET_EFFECTIVE_BATCH = 64
SEQ_LEN = 1024


def main() -> None:
    console = Console()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())  # random weights, no download
    tokens = torch.randint(0, model.config.vocab_size, (8, SEQ_LEN))
    sample = {"input_ids": tokens, "labels": tokens}

    curve = memfit.trace(model, sample, optimizer="adamw", precision="bf16-mixed", target=memfit.Target("cuda"))
    estimate = curve.estimate
    console.print(estimate_table(estimate))
    console.print(phases_table(estimate))
    console.print(f"traced 2 x 2 training steps in {estimate.trace_seconds:.1f} s; " + "; ".join(estimate.notes))

    def traced(micro: int, checkpointing: bool, accumulation: int = 1) -> memfit.StepCurve:
        return memfit.trace(
            model, sample, optimizer="adamw", precision="bf16-mixed", target=memfit.Target("cuda"),
            batch_size=micro, gradient_checkpointing=checkpointing,
            loop=memfit.TrainingLoop(accumulation_steps=accumulation),
        )  # fmt: skip

    try:
        plan = memfit.plan(
            curve,
            CAPACITY,
            margin=MARGIN,
            target_batch_size=TARGET_EFFECTIVE_BATCH,
            checkpointed=lambda: traced(8, True),
            confirm=traced,  # one more trace at the chosen size instead of interpolating
        )
    except memfit.InsufficientMemoryError as error:
        console.print(f"[red]{error}[/red]")
        return
    console.print(f"\n[bold]Plan for {memfit.format_bytes(CAPACITY)}[/bold]: {plan.summary()}")
    for reason in plan.reasons:
        console.print(f"  - {reason}")


if __name__ == "__main__":
    main()
