"""The trace cache on disk: a kept trace answers exactly as a fresh one, and nothing stale, foreign or damaged is
ever read back (``memfit.tracing.trace_cache``)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import memfit
from memfit.diagnostics import forget_warnings
from memfit.prediction.exact import clear_sessions
from memfit.tracing import trace_cache

SEQ, VOCAB = 16, 96


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEMFIT_CACHE", "on")
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    clear_sessions()
    forget_warnings()
    yield tmp_path / "traces"
    clear_sessions()
    forget_warnings()


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every trace run (symbolic or concrete), by its batch: a kept trace runs none."""
    import memfit.prediction.estimator as estimator_module
    import memfit.prediction.exact as exact_module
    import memfit.tracing.symbolic as symbolic_module

    runs: list[int] = []
    for module in (exact_module, symbolic_module, estimator_module):
        original = module.trace_steps

        def counted(*args, _original=original, **kwargs):
            runs.append(args[3] if len(args) > 3 else kwargs.get("batch_size"))
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "trace_steps", counted)
    return runs


def _gpt2(n_layer: int = 2) -> torch.nn.Module:
    config = GPT2Config(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.ones(2, SEQ, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def _trace(model: torch.nn.Module, batch: dict | None = None, **options) -> memfit.StepCurve:
    clear_sessions()  # the process's own kept traces would answer first: only the disk may
    return memfit.trace(
        model, batch or _batch(), batch_size=4, optimizer="adamw", target=memfit.Target("cuda"), **options
    )


def _answers(curve: memfit.StepCurve) -> list[tuple[int, int]]:
    return [(curve.estimate.peak_allocated_bytes, curve.estimate.peak_reserved_bytes)] + [
        (peak.allocated_bytes, peak.reserved_bytes) for peak in (curve.at(b) for b in (2, 3, 7, 16))
    ]


def test_a_kept_trace_answers_every_batch_exactly_as_a_fresh_trace(
    cache: Path, traces: list[int], replays: list[int]
) -> None:
    fresh = _trace(_gpt2())
    answers = _answers(fresh)
    assert traces and len(list(cache.glob("*.json.gz"))) >= 1
    traces.clear()
    replays.clear()
    kept = _trace(_gpt2())
    assert _answers(kept) == answers
    assert traces == []  # nothing was traced
    assert replays == []  # nor replayed: the estimate's own replays are kept with the trace
    assert kept.estimate.breakdown == fresh.estimate.breakdown


def test_every_accumulation_count_answers_from_the_traces_of_another(
    cache: Path, traces: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace reads gradient accumulation as "more than one micro batch": a target that accumulates 8 micro
    batches answers, in another process, from the traces kept for 4, as a fresh trace at 8 does."""
    _trace(_gpt2(), loop=memfit.TrainingLoop(accumulation_steps=4))
    traces.clear()
    kept = _trace(_gpt2(), loop=memfit.TrainingLoop(accumulation_steps=8))
    assert traces == []  # nothing was traced
    answers = _answers(kept)
    monkeypatch.setenv("MEMFIT_CACHE", "off")
    fresh = _trace(_gpt2(), loop=memfit.TrainingLoop(accumulation_steps=8))
    assert _answers(fresh) == answers and fresh.estimate == kept.estimate
    assert kept.estimate.accumulation_steps == 8 and any("over 8 micro batches" in n for n in kept.estimate.notes)


def test_another_sequence_length_is_kept_too(cache: Path) -> None:
    fresh = _trace(_gpt2())
    first = fresh.at(4, seq_len=SEQ // 2)
    again = _trace(_gpt2()).at(4, seq_len=SEQ // 2)
    assert (again.allocated_bytes, again.reserved_bytes) == (first.allocated_bytes, first.reserved_bytes)


@pytest.mark.parametrize(
    "change",
    ["deeper", "frozen embedding", "precision", "shorter sequence", "optimizer"],
)
def test_anything_the_trace_reads_changes_the_key(cache: Path, traces: list[int], change: str) -> None:
    _trace(_gpt2())
    traces.clear()
    entries = set(cache.glob("*.json.gz"))
    model, batch, options = _gpt2(), None, {}
    if change == "deeper":
        model = _gpt2(n_layer=3)
    elif change == "frozen embedding":
        model.transformer.wte.weight.requires_grad_(False)
    elif change == "precision":
        options["precision"] = "bf16-mixed"
    elif change == "shorter sequence":  # (token values are not read: the trace runs on the sample's shapes)
        batch = {k: v[:, : SEQ // 2] for k, v in _batch().items()}
    if change == "optimizer":
        clear_sessions()
        memfit.estimate(model, _batch(), batch_size=4, optimizer="sgd", target=memfit.Target("cuda"))
    else:
        _trace(model, batch, **options)
    assert traces
    assert set(cache.glob("*.json.gz")) > entries


class ScriptModel(torch.nn.Module):
    """A model whose code lives outside any installed distribution: it has no version to key it by."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).sum()


def test_a_callable_object_is_keyed_by_its_settings_not_its_class_alone() -> None:
    """A loss or forward object (``nn.CrossEntropyLoss(label_smoothing=0.1)``, a step with options) reads its
    attributes when the trace calls it: they are part of the key, and an object that cannot be kept says so."""
    key = trace_cache._canonical
    assert key(torch.nn.CrossEntropyLoss(label_smoothing=0.1)) != key(torch.nn.CrossEntropyLoss())
    assert key(torch.nn.CrossEntropyLoss(label_smoothing=0.1)) == key(torch.nn.CrossEntropyLoss(label_smoothing=0.1))

    class Step:  # a class of a memfit module stands in for any installed one
        __module__ = "memfit.some_step"

        def __init__(self, scale: float) -> None:
            self.scale = scale

        def __call__(self, module: torch.nn.Module, batch: object) -> object:
            return module(batch) * self.scale

    Step.__qualname__ = "Step"
    assert key(Step(1.0)) != key(Step(2.0))

    class Noting(Step):
        def memfit_cache_key(self) -> object:
            raise trace_cache.Uncacheable("it notes what it sees")

    Noting.__qualname__ = "Noting"
    with pytest.raises(trace_cache.Uncacheable):
        key(Noting(1.0))


def test_code_outside_an_installed_distribution_is_never_cached(cache: Path) -> None:
    memfit.estimate(ScriptModel(), torch.zeros(2, 8), batch_size=2, target=memfit.Target("cuda"))
    assert not cache.exists() or not list(cache.glob("*.json.gz"))


def _doubled_mlp(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A forward of user code set in place of GPT-2's MLP: it holds a tensor eight times as wide."""
    wide = torch.cat([hidden] * 8, -1)
    return self.c_proj(self.act(self.c_fc(hidden))) + wide[..., : hidden.shape[-1]] * 0


def test_a_layer_whose_forward_user_code_replaced_is_never_cached(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library class's name and version do not say what runs when its forward was replaced, on the module or on
    the class: such a step is traced afresh, never answered from a trace of the original."""
    from transformers.models.gpt2 import modeling_gpt2

    plain = _gpt2()
    assert trace_cache.session_key(plain, _batch(), 2, None) is not None
    patched = _gpt2()
    patched.transformer.h[0].mlp.forward = _doubled_mlp.__get__(patched.transformer.h[0].mlp)
    with pytest.raises(trace_cache.Uncacheable, match="not part of an installed distribution"):
        trace_cache._model_key(patched)
    monkeypatch.setattr(modeling_gpt2.GPT2MLP, "forward", _doubled_mlp)
    assert trace_cache.session_key(_gpt2(), _batch(), 2, None) is None


def test_a_method_an_installed_library_adds_to_torch_keeps_its_models_cacheable(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers sets a function it defines inside a method on ``nn.Module`` (``smart_apply``): versioned by the
    library, it leaves every model cacheable."""
    from transformers import modeling_utils

    def added(module: torch.nn.Module) -> None:
        return None

    added.__module__, added.__qualname__ = modeling_utils.__name__, "PreTrainedModel.initialize_weights.<locals>.added"
    monkeypatch.setattr(torch.nn.Module, "added_by_a_library", added, raising=False)
    assert trace_cache.session_key(_gpt2(), _batch(), 2, None) is not None


def test_off_means_nothing_is_written(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMFIT_CACHE", "off")
    _trace(_gpt2())
    assert not cache.exists() or not list(cache.glob("*.json.gz"))


def test_a_setting_that_is_neither_on_nor_off_warns_once_and_keeps_the_cache(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEMFIT_CACHE", "sometimes")
    forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trace(_gpt2())
    said = [str(w.message) for w in caught if "MEMFIT_CACHE" in str(w.message)]
    assert said == ["MEMFIT_CACHE='sometimes' is neither on nor off; memfit's caches stay on (set MEMFIT_CACHE=off "
                    "to turn them off, or on)"]  # fmt: skip
    assert list(cache.glob("*.json.gz"))


def _rewrite(path: Path, edit) -> None:
    with gzip.open(path, "rt") as file:
        entry = json.load(file)
    edit(entry)
    with gzip.open(path, "wt") as file:
        json.dump(entry, file)


@pytest.mark.parametrize("damage", ["truncated", "foreign key", "unknown class", "not json"])
def test_a_damaged_or_foreign_entry_is_ignored_with_one_warning_and_traced_again(
    cache: Path, traces: list[int], damage: str
) -> None:
    answers = _answers(_trace(_gpt2()))
    traces.clear()
    paths = sorted(cache.glob("*.json.gz"))
    for path in paths:
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
        elif damage == "foreign key":
            _rewrite(
                path,
                lambda e: e.update(
                    key=e["key"].replace(f'"format":{trace_cache.FORMAT}', f'"format":{trace_cache.FORMAT},"x":0')
                ),
            )
        elif damage == "unknown class":  # a size naming a class outside the table is refused, never built

            def poison(entry: dict) -> None:
                if entry["part"].startswith("replay:"):  # a replay's figures hold no expression
                    return
                trace = entry["value"]["trace"]
                sizes = trace.get("trace", trace)["recorder"]["sizes"]
                symbolic = next(pair for pair in sizes if isinstance(pair[1], list))
                symbolic[1] = ["x", ["os.system", ["Symbol", "s0", {}]]]

            _rewrite(path, poison)
        else:
            path.write_bytes(b"\x00not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _trace(_gpt2())
    ignored = [w for w in caught if "ignored the trace cache entry" in str(w.message)]
    assert len(ignored) == 1, [str(w.message) for w in caught]
    assert traces
    assert _answers(again) == answers
    assert len(list(cache.glob("*.json.gz"))) == len(paths)  # written again, whole


def test_expressions_are_read_back_only_through_the_table() -> None:
    s0 = trace_cache.decode_expr(["Symbol", "s0", {"integer": True, "positive": True}])
    expression = 3 * s0**2 + 7
    assert trace_cache.decode_expr(trace_cache.encode_expr(expression)) == expression
    with pytest.raises(ValueError, match="not one memfit reads back"):
        trace_cache.decode_expr(["__import__", 1])


def test_the_cli_answers_the_same_from_the_cache(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "memfit", "plan", "--hf-config", "gpt2", "--layers", "2", "--seq-len", "64",
               "--gpu", "t4", "--json"]  # fmt: skip
    env = {**__import__("os").environ, "MEMFIT_CACHE": "on", "MEMFIT_CACHE_DIR": str(tmp_path)}
    first, second = (subprocess.run(command, capture_output=True, text=True, env=env, check=True) for _ in range(2))
    assert list((tmp_path / "traces").glob("*.json.gz"))
    drop = ("trace_seconds", "available_bytes", "seconds")

    def answer(text: str) -> object:
        def clean(value: object) -> object:
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items() if k not in drop}
            if isinstance(value, list):
                return [clean(v) for v in value]
            return value

        return clean(json.loads(text))

    assert answer(first.stdout) == answer(second.stdout)


def test_the_cache_command_says_where_and_clears(tmp_path: Path) -> None:
    env = {**__import__("os").environ, "MEMFIT_CACHE": "on", "MEMFIT_CACHE_DIR": str(tmp_path)}
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "a.json.gz").write_bytes(b"x")
    shown = subprocess.run([sys.executable, "-m", "memfit", "cache"], capture_output=True, text=True, env=env)
    assert shown.returncode == 0 and str(folder) in shown.stdout and "kept traces: 1" in shown.stdout
    cleared = subprocess.run([sys.executable, "-m", "memfit", "cache", "--clear"], capture_output=True, text=True,
                             env=env)  # fmt: skip
    assert cleared.returncode == 0 and "removed 1" in cleared.stdout
    assert not list(folder.glob("*.json.gz"))


def test_an_optimizer_instance_is_keyed_by_its_groups_and_state(cache: Path, traces: list[int]) -> None:
    """A Trainer's optimizer is an instance: the same groups answer from the cache, other hyperparameters do not."""

    def run(lr: float, weight_decay: float) -> list[tuple[int, int]]:
        model = _gpt2()
        decay = [p for n, p in model.named_parameters() if "ln" not in n]
        rest = [p for n, p in model.named_parameters() if "ln" in n]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest}], lr=lr)
        clear_sessions()
        return _answers(memfit.trace(model, _batch(), batch_size=4, optimizer=optimizer, target=memfit.Target("cuda")))

    first = run(1e-3, 0.1)
    traces.clear()
    assert run(1e-3, 0.1) == first and traces == []
    run(1e-3, 0.0)
    assert traces


def test_a_factory_of_random_tokens_answers_from_the_cache(cache: Path, traces: list[int]) -> None:
    """The trace never reads a sample's values: a factory that draws new tokens each call keys the same."""

    def random_tokens(batch: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (batch, SEQ))
        return {"input_ids": ids, "labels": ids}

    first = _answers(_trace(_gpt2(), random_tokens))
    traces.clear()
    assert _answers(_trace(_gpt2(), random_tokens)) == first and traces == []


def test_a_read_only_cache_still_answers(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries that can be neither rewritten nor deleted (a read-only file system) are ignored; the answer stands."""
    import errno

    answers = _answers(_trace(_gpt2()))
    for path in cache.glob("*.json.gz"):
        path.write_bytes(b"damaged")

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.setattr(trace_cache.tempfile, "mkstemp", read_only)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert _answers(_trace(_gpt2())) == answers


def test_a_deep_log_built_from_kept_traces_is_the_fresh_one(cache: Path, traces: list[int]) -> None:
    """The shallow traces a deep log is built from keep their in-place gradient sums apart (they record blocks);
    the kept ones must say which, or the log built from them is not the whole model's."""
    from memfit.prediction.estimator import trace_for_runtimes
    from memfit.simulation.runtime import CudaRuntime
    from memfit.tracing.depth import log_difference

    def built() -> memfit.StepCurve:
        clear_sessions()
        return trace_for_runtimes(
            _gpt2(6), _batch(), runtimes=[CudaRuntime()], batch_size=4, optimizer="adamw",
            target=memfit.Target("cuda"), repeated=[_gpt2(3), _gpt2(4)],
        )[0]  # fmt: skip

    fresh = built()
    logs = {batch: fresh.replayer._session.trace_at(batch)[0].recorder for batch in (2, 3, 7)}
    answers = _answers(fresh)
    traces.clear()
    kept = built()
    assert traces == []  # nothing was traced
    for batch, log in logs.items():
        assert log_difference(kept.replayer._session.trace_at(batch)[0].recorder, log) is None, batch
    assert _answers(kept) == answers


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every replay of a log (the allocator simulated afresh for it): a kept replay runs none."""
    import memfit.simulation.replay as replay_module

    runs: list[int] = []

    class Counted(replay_module.CachingAllocatorSimulator):
        def __init__(self, *args, **kwargs) -> None:
            runs.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(replay_module, "CachingAllocatorSimulator", Counted)
    return runs


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_a_sharded_rank_replays_from_the_cache_as_it_replays_fresh(
    cache: Path, traces: list[int], replays: list[int], strategy: str
) -> None:
    """One rank's log is a rewrite of the trace; its replays are kept under the rewrite's own data (the sharding
    and the model's facts), so a question asked again replays nothing, and another sharding replays its own."""
    from memfit.tracing.sharding import ShardingConfig

    def sharded(world_size: int) -> memfit.StepCurve:
        loop = memfit.TrainingLoop(sharding=ShardingConfig(strategy, world_size))
        return _trace(_gpt2(), precision="bf16-mixed", loop=loop)

    def answers(curve: memfit.StepCurve) -> list[object]:
        limit = curve.max_batch_size(curve.estimate.peak_reserved_bytes * 3, include_context=False, at_limit=True)
        return [*_answers(curve), curve.estimate.rank_terms, limit]

    fresh = answers(sharded(4))
    assert replays
    traces.clear()
    replays.clear()
    assert answers(sharded(4)) == fresh
    assert traces == [] and replays == []
    other = answers(sharded(2))
    assert replays and other != fresh


def test_a_step_traced_only_at_concrete_batches_answers_from_the_cache(
    cache: Path, traces: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the step cannot be traced with a symbolic batch (here: told not to), its two concrete traces are kept
    too, and asked again it traces nothing and answers the same."""
    monkeypatch.setenv("MEMFIT_TRACE", "concrete")
    fresh = _trace(_gpt2())
    assert sorted(traces) == [4, 8]  # the batch asked and twice it, for the fit between them
    traces.clear()
    kept = _trace(_gpt2())
    assert traces == []
    assert _answers(kept) == _answers(fresh) and kept.estimate.breakdown == fresh.estimate.breakdown


def test_a_forward_that_writes_to_its_config_leaves_it_and_its_key_as_they_were(cache: Path, traces: list[int]) -> None:
    """transformers' classification loss sets ``config.problem_type`` on the first batch with labels: the trace
    leaves the user's config as it was, so the model keys the same after a trace as before it, and a second
    estimate answers from the cache."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        vocab_size=VOCAB, max_position_embeddings=SEQ, num_labels=3)  # fmt: skip
    model = BertForSequenceClassification(config)
    batch = {"input_ids": torch.ones(2, SEQ, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)}
    before = trace_cache.session_key(model, batch, 2, None)
    fresh = _trace(model, batch)
    assert model.config.problem_type is None
    assert trace_cache.session_key(model, batch, 2, None) == before
    traces.clear()
    assert _answers(_trace(model, batch)) == _answers(fresh)
    assert traces == []
