"""Kept ``memfit plan`` answers (``memfit.cli.answers``): a question asked again prints the same answer without
building the model, live facts stay live, and nothing that could differ is ever replayed."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import memfit.planning.capacity as capacity
import memfit.planning.gpu_report as gpu_report
import memfit.prediction.host as host_module
from memfit.cli import answers
from memfit.cli.main import main
from memfit.prediction.exact import clear_sessions
from memfit.prediction.host import HostEstimate

CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 128}
QUESTION = ["plan", "--seq-len", "64", "--gpu", "t4"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEMFIT_CACHE", "on")
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    clear_sessions()
    yield tmp_path / "cache" / "answers"
    clear_sessions()


def _calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """One entry per call of ``module.name`` from now on (it still runs)."""
    calls: list[int] = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the model was built and planned: a kept answer plans nothing."""
    return _calls(monkeypatch, gpu_report, "plan_for_gpus")


def _available(monkeypatch: pytest.MonkeyPatch, value: int) -> None:
    monkeypatch.setattr(capacity, "available_ram_bytes", lambda: value)
    monkeypatch.setattr(host_module, "available_ram_bytes", lambda: value)


def _config(tmp_path: Path, **changes: int) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, **changes}))
    return str(path)


def _ask(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().out


def test_a_question_asked_again_is_answered_from_the_cache_byte_for_byte(
    tmp_path: Path, cache: Path, planned: list[int], capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    _available(monkeypatch, 20 * 2**30)
    argv = [*QUESTION, "--hf-config", _config(tmp_path)]
    first = _ask(capsys, argv)
    second = _ask(capsys, argv)
    assert planned == [1] and first == second and first[0] == 0 and "micro batch" in first[1]
    assert len(list(cache.glob("*.json.gz"))) == 1


def test_the_host_line_is_measured_again(
    tmp_path: Path, cache: Path, planned: list[int], capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    argv = [*QUESTION, "--hf-config", _config(tmp_path)]
    _available(monkeypatch, 20 * 2**30)
    _, text = _ask(capsys, argv)
    _, as_json = _ask(capsys, [*argv, "--json"])
    _available(monkeypatch, 2**20)  # less than the weights: the verdict turns too
    _, text_again = _ask(capsys, argv)
    _, json_again = _ask(capsys, [*argv, "--json"])
    assert len(planned) == 2  # one text, one JSON answer; the repeats plan nothing
    changed = [(a, b) for a, b in zip(text.splitlines(), text_again.splitlines(), strict=True) if a != b]
    assert len(changed) == 1 and "20.00 GiB available here" in changed[0][0]
    assert "1.00 MiB available here; more than this machine has available" in changed[0][1]
    host, host_again = json.loads(as_json)["host"], json.loads(json_again)["host"]
    assert (host["available_bytes"], host["fits"]) == (20 * 2**30, True)
    assert (host_again["available_bytes"], host_again["fits"]) == (2**20, False)
    assert {k: v for k, v in host.items() if k not in ("available_bytes", "fits")} == {
        k: v for k, v in host_again.items() if k not in ("available_bytes", "fits")
    }


def test_a_changed_config_file_or_option_is_a_new_question(
    tmp_path: Path, cache: Path, planned: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*QUESTION, "--hf-config", _config(tmp_path)]
    _, shallow = _ask(capsys, argv)
    _config(tmp_path, n_layer=4)
    _, deep = _ask(capsys, argv)
    _ask(capsys, [*argv, "--precision", "fp32"])
    assert len(planned) == 3 and shallow != deep


def test_nothing_is_kept_when_the_cache_is_off_or_the_answer_is_an_error(
    tmp_path: Path, cache: Path, planned: list[int], capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    argv = [*QUESTION, "--hf-config", _config(tmp_path)]
    monkeypatch.setenv("MEMFIT_CACHE", "off")
    _ask(capsys, argv)
    _ask(capsys, argv)
    monkeypatch.setenv("MEMFIT_CACHE", "on")
    assert main([*argv, "--gpu", "no-such-card"]) == 2  # bad input: an error, not an answer
    assert len(planned) == 3 and not list(cache.glob("*.json.gz"))


def _namespace(**more: object) -> argparse.Namespace:
    asked = {"command": "plan", "hf_config": "gpt2", "gpu": ["t4"], "budget": None, "model": None, "plot": None}
    return argparse.Namespace(**{**asked, **more})


def test_warnings_are_raised_again_and_standard_error_output_is_never_replayed(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class Console:  # the little of rich's console that host_line uses
        width = 80

        def print(self, text: str, highlight: bool) -> None:
            print(text)

    def answer() -> int:
        print("the table")
        answers.host_line(Console(), HostEstimate(1, 2, 0, 0, None), "")
        warnings.warn("planned in 16-mixed", UserWarning, stacklevel=1)
        return 0

    def must_not_run() -> int:
        raise AssertionError("answered again instead of from the cache")

    for run in (answer, must_not_run):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert answers.answered(_namespace(), ["plan"], run) == 0
        assert capsys.readouterr().out == "the table\nhost RAM: 3 B (weights 1 B, batches 2 B)\n"
        assert [str(w.message) for w in caught] == ["planned in 16-mixed"]

    def talks_on_stderr() -> int:
        import sys

        print("a library's note", file=sys.stderr)
        return 0

    assert answers.answered(_namespace(margin=0.1), ["plan"], talks_on_stderr) == 0
    assert len(list(cache.glob("*.json.gz"))) == 1  # the first answer only


@pytest.mark.parametrize("damage", ["garbage", "foreign", "incomplete", "malformed"])
def test_a_damaged_or_foreign_entry_is_ignored_with_one_line_and_deleted(
    cache: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    runs: list[int] = []

    def answer() -> int:
        runs.append(1)
        print("fresh")
        return 0

    answers.answered(_namespace(), ["plan"], answer)
    (path,) = cache.glob("*.json.gz")
    if damage == "garbage":
        path.write_bytes(b"not gzip")
    elif damage == "foreign":
        with gzip.open(path, "wt") as file:
            json.dump({"format": answers.FORMAT, "key": "another", "answer": {"code": 0, "stdout": "stale"}}, file)
    else:  # this question's key, with what the answer holds missing or in another shape
        with gzip.open(path, "rt") as file:
            entry = json.load(file)
        if damage == "incomplete":
            entry["answer"] = {"code": 0, "stdout": "stale"}
        else:
            entry["answer"]["warnings"] = [["only"]]
        with gzip.open(path, "wt") as file:
            json.dump(entry, file)
    capsys.readouterr()
    assert answers.answered(_namespace(), ["plan"], answer) == 0
    out, err = capsys.readouterr()
    assert runs == [1, 1] and out == "fresh\n" and "stale" not in out
    assert len(err.splitlines()) == 1 and err.startswith("memfit: warning: ignored the kept answer")


def test_memfit_cache_counts_and_clears_answers(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    answers.answered(_namespace(), ["plan"], lambda: 0)
    capsys.readouterr()
    assert main(["cache"]) == 0 and "kept answers: 1" in capsys.readouterr().out
    assert main(["cache", "--clear"]) == 0 and "1 kept answer(s)" in capsys.readouterr().out
    assert not list(cache.glob("*.json.gz"))


def test_the_key_changes_with_every_fact_the_answer_depends_on(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memfit.cli.answers as module

    config = _config(tmp_path)

    def key(*options: str, config_flag: str = "--hf-config", **more: object) -> str | None:
        asked = {"hf_config": config, **more}
        argv = ["plan", *QUESTION[1:], *([f"{config_flag}={asked['hf_config']}"]), *options]
        return answers.question_key(_namespace(**asked), argv)

    base = key()
    changed = {"an option": key("--margin", "0.1"), "another config file": key(hf_config="gpt2")}
    with monkeypatch.context() as patched:
        patched.setattr(module, "installed_distributions", lambda: ["torch-9.9.dist-info"])
        changed["a package"] = key()
    with monkeypatch.context() as patched:
        patched.setattr(module, "memfit_source_digest", lambda: "edited")
        changed["memfit's source"] = key()
    with monkeypatch.context() as patched:
        patched.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        changed["an environment variable"] = key()
    with monkeypatch.context() as patched:
        patched.chdir(cache.parent.parent)
        changed["the working folder"] = key()
    Path(config).write_text(json.dumps({**CONFIG, "n_layer": 3}))
    changed["the config file's bytes"] = key()
    abbreviated = key(config_flag="--hf")  # argparse takes --hf for --hf-config
    Path(config).write_text(json.dumps({**CONFIG, "n_layer": 5}))
    assert key(config_flag="--hf") != abbreviated
    assert base is not None and len({base, *changed.values()}) == len(changed) + 1, changed
    assert key(model="mymodule:build") is None  # user code
    assert key(loss="mymodule:loss") is None  # user code too
    assert key(plot="plan.png") is None  # writes a file
    assert key(gpu=None) is None  # the GPU of this machine, whichever it is


def test_a_kept_answer_is_printed_by_the_command_without_importing_torch(tmp_path: Path) -> None:
    """The console script replays a kept answer before it parses the command line: parsing imports the planner,
    torch and transformers (seconds), which the answer does not need."""
    env = {**os.environ, "MEMFIT_CACHE": "on", "MEMFIT_CACHE_DIR": str(tmp_path / "cache")}
    argv = [sys.executable, "-X", "importtime", "-m", "memfit", *QUESTION, "--hf-config", _config(tmp_path)]
    first, again = (subprocess.run(argv, capture_output=True, text=True, env=env, check=True) for _ in range(2))

    def imported(run: subprocess.CompletedProcess) -> set[str]:
        return {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}

    def answer(run: subprocess.CompletedProcess) -> list[str]:  # the host line's free RAM is measured again
        return [line for line in run.stdout.splitlines() if not line.startswith("host RAM")]

    assert "torch" in imported(first) and "memfit.planning.planner" in imported(first)
    assert answer(again) == answer(first) and "micro batch" in again.stdout
    assert not {"torch", "sympy", "transformers", "memfit.cli.main"} & imported(again)


def test_from_kept_traces_the_planner_replays_nothing_and_answers_the_same(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the kept answer deleted, the replays' results (at the allocator's limit, its least reserve, the
    phase peaks) come from the trace cache too: for a model built from shallow traces (6 blocks from 3 and 4)."""
    import shutil

    import memfit.prediction.exact as exact

    _available(monkeypatch, 20 * 2**30)
    replayers = _calls(monkeypatch, exact, "LimitReplayer")
    argv = [*QUESTION, "--hf-config", _config(tmp_path, n_layer=6), "--target-batch-size", "24", "--json"]
    first = _ask(capsys, argv)
    assert replayers, "the first answer replays at the allocator's limit"
    replayers.clear()
    shutil.rmtree(cache)
    clear_sessions()
    again = _ask(capsys, argv)
    assert again == first and replayers == []


def test_a_warning_about_a_damaged_cache_entry_is_not_kept_with_the_answer(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def answer() -> int:
        warnings.warn("memfit ignored the trace cache entry /x.json.gz (EOFError) and traces again", stacklevel=1)
        print("the table")
        return 0

    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            answers.answered(_namespace(), ["plan"], answer)
        seen = [str(w.message) for w in caught]
    assert capsys.readouterr().out == "the table\n" * 2
    assert seen == []  # the replay is quiet: the damage was the first run's
