"""A deep model's second shallow trace taken in a forked child: the same answer, or the child's work discarded."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest

from memfit.cli.main import main
from memfit.prediction import forked

pytest.importorskip("transformers")

IDLE_CORE, RUNNABLE, NOTHING_STARTED = forked._idle_core, forked._runnable, forked._nothing_started
needs_fork = pytest.mark.skipif(not forked._safe(), reason="a child is only forked on Linux with two cores")


@pytest.fixture(autouse=True)
def _an_idle_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite keeps every core busy, and other tests in the same worker may leave threads behind (a tracker's
    writer): these tests fork whatever the load and the threads."""
    monkeypatch.setattr(forked, "_idle_core", lambda: True)
    monkeypatch.setattr(forked, "_no_other_threads", lambda: True)
    monkeypatch.setattr(forked, "_nothing_started", lambda: True)


NARROW_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                "max_position_embeddings": 256}  # fmt: skip
MACHINE_STATE = {"available_bytes", "trace_seconds", "seconds", "load_average"}


def _answer(value: object) -> object:
    if isinstance(value, dict):
        return {k: _answer(v) for k, v in value.items() if k not in MACHINE_STATE}
    if isinstance(value, list):
        return [_answer(v) for v in value]
    return value


def _delivered(compute: object) -> list[tuple[object, float]]:
    got: list[tuple[object, float]] = []
    with forked.aside(compute, lambda data, seconds: got.append((data, seconds))):  # type: ignore[arg-type]
        time.sleep(0.05)
    return got


@needs_fork
def test_a_plan_with_its_deeper_traces_forked_is_the_plan_of_one_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(NARROW_LLAMA))
    forks: list[bool] = []
    fork = forked._fork
    monkeypatch.setattr(forked, "_fork", lambda compute: forks.append(True) or fork(compute))
    monkeypatch.setenv("MEMFIT_CACHE", "off")
    command = ["plan", "--hf-config", str(config), "--budget", "1GiB", "--seq-len", "64", "--json"]
    answers = []
    for parallel in ("on", "off"):
        monkeypatch.setenv(forked.PARALLEL_ENV, parallel)
        assert main(command) == 0
        answers.append(_answer(json.loads(capsys.readouterr().out)))
        if parallel == "on":
            assert forks, "the deeper model's traces were taken in a child"
            taken = len(forks)
    assert len(forks) == taken, "MEMFIT_PARALLEL_TRACES=off forks nothing"
    assert answers[0] == answers[1]
    assert answers[0]["depth_built_from"] == [3, 4]


@needs_fork
def test_what_a_child_computes_comes_back_with_its_time() -> None:
    ((data, seconds),) = _delivered(lambda: {"pid": os.getpid(), "sizes": [1, 2, 3]})
    assert data["sizes"] == [1, 2, 3] and data["pid"] != os.getpid()  # computed in another process
    assert seconds >= 0


@needs_fork
@pytest.mark.parametrize(
    "compute",
    [
        lambda: warnings.warn("a warning the parent would have shown", UserWarning, stacklevel=1) or {},
        lambda: print("a line the parent would have printed") or {},
        lambda: sys.stderr.write("a line on stderr") and {},
        lambda: 1 / 0,
        lambda: {"not json": object()},
    ],
    ids=["warned", "printed", "wrote-stderr", "raised", "not-data"],
)
def test_a_child_that_shows_anything_or_fails_is_discarded(compute: object, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert _delivered(compute) == []
    out, err = capsys.readouterr()
    assert out == "" and err == "", "the child's output never reaches the parent's streams"


@needs_fork
def test_a_child_that_does_not_answer_in_time_is_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forked, "_LEAST_WAIT_S", 0.5)
    started = time.perf_counter()
    assert _delivered(lambda: time.sleep(60) or {}) == []
    assert time.perf_counter() - started < 10


def test_no_child_is_forked_when_turned_off_or_cuda_is_live(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(forked.PARALLEL_ENV, "off")
    assert not forked.can_fork()
    assert _delivered(lambda: {}) == []
    monkeypatch.setenv(forked.PARALLEL_ENV, "on")
    monkeypatch.setattr(forked.torch.cuda, "is_initialized", lambda: True)
    assert not NOTHING_STARTED()


def test_an_error_in_the_parents_body_ends_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    ended: list[int] = []
    end = forked._end
    monkeypatch.setattr(forked, "_end", lambda pid: ended.append(pid) or end(pid))
    with pytest.raises(KeyError), forked.aside(lambda: time.sleep(60) or {}, lambda data, seconds: None):
        raise KeyError("the parent's own trace failed")
    assert len(ended) == (1 if forked.can_fork() else 0)


@needs_fork
def test_an_estimates_two_replays_side_by_side_are_the_replays_of_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from memfit.prediction import exact
    from memfit.prediction.estimator import _prepare, _Step
    from memfit.simulation.replay import replay_step
    from memfit.tracing.config import Target, TrainingLoop
    from memfit.tracing.tracer import trace_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    sample = torch.zeros(4, 64)
    step = _Step("adamw", None, "fp32", False, None, lambda output, batch: output.square().mean(), None, False)
    settings, (_, _, sample_batch) = _prepare(model, sample, None, step, TrainingLoop(), Target("cuda"))
    primary, secondary = (trace_steps(model, sample, sample_batch, b, settings).recorder for b in (4, 8))
    forks: list[bool] = []
    fork = forked._fork
    monkeypatch.setattr(forked, "_fork", lambda compute: forks.append(True) or fork(compute))
    monkeypatch.setattr(exact, "_FORKED_REPLAY_EVENTS", 0)  # this small log too
    assert exact._replayed_side_by_side(primary, secondary, True) == replay_step(primary, secondary, True)
    assert forks == [True]


def test_a_busy_machine_forks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    monkeypatch.setattr(forked, "_runnable", lambda: cores - 1)  # every other core busy
    assert not IDLE_CORE()
    monkeypatch.setattr(forked, "_runnable", lambda: 0)
    assert IDLE_CORE() == (cores >= 2)
    monkeypatch.setattr(forked, "_runnable", lambda: None)  # no /proc: the last minute's load
    monkeypatch.setattr(forked.os, "getloadavg", lambda: (float(cores), 0.0, 0.0))
    assert not IDLE_CORE()
    counted = RUNNABLE()  # this machine's own count, read from /proc/loadavg
    assert counted is None or counted >= 0


def test_a_live_thread_forks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.undo()  # this test reads the thread check itself
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)  # a non-daemon thread, as a tracker's writer may be
    worker.start()
    try:
        assert not forked._no_other_threads()
    finally:
        stop.set()
        worker.join()
