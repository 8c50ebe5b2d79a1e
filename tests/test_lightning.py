"""MemoryPlanner with a real lightning.Trainer on CPU and real loggers whose files are read back."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger
from torch.utils.data import DataLoader

import memfit
from lightning_models import SEQ, ModuleForDataModule, NoBatchAttribute, ReadsValues, TinyGPT, TokenData, tokens
from memfit.integrations.huggingface.arguments import model_checkpointing
from memfit.lightning import MemoryPlanner
from memfit.planning.margin import DEFAULT_MARGIN
from memfit.units import format_margin

MARGIN = 0.05
# On CPU: the prediction and the process's resident memory, never a drift between the two
DRIFT_KEYS = {"memfit/predicted_peak_allocated_bytes", "memfit/measured_peak_rss_bytes"}


def budget_for_micro_batch(module: TinyGPT, micro: int, configured: int = 12, **loop: Any) -> int:
    """A budget whose usable part lies between the predicted peaks of ``micro`` and ``micro + 1``, in
    Lightning's loop (``loop``: more of ``memfit.TrainingLoop``'s fields, accumulation, DDP)."""
    ids = torch.zeros(configured, SEQ, dtype=torch.long)
    curve = memfit.trace(
        module, (ids,), target=memfit.Target("cpu"), forward_fn=lambda m, b: m.model(input_ids=b[0], labels=b[0]),
        loop=memfit.TrainingLoop(zero_grad="before_backward", **loop),
    )  # fmt: skip
    low, high = curve.at(micro).device_bytes, curve.at(micro + 1).device_bytes
    assert low < high
    return math.ceil((low + high) / 2 / (1 - MARGIN))


def trainer(tmp_path: Path, callback: MemoryPlanner | None, loggers: list | None = None, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=kwargs.pop("max_steps", 6),
        callbacks=[callback] if callback is not None else [],
        logger=loggers if loggers is not None else CSVLogger(tmp_path),
        log_every_n_steps=kwargs.pop("log_every_n_steps", 2),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=kwargs.pop("enable_checkpointing", False),
        default_root_dir=tmp_path,
        **kwargs,
    )


def read_csv_metrics(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def test_plan_sets_micro_batch_and_accumulation_and_keeps_the_effective_batch(tmp_path: Path) -> None:
    module = TinyGPT(batch_size=12)
    callback = MemoryPlanner(budget=budget_for_micro_batch(module, 3), margin=MARGIN)
    fit = trainer(tmp_path, callback)
    fit.fit(module)
    assert module.batch_size == 3
    assert fit.train_dataloader.batch_size == 3
    assert fit.accumulate_grad_batches == 4
    assert set(module.seen_batch_sizes) == {3}
    plan = callback.plan
    assert plan is not None and plan.effective_batch_size == plan.target_batch_size == 12
    assert plan.largest_micro_batch == 3 and not plan.gradient_checkpointing
    assert fit.global_step == 6  # 6 optimizer steps of 4 micro batches each
    assert len(module.seen_batch_sizes) == 24


def test_csv_tensorboard_and_mlflow_receive_the_documented_keys(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    module = TinyGPT(batch_size=12)
    csv_logger = CSVLogger(tmp_path / "csv")
    tb_logger = TensorBoardLogger(tmp_path / "tb")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow_logger = MLFlowLogger(experiment_name="memfit", tracking_uri=uri, artifact_location=str(tmp_path / "art"))
    callback = MemoryPlanner(budget=budget_for_micro_batch(module, 4), margin=MARGIN)
    trainer(tmp_path, callback, loggers=[csv_logger, tb_logger, mlflow_logger]).fit(module)

    rows = [r for r in read_csv_metrics(csv_logger) if r.get("memfit/measured_peak_rss_bytes")]
    assert {int(r["step"]) for r in rows} == {1, 3, 5}  # where Lightning logs the module's train_loss
    losses = [r for r in read_csv_metrics(csv_logger) if r.get("train_loss")]
    assert {int(r["step"]) for r in losses} == {1, 3, 5}
    assert set(rows[0]) >= DRIFT_KEYS
    assert not [key for key in rows[0] if key.startswith("memfit/drift_") or "from_rss" in key]
    decision = callback.controller.decision
    for row in rows:
        assert int(float(row["memfit/predicted_peak_allocated_bytes"])) == decision.predicted_allocated_bytes
        assert float(row["memfit/measured_peak_rss_bytes"]) > 50 * 2**20  # a Python process with torch loaded
        assert math.isfinite(float(row["memfit/measured_peak_rss_bytes"]))
    hparams = (Path(csv_logger.log_dir) / "hparams.yaml").read_text()
    assert "memfit/micro_batch_size: 4" in hparams and "memfit/accumulate_grad_batches: 3" in hparams
    assert "\nbatch_size: 4\n" in f"\n{hparams}"  # the module's own hyperparameter shows the batch that ran

    events = EventAccumulator(str(tb_logger.log_dir))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert scalars >= DRIFT_KEYS
    assert [e.step for e in events.Scalars("memfit/measured_peak_rss_bytes")] == [1, 3, 5]

    run = mlflow.tracking.MlflowClient(tracking_uri=uri).get_run(mlflow_logger.run_id)
    assert set(run.data.metrics) >= DRIFT_KEYS
    assert run.data.params["memfit/micro_batch_size"] == "4"
    assert float(run.data.params["memfit/predicted_peak_bytes"]) > 0


def test_observe_mode_changes_nothing_and_still_logs(tmp_path: Path) -> None:
    module = TinyGPT(batch_size=12)
    callback = MemoryPlanner(budget=budget_for_micro_batch(module, 3), margin=MARGIN, mode="observe")
    fit = trainer(tmp_path, callback, max_steps=4)
    with pytest.warns(UserWarning, match=r"at micro batch 12, is over the .* budget .*: this run may run out of"):
        fit.fit(module)
    assert module.batch_size == 12 and fit.accumulate_grad_batches == 1
    assert set(module.seen_batch_sizes) == {12}
    rows = [r for r in read_csv_metrics(fit.logger) if r.get("memfit/measured_peak_rss_bytes")]
    assert len(rows) == 2


def test_observe_mode_logs_its_mode_and_the_prediction_it_measures_against(tmp_path: Path) -> None:
    callback = MemoryPlanner(budget="1GiB", mode="observe", verbose=False)
    fit = trainer(tmp_path, callback, max_steps=1)
    fit.fit(TinyGPT(batch_size=12))
    hparams = (Path(fit.logger.log_dir) / "hparams.yaml").read_text()
    assert "memfit/mode: observe" in hparams
    assert f"memfit/predicted_allocated_bytes: {callback.controller.decision.predicted_allocated_bytes}" in hparams


def test_batch_size_on_the_datamodule_is_planned(tmp_path: Path) -> None:
    module = ModuleForDataModule()
    data = TokenData(batch_size=12)
    callback = MemoryPlanner(budget=budget_for_micro_batch(module, 6), margin=MARGIN)
    fit = trainer(tmp_path, callback, max_steps=2)
    fit.fit(module, datamodule=data)
    assert data.batch_size == 6 and fit.accumulate_grad_batches == 2
    assert set(module.seen_batch_sizes) == {6}


def test_target_max_takes_the_largest_micro_batch(tmp_path: Path) -> None:
    module = TinyGPT(batch_size=2)
    callback = MemoryPlanner(
        budget=budget_for_micro_batch(module, 5, configured=2), margin=MARGIN, target_batch_size="max"
    )
    fit = trainer(tmp_path, callback, max_steps=2)
    fit.fit(module)
    assert module.batch_size == 5 and fit.accumulate_grad_batches == 1


def test_budget_too_small_even_with_checkpointing_fails_before_training(tmp_path: Path) -> None:
    module = TinyGPT(batch_size=12)
    fit = trainer(tmp_path, MemoryPlanner(budget=100_000))
    with pytest.raises(memfit.InsufficientMemoryError) as error:
        fit.fit(module)
    # the optimizer step alone is over this budget, so the checkpointed trace is skipped and the message says why
    assert "micro batch 1 does not fit and checkpointing cannot help" in str(error.value)
    kept = memfit.format_bytes(round(100_000 * (1 - DEFAULT_MARGIN)))
    assert f"against a 97.66 KiB budget ({kept} after its {format_margin(DEFAULT_MARGIN)} margin)" in str(error.value)
    assert "the optimizer step alone holds" in str(error.value)
    assert fit.global_step == 0 and module.seen_batch_sizes == []


def test_tight_budget_turns_on_checkpointing_of_the_hf_model(tmp_path: Path) -> None:
    module = TinyGPT(batch_size=12, n_layer=4)
    ids = torch.zeros(12, SEQ, dtype=torch.long)
    kwargs = {
        "target": memfit.Target("cpu"),
        "forward_fn": lambda m, b: m.model(input_ids=b[0], labels=b[0]),
        # micro batch 1 or 2 of 12: accumulation either way
        "loop": memfit.TrainingLoop(zero_grad="before_backward", accumulation_steps=12),
    }
    plain_curve = memfit.trace(module, (ids,), **kwargs)
    checkpointed_curve = memfit.trace(module, (ids,), gradient_checkpointing=True, **kwargs)
    budget = math.ceil((plain_curve.at(1).device_bytes + checkpointed_curve.at(1).device_bytes) / 2 / (1 - MARGIN))
    assert checkpointed_curve.at(1).device_bytes < plain_curve.at(1).device_bytes
    callback = MemoryPlanner(budget=budget, margin=MARGIN)
    fit = trainer(tmp_path, callback, max_steps=1)
    fit.fit(module)
    assert callback.plan.gradient_checkpointing
    assert model_checkpointing(module.model)


def test_missing_batch_attribute_warns_and_changes_nothing(tmp_path: Path) -> None:
    module = NoBatchAttribute()
    fit = trainer(tmp_path, MemoryPlanner(budget=budget_for_micro_batch(TinyGPT(), 3), margin=MARGIN), max_steps=2)
    with pytest.warns(UserWarning, match="found no `batch_size`"):
        fit.fit(module)
    assert fit.accumulate_grad_batches == 1 and set(module.seen_batch_sizes) == {12}
    # nothing memfit reports describes the plan it could not apply: it measures the run as configured
    callback = next(c for c in fit.callbacks if isinstance(c, MemoryPlanner))
    assert callback.plan is None and callback.estimate.batch_size == 12
    assert {w.predicted_allocated_bytes for w in callback.monitor.history} == {callback.traced.at(12).allocated_bytes}


def test_without_a_batch_attribute_a_plan_that_is_the_run_as_configured_says_nothing_is_missing(
    tmp_path: Path,
) -> None:
    module = NoBatchAttribute()
    callback = MemoryPlanner(budget=budget_for_micro_batch(TinyGPT(), 12), margin=MARGIN)  # 12 x 1 fits
    fit = trainer(tmp_path, callback, max_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(module)
    assert not [w for w in caught if "found no `batch_size`" in str(w.message)]
    assert callback.plan.micro_batch_size == 12 and set(module.seen_batch_sizes) == {12}


@pytest.mark.usefixtures("lenient")
def test_a_model_memfit_cannot_trace_still_trains(tmp_path: Path) -> None:
    module = ReadsValues(batch_size=12)
    fit = trainer(tmp_path, MemoryPlanner(budget="1GiB"), max_steps=2)
    with pytest.warns(UserWarning, match="memfit could not plan this run.*reads tensor values"):
        fit.fit(module)
    assert fit.global_step == 2 and module.batch_size == 12 and fit.accumulate_grad_batches == 1
    callback = next(c for c in fit.callbacks if isinstance(c, MemoryPlanner))
    assert callback.monitor is not None and callback.monitor.history  # the run is measured all the same
    assert all(w.predicted_allocated_bytes is None for w in callback.monitor.history)


def test_resume_keeps_the_plan_of_the_first_run(tmp_path: Path) -> None:
    module = TinyGPT(batch_size=12)
    first = trainer(tmp_path, MemoryPlanner(budget=budget_for_micro_batch(module, 3), margin=MARGIN), max_steps=2,
                    enable_checkpointing=True)  # fmt: skip
    first.fit(module)
    checkpoint = first.checkpoint_callback.best_model_path
    assert checkpoint

    resumed_module = TinyGPT(batch_size=12)
    callback = MemoryPlanner(budget=budget_for_micro_batch(resumed_module, 6), margin=MARGIN)  # would plan 6 x 2
    second = trainer(tmp_path, callback, max_steps=4)
    second.fit(resumed_module, ckpt_path=checkpoint)
    assert resumed_module.batch_size == 3 and second.accumulate_grad_batches == 4
    assert set(resumed_module.seen_batch_sizes) == {3}
    assert "restored from the checkpoint" in callback.plan.reasons


def test_a_resumed_run_is_measured_against_the_restored_plans_prediction(tmp_path: Path) -> None:
    """Setup plans 6 x 2 before Lightning restores the callback's state; the run then trains the saved 3 x 4, and its
    predicted peak, its estimate and the logged prediction are the saved plan's, not the discarded one's."""
    module = TinyGPT(batch_size=12)
    first_planner = MemoryPlanner(budget=budget_for_micro_batch(module, 3), margin=MARGIN, verbose=False)
    first = trainer(tmp_path, first_planner, max_steps=2, enable_checkpointing=True)
    first.fit(module)
    resumed_module = TinyGPT(batch_size=12)
    callback = MemoryPlanner(budget=budget_for_micro_batch(resumed_module, 6), margin=MARGIN, verbose=False)
    logger = CSVLogger(tmp_path, name="resumed")
    trainer(tmp_path, callback, loggers=[logger], max_steps=4).fit(
        resumed_module, ckpt_path=first.checkpoint_callback.best_model_path
    )
    assert callback.estimate.batch_size == 3 and callback.estimate.accumulation_steps == 4
    assert callback.monitor.drift.predicted_allocated_bytes == first_planner.plan.predicted_allocated_bytes
    logged = {float(row["memfit/predicted_peak_allocated_bytes"]) for row in read_csv_metrics(logger)
              if row.get("memfit/predicted_peak_allocated_bytes")}  # fmt: skip
    assert logged == {first_planner.plan.predicted_allocated_bytes}


def test_a_run_resumed_on_a_budget_nothing_fits_in_keeps_its_saved_plan_with_one_warning(tmp_path: Path) -> None:
    """Setup finds nothing that fits the budget given now, before Lightning restores the callback's state: the
    checkpoint's plan is kept (its batches stay the run's), with the warning that it is over the budget."""
    module = TinyGPT(batch_size=12)
    first = trainer(tmp_path, MemoryPlanner(budget=budget_for_micro_batch(module, 3), margin=MARGIN, verbose=False),
                    max_steps=2, enable_checkpointing=True)  # fmt: skip
    first.fit(module)
    resumed_module = TinyGPT(batch_size=12)
    callback = MemoryPlanner(budget=100_000, verbose=False)  # nothing fits: a fresh run raises before training
    saved = first.checkpoint_callback.best_model_path
    with pytest.warns(UserWarning, match=r"restored from the checkpoint \(micro batch 3 x 4\) is predicted at"):
        trainer(tmp_path, callback, max_steps=4).fit(resumed_module, ckpt_path=saved)
    assert resumed_module.batch_size == 3 and set(resumed_module.seen_batch_sizes) == {3}
    assert callback.plan.reasons[-1] == "restored from the checkpoint"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"margin": 1.5}, "`margin` must be a fraction"),
        ({"mode": "apply"}, "`mode` must be one of 'plan', 'observe', got 'apply'"),
        ({"target_batch_size": 0}, "`target_batch_size` must be a positive integer, 'max' or None, got 0"),
        ({"budget": "12 parsecs"}, "could not read '12 parsecs'"),
        ({"budget": "h1000"}, "unknown GPU 'h1000'; did you mean H100"),
        ({"log_every_n_steps": 0}, "`log_every_n_steps` must be a positive integer"),
        ({"on_oom": "retry"}, "`on_oom` must be 'replan' or 'raise', got 'retry'"),
        ({"loss_reduction": "none"}, "`loss_reduction` must be 'mean' or 'sum'"),
    ],
)
def test_constructor_validates_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MemoryPlanner(**kwargs)


def test_gpu_name_budget_and_pytorch_lightning_namespace() -> None:
    assert MemoryPlanner(budget="H100-80GB").budget_bytes == 81559 * 2**20  # what the driver reports
    pl_namespace = pytest.importorskip("memfit.pytorch_lightning")
    import pytorch_lightning

    assert isinstance(pl_namespace.MemoryPlanner(), pytorch_lightning.Callback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(MemoryPlanner(), L.pytorch.Callback)


def test_pictures_reach_tensorboard_mlflow_and_the_csv_folder(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    module = TinyGPT(batch_size=12)
    csv_logger, tb_logger = CSVLogger(tmp_path / "csv"), TensorBoardLogger(tmp_path / "tb")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow_logger = MLFlowLogger(
        experiment_name="memfit-pictures", tracking_uri=uri, artifact_location=str(tmp_path / "art")
    )
    callback = MemoryPlanner(budget=budget_for_micro_batch(module, 4), margin=MARGIN)
    trainer(tmp_path, callback, loggers=[csv_logger, tb_logger, mlflow_logger], max_steps=4).fit(module)

    for name in ("memfit_timeline.png", "memfit_drift.png"):
        png = Path(csv_logger.log_dir) / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = EventAccumulator(str(tb_logger.log_dir), size_guidance={"images": 0})
    events.Reload()
    assert {"memfit/timeline", "memfit/drift"} <= set(events.Tags()["images"])
    artifacts = {
        a.path for a in mlflow.tracking.MlflowClient(tracking_uri=uri).list_artifacts(mlflow_logger.run_id, "memfit")
    }
    assert artifacts == {"memfit/timeline.png", "memfit/drift.png"}


def test_pytorch_lightning_alone_fits_with_the_callback(tmp_path: Path) -> None:
    """Where only ``pytorch-lightning`` is installed, ``memfit.pytorch_lightning`` must not need ``lightning``."""
    script = """
import sys
sys.modules["lightning"] = None  # importing lightning now fails, as without the package
import pytorch_lightning as pl
import torch
from memfit.pytorch_lightning import MemoryPlanner

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net, self.batch_size = torch.nn.Linear(8, 1), 16
    def training_step(self, batch, index):
        return self.net(batch[0]).square().mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 8))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

planner = MemoryPlanner(budget="1GiB")
trainer = pl.Trainer(max_steps=2, callbacks=[planner], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
trainer.fit(Module())
print(planner.plan.micro_batch_size, trainer.global_step)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["16", "2"]


def test_an_untested_lightning_release_turns_recovery_off_and_leaves_the_run_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop privates the recovering closure needs are only used on the Lightning releases they were tested on."""
    import lightning.pytorch

    from memfit.integrations.lightning.internals import TESTED_VERSIONS

    module, reference = TinyGPT(batch_size=4), TinyGPT(batch_size=4)
    L.seed_everything(0)
    trainer(tmp_path / "reference", None, max_steps=3).fit(reference)
    L.seed_everything(0)
    monkeypatch.setattr(lightning.pytorch, "__version__", "9.1.0")
    callback = MemoryPlanner(mode="observe")
    fit = trainer(tmp_path / "observed", callback, max_steps=3)
    with pytest.warns(UserWarning, match=r"tested on Lightning .*not 9\.1\.0.*recovery off"):
        fit.fit(module)
    assert callback.recovery is None and callback.estimate is not None  # it still predicts and measures
    assert "_make_closure" not in vars(fit.fit_loop.epoch_loop.automatic_optimization)
    assert fit.global_step == 3
    for mine, theirs in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)  # the same run as without memfit
    monkeypatch.undo()
    assert (int(lightning.pytorch.__version__.split(".")[0]), int(lightning.pytorch.__version__.split(".")[1])) in (
        TESTED_VERSIONS
    )


class TwoOptimizerGAN(L.LightningModule):
    """A GAN-like module with manual optimization: training_step steps a generator and a discriminator."""

    def __init__(self, batch_size: int = 16, width: int = 64) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batch_size = batch_size
        self.generator = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 16))
        self.discriminator = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.seen_batch_sizes: list[int] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (real,) = batch
        self.seen_batch_sizes.append(real.shape[0])
        opt_g, opt_d = self.optimizers()
        noise = torch.randn(real.shape[0], 8)
        fake = self.generator(noise)
        d_loss = (
            torch.nn.functional.softplus(-self.discriminator(real)).mean()
            + torch.nn.functional.softplus(self.discriminator(fake.detach())).mean()
        )
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = torch.nn.functional.softplus(-self.discriminator(self.generator(noise))).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.generator.parameters()), torch.optim.Adam(self.discriminator.parameters())]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


@pytest.mark.parametrize("mode", ["plan", "observe"])
def test_manual_optimization_with_two_optimizers_trains_as_configured_and_logs_measured_memory(
    tmp_path: Path, mode: str
) -> None:
    module = TwoOptimizerGAN(batch_size=16)
    callback = MemoryPlanner(budget="64MiB", mode=mode)
    fit = trainer(tmp_path, callback, max_steps=8, log_every_n_steps=2)
    with pytest.warns(UserWarning, match="does not trace manual optimization yet") as caught:
        fit.fit(module)
    assert not [w for w in caught if "could not plan" in str(w.message)]
    assert callback.plan is None and module.batch_size == 16 and set(module.seen_batch_sizes) == {16}
    assert fit.global_step == 8  # two optimizer steps per batch
    rows = [r for r in read_csv_metrics(fit.logger) if r.get("memfit/measured_peak_rss_bytes")]
    assert {int(r["step"]) for r in rows} == {1, 3}  # batches 2 and 4: Lightning counts batches that step
    assert not [key for key in rows[0] if key.startswith("memfit/predicted_") or key.startswith("memfit/drift_")]
    assert all(float(r["memfit/measured_peak_rss_bytes"]) > 50 * 2**20 for r in rows)
    assert "no prediction" in callback.monitor.final_line()


def test_the_plan_and_the_final_line_quote_the_same_peak_and_the_line_names_the_process_rss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    module = TinyGPT(batch_size=12)
    callback = MemoryPlanner(budget=budget_for_micro_batch(module, 3), margin=MARGIN)
    with caplog.at_level("INFO"):
        trainer(tmp_path, callback, max_steps=2).fit(module)
    peak = memfit.format_bytes(callback.plan.predicted_peak_bytes)
    (plan_line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memfit plan:")]
    (final_line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memfit: process RSS")]
    assert f"predicted peak {peak} of" in plan_line
    assert f"predicted peak {peak} of tensors" in final_line and "drift" not in final_line


def test_a_stream_is_planned_at_the_longest_batch_it_can_produce(tmp_path: Path) -> None:
    """An iterable dataset's first examples are short here; the model holds 32 positions. The plan is made at 32
    tokens (what a later batch can reach) and says so, not at the first batch's 4."""

    class ShortFirst(torch.utils.data.IterableDataset):
        def __iter__(self):
            generator = torch.Generator().manual_seed(0)
            for index in range(48):
                yield torch.randint(0, 100, (4 if index < 24 else SEQ,), generator=generator)

    def pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor]:
        length = max(len(r) for r in rows)
        return (torch.stack([torch.nn.functional.pad(r, (0, length - len(r))) for r in rows]),)

    class StreamedGPT(TinyGPT):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(ShortFirst(), batch_size=self.batch_size, collate_fn=pad)

    callback = MemoryPlanner(budget="1GiB", verbose=False)
    trainer(tmp_path, callback, max_steps=2).fit(StreamedGPT(batch_size=4))
    assert any("stretched to 32 tokens" in reason and "first examples (4 tokens)" in reason
               for reason in callback.plan.reasons)  # fmt: skip
    assert callback.estimate.seq_len == SEQ  # the traced batch is the longest the stream can produce


class _NoBlocks(L.LightningModule):
    """An MLP: nothing repeats, so checkpointing has no block to wrap."""

    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(1024, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(torch.randn(256, 1024), torch.randn(256, 1))
        return torch.utils.data.DataLoader(data, batch_size=self.hparams.batch_size)


def test_a_budget_only_the_kept_window_overflows_says_so_and_not_that_checkpointing_failed(tmp_path: Path) -> None:
    """With out-of-memory recovery on, accumulating keeps the window's earlier batches on the device: at a small
    budget no split of the effective batch fits. The fit stops with that reason, not with checkpointing's (the model
    has no blocks to checkpoint); without recovery the same budget plans a split."""
    with pytest.raises(memfit.InsufficientMemoryError) as raised:
        trainer(tmp_path, MemoryPlanner(budget="400KiB", verbose=False), max_steps=1).fit(_NoBlocks())
    message = str(raised.value)
    assert "the loop holds 63 more batch(es) on the device" in message and "on_oom='raise' keeps none" in message
    assert message.endswith("checkpointing could not be tried: found no repeated blocks to checkpoint in _NoBlocks; "
                            "pass checkpoint_modules=[YourBlockClass].")  # fmt: skip
    planner = MemoryPlanner(budget="400KiB", on_oom="raise", verbose=False)
    trainer(tmp_path, planner, max_steps=1).fit(_NoBlocks())
    assert planner.plan.effective_batch_size == 64 and planner.plan.accumulate_grad_batches > 1


class DropsLast(TinyGPT):
    """Its loader drops the last incomplete batch: 250 samples are 20 batches of 12 (10 dropped)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(tokens(self.samples), batch_size=self.batch_size, shuffle=True, drop_last=True)


def test_a_loader_that_drops_its_last_batch_is_named_when_the_plan_changes_what_it_drops(tmp_path: Path) -> None:
    module = DropsLast(samples=250)
    fit = trainer(tmp_path, MemoryPlanner(budget=budget_for_micro_batch(TinyGPT(), 3), margin=MARGIN), max_steps=1)
    with pytest.warns(UserWarning, match=r"batches of 12 dropped 10, the planned 3 drop 1, so each epoch trains on 9 "
                                         r"more samples"):  # fmt: skip
        fit.fit(module)
    assert module.batch_size == 3


def test_an_epochs_last_window_whose_update_the_plan_changes_is_named(tmp_path: Path) -> None:
    """242 samples in batches of 12 end each epoch with 2 samples, one micro batch of the configured 12 x 1; at 3 x 4
    they are one micro batch of four steps, and Lightning divides its loss by 4."""
    module = TinyGPT(samples=242)
    fit = trainer(tmp_path, MemoryPlanner(budget=budget_for_micro_batch(TinyGPT(), 3), margin=MARGIN), max_steps=1)
    with pytest.warns(UserWarning, match=r"window of 2 samples; Lightning divides .* at 3 x 4 that window's update is "
                                         r"0\.25 x the one the run as configured \(12 x 1\) makes"):  # fmt: skip
        fit.fit(module)


def test_no_last_window_is_named_where_the_configured_loader_drops_the_samples_it_would_hold(tmp_path: Path) -> None:
    """242 samples in batches of 12 with drop_last: the run as configured drops the last 2, so its epochs end with
    a whole window, as 3 x 4 ones do (their 80 batches of 3 drop the same 2): nothing to warn of."""
    module = DropsLast(samples=242)
    fit = trainer(tmp_path, MemoryPlanner(budget=budget_for_micro_batch(TinyGPT(), 3), margin=MARGIN), max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(module)
    assert module.batch_size == 3
    assert not [w for w in caught if "incomplete accumulation window" in str(w.message)]


class SummedRegression(L.LightningModule):
    """A loss summed over the batch, and the first update's gradient recorded."""

    def __init__(self, batch_size: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_size = batch_size
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.first_gradient: torch.Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.net(x) - y) ** 2).sum()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.first_gradient is None:
            self.first_gradient = self.net[0].weight.grad.clone()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(48, 16, generator=generator), torch.randn(48, 1, generator=generator)
        )
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


def test_a_summed_loss_whose_accumulation_the_plan_changes_is_named_with_the_update_lightning_makes(
    tmp_path: Path,
) -> None:
    """Lightning divides every micro batch's loss by the accumulation steps: a summed loss planned from 12 x 1 to
    3 x 4 makes each update a quarter of the configured one. The warning says so, and the gradients agree."""
    configured = SummedRegression()
    trainer(tmp_path, None, max_steps=1).fit(configured)
    planned = SummedRegression()
    callback = MemoryPlanner(budget="1GiB", max_batch_size=3, loss_reduction="sum", verbose=False)
    with pytest.warns(UserWarning, match=r"loss_reduction='sum': Lightning .* at 3 x 4 each update is 0\.25 x"):
        trainer(tmp_path, callback, max_steps=1).fit(planned)
    assert (planned.batch_size, callback.plan.accumulate_grad_batches) == (3, 4)
    torch.testing.assert_close(planned.first_gradient, 0.25 * configured.first_gradient)
