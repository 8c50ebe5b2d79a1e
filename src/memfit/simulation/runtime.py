"""Device memory that no tensor owns: the CUDA context and the cuBLAS workspace."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.units import KiB, MiB

__all__ = ["CudaRuntime", "cublas_workspace_bytes"]

# CUDA context with lazy module loading (torch >= 1.13 default), after a training step has loaded its
# kernels: NVML's used memory less the device's idle usage less the caching allocator's reserve measured
# 748-764 MiB for every model of the accuracy zoo on an H100 (CUDA 13.0, driver 580, torch 2.11;
# benchmarks/results/trace_zoo-gpu.json). It varies with driver, GPU and torch build; the callbacks
# measure it on the real device when they can.
DEFAULT_CUDA_CONTEXT_BYTES = 768 * MiB


def cublas_workspace_bytes(compute_capability: tuple[int, int] = (9, 0)) -> int:
    """Per-handle workspace torch gives cuBLAS (``CublasHandlePool.cpp``).

    Default ``CUBLAS_WORKSPACE_CONFIG``: ``:4096:8`` (32 MiB) on Hopper and newer,
    ``:4096:2:16:8`` (8 MiB + 128 KiB) before. It comes from the caching allocator, so it counts
    in ``max_memory_allocated``.
    """
    if compute_capability[0] >= 9:
        return 4096 * KiB * 8
    return 4096 * KiB * 2 + 16 * KiB * 8


@dataclass(frozen=True)
class CudaRuntime:
    """Runtime facts of the target GPU that change the estimate."""

    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES
    compute_capability: tuple[int, int] = (9, 0)
    # what kernels size their launch grids by (and so the buffers some allocate): an H100 SXM's by default
    multiprocessors: int = 132
    max_threads_per_multiprocessor: int = 2048

    @property
    def workspace_bytes(self) -> int:
        return cublas_workspace_bytes(self.compute_capability)

    @classmethod
    def of_current_device(cls) -> CudaRuntime:
        """Facts of the visible GPU when torch has one, else defaults for an H100-class card (asked of the CUDA
        backend, ``memfit.devices.cuda``, the one place that reads ``torch.cuda``)."""
        from memfit.devices import backend_for

        return backend_for("cuda").current_runtime()
