"""``MemoryPlanner``: a Lightning callback that plans the batch at setup and logs memory drift.

    from lightning.pytorch import Trainer
    from memfit.lightning import MemoryPlanner

    trainer = Trainer(callbacks=[MemoryPlanner()])

For ``pytorch_lightning`` imports use ``memfit.pytorch_lightning.MemoryPlanner``.
"""

from __future__ import annotations

try:
    import lightning.pytorch as _pl
    from lightning.pytorch.callbacks import Callback
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("memfit.lightning needs Lightning: pip install 'memfit[lightning]'") from error

from memfit.integrations.lightning.callback import _DOC, MemoryPlannerBase

__all__ = ["MemoryPlanner"]


class MemoryPlanner(MemoryPlannerBase, Callback):
    __doc__ = _DOC
    _pl = _pl
