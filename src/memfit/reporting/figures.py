"""Hand figures to whatever tracker an adapter has: TensorBoard, MLflow, or a folder. Best effort."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

__all__ = ["log_figure", "matplotlib_available"]


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


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
        with contextlib.suppress(Exception):
            tensorboard.add_figure(name, figure, global_step=step)
            sent.append("tensorboard")
    if mlflow_client is not None and mlflow_run_id:
        with contextlib.suppress(Exception):
            mlflow_client.log_figure(mlflow_run_id, figure, f"{name}.png")
            sent.append("mlflow")
    if mlflow_module is not None:
        with contextlib.suppress(Exception):
            if mlflow_module.active_run() is not None:
                mlflow_module.log_figure(figure, f"{name}.png")
                sent.append("mlflow")
    if folder is not None:
        with contextlib.suppress(Exception):
            path = Path(folder) / f"{name.replace('/', '_')}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            figure.savefig(path, dpi=110)
            sent.append(str(path))
    return sent
