"""What the trace without a GPU makes of CUDA's kernels: the attention kernel CUDA would choose and the memory it
keeps, fused dropout, and the scratch kernels allocate for themselves (cuDNN workspaces, reduction staging
buffers, embedding backward's sort, cuDNN attention's backward workspace), each against torch's source and, where
there is one, an allocator snapshot of the same kernel on an H100 (``benchmarks/results/gpu-truth/``)."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
from memfit.categories import Phase
from memfit.tracing import cuda_scratch
from memfit.tracing.cuda_reductions import GridLimits, staging_bytes
from memfit.tracing.cudnn import conv_workspaces
from memfit.tracing.sdpa import Backend, CudaBuild, _math_attention, choose_backend

SNAPSHOTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu-truth"
H100, A100, T4, L4, RTX3090 = (
    CudaBuild((9, 0)),
    CudaBuild((8, 0)),
    CudaBuild((7, 5)),
    CudaBuild((8, 9)),
    CudaBuild((8, 6)),
)


def qkv(dtype=torch.float16, heads=8, kv_heads=None, head_dim=64, length=128, grad=True):
    make = lambda h: torch.empty(2, h, length, head_dim, dtype=dtype, device="meta", requires_grad=grad)  # noqa: E731
    return make(heads), make(kv_heads or heads), make(kv_heads or heads)


def snapshot_requests(name: str) -> list[int]:
    """Every requested size of a snapshot's allocator trace, in order."""
    with gzip.open(SNAPSHOTS / f"snapshot-{name}.json.gz") as file:
        snap = json.load(file)
    return [e["size"] for e in snap["trace"] if e["action"] == "alloc"]


# --- which attention kernel ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "build", "expected"),
    [
        ("16-bit, no mask, no dropout: cuDNN first on Hopper with cuDNN > 9.15", H100, Backend.CUDNN),
        ("16-bit, no mask, no dropout on an A100: flash first", A100, Backend.FLASH),
        ("dropout 0.1 is not a multiple of 1/16: flash, not cuDNN", H100, Backend.FLASH),
        ("fp32: memory-efficient", H100, Backend.EFFICIENT),
        ("fp32, grouped key/value heads: efficient has no GQA in torch 2.13, math", H100, Backend.MATH),
        ("16-bit, grouped heads on an A100: flash handles GQA", A100, Backend.FLASH),
        ("16-bit, a mask that needs a gradient: not cuDNN, not flash", H100, Backend.EFFICIENT),
        ("16-bit, a mask whose last stride is not 1: no fused kernel", H100, Backend.MATH),
        ("16-bit on a T4 (sm75): no flash, no cuDNN attention", T4, Backend.EFFICIENT),
        ("head dim 200 in training on an RTX 3090 (sm86): flash refuses", RTX3090, Backend.EFFICIENT),
        ("causal with fewer queries than keys: flash refuses", A100, Backend.EFFICIENT),
    ],
)
def test_the_kernel_is_chosen_by_torchs_rules(case: str, build: CudaBuild, expected: Backend) -> None:
    q, k, v = qkv()
    kwargs: dict = {}
    if "dropout 0.1" in case:
        kwargs["dropout_p"] = 0.1
    if case.startswith("fp32"):
        q, k, v = qkv(torch.float32, kv_heads=2 if "grouped" in case else None)
        kwargs["enable_gqa"] = "grouped" in case
    if "grouped heads on an A100" in case:
        q, k, v = qkv(kv_heads=2)
        kwargs["enable_gqa"] = True
    if "needs a gradient" in case:
        kwargs["attn_mask"] = torch.empty(1, 8, 128, 128, dtype=torch.float16, device="meta", requires_grad=True)
    if "last stride" in case:
        kwargs["attn_mask"] = torch.empty(1, 128, 128, 8, dtype=torch.float16, device="meta").permute(0, 3, 1, 2)
    if "head dim 200" in case:
        q, k, v = qkv(head_dim=200)
    if "causal" in case:
        q = q[:, :, :64]
        kwargs["is_causal"] = True
    assert choose_backend(q, k, v, build=build, **kwargs) is expected, case


def test_cudnn_comes_first_only_where_torch_puts_it_first() -> None:
    assert CudaBuild((9, 0)).prefers_cudnn() and CudaBuild((10, 0)).prefers_cudnn()
    assert not CudaBuild((8, 0)).prefers_cudnn() and not CudaBuild((8, 9)).prefers_cudnn()
    assert not CudaBuild((9, 0), cudnn_version=91400).prefers_cudnn()  # before 9.15.1's sequence-length fix
    assert not CudaBuild((10, 1), cuda_major=12).prefers_cudnn() and CudaBuild((10, 1)).prefers_cudnn()


# --- what each kernel keeps -------------------------------------------------------------------------------------


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_the_math_kernel_is_torchs_own_op_for_op(dtype: torch.dtype, masked: bool) -> None:
    """Without dropout the port and ``aten._scaled_dot_product_attention_math`` run the same ops to the same values:
    16-bit inputs computed in fp32, then the output and the weights cast back. (Under a dispatch mode torch adds the
    mask out of place, as it does for a tensor subclass; on a plain tensor it adds in place, as the port does.)"""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=generator).to(dtype) for _ in range(3))
    mask = torch.randn(1, 4, 16, 16, generator=generator).to(dtype) if masked else None
    with _Ops() as theirs:
        expected = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, 0.0, False)[0]
    with _Ops() as ours:
        got = _math_attention(q, k, v, mask, 0.0, False, None, False)
    torch.testing.assert_close(got, expected)

    def names(ops: list[str]) -> list[str]:
        return [op.split(".")[0].rstrip("_") for op in ops if not op.startswith("detach")]

    assert names(ours.ops) == names(theirs.ops)
    assert names(ours.ops).count("_to_copy") == (5 if dtype == torch.bfloat16 else 0)


class _Attention(nn.Module):
    def __init__(self, dropout: float, **sdpa: object) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 3 * 64)
        self.dropout, self.sdpa = dropout, sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, **self.sdpa).sum()


def _activations(model: nn.Module, batch: int, length: int, precision: str = "fp32") -> int:
    sample = torch.randn(batch, length, 64)
    estimate = memfit.estimate(
        model, sample, optimizer="sgd", precision=precision, loss_fn=lambda out, _: out, target=memfit.Target("cuda")
    )
    return estimate.activation_bytes


def test_the_math_kernel_keeps_the_softmax_its_dropout_mask_and_the_dropped_matrix() -> None:
    """fp32 grouped heads go to math on CUDA: per (batch, head, query, key) it keeps the fp32 softmax for its
    backward, the 1-byte dropout mask and the fp32 dropped-out matrix for the second matmul."""
    batch, heads, length = 2, 4, 256

    def kept(dropout: float) -> int:
        class Grouped(_Attention):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
                k, v = k[:, :2], v[:, :2]  # two key/value heads for four query heads
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, enable_gqa=True).sum()

        return _activations(Grouped(dropout), batch, length)

    scores = batch * heads * length * length
    assert kept(0.1) - kept(0.0) == scores * (1 + 4)  # the mask and the dropped matrix on top of the softmax


def test_fused_attention_keeps_no_seq_by_seq_matrix() -> None:
    short, long = _activations(_Attention(0.0), 2, 128), _activations(_Attention(0.0), 2, 512)
    assert long < 4 * short + 2 * 512 * 64 * 4 * 16  # linear in the length, where math would be quadratic


def test_dropout_keeps_a_one_byte_mask_as_cudas_fused_kernel_does() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1), nn.Linear(64, 1))
    without = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.0), nn.Linear(64, 1))
    x = torch.randn(8, 64)

    def activations(m: nn.Module) -> int:
        return memfit.estimate(
            m, x, optimizer="sgd", loss_fn=lambda out, _: out.sum(), target=memfit.Target("cuda")
        ).activation_bytes

    # the second linear keeps the dropout's output instead of the first one's, and the dropout its 1-byte mask (CPU's
    # dropout would keep an fp32 noise tensor: 4 bytes an element)
    assert activations(model) - activations(without) == 8 * 64 * 1


# --- cuDNN convolution workspaces -------------------------------------------------------------------------------


def _conv_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tensor_core_convolution_takes_its_operands_nhwc_in_a_workspace(dtype: torch.dtype) -> None:
    with FakeTensorMode():
        x = torch.empty(8, 64, 56, 56, dtype=dtype)
        w = torch.empty(64, 64, 3, 3, dtype=dtype)
        out = _conv_out(x, w)
        args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        found = conv_workspaces(torch.ops.aten.convolution.default, args, out, (9, 0))
        size = dtype.itemsize
        assert found == {id(out): (x.numel() + out.numel() + w.numel()) * size}
        assert conv_workspaces(torch.ops.aten.convolution.default, args, out, (7, 5)) == {}  # no bf16/TF32 cores
        rgb = torch.empty(8, 3, 56, 56, dtype=dtype)
        stem = torch.empty(64, 3, 3, 3, dtype=dtype)
        rgb_args = (rgb, stem, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        assert conv_workspaces(torch.ops.aten.convolution.default, rgb_args, _conv_out(rgb, stem), (9, 0)) == {}
        nhwc = x.to(memory_format=torch.channels_last)
        nhwc_args = (nhwc, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        assert conv_workspaces(torch.ops.aten.convolution.default, nhwc_args, _conv_out(nhwc, w), (9, 0)) == {}


def test_the_workspace_is_what_cudnn_took_on_an_h100() -> None:
    """ResNet's 64-channel 3x3 convolutions at 224 px: forward and backward-data took input + output + filter
    (+147 bytes of alignment), in fp32 at batch 8 and in bf16 at batch 16."""
    for name, batch, itemsize in (
        ("resnet-bn-fp32-adamw-b8", 8, 4),
        ("resnet-bn-bf16-mixed-sgd-momentum-ckpt-b16", 16, 2),
    ):
        operands = (2 * batch * 64 * 224 * 224 + 64 * 64 * 9) * itemsize
        requests = snapshot_requests(name)
        assert requests.count(operands + 147) >= 2 * 16, name  # every block convolution, forward and backward


# --- reductions' staging buffers --------------------------------------------------------------------------------


def test_the_staging_buffer_is_what_the_bias_gradients_took_on_an_h100() -> None:
    """ViT-Base at batch 32 (6,304 rows of 197 tokens): its 3072- and 768-wide bias gradients, summed over the rows,
    each took a buffer and semaphores of exactly these sizes, right after the gradient."""
    requests = snapshot_requests("vit-bf16-mixed-sgd-momentum-ckpt-b32")
    for width in (3072, 768):
        buffer, semaphores = staging_bytes(
            32 * 197, width, on_fastest_dim=False, input_vec_size=8, accumulate_bytes=4, limits=GridLimits(132, 2048)
        )
        assert buffer > 0
        pairs = list(zip(requests, requests[1:], requests[2:], strict=False))
        assert (2 * width, buffer, semaphores) in pairs, width


def test_a_short_or_wide_reduction_needs_no_staging_and_the_gpu_sizes_it() -> None:
    limits = GridLimits(132, 2048)
    assert staging_bytes(64, 3072, on_fastest_dim=False, input_vec_size=8, accumulate_bytes=4, limits=limits) == (0, 0)
    assert staging_bytes(6304, 2048, on_fastest_dim=True, input_vec_size=4, accumulate_bytes=4, limits=limits) == (0, 0)
    h100 = staging_bytes(6304, 3072, on_fastest_dim=False, input_vec_size=8, accumulate_bytes=4, limits=limits)
    t4 = staging_bytes(
        6304, 3072, on_fastest_dim=False, input_vec_size=8, accumulate_bytes=4, limits=GridLimits(40, 1024)
    )
    assert t4[0] < h100[0]  # fewer multiprocessors, fewer blocks an output


def test_a_symbolic_batch_sizes_the_staging_buffer_at_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer is a step function of the rows; one trace with the batch symbolic reads it at any batch as a trace
    at that batch does."""
    model = nn.Sequential(nn.Linear(768, 3072), nn.GELU(), nn.Linear(3072, 768))

    def loss(out: torch.Tensor, _: object) -> torch.Tensor:
        return out.float().mean()

    def sample(batch: int) -> torch.Tensor:
        return torch.randn(batch, 197, 768)

    symbolic_curve = memfit.trace(model, sample, batch_size=2, optimizer="sgd", precision="bf16-mixed", loss_fn=loss,
                               target=memfit.Target("cuda"))  # fmt: skip
    monkeypatch.setenv("MEMFIT_TRACE", "concrete")
    for batch in (2, 32):
        concrete = memfit.estimate(model, sample, batch_size=batch, optimizer="sgd", precision="bf16-mixed",
                                   loss_fn=loss, target=memfit.Target("cuda"))  # fmt: skip
        assert symbolic_curve.at(batch).allocated_bytes == concrete.peak_allocated_bytes, batch


# --- embedding backward and cuDNN attention backward ------------------------------------------------------------


def test_embedding_backward_sorts_more_than_3072_indices_and_sums_rows_per_index() -> None:
    target = cuda_scratch.CudaTarget()
    grad = torch.empty(8, 1024, 512, device="meta")
    ids = torch.empty(8, 1024, dtype=torch.long, device="meta")
    func = torch.ops.aten.embedding_dense_backward.default
    before = dict(step for step in cuda_scratch.before_outputs(func, (grad, ids, 1000, -1, False), target) if step[1])
    after = cuda_scratch.after_outputs(func, (grad, ids, 1000, -1, False), None, target)
    assert before["sorted_indices"] == before["orig_indices"] == 8 * 1024 * 8
    assert next(size for name, size in after if name == "grad_weight_per_segment") == 8 * 1024 * 512 * 4
    steps = [*cuda_scratch.before_outputs(func, (grad, ids, 1000, -1, False), target), *after]
    allocated = [name for name, size in steps if size is not None]
    assert sorted(allocated) == sorted(name for name, size in steps if size is None)  # all freed before it returns
    few = torch.empty(2, 1024, dtype=torch.long, device="meta")
    assert cuda_scratch.before_outputs(func, (grad[:2], few, 1000, -1, False), target) is None


def test_cudnn_attention_backward_takes_an_fp32_query_gradient_as_on_an_h100() -> None:
    requests = snapshot_requests("vit-bf16-mixed-sgd-momentum-ckpt-b32")
    query = torch.empty(32, 12, 197, 64, dtype=torch.bfloat16, device="meta")
    func = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    (_, workspace), _ = cuda_scratch.after_outputs(func, (None, query), None, cuda_scratch.CudaTarget())
    assert any(0 <= size - workspace <= 256 for size in requests), workspace


# --- the autograd engine and autocast ---------------------------------------------------------------------------


def test_the_engine_adds_a_second_gradient_where_the_first_was() -> None:
    """A leaf used by two branches gets two gradients; on a real tensor the engine adds the second into the first's
    memory (``InputBuffer::accumulate``: ``old_var.add_(var)``), which a fake tensor never lets it do. The log keeps
    the first's block for the sum: no free of the first, no allocation of the sum (a free and an allocation of the
    same size could land in another of the caching allocator's equal free blocks)."""
    from memfit.tracing.recorder import StorageRecorder

    fake, recorder = FakeTensorMode(), StorageRecorder()
    x = fake.from_tensor(torch.randn(64, 256)).requires_grad_()
    with fake, recorder:
        recorder.mark(1, Phase.FORWARD)
        loss = torch.relu(x).sum() + torch.sigmoid(x).sum()
        recorder.mark(1, Phase.BACKWARD)
        loss.backward()
        total = recorder.track(x.grad)
    gradient = 64 * 256 * 4
    assert recorder.sizes[total] == gradient and -total not in recorder.events  # the first gradient's block, kept
    assert recorder.alloc_phase[total] == 1  # made in backward, not a forward activation
    backward = recorder.events[recorder.marks[1].event_index :]
    assert [e for e in backward if e > 0 and recorder.sizes[e] == gradient].count(total) == 1
    assert len([e for e in backward if e > 0 and recorder.sizes[e] == gradient]) == 2  # the two gradients, no sum


def _trace(model: nn.Module, sample: torch.Tensor, precision: str) -> Any:
    from memfit.prediction.estimator import _prepare, _Step
    from memfit.tracing.config import Target, TrainingLoop
    from memfit.tracing.tracer import trace_steps

    step = _Step(
        precision=precision, optimizer="sgd", optimizer_kwargs=None, gradient_checkpointing=False,
        checkpoint_modules=None, loss_fn=lambda out, _: out.float().sum(), forward_fn=None, inference=False,
    )  # fmt: skip
    settings, _ = _prepare(model, sample, None, step, TrainingLoop(), Target(device="cuda"))
    return trace_steps(model, sample, sample.shape[0], sample.shape[0], settings).recorder


def _logged_sizes(model: nn.Module, sample: torch.Tensor, precision: str) -> list[int]:
    """The sizes of every allocation of a trace for a CUDA target, in order."""
    recorder = _trace(model, sample, precision)
    return [recorder.sizes[event] for event in recorder.events if event > 0]


def test_autocast_casts_a_linear_layers_bias_before_its_weight() -> None:
    """CUDA autocast casts a call's arguments in one C++ expression, which GCC evaluates right to left: the
    allocator sees the bias's bf16 copy, then the weight's (as in the ViT snapshot, 1,536 then 1,179,648 bytes)."""
    requests = snapshot_requests("vit-bf16-mixed-sgd-momentum-ckpt-b32")
    assert (768 * 2, 768 * 768 * 2) in list(itertools.pairwise(requests))
    sizes = _logged_sizes(nn.Linear(768, 768), torch.randn(4, 768), "bf16-mixed")
    assert (768 * 2, 768 * 768 * 2) in list(itertools.pairwise(sizes))
    assert sizes.index(768 * 2) < sizes.index(768 * 768 * 2)  # the first casts: the bias's, then the weight's
