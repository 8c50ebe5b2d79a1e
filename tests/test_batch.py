"""Which examples the plan's batch is built from: the longest, read within a time budget."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, IterableDataset

import memfit.tracing.batch
from memfit import InvalidInputError
from memfit.tracing.batch import batch_examples, longest_batch, longest_examples
from memfit.tracing.model_state import preserved_rng_state


def rows(lengths: list[int]) -> list[dict[str, list[int]]]:
    return [{"input_ids": [i] * n} for i, n in enumerate(lengths)]


def pad(examples: list[dict[str, list[int]]]) -> torch.Tensor:
    longest = max(len(e["input_ids"]) for e in examples)
    return torch.tensor([e["input_ids"] + [0] * (longest - len(e["input_ids"])) for e in examples])


class CountingReads(Dataset):
    """Examples of growing length that count how often they are read, each read taking ``seconds``."""

    def __init__(self, size: int, seconds: float = 0.0) -> None:
        self.size, self.seconds, self.reads = size, seconds, 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.reads += 1
        if self.seconds:
            time.sleep(self.seconds)
        return {"input_ids": torch.zeros(1 + index % 1000)}


def test_longest_examples_picks_the_longest_and_keeps_order_among_equals() -> None:
    assert longest_examples(rows([8, 8, 32, 8]), 3) == [2, 0, 1]  # the longest, then the earlier of equals
    assert longest_examples(rows([8, 8]), 3) == [0, 1, 0]  # all as long: the first ones, repeated to a batch
    assert longest_examples(rows([8, 32]), 3) == [1, 0, 1]  # fewer examples than the batch: repeated
    tensors = [(torch.zeros(n), torch.tensor(0)) for n in [4, 9, 2]]
    assert longest_examples(tensors, 1) == [1]  # tuples of tensors: the longest first dimension
    with pytest.raises(InvalidInputError, match="the dataset is empty"):
        longest_examples([], 2)


def test_a_length_column_is_read_instead_of_the_examples() -> None:
    class WithColumn(list):
        column_names = ("input_ids", "length")

        def __getitem__(self, key: Any) -> Any:
            if key == "length":
                return [3, 50, 7]
            raise AssertionError("the examples themselves are not read")

    assert longest_examples(WithColumn([None] * 3), 2) == [1, 2]


def test_large_datasets_are_read_evenly_spaced_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memfit.tracing.batch, "LENGTH_SCAN_SECONDS", 600.0)  # only the count limits here
    dataset = CountingReads(100_000)
    longest = longest_examples(dataset, 1)
    limit = memfit.tracing.batch.LENGTH_SCAN_LIMIT
    assert limit <= dataset.reads <= limit + 64  # and the probe
    assert longest[0] % 1000 >= 995  # one of the longest of the read examples (lengths cycle to 1000)


def test_slow_datasets_are_read_more_sparsely(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memfit.tracing.batch, "LENGTH_SCAN_SECONDS", 0.5)
    dataset = CountingReads(10_000, seconds=0.002)  # 20 s to read them all
    longest_examples(dataset, 4)
    assert 64 <= dataset.reads < 1_000  # the probe, then what fits in about half a second


def test_longest_batch_collates_the_longest_examples_only_where_the_collate_fn_can_pad() -> None:
    data = rows([8] * 20 + [32] + [8] * 20)
    assert longest_batch(DataLoader(data, batch_size=8, collate_fn=pad)).shape == (8, 32)
    assert next(iter(DataLoader(data, batch_size=8, collate_fn=pad))).shape == (8, 8)  # what the first batch holds
    same = [torch.zeros(4) + i for i in range(10)]
    first = longest_batch(DataLoader(same, batch_size=4))  # default_collate stacks equal shapes: the first batch
    assert first[:, 0].tolist() == [0, 1, 2, 3]

    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            return iter(data)

    assert longest_batch(DataLoader(Stream(), batch_size=8, collate_fn=pad)).shape == (8, 8)  # no index: first batch
    sampler = torch.utils.data.BatchSampler(range(41), batch_size=4, drop_last=False)
    assert longest_batch(DataLoader(data, batch_sampler=sampler, collate_fn=pad)).shape == (4, 8)  # its own batches

    class KeyedByName(Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, key: str) -> dict[str, list[int]]:
            return {"a": {"input_ids": [1] * 3}, "b": {"input_ids": [1] * 5}}[key]

    keyed = DataLoader(KeyedByName(), batch_size=2, sampler=["a", "b"], collate_fn=pad)
    assert longest_batch(keyed).shape == (2, 5)  # not readable by position: the loader's own first batch


def test_batch_examples_reads_streams_from_their_start_and_refuses_one_shot_iterators() -> None:
    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            return iter(rows([3, 9, 5]))

    assert [len(e["input_ids"]) for e in batch_examples(Stream(), 4)] == [3, 9, 5, 3]  # its first, repeated
    assert [len(e["input_ids"]) for e in batch_examples(rows([3, 9, 5]), 2)] == [9, 5]  # by index: the longest
    with pytest.raises(InvalidInputError, match="one-shot iterator"):
        batch_examples(iter(rows([3])), 1)

    class Empty(IterableDataset):
        def __iter__(self) -> Any:
            return iter([])

    with pytest.raises(InvalidInputError, match="the dataset is empty"):
        batch_examples(Empty(), 1)


def test_reading_a_batch_leaves_the_random_numbers_as_they_were() -> None:
    torch.manual_seed(1)
    random.seed(1)
    expected = (torch.rand(1), random.random())
    torch.manual_seed(1)
    random.seed(1)
    with preserved_rng_state():
        torch.rand(5), random.random()  # a dataset's random transform
    assert (torch.rand(1), random.random()) == expected


class Examples(Dataset):
    """A map-style dataset of ready-made examples, as a user's ``Dataset`` subclass returns them."""

    def __init__(self, examples: list[Any]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Any:
        return self.examples[index]


def pad_ids(sequences: list[Any]) -> torch.Tensor:
    """Right-pad token sequences (tensors or lists) with zeros to the longest in the batch."""
    tensors = [torch.as_tensor(s) for s in sequences]
    return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True)


LAYOUTS: dict[str, tuple[Callable[[int], Any], Callable[[list[Any]], torch.Tensor]]] = {
    # name: (an example of n tokens, a padding collate_fn whose result's width is the batch's length)
    "bare tensor": (lambda n: torch.ones(n, dtype=torch.long), pad_ids),
    "bare list": (lambda n: [1] * n, pad_ids),
    "tuple (ids, labels)": (
        lambda n: (torch.ones(n, dtype=torch.long), torch.ones(n, dtype=torch.long)),
        lambda batch: pad_ids([ids for ids, _labels in batch]),
    ),
    "nested dict": (
        lambda n: {"text": {"input_ids": [1] * n, "attention_mask": [1] * n}, "label": 0, "id": "doc"},
        lambda batch: pad_ids([e["text"]["input_ids"] for e in batch]),
    ),
    "tensor of vectors": (lambda n: torch.ones(n, 4), lambda batch: pad_ids(batch).sum(-1).clamp(max=1)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_longest_batch_finds_the_longest_examples_in_every_layout(layout: str) -> None:
    make, collate = LAYOUTS[layout]
    lengths = [8] * 20 + [300] + [8] * 20
    loader = DataLoader(Examples([make(n) for n in lengths]), batch_size=4, collate_fn=collate)
    notes: list[str] = []
    assert next(iter(loader)).shape[1] == 8  # what the first batch holds
    assert longest_batch(loader, notes=notes).shape[1] == 300
    assert notes == []  # lengths were found: nothing to caveat


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    lengths=st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=40),
    batch_size=st.integers(min_value=1, max_value=8),
)
def test_the_batch_chosen_holds_the_longest_examples(layout: str, lengths: list[int], batch_size: int) -> None:
    make, collate = LAYOUTS[layout]
    loader = DataLoader(Examples([make(n) for n in lengths]), batch_size=batch_size, collate_fn=collate)
    batch = longest_batch(loader)
    held = sorted(batch.sum(dim=1).tolist(), reverse=True)  # tokens are ones and padding zeros
    assert held[0] == max(lengths)
    longest = sorted(lengths, reverse=True)[:batch_size]  # repeated to a batch when there are fewer
    assert held == sorted((longest[i % len(longest)] for i in range(batch_size)), reverse=True)


def test_a_dataset_without_lengths_says_so_in_the_notes() -> None:
    notes: list[str] = []
    # raw text for a collate_fn that tokenizes: no sequence memfit can measure
    scalars = Examples([{"text": "word " * (1 + i), "label": i % 2} for i in range(10)])
    assert longest_examples(scalars, 3, notes=notes) == [0, 1, 2]  # the first ones, as before
    (note,) = notes
    assert "no example length" in note and "first 3" in note

    notes.clear()
    loader = DataLoader(scalars, batch_size=3, collate_fn=lambda batch: batch)
    assert len(longest_batch(loader, notes=notes)) == 3
    assert len(notes) == 1 and "no example length" in notes[0]

    notes.clear()
    assert len(batch_examples(scalars, 2, notes=notes)) == 2
    assert len(notes) == 1 and "no example length" in notes[0]

    notes.clear()
    equal = Examples([[1] * 5 for _ in range(6)])  # lengths found, all as long: the first ones, nothing to say
    assert longest_examples(equal, 2, notes=notes) == [0, 1] and notes == []


def test_a_first_batch_taken_without_reading_lengths_says_so_in_the_notes() -> None:
    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            return iter(rows([3, 9, 5]))

    notes: list[str] = []
    batch_examples(Stream(), 2, notes=notes)
    assert len(notes) == 1 and "stream" in notes[0]

    notes.clear()
    longest_batch(DataLoader(Stream(), batch_size=2, collate_fn=pad), notes=notes)
    assert len(notes) == 1 and "stream" in notes[0] and "first" in notes[0]

    notes.clear()
    same = [torch.zeros(4) + i for i in range(10)]
    longest_batch(DataLoader(same, batch_size=4), notes=notes)  # default_collate: every batch is as long
    assert notes == []


def test_reading_the_batch_leaves_a_loaders_own_shuffling_alone() -> None:
    """A loader with its own generator seeds each pass's shuffle from it, outside the global RNG state: after
    memfit reads its longest batch, the run's first epoch is the one it would have had."""
    data = torch.arange(40).unsqueeze(1)

    def loader() -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))

    untouched, read = loader(), loader()
    longest_batch(read)
    assert torch.equal(torch.cat(list(read)), torch.cat(list(untouched)))
