"""The device boundary: every fact memfit needs of an accelerator, asked of one ``DeviceBackend``.

``backend_for(device)`` answers for a ``torch.device``, a device string, a ``memfit.Target`` or a catalog card.
Two backends are registered: ``"cuda"`` (``memfit.devices.cuda``) and the host, ``"cpu"``
(``memfit.devices.host``). Another accelerator is one module: subclass ``DeviceBackend``, give its
``device_type``, presence, free memory and (optionally) its cards, runtime, kernel semantics and peak counters,
and pass an instance to ``register_backend``; its cards then resolve as budgets and targets, and the planner's
capacity and the run monitor read that device through it.
"""

from __future__ import annotations

from memfit.devices.backend import (
    DeviceBackend,
    backend_for,
    collective_device,
    find_backend,
    register_backend,
    registered_backends,
    unregister_backend,
)
from memfit.devices.catalog import GPU, gpu_by_name, known_gpus
from memfit.devices.cuda import CudaBackend
from memfit.devices.host import HostBackend

register_backend(CudaBackend())
register_backend(HostBackend())

__all__ = [
    "GPU",
    "CudaBackend",
    "DeviceBackend",
    "HostBackend",
    "backend_for",
    "collective_device",
    "find_backend",
    "gpu_by_name",
    "known_gpus",
    "register_backend",
    "registered_backends",
    "unregister_backend",
]
