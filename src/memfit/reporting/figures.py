"""Hand figures to whatever tracker an adapter has: TensorBoard, MLflow, or a folder. Best effort: a
destination that fails is skipped with one warning (an error under ``MEMFIT_STRICT=1``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.diagnostics import degrade

__all__ = ["drawn", "log_figure", "matplotlib_available"]


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def drawn(make: Any, name: str, *, seen: set[str]) -> Any | None:
    """The figure ``make()`` draws, or ``None`` after one warning per ``name`` (a picture is never worth a run)."""
    try:
        return make()
    except Exception as error:
        degrade(f"memfit could not draw {name} ({type(error).__name__}: {error})", error, key=f"figure-{name}",
                seen=seen)  # fmt: skip
        return None


def log_figure(
    figure: Any,
    name: str,
    *,
    tensorboard: Any = None,
    mlflow_client: Any = None,
    mlflow_run_id: str | None = None,
    mlflow_module: Any = None,
    folder: str | Path | None = None,
    step: int = 0,
) -> list[str]:
    """Send ``figure`` to each destination given; return where it went (failures are skipped)."""
    sent = []
    if tensorboard is not None:
        try:
            tensorboard.add_figure(name, figure, global_step=step)
            sent.append("tensorboard")
        except Exception as error:
            _skipped("TensorBoard", name, error)
    if mlflow_client is not None and mlflow_run_id:
        try:
            mlflow_client.log_figure(mlflow_run_id, figure, f"{name}.png")
            sent.append("mlflow")
        except Exception as error:
            _skipped("MLflow", name, error)
    if mlflow_module is not None:
        try:
            if mlflow_module.active_run() is not None:
                mlflow_module.log_figure(figure, f"{name}.png")
                sent.append("mlflow")
        except Exception as error:
            _skipped("MLflow", name, error)
    if folder is not None:
        try:
            path = Path(folder) / f"{name.replace('/', '_')}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            figure.savefig(path, dpi=110)
            sent.append(str(path))
        except Exception as error:
            _skipped(f"the folder {folder}", name, error)
    return sent


def _skipped(destination: str, name: str, error: Exception) -> None:
    """A tracker that refuses a figure loses only the figure: the run and the other trackers go on."""
    degrade(f"memfit could not send {name} to {destination} ({type(error).__name__}: {error})", error,
            key=f"figure:{destination}", stacklevel=3)  # fmt: skip
