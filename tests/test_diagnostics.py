"""memfit's logging and its strict switch: one warning per problem, info on rank zero, errors under MEMFIT_STRICT."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch

from memfit.diagnostics import degrade, info, warn_once
from memfit.errors import MemfitError, StrictModeError
from memfit.planning.capacity import free_device_bytes
from memfit.reporting.figures import log_figure
from memfit.run.recovery import OOMRecovery


def _fails() -> None:
    raise ConnectionError("tracker unreachable")


def _library_call(message: str, error: Exception, key: str, seen: set[str]) -> None:
    """Where memfit calls degrade: the warning points at the caller of this function."""
    degrade(message, error, key=key, seen=seen)


def test_strict_raises_the_original_error_chained_with_the_message() -> None:
    original: BaseException | None = None
    with pytest.raises(StrictModeError, match=r"memfit could not log.*MEMFIT_STRICT=1") as caught:
        try:
            _fails()
        except ConnectionError as error:
            original = error
            degrade("memfit could not log", error)
    assert caught.value.__cause__ is original
    assert not isinstance(caught.value, MemfitError)  # memfit's own handlers cannot swallow it again


def test_the_switch_is_read_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMFIT_STRICT", "0")
    with pytest.warns(UserWarning, match="read at call time"):
        degrade("read at call time", ValueError("x"), seen=set())
    monkeypatch.setenv("MEMFIT_STRICT", "1")
    with pytest.raises(StrictModeError):
        degrade("read at call time", ValueError("x"), seen=set())


@pytest.mark.usefixtures("lenient")
def test_lenient_warns_exactly_once_per_key() -> None:
    seen: set[str] = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _library_call("memfit could not log (ConnectionError)", ConnectionError("a"), "log", seen)
        _library_call("memfit could not draw", OSError("b"), "figure", seen)
        _library_call("memfit could not log, again", ConnectionError("c"), "log", seen)
        _library_call("memfit could not log (ConnectionError)", ConnectionError("d"), "log", set())  # a new run
    assert [str(w.message) for w in caught] == [
        "memfit could not log (ConnectionError)",
        "memfit could not draw",
        "memfit could not log (ConnectionError)",
    ]
    assert all(w.category is UserWarning and w.filename == __file__ for w in caught)  # points at the caller


@pytest.mark.usefixtures("lenient")
def test_quiet_degrade_is_an_info_line_not_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="memfit"), warnings.catch_warnings():
        warnings.simplefilter("error")
        degrade("memfit could not check the validation pass", ValueError("x"), quiet=True)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        "memfit could not check the validation pass"
    ]


def test_info_and_warnings_come_from_rank_zero_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert not torch.distributed.is_initialized()  # the rank comes from the environment here
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO, logger="memfit"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info("planned 3 x 4 on every rank")
        assert not warn_once("plan", "said once", seen=set())
        assert warn_once("oom", "this rank ran out of memory", seen=set(), all_ranks=True)
    assert not caplog.records and [str(w.message) for w in caught] == ["this rank ran out of memory"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "1")  # RANK wins: a second node's local rank 0 is not global rank 0
    with caplog.at_level(logging.INFO, logger="memfit"):
        info("planned 3 x 4 on every rank")
    assert [r.getMessage() for r in caplog.records] == ["planned 3 x 4 on every rank"]
    monkeypatch.delenv("RANK")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memfit"):
        info("planned 3 x 4 on every rank")
    assert not caplog.records  # only LOCAL_RANK=1 is known


def test_free_memory_that_cannot_be_read_raises_under_strict_and_is_unknown_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(device: object = None) -> tuple[int, int]:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    with pytest.raises(StrictModeError, match="free memory of cuda:0") as caught:
        free_device_bytes(torch.device("cuda", 0))
    assert isinstance(caught.value.__cause__, RuntimeError)
    monkeypatch.delenv("MEMFIT_STRICT")
    with pytest.warns(UserWarning, match="could not read the free memory of cuda:0.*driver initialization"):
        assert free_device_bytes(torch.device("cuda", 0)) == 0


class _Figure:
    def savefig(self, path: Path, dpi: int) -> None:
        Path(path).write_bytes(b"png")


class _RefusingBoard:
    def add_figure(self, *args: object, **kwargs: object) -> None:
        _fails()


@pytest.mark.usefixtures("lenient")
def test_a_tracker_that_refuses_a_figure(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            sent = log_figure(_Figure(), "memfit/drift", tensorboard=_RefusingBoard(), folder=tmp_path)
            assert sent == [str(tmp_path / "memfit_drift.png")]  # the folder still gets it
    assert [str(w.message) for w in caught] == [
        "memfit could not send memfit/drift to TensorBoard (ConnectionError: tracker unreachable)"
    ]


def test_a_tracker_that_refuses_a_figure_fails_under_strict(tmp_path: Path) -> None:
    with pytest.raises(StrictModeError, match="TensorBoard") as caught:
        log_figure(_Figure(), "memfit/drift", tensorboard=_RefusingBoard(), folder=tmp_path)
    assert isinstance(caught.value.__cause__, ConnectionError)


def test_a_failing_recovery_report_raises_under_strict_and_warns_once_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def report(record: object) -> None:
        _fails()

    recovery = OOMRecovery(reset_gradients=lambda: None, on_recovery=report)
    with pytest.raises(StrictModeError, match="could not report a recovery"):
        recovery._shrink(8, "CUDA out of memory", step=1, replayed=0)
    monkeypatch.delenv("MEMFIT_STRICT")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recovery._shrink(4, "CUDA out of memory", step=2, replayed=0)
        recovery._shrink(2, "CUDA out of memory", step=3, replayed=0)
    assert len(caught) == 1 and "could not report a recovery (ConnectionError" in str(caught[0].message)
    assert [r.chunk_after for r in recovery.recoveries] == [4, 2, 1]  # the recovery itself went on


def test_an_nvml_reader_bug_is_not_mistaken_for_a_missing_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")
    from memfit.run.measure import nvml_device_used_bytes

    def buggy(index: int) -> None:
        raise AttributeError("'NoneType' object has no attribute 'used'")

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", buggy)
    with pytest.raises(AttributeError):
        nvml_device_used_bytes(0)
