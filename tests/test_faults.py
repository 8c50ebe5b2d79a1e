"""The ways memfit itself can fail around a real run: each one ends in a warning and an untouched run.

Out-of-memory recovery has its own file (test_oom_recovery.py); the planning faults (a model the
trace cannot run, no batch-size attribute, a budget too small, resume, DDP ranks with different
free memory) are in test_lightning.py, test_huggingface.py and test_lightning_ddp.py.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger

from fault_models import Regression
from lightning_models import TinyGPT
from memfit.devices import cuda
from memfit.lightning import MemoryPlanner
from memfit.planning.capacity import free_device_bytes
from memfit.run.drift import DriftMonitor
from memfit.run.measure import PeakSampler, nvml_device_used_bytes

GiB = 1024**3


def fit(tmp_path: Path, module: L.LightningModule, callback: MemoryPlanner, **kwargs: object) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        callbacks=[callback],
        logger=kwargs.pop("logger", CSVLogger(tmp_path)),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module)
    return trainer


def test_no_nvml_library_gives_no_nvml_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert nvml_device_used_bytes(0) is None


def test_nvml_without_a_driver_gives_no_nvml_figure() -> None:
    pytest.importorskip("pynvml")
    if torch.cuda.is_available():
        pytest.skip("this machine has a driver")
    assert nvml_device_used_bytes(0) is None  # the real nvmlInit fails: no libnvidia-ml here


class CountersOfAGpu:
    """The CUDA peak counters PeakSampler reads, with values a test sets (this machine has no GPU)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.allocated, self.reserved = 6 * GiB, 7 * GiB
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_nvml_failing_mid_run_drops_only_the_nvml_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    CountersOfAGpu(monkeypatch)
    answers = iter([8 * GiB])  # NVML answers once, then its library raises
    monkeypatch.setattr(cuda, "nvml_device_used_bytes", lambda index: next(answers, None))
    sampler = PeakSampler("cuda:0")
    monitor = DriftMonitor(predicted_allocated_bytes=6 * GiB, predicted_reserved_bytes=7 * GiB, margin=0.05)
    first, second, third = (monitor.observe(step, sampler.sample()).metrics() for step in (1, 2, 3))
    assert first["memfit/measured_device_used_bytes"] == 8 * GiB
    for later in (second, third):
        assert "memfit/measured_device_used_bytes" not in later
        assert later["memfit/measured_peak_reserved_bytes"] == 7 * GiB and later["memfit/drift_reserved_pct"] == 0


def test_nvml_error_is_swallowed_by_the_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")

    def fails(*args: object) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", fails)
    assert nvml_device_used_bytes(0) is None


def test_capacity_is_the_free_memory_not_the_card_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # another process holds most of an 80 GiB card: 3 GiB free, plus 1 GiB this process's allocator caches
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1 * GiB)
    assert free_device_bytes(torch.device("cuda", 0)) == 4 * GiB


@pytest.mark.usefixtures("lenient")
def test_a_sample_the_model_rejects_warns_and_the_run_goes_on(tmp_path: Path) -> None:
    module = TinyGPT(batch_size=6)
    wrong = (torch.zeros(6, 32),)  # float ids: the embedding refuses them
    with pytest.warns(UserWarning, match="memfit could not plan this run"):
        trainer = fit(tmp_path, module, MemoryPlanner(budget="1GiB", sample=wrong))
    assert trainer.global_step == 4 and module.batch_size == 6 and trainer.accumulate_grad_batches == 1


class RefusesMemfitKeys(Logger):
    """A tracker that breaks on memfit's metrics and hyperparameters but takes the user's."""

    def __init__(self) -> None:
        super().__init__()
        self.user_metrics: list[dict] = []

    @property
    def name(self) -> str:
        return "refuses"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: object, *args: object, **kwargs: object) -> None:
        if isinstance(params, dict) and any(str(k).startswith("memfit/") for k in params):
            raise ConnectionError("tracker unreachable")

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if any(k.startswith("memfit/") for k in metrics):
            raise ConnectionError("tracker unreachable")
        self.user_metrics.append(metrics)


@pytest.mark.usefixtures("lenient")
def test_a_tracker_that_fails_on_memfit_metrics_does_not_stop_training(tmp_path: Path) -> None:
    logger = RefusesMemfitKeys()
    module = Regression()
    with pytest.warns(UserWarning, match="memfit could not log to RefusesMemfitKeys"):
        trainer = fit(tmp_path, module, MemoryPlanner(mode="observe"), logger=logger)
    assert trainer.global_step == 4 and logger.user_metrics  # the user's own metrics still arrive


@pytest.mark.usefixtures("lenient")
def test_measurement_failing_mid_run_stops_measuring_not_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real_sample = PeakSampler.sample

    def sample_then_fail(self: PeakSampler) -> object:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError("/proc/self/status: no such file")
        return real_sample(self)

    monkeypatch.setattr(PeakSampler, "sample", sample_then_fail)
    with pytest.warns(UserWarning, match="memfit stopped measuring.*OSError"):
        trainer = fit(tmp_path, Regression(), MemoryPlanner(mode="observe"))
    assert trainer.global_step == 4 and calls["n"] == 2  # measured once, failed once, then left alone


def test_the_loop_gets_its_own_closure_back_after_fit(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = fit(tmp_path, Regression(), MemoryPlanner(mode="observe"))
    assert "_make_closure" not in vars(trainer.fit_loop.epoch_loop.automatic_optimization)
