"""Replays at an allocator limit resumed from checkpoints of the unlimited replay answer exactly as whole replays
(``memfit.simulation.replay.LimitReplayer``), on real allocator request sequences and on random ones."""

from __future__ import annotations

import functools
import gzip
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from memfit.simulation.allocator import AllocatorConfig
from memfit.simulation.replay import RESERVE_RESOLUTION, LimitReplayer, replay_at_limit

SNAPSHOTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu-truth").rglob("snapshot-*"))
CONFIGS = [AllocatorConfig(), AllocatorConfig(expandable_segments=True), AllocatorConfig(max_split_size=200 << 20),
           AllocatorConfig(garbage_collection_threshold=0.6)]  # fmt: skip


def _log_of_snapshot(path: Path) -> SimpleNamespace:
    """A real allocator's requests (a GPU's snapshot) as a storage log: +id allocates, -id frees."""
    with gzip.open(path) as file:
        trace = json.load(file)["trace"]
    events, sizes, ids, next_id = [], {}, {}, 1
    for entry in trace:
        if entry["action"] == "alloc":
            ids[entry["addr"]] = next_id
            sizes[next_id] = entry["size"]
            events.append(next_id)
            next_id += 1
        elif entry["action"] == "free_completed" and entry["addr"] in ids:
            events.append(-ids.pop(entry["addr"]))
    return SimpleNamespace(events=events, sizes=sizes, marks=[])


def _random_log(seed: int) -> SimpleNamespace:
    rng = random.Random(seed)
    events, sizes, live = [], {}, []
    for key in range(1, 600):
        sizes[key] = rng.choice([512, 4096, 1 << 20, 3 << 20, 21 << 20, rng.randrange(1, 80 << 20)])
        events.append(key)
        live.append(key)
        while live and rng.random() < 0.45:
            events.append(-live.pop(rng.randrange(len(live))))
    return SimpleNamespace(events=events, sizes=sizes, marks=[])


@functools.cache
def _traced_log() -> object:
    """A traced step's log, with its phases marked: its steady step is run again until the allocator settles."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import memfit
    from memfit.prediction.exact import clear_sessions, kept_sessions

    clear_sessions()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32))
    ids = torch.zeros(2, 32, dtype=torch.long)
    memfit.estimate(model, {"input_ids": ids, "labels": ids}, batch_size=6, target=memfit.Target("cuda"))
    return kept_sessions()[0].trace_at(6)[0].recorder


def _logs() -> list[tuple[str, object]]:
    return (
        [(path.name, _log_of_snapshot(path)) for path in SNAPSHOTS[:3]]
        + [(f"random-{seed}", _random_log(seed)) for seed in range(3)]
        + [("traced gpt2", _traced_log())]
    )


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "expandable", "max-split", "gc"])
def test_a_resumed_replay_is_the_whole_replay(config: AllocatorConfig) -> None:
    assert SNAPSHOTS, "the GPU-truth snapshots are the real request sequences this test replays"
    for name, log in _logs():
        replayer = LimitReplayer(log, config)
        unlimited = replayer.unlimited
        rng = random.Random(name)
        limits = [rng.randrange(unlimited.peak_allocated_bytes // 2, unlimited.peak_reserved_bytes * 11 // 10)
                  for _ in range(6)] + [unlimited.peak_reserved_bytes, unlimited.peak_allocated_bytes]  # fmt: skip
        for limit in limits:
            for until_oom in (False, True):
                whole = replay_at_limit(log, limit, config, until_oom=until_oom)
                assert replayer.at(limit, until_oom=until_oom) == whole, (name, limit, until_oom)


def test_the_least_capacity_is_where_the_step_starts_to_fit() -> None:
    for name, log in _logs():
        least = LimitReplayer(log).least()
        assert replay_at_limit(log, least).fits, name
        assert not replay_at_limit(log, least - RESERVE_RESOLUTION).fits, name
