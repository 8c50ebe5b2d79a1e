"""CUDA, the first device backend: runtime and context, the caching allocator, kernel semantics, cards, capacity
and measured peaks of NVIDIA GPUs, each asked of ``torch.cuda`` (or NVML) here and nowhere else.

The models themselves stay where the rest of memfit reads them: the runtime and context in
``memfit.simulation.runtime``, the caching allocator in ``memfit.simulation.allocator``, the kernels' memory on
fake CPU tensors in ``memfit.tracing.cuda_semantics`` (and ``cuda_scratch``, ``cuda_reductions``, ``cudnn*``,
``sdpa``). The catalog's figures are from published specifications and common driver readings; the callbacks
measure the real device when they run on it. Its AMD and Apple M-series entries are planned with CUDA's
semantics until those devices have backends of their own; the Apple ones are approximations: their memory is
unified with the CPU, macOS lets the GPU use about three quarters of it, and the MPS allocator is not CUDA's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from memfit.devices.backend import DeviceBackend
from memfit.devices.catalog import GPU
from memfit.simulation.runtime import CudaRuntime
from memfit.units import GiB, MiB

__all__ = ["CATALOG", "CudaBackend", "nvml_device_used_bytes"]


CATALOG: tuple[GPU, ...] = (
    GPU("T4", 15360 * MiB, "NVIDIA", "Turing", (7, 5), bf16=False, fp8=False, aliases=("T4-16GB", "Tesla T4"),
        multiprocessors=40, max_threads_per_multiprocessor=1024),
    GPU("V100-16GB", 16160 * MiB, "NVIDIA", "Volta", (7, 0), bf16=False, fp8=False, aliases=("V100-SXM2-16GB",),
        multiprocessors=80, max_threads_per_multiprocessor=2048),
    GPU("V100-32GB", 32510 * MiB, "NVIDIA", "Volta", (7, 0), bf16=False, fp8=False, aliases=("V100-SXM2-32GB",),
        multiprocessors=80, max_threads_per_multiprocessor=2048),
    GPU("A10G", 23028 * MiB, "NVIDIA", "Ampere", (8, 6), bf16=True, fp8=False, aliases=("A10G-24GB",),
        multiprocessors=80, max_threads_per_multiprocessor=1536),
    GPU("L4", 23034 * MiB, "NVIDIA", "Ada", (8, 9), bf16=True, fp8=True, aliases=("L4-24GB",),
        multiprocessors=58, max_threads_per_multiprocessor=1536),
    GPU("RTX3090", 24576 * MiB, "NVIDIA", "Ampere", (8, 6), bf16=True, fp8=False, aliases=("GeForce RTX 3090",),
        multiprocessors=82, max_threads_per_multiprocessor=1536),
    GPU("RTX4090", 24564 * MiB, "NVIDIA", "Ada", (8, 9), bf16=True, fp8=True, aliases=("GeForce RTX 4090",),
        multiprocessors=128, max_threads_per_multiprocessor=1536),
    GPU("RTX5090", 32607 * MiB, "NVIDIA", "Blackwell", (12, 0), bf16=True, fp8=True, aliases=("GeForce RTX 5090",),
        multiprocessors=170, max_threads_per_multiprocessor=1536),
    GPU("A100-40GB", 40960 * MiB, "NVIDIA", "Ampere", (8, 0), bf16=True, fp8=False, aliases=("A100-SXM4-40GB",),
        multiprocessors=108, max_threads_per_multiprocessor=2048),
    GPU("A100-80GB", 81920 * MiB, "NVIDIA", "Ampere", (8, 0), bf16=True, fp8=False, aliases=("A100-SXM4-80GB",),
        multiprocessors=108, max_threads_per_multiprocessor=2048),
    GPU("L40S", 46068 * MiB, "NVIDIA", "Ada", (8, 9), bf16=True, fp8=True, aliases=("L40S-48GB",),
        multiprocessors=142, max_threads_per_multiprocessor=1536),
    GPU("H100", 81559 * MiB, "NVIDIA", "Hopper", (9, 0), bf16=True, fp8=True,
        aliases=("H100-80GB", "H100 SXM", "H100-80GB-HBM3"), multiprocessors=132, max_threads_per_multiprocessor=2048),
    GPU("H100-PCIe", 81559 * MiB, "NVIDIA", "Hopper", (9, 0), bf16=True, fp8=True, aliases=("H100 PCIe",),
        multiprocessors=114, max_threads_per_multiprocessor=2048),
    GPU("H200", 143771 * MiB, "NVIDIA", "Hopper", (9, 0), bf16=True, fp8=True, aliases=("H200-141GB",),
        multiprocessors=132, max_threads_per_multiprocessor=2048),
    GPU("B200", 183359 * MiB, "NVIDIA", "Blackwell", (10, 0), bf16=True, fp8=True, aliases=("B200-192GB",),
        multiprocessors=148, max_threads_per_multiprocessor=2048),
    GPU("MI300X", 196592 * MiB, "AMD", "CDNA3", None, bf16=True, fp8=True, aliases=("MI300X-192GB", "Instinct MI300X")),
    GPU("M3-Max-128GB", 96 * GiB, "Apple", "M3", None, bf16=True, fp8=False, approximate=True, aliases=("M3 Max",)),
    GPU("M2-Ultra-192GB", 144 * GiB, "Apple", "M2", None, bf16=True, fp8=False, approximate=True,
        aliases=("M2 Ultra",)),
)  # fmt: skip


class CudaBackend(DeviceBackend):
    """NVIDIA GPUs through ``torch.cuda``: the caching allocator is simulated and a CPU-only torch traces on fake
    CPU tensors with CUDA's kernels substituted (``memfit.tracing.cuda_semantics``)."""

    device_type = "cuda"
    trace_device = "cuda"
    simulates_caching_allocator = True
    has_context = True
    has_peak_counters = True
    collective_backend = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def default_runtime(self) -> CudaRuntime:
        return CudaRuntime()

    def current_runtime(self) -> CudaRuntime:
        """Facts of the visible GPU when torch has one, else defaults for an H100-class card."""
        if torch.cuda.is_available():
            properties = torch.cuda.get_device_properties()
            return CudaRuntime(
                compute_capability=(properties.major, properties.minor),
                multiprocessors=properties.multi_processor_count,
                max_threads_per_multiprocessor=getattr(properties, "max_threads_per_multi_processor", 2048),
            )
        return CudaRuntime()

    def runtime_for(self, card: GPU) -> CudaRuntime:
        """The card's kernels' facts (an H100-class card's where the catalog has none); the context stays the
        default, which the callbacks measure on the real device."""
        default = CudaRuntime()
        return CudaRuntime(
            compute_capability=card.compute_capability or default.compute_capability,
            multiprocessors=card.multiprocessors or default.multiprocessors,
            max_threads_per_multiprocessor=card.max_threads_per_multiprocessor
            or default.max_threads_per_multiprocessor,
        )

    def emulates_on_host(self) -> bool:
        """Faking CUDA tensors on a CPU-only build aborts the process, so such a build traces on fake CPU tensors."""
        return not torch.cuda.is_available()

    def trace_environment(self) -> dict[str, Any]:
        """Whether CUDA is visible, and which scaled-dot-product attention kernels torch may pick."""
        backends = torch.backends.cuda
        return {
            "cuda_available": torch.cuda.is_available(),
            "sdp": [
                backends.flash_sdp_enabled(),
                backends.mem_efficient_sdp_enabled(),
                backends.math_sdp_enabled(),
                getattr(backends, "cudnn_sdp_enabled", lambda: None)(),
            ],
        }

    def kernel_semantics(self, autocast_dtype: torch.dtype | None, runtime: CudaRuntime) -> Any:
        from memfit.tracing.cuda_semantics import CudaSemantics
        from memfit.tracing.sdpa import CudaBuild

        return CudaSemantics(autocast_dtype, CudaBuild(compute_capability=runtime.compute_capability))

    def catalog(self) -> tuple[GPU, ...]:
        return CATALOG

    def free_bytes(self, device: torch.device) -> int:
        """Free memory plus what this process's caching allocator holds (it can reuse that)."""
        free, _total = torch.cuda.mem_get_info(device)
        return int(free) + int(torch.cuda.memory_reserved(device))

    def total_bytes(self, device: torch.device) -> int | None:
        _free, total = torch.cuda.mem_get_info(device)
        return int(total)

    def reset_peaks(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def peak_allocated_bytes(self, device: torch.device) -> int | None:
        return torch.cuda.max_memory_allocated(device)

    def peak_reserved_bytes(self, device: torch.device) -> int | None:
        return torch.cuda.max_memory_reserved(device)

    def device_used_bytes(self, device: torch.device) -> int | None:
        """NVML's used memory of the device (all processes, context included), ``None`` without NVML."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        return nvml_device_used_bytes(index)

    def is_out_of_memory(self, error: BaseException) -> bool:
        return isinstance(error, torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError since 2.5, same class

    def release_cached_memory(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def in_use(self) -> bool:
        return torch.cuda.is_initialized()

    def rng_states(self) -> Any | None:
        return torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def set_rng_states(self, states: Any) -> None:
        torch.cuda.set_rng_state_all(states)


def nvml_device_used_bytes(index: int) -> int | None:
    """Used memory of GPU ``index`` from NVML, or ``None`` without ``nvidia-ml-py`` or a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return int(_memory_info(pynvml, handle).used)
    except pynvml.NVMLError:  # no driver, no such device, a lost GPU: no NVML figure
        return None


def _memory_info(pynvml: Any, handle: Any) -> Any:
    """NVML's memory info, version 2 where the driver has it: version 1 counts the memory the driver
    reserves for itself (hundreds of MiB on a data-centre GPU) as used, though no process can have it."""
    version = getattr(pynvml, "nvmlMemory_v2", None)
    if version is not None:
        with contextlib.suppress(pynvml.NVMLError):  # a driver without version 2
            return pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
    return pynvml.nvmlDeviceGetMemoryInfo(handle)
