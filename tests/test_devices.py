"""The device boundary (``memfit.devices``): CUDA is asked in one place, and another accelerator is one module.

The first half reads memfit's source: ``torch.cuda``, ``torch.backends.cuda`` and NVML appear only in the CUDA
backend (and the two places named below, with their reason), and only the tracer's CUDA internals and the
backend import the CUDA kernel modules. The second half registers a stand-in accelerator, defined here with
its own card and counters, and plans a real Lightning run for that card through it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_models import TinyGPT
from memfit.devices import (
    GPU,
    CudaBackend,
    DeviceBackend,
    HostBackend,
    backend_for,
    collective_device,
    find_backend,
    register_backend,
    registered_backends,
    unregister_backend,
)
from memfit.errors import InvalidInputError
from memfit.lightning import MemoryPlanner
from memfit.planning.capacity import free_device_bytes, parse_budget
from memfit.planning.gpus import check_target, gpu_by_name, known_gpus, planning_target
from memfit.run.measure import PeakSampler
from memfit.run.recovery import is_out_of_memory
from memfit.units import GiB
from test_lightning import trainer

SOURCE = Path(__file__).resolve().parents[1] / "src" / "memfit"

# what CUDA's runtime is asked through, and the modules that model CUDA's kernels on fake CPU tensors
CUDA_APIS = ("torch.cuda", "torch.backends.cuda", "pynvml")
CUDA_KERNEL_MODULES = frozenset(
    f"memfit.tracing.{name}"
    for name in ("cuda_semantics", "cuda_scratch", "cuda_reductions", "cudnn", "cudnn_rnn", "sdpa")
)
# every module that may reach CUDA's runtime directly, and why
ALLOWED_CUDA_APIS = {
    "devices/cuda.py": {"torch.cuda", "torch.backends.cuda", "pynvml"},  # the CUDA backend: the boundary itself
    "errors.py": {"torch.cuda"},  # a class's base: torch raises torch.cuda.OutOfMemoryError on torch 2.4
    "tracing/sdpa.py": {"torch.backends.cuda"},  # the attention kernel choice, read as torch makes it
}
# who may import the kernel modules: the tracer's CUDA internals and the backend that hands them out
KERNEL_IMPORTERS = ("devices/", "tracing/")


def _cuda_references(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The CUDA runtime APIs a module's code reaches (docstrings aside) and the kernel modules it imports."""
    apis: set[str] = set()
    kernels: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "cuda":
            if isinstance(node.value, ast.Name) and node.value.id == "torch":
                apis.add("torch.cuda")
            elif isinstance(node.value, ast.Attribute) and node.value.attr == "backends":
                apis.add("torch.backends.cuda")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                apis.update(api for api in CUDA_APIS if alias.name == api or alias.name.startswith(f"{api}."))
                kernels.update({alias.name} & CUDA_KERNEL_MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module:
            apis.update(api for api in CUDA_APIS if node.module == api or node.module.startswith(f"{api}."))
            named = {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            kernels.update(named & CUDA_KERNEL_MODULES)
    return apis, kernels


def _sources() -> Iterator[tuple[str, ast.AST]]:
    for path in sorted(SOURCE.rglob("*.py")):
        yield path.relative_to(SOURCE).as_posix(), ast.parse(path.read_text(), str(path))


def test_cuda_runtime_is_asked_only_behind_the_device_boundary() -> None:
    found = {}
    for name, tree in _sources():
        apis, _kernels = _cuda_references(tree)
        if apis:
            found[name] = apis
    assert found == ALLOWED_CUDA_APIS


def test_cuda_kernel_modules_are_imported_only_by_the_tracer_and_the_cuda_backend() -> None:
    outside = {}
    for name, tree in _sources():
        _apis, kernels = _cuda_references(tree)
        if kernels and not name.startswith(KERNEL_IMPORTERS):
            outside[name] = kernels
    assert outside == {}


def test_the_reader_sees_what_it_is_meant_to_catch() -> None:
    """The check above would pass vacuously if the reader missed these spellings."""
    code = "\n".join(
        [
            "import torch",
            "import pynvml",
            "from memfit.tracing import sdpa",
            "torch.cuda.empty_cache()",
            "torch.backends.cuda",
        ]
    )
    apis, kernels = _cuda_references(ast.parse(code))
    assert apis == {"torch.cuda", "torch.backends.cuda", "pynvml"} and kernels == {"memfit.tracing.sdpa"}


def test_cuda_and_the_host_are_the_registered_backends() -> None:
    cuda, host = backend_for("cuda"), backend_for(torch.device("cpu"))
    assert isinstance(cuda, CudaBackend) and isinstance(host, HostBackend)
    assert [b.device_type for b in registered_backends()] == ["cuda", "cpu"]
    assert backend_for("cuda:1") is cuda and backend_for(gpu_by_name("h100")) is cuda
    assert cuda.simulates_caching_allocator and cuda.has_context and cuda.trace_device == "cuda"
    assert not host.simulates_caching_allocator and not host.has_context and host.catalog() == ()
    assert known_gpus() == cuda.catalog()
    assert cuda.runtime_for(gpu_by_name("t4")) == gpu_by_name("t4").runtime
    assert collective_device("nccl") == "cuda" and collective_device("gloo") == "cpu"
    assert find_backend("mps") is None
    with pytest.raises(InvalidInputError, match="no backend for the device 'mps'; it knows 'cuda', 'cpu'"):
        backend_for("mps")


# ------------------------------------------------------------------------------------- a stand-in accelerator


class StandInOutOfMemory(RuntimeError):
    """The stand-in's own out-of-memory exception."""


class StandInBackend(DeviceBackend):
    """An accelerator memfit has no module for: its cards, its free memory and its peak counters."""

    device_type = "xpu"
    has_peak_counters = True

    def __init__(self) -> None:
        self.card = GPU("Max-1550", 128 * GiB, "Intel", "Xe-HPC", None, bf16=True, fp8=False,
                        aliases=("Data Center GPU Max 1550",), device_type="xpu")  # fmt: skip
        self.resets = 0

    def is_available(self) -> bool:
        return False

    def catalog(self) -> tuple[GPU, ...]:
        return (self.card,)

    def free_bytes(self, device: torch.device) -> int:
        return 40 * GiB

    def reset_peaks(self, device: torch.device) -> None:
        self.resets += 1

    def peak_allocated_bytes(self, device: torch.device) -> int | None:
        return 6 * GiB

    def peak_reserved_bytes(self, device: torch.device) -> int | None:
        return 7 * GiB

    def is_out_of_memory(self, error: BaseException) -> bool:
        return isinstance(error, StandInOutOfMemory)


@pytest.fixture
def stand_in() -> Iterator[StandInBackend]:
    backend = register_backend(StandInBackend())
    assert isinstance(backend, StandInBackend)
    try:
        yield backend
    finally:
        unregister_backend("xpu")


def test_a_registered_backend_answers_for_its_devices_and_cards(stand_in: StandInBackend) -> None:
    assert backend_for("xpu") is stand_in and backend_for(torch.device("xpu", 0)) is stand_in
    assert gpu_by_name("data center gpu max 1550") is stand_in.card and backend_for(stand_in.card) is stand_in
    assert known_gpus()[-1] is stand_in.card and len(known_gpus()) == len(backend_for("cuda").catalog()) + 1
    assert parse_budget("max-1550") == 128 * GiB
    assert free_device_bytes(torch.device("xpu", 0)) == 40 * GiB
    assert check_target("XPU") == "xpu" and check_target("max 1550") == "max 1550"
    assert is_out_of_memory(StandInOutOfMemory("out of device memory"))


def test_a_registered_backend_is_gone_once_unregistered() -> None:
    register_backend(StandInBackend())
    unregister_backend("xpu")
    with pytest.raises(InvalidInputError, match="unknown GPU 'max-1550'"):
        gpu_by_name("max-1550")
    assert free_device_bytes(torch.device("xpu", 0)) == 0


def test_a_plan_for_the_card_uses_its_memory_and_its_backend(stand_in: StandInBackend) -> None:
    run_device = torch.device("cpu")
    named = planning_target("max1550", None, run_device)
    assert named.gpu is stand_in.card and named.budget_bytes == 128 * GiB and named.device == "xpu"
    assert named.target.device == "cpu" and named.target.runtime is None  # traced as its backend says
    assert not named.include_context  # the stand-in declares no context
    assert named.note(run_device) == "planned for the Max-1550 (cpu semantics); this process runs on cpu"

    on_it = planning_target(None, None, torch.device("xpu", 0))  # a run on the device: its free memory
    assert on_it.capacity_bytes(torch.device("xpu", 0)) == 40 * GiB and on_it.note(torch.device("xpu")) is None


def test_the_monitor_reads_the_backends_counters(stand_in: StandInBackend) -> None:
    sampler = PeakSampler("xpu:0")
    sample = sampler.sample()
    assert (sample.allocated_bytes, sample.reserved_bytes, sample.device_used_bytes) == (6 * GiB, 7 * GiB, None)
    assert sample.rss_bytes is None and stand_in.resets == 2  # at start, and after the read


def test_lightning_plans_a_run_for_the_registered_card(stand_in: StandInBackend, tmp_path: Path) -> None:
    module = TinyGPT(batch_size=12)
    callback = MemoryPlanner(budget="max-1550")
    fit = trainer(tmp_path, callback, max_steps=2)
    fit.fit(module)
    assert callback.plan is not None and callback.estimate is not None
    assert callback.plan.capacity_bytes == stand_in.card.memory_bytes
    assert callback.estimate.device == "cpu" and not callback.estimate.cuda_context_bytes
    assert any("planned for the Max-1550" in note for note in callback.estimate.notes)
    assert fit.global_step == 2 and set(module.seen_batch_sizes) == {callback.plan.micro_batch_size}
