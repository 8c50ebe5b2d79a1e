"""What memfit asks of an accelerator, and the registry that answers "which backend runs this device?".

Every device fact the planner, the estimator, the monitor and the integrations need goes through a
``DeviceBackend``: whether the device is present, the runtime and context it costs, whether its caching
allocator is simulated, how a trace for it substitutes kernels, the cards it comes as, its free memory and
its measured peaks. CUDA is the first implementation (``memfit.devices.cuda``); the host (``"cpu"``) is the
second. A new accelerator is one module that subclasses ``DeviceBackend`` and calls ``register_backend``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

import torch

from memfit.errors import InvalidInputError

if TYPE_CHECKING:
    from memfit.devices.catalog import GPU

__all__ = [
    "DeviceBackend",
    "backend_for",
    "collective_device",
    "find_backend",
    "register_backend",
    "registered_backends",
    "unregister_backend",
]


class DeviceBackend(abc.ABC):
    """One kind of device (``torch.device.type``), as memfit plans, predicts and measures for it.

    Only ``device_type``, ``is_available`` and ``free_bytes`` must be given; the rest default to "nothing
    to add": no runtime facts, no allocator simulation, host semantics while tracing, no cards, no counters.
    """

    #: ``torch.device(...).type`` of the devices this backend runs (``"cuda"``, ``"xpu"``, ...)
    device_type: str = ""
    #: what a trace for this device runs as: ``"cuda"`` traces with CUDA's kernel semantics, ``"cpu"`` with the host's
    trace_device: str = "cpu"
    #: whether reserved memory is predicted by replaying the log through ``CachingAllocatorSimulator``
    simulates_caching_allocator: bool = False
    #: whether a plan against a given capacity must leave room for a per-process context the trace does not see
    has_context: bool = False
    #: whether ``reset_peaks``/``peak_*_bytes`` read an allocator's counters (else the monitor reads the host's RSS)
    has_peak_counters: bool = False
    #: ``torch.distributed`` backend whose collectives run on this device (``"nccl"`` for CUDA)
    collective_backend: str | None = None

    # ---------------------------------------------------------------------------------------- presence and runtime

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this process can run on such a device now."""

    def default_runtime(self) -> Any | None:
        """Runtime facts an estimate takes when nothing better is known (a reference card's)."""
        return None

    def current_runtime(self) -> Any | None:
        """Runtime facts of the visible device, or ``default_runtime()`` where none is visible."""
        return self.default_runtime()

    def runtime_for(self, card: GPU) -> Any | None:
        """Runtime facts an estimate for ``card`` takes."""
        return None

    def trace_environment(self) -> dict[str, Any]:
        """Switches of this process that change which kernels a trace for this device picks (a cached trace is
        reused only where they are the same)."""
        return {}

    def emulates_on_host(self) -> bool:
        """Whether a trace for this device must run on fake host tensors with its kernels substituted
        (the device's own fake tensors are not available in this torch build)."""
        return False

    def kernel_semantics(self, autocast_dtype: torch.dtype | None, runtime: Any) -> Any | None:
        """The dispatch mode that substitutes this device's kernels on fake host tensors, or ``None``."""
        return None

    # ---------------------------------------------------------------------------------------------------- catalog

    def catalog(self) -> tuple[GPU, ...]:
        """The cards of this kind memfit knows by name (``memfit gpus`` lists all backends' together)."""
        return ()

    # --------------------------------------------------------------------------------------------------- capacity

    @abc.abstractmethod
    def free_bytes(self, device: torch.device) -> int:
        """Memory this process could still use on ``device`` now (what it holds cached counts as usable).
        May raise when the runtime cannot answer; the caller turns that into "unknown"."""

    def total_bytes(self, device: torch.device) -> int | None:
        """The device's whole memory, or ``None`` where it cannot be told."""
        return None

    # ------------------------------------------------------------------------------------------------ measurement

    def reset_peaks(self, device: torch.device) -> None:
        """Start the peak counters over (``has_peak_counters`` backends)."""
        return None

    def peak_allocated_bytes(self, device: torch.device) -> int | None:
        """Most memory tensors held since the last ``reset_peaks``."""
        return None

    def peak_reserved_bytes(self, device: torch.device) -> int | None:
        """Most memory the caching allocator held since the last ``reset_peaks``."""
        return None

    def device_used_bytes(self, device: torch.device) -> int | None:
        """Memory in use on the whole device (all processes, context included), or ``None``."""
        return None

    def is_out_of_memory(self, error: BaseException) -> bool:
        """Whether ``error`` is this device's own out-of-memory exception."""
        return False

    def release_cached_memory(self) -> None:
        """Give cached blocks back to the device after a failed step (no-op where nothing is cached)."""
        return None

    def in_use(self) -> bool:
        """Whether this process has started the device's runtime (a forked child could not use the device, and a
        fork of a process holding it is not safe)."""
        return False

    def rng_states(self) -> Any | None:
        """This device's random generator states, to restore after a trace; ``None`` when there are none."""
        return None

    def set_rng_states(self, states: Any) -> None:
        """Restore what ``rng_states`` returned."""
        return None


_BACKENDS: dict[str, DeviceBackend] = {}


def register_backend(backend: DeviceBackend) -> DeviceBackend:
    """Make ``backend`` the one that answers for devices of its ``device_type`` (replacing any before it)."""
    if not backend.device_type:
        raise InvalidInputError(f"a device backend needs a device_type, got {backend!r}")
    _BACKENDS[backend.device_type] = backend
    from memfit.devices import catalog

    catalog.forget_index()
    return backend


def unregister_backend(device_type: str) -> None:
    """Forget the backend of ``device_type`` (tests that register a stand-in clean up with this)."""
    _BACKENDS.pop(device_type, None)
    from memfit.devices import catalog

    catalog.forget_index()


def registered_backends() -> tuple[DeviceBackend, ...]:
    """Every backend, in the order registered (CUDA first, then the host)."""
    return tuple(_BACKENDS.values())


def _device_type(device: Any) -> str:
    from memfit.devices.catalog import GPU

    if isinstance(device, GPU):
        return device.device_type
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return torch.device(device).type if ":" in device else device.strip().lower()
    target = getattr(device, "device", None)  # a memfit.Target
    if isinstance(target, str):
        return target
    raise InvalidInputError(f"a device must be a torch.device, a device string or a memfit.Target, got {device!r}")


def find_backend(device: Any) -> DeviceBackend | None:
    """The backend for ``device`` (a ``torch.device``, ``"cuda:0"``, a ``memfit.Target`` or a catalog card), or
    ``None`` for a kind no backend answers for."""
    return _BACKENDS.get(_device_type(device))


def collective_device(process_group_backend: str) -> str:
    """The device type a ``torch.distributed`` backend's collectives run on (``"nccl"``: CUDA), else the host's."""
    for backend in _BACKENDS.values():
        if backend.collective_backend == process_group_backend and backend.device_type != "cpu":
            return backend.device_type
    return "cpu"


def backend_for(device: Any) -> DeviceBackend:
    """Like ``find_backend``, but a device no backend answers for raises ``InvalidInputError``."""
    backend = find_backend(device)
    if backend is None:
        known = ", ".join(repr(name) for name in _BACKENDS)
        raise InvalidInputError(f"memfit has no backend for the device {device!r}; it knows {known}")
    return backend
