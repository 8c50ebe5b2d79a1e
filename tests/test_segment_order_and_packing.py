"""Two mechanisms behind the Llama rows of the GPU truth whose reserved peak memfit put 2-4 % under the H200's:

1. the order of segment addresses: ``cudaMalloc`` gives out address space from the top down, and the caching
   allocator's best fit takes the lowest of equal free blocks, so which segment a block is cut from (and how the
   cache fragments) depends on later segments lying lower;
2. transformers' packed-sequence check (``find_packed_sequence_indices``) takes its traced branch on fake tensors:
   the trace built a causal mask (and repeated the grouped key/value heads for it) where an eager run on the GPU
   attends with ``is_causal`` and no mask.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import memfit
from memfit.simulation.allocator import CachingAllocatorSimulator
from memfit.tracing.packed_sequences import eager_packing_check
from memfit.tracing.recorder import StorageRecorder

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")

H200 = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu-truth" / "h200-2026-11-27"
MiB = 1 << 20


# -- 1. segment addresses ---------------------------------------------------------------------------------


def test_each_new_segment_lies_below_the_ones_before() -> None:
    sim = CachingAllocatorSimulator()
    for key in range(3):
        sim.malloc(key, 44 * MiB)  # three equal segments; the newest is the lowest
    sim.free(0)
    sim.free(2)
    sim.malloc(3, 30 * MiB)  # best fit ties between segments 0 and 2: the lower address, segment 2's
    assert [any(b.allocated for b in seg.blocks) for seg in sim.snapshot()] == [False, True, True]


def test_a_real_llama_steps_requests_reserve_what_the_h200_reserved_without_its_addresses() -> None:
    """The snapshot's own alloc/free sequence (three steps of Llama 16-mixed, fused AdamW, batch 4), replayed with
    memfit's own segment addresses: the real allocator's peak and segments, where addresses ascending in creation
    order reserved 31,497,125,888 bytes (3.5 % under)."""
    with gzip.open(H200 / "snapshot-llama-16-mixed-adamw-fused-b4-at4.json.gz") as file:
        snapshot = json.load(file)
    sim = CachingAllocatorSimulator()
    for event in snapshot["trace"]:
        if event["action"] == "alloc":
            sim.malloc(event["addr"], event["size"])
        elif event["action"] == "free_completed":
            sim.free(event["addr"])
    assert sim.peak_reserved_bytes == snapshot["row"]["measured_peak_reserved_bytes"] == 32_637_976_576
    assert sorted(s.size for s in sim.snapshot()) == sorted(s["total_size"] for s in snapshot["segments"])


# -- 2. transformers' packed-sequence check ---------------------------------------------------------------


def test_the_models_own_positions_are_known_consecutive_and_batch_positions_are_not() -> None:
    recorder = StorageRecorder()
    with FakeTensorMode(allow_non_fake_inputs=True), recorder, eager_packing_check(recorder.positions):
        known = recorder.positions
        # LlamaModel.forward: torch.arange(seq) + past_seen_tokens, unsqueezed; the mask code expands it per row
        positions = (torch.arange(16) + 0).unsqueeze(0).expand(3, -1)
        assert known.consecutive_rows(positions)
        assert masking_utils.find_packed_sequence_indices(positions) is None  # eager's answer: nothing packed
        assert known.consecutive_rows(positions.clone()) and known.consecutive_rows(positions[:, 4:])
        assert not known.consecutive_rows(torch.arange(32)[::2])  # every other position: steps of 2
        assert not known.consecutive_rows(torch.arange(32).view(2, 16).t())  # columns run down, not along
        assert not known.consecutive_rows(torch.arange(16) * 2)
        given = torch.zeros(3, 16, dtype=torch.long)  # position ids from the batch: values the trace cannot know
        assert not known.consecutive_rows(given)
        assert masking_utils.find_packed_sequence_indices(given) is not None  # the traced branch, as before
    assert masking_utils.find_packed_sequence_indices.__module__ == "transformers.masking_utils"  # restored


def _tiny_llama() -> torch.nn.Module:
    # no cache, as under gradient checkpointing: transformers checks for packed sequences only without one
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=64, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _masks_seen(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[object]:
    seen: list[object] = []

    def hook(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        seen.append(kwargs.get("attention_mask"))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        memfit.estimate(model, batch, optimizer="adamw", precision="bf16-mixed", target=memfit.Target("cuda"))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_a_traced_llama_attends_causally_without_a_mask_as_an_eager_run_does() -> None:
    """An eager step on the GPU passes no mask (``is_causal``, grouped heads as ``enable_gqa``): no (batch, 1, seq,
    seq) mask, no repeated key/value heads, no mask conversion in the trace either."""
    ids = torch.randint(1, 1000, (2, 64))
    seen = _masks_seen(_tiny_llama(), {"input_ids": ids, "labels": ids})
    assert seen and all(mask is None for mask in seen)


def test_position_ids_from_the_batch_keep_the_mask() -> None:
    """A packing collator's position ids are values the trace does not read: the traced branch (a mask) stays."""
    ids = torch.randint(1, 1000, (2, 64))
    positions = torch.arange(64).repeat(2, 1)
    seen = _masks_seen(_tiny_llama(), {"input_ids": ids, "labels": ids, "position_ids": positions})
    assert seen and all(isinstance(mask, torch.Tensor) for mask in seen)
