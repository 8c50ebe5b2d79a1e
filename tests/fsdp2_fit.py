"""Real FSDP2 (``fully_shard``) training on CPU with the gloo backend: each rank's measured peak tensor bytes.

Used by test_sharding.py and benchmarks/sharding_gloo.py. Every rank builds the same tiny GPT-2 (seeded),
wraps each block with ``fully_shard`` and then the root (with ``MixedPrecisionPolicy(param_dtype=...)`` when a
``param_dtype`` is given: fp32 sharded parameters, 16-bit compute, no autocast), and runs two AdamW steps under
PyTorch's ``MemTracker`` (it follows storages, including FSDP's ``resize_`` of gathered parameters), which
reports the peak of this rank's CPU tensor bytes.

Usage: python fsdp2_fit.py WORLD_SIZE OUT_JSON [LAYERS] [BATCH] [SEQ] [PARAM_DTYPE]
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, EMBED, HEADS = 512, 128, 4


def tiny_gpt2(layers: int, seq: int) -> Any:
    """The model every rank and the prediction build: a GPT-2 from a config, random weights, seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers, n_embd=EMBED, n_head=HEADS, vocab_size=VOCAB, n_positions=seq, bos_token_id=0, eos_token_id=0
    )
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def tiny_llama(layers: int, seq: int) -> Any:
    """A Llama from a config (grouped-query attention, RMSNorm, SwiGLU, an untied output projection), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=EMBED, intermediate_size=344, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=2, max_position_embeddings=seq, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def sample(batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _rank(
    rank: int, world: int, port: int, out: str, layers: int, batch: int, seq: int, param_dtype: str | None
) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = tiny_gpt2(layers, seq)
        options = {"mp_policy": MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype))} if param_dtype else {}
        for block in model.transformer.h:
            fully_shard(block, **options)
        fully_shard(model, **options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        data = sample(batch, seq)
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            for _ in range(2):
                loss = model(**data).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                tracker.reset_mod_stats()  # per-module stats are per iteration; the device peak is kept
        peak = tracker.get_tracker_snapshot("peak")
        cpu = next(value for device, value in peak.items() if torch.device(device).type == "cpu")
        result = {"rank": rank, "peak_bytes": int(cpu["Total"]),
                  "by_kind": {str(k): int(v) for k, v in cpu.items() if k != "Total"}}  # fmt: skip
        Path(f"{out}.rank{rank}").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run(
    world: int, out: str | Path, layers: int = 2, batch: int = 2, seq: int = 64, param_dtype: str | None = None
) -> list[dict[str, Any]]:
    """Run ``world`` ranks and return each rank's measured peak (in rank order); ``param_dtype`` (``"bfloat16"``):
    FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank, args=(world, port, str(out), layers, batch, seq, param_dtype), nprocs=world, join=True)
    results = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(world)]
    Path(out).write_text(json.dumps(results))
    return results


if __name__ == "__main__":
    world_size, path = int(sys.argv[1]), sys.argv[2]
    extra = [int(a) for a in sys.argv[3:6]]
    dtype = sys.argv[6] if len(sys.argv) > 6 else None
    print(json.dumps(run(world_size, path, *extra, param_dtype=dtype)))  # type: ignore[misc]
