"""How far ``curve.at(b)`` (fixed + per-sample fits from traces at b0 and 2 x b0) is from a trace at b.

    python benchmarks/interpolation.py

Uses the model of ``examples/hf_trainer_quickstart.py`` (GPT-2 config, 4 layers, 128 wide, seq 128,
checkpointing on, CPU target) traced at batch 12; prints the interpolated and the traced peak for
smaller and larger batches. A phase's peak is a maximum over ops, convex in the batch, so the
linear fit underestimates away from the traced points: the reason ``memfit.plan`` confirms its
choice with a trace at the chosen size.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import memfit


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=2048, n_positions=128, loss_type="ForCausalLM")
    model = GPT2LMHeadModel(config)
    ids = torch.zeros(12, 128, dtype=torch.long)
    sample = {"input_ids": ids, "labels": ids}
    kwargs = {"target": memfit.Target("cpu"), "gradient_checkpointing": True}
    fitted_curve = memfit.trace(model, sample, **kwargs)
    print(f"{'batch':>5} {'interpolated':>14} {'traced':>14} {'error %':>8}")
    for batch in (1, 2, 4, 8, 12, 24, 48):
        traced = memfit.estimate(model, sample, batch_size=batch, **kwargs).peak_allocated_bytes
        predicted = fitted_curve.at(batch).allocated_bytes
        print(f"{batch:>5} {memfit.format_bytes(predicted):>14} {memfit.format_bytes(traced):>14} "
              f"{100 * (predicted - traced) / traced:>+8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
