"""``MemoryPlanner`` for code that imports ``pytorch_lightning`` (same callback as ``memfit.lightning``)."""

from __future__ import annotations

try:
    import pytorch_lightning as _pl
    from pytorch_lightning.callbacks import Callback
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("memfit.pytorch_lightning needs pytorch-lightning: pip install pytorch-lightning") from error

from memfit.integrations.lightning.callback import _DOC, MemoryPlannerBase

__all__ = ["MemoryPlanner"]


class MemoryPlanner(MemoryPlannerBase, Callback):
    __doc__ = _DOC
    _pl = _pl
