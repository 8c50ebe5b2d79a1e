"""cuDNN's RNN has no fake kernel that knows its memory, so traces for a CUDA target run LSTMs, GRUs and plain RNNs
on a stand-in that allocates what cuDNN's kernels allocate (``memfit.tracing.cudnn_rnn``), checked against H200
allocator snapshots and a grid of 107 shapes measured on an H100, and packed sequences on PyTorch's native RNN
kernels. The switch is checked here on CPU; tests/test_gpu.py traces
an LSTM on fake CUDA tensors where a GPU is present."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import zoo
from memfit.tracing import cudnn_rnn
from memfit.tracing.model_state import cudnn_rnn_disabled, swap_tensors_in


class _Recording(nn.LSTM):
    """An LSTM that writes down whether cuDNN was on while it ran."""

    seen: list[bool]

    def forward(self, *args, **kwargs):  # type: ignore[override]
        self.seen.append(torch.backends.cudnn.enabled)
        return super().forward(*args, **kwargs)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.before = nn.Linear(4, 4)
        self.rnn = _Recording(4, 4, batch_first=True)
        self.rnn.seen = []
        self.seen_after: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.before(x))
        self.seen_after.append(torch.backends.cudnn.enabled)
        return out


def test_cudnn_is_off_inside_rnn_modules_only_and_restored() -> None:
    model = _Model()
    assert torch.backends.cudnn.enabled
    with cudnn_rnn_disabled(model):
        model(torch.randn(2, 3, 4)).sum().backward()
        model(torch.randn(2, 3, 4))
    assert model.rnn.seen == [False, False]
    assert model.seen_after == [True, True]  # convolutions and the rest keep cuDNN
    assert torch.backends.cudnn.enabled
    assert not model.rnn._forward_pre_hooks and not model.rnn._forward_hooks


def test_a_failing_rnn_forward_leaves_cudnn_as_it_was() -> None:
    model = _Model()
    with pytest.raises(RuntimeError), cudnn_rnn_disabled(model):
        model.rnn(torch.randn(2, 3, 5))  # wrong feature size: the LSTM raises inside its forward
    assert model.rnn.seen == [False]
    assert torch.backends.cudnn.enabled
    assert not model.rnn._forward_pre_hooks and not model.rnn._forward_hooks


def test_models_without_rnns_are_left_alone() -> None:
    model = nn.Linear(2, 2)
    torch.backends.cudnn.enabled = False
    try:
        with cudnn_rnn_disabled(model):
            assert not torch.backends.cudnn.enabled
        assert not torch.backends.cudnn.enabled
    finally:
        torch.backends.cudnn.enabled = True


# --- cuDNN's LSTM as the trace for a CUDA target runs it (memfit.tracing.cudnn_rnn) -----------------------------

SNAPSHOTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu-truth" / "h200-2026-11-27"


def _snapshot_requests(name: str) -> list[int]:
    with gzip.open(SNAPSHOTS / f"snapshot-{name}.json.gz") as file:
        return [e["size"] for e in json.load(file)["trace"] if e["action"] == "alloc"]


def _traced_requests(precision: str, batch: int) -> list[int]:
    """Every allocation of a trace without a GPU, for a CUDA target, of the zoo's LSTM at the size measured."""
    from memfit.prediction.estimator import _prepare, _Step
    from memfit.tracing.config import Target, TrainingLoop
    from memfit.tracing.tracer import trace_steps

    model = zoo.LSTMClassifier(vocab=10000, hidden=1024, layers=2)
    sample = torch.randint(0, 500, (batch, 128))
    step = _Step(
        precision=precision, optimizer="sgd", optimizer_kwargs=None, gradient_checkpointing=False,
        checkpoint_modules=None, loss_fn=lambda out, _: out.float().sum(), forward_fn=None, inference=False,
    )  # fmt: skip
    settings, _ = _prepare(model, sample, None, step, TrainingLoop(), Target(device="cuda"))
    recorder = trace_steps(model, sample, batch, batch, settings).recorder
    return [recorder.sizes[event] for event in recorder.events if event > 0]


def _contains(sequence: list[int], part: list[int]) -> bool:
    return any(sequence[i : i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


@pytest.mark.parametrize(("snapshot", "precision", "batch"), [
    ("lstm-16-mixed-adamw-fused-b16-at32", "16-mixed", 32),
    ("lstm-fp32-adamw-b8-at8", "fp32", 8),
])  # fmt: skip
def test_the_lstm_allocates_what_cudnn_allocated_on_an_h200(snapshot: str, precision: str, batch: int) -> None:
    """The H200 snapshots' own requests around cuDNN's LSTM, in order: forward (under autocast: one fp16 copy of all
    the weights, ``cx``, ``hx`` and the input cast, then the sequence-major input, the output, ``hy``, ``cy``, the
    workspace and the reserve space) and backward (``dhy``/``dcy`` zeros, the input and output gradient made
    sequence-major, ``dx``, ``dhx``, ``dcx``, the workspace; the input again, the flat weight gradient, the
    workspace). A CPU-only torch runs the LSTM step by step, none of which matches."""
    real = _snapshot_requests(snapshot)
    state = 2 * batch * 1024 * (2 if precision == "16-mixed" else 4)
    sequence = batch * 128 * 1024 * (2 if precision == "16-mixed" else 4)
    reserve = 128 * batch * 1024 * (2 if precision == "16-mixed" else 4) * 11 + 256  # 4 gates and c a layer, h of one
    workspace = real[real.index(reserve) - 1]  # requested right before the reserve space
    weights = 2 * (4 * 1024 * 2048 + 2 * 4096)
    if precision == "16-mixed":
        forward = [weights * 2, state, state, sequence, sequence, sequence, state, state, workspace, reserve]
        gradient = weights * 2
    else:
        forward = [sequence, sequence, state, state, workspace, reserve]
        gradient = weights * 4
    backward = [state, state, sequence, sequence, sequence, state, state, workspace, sequence, gradient, workspace]
    assert _contains(real, forward) and _contains(real, backward)  # what cuDNN did
    element = sequence // (batch * 128 * 1024)
    assert workspace == cudnn_rnn.workspace_bytes(batch, 128, 1024, 1024, 2, 1, element)
    assert reserve == cudnn_rnn.reserve_bytes(batch, 128, 1024, 2, 1, element)
    traced = _traced_requests(precision, batch)
    assert _contains(traced, forward)
    assert _contains(traced, backward)


def test_rnn_weights_are_flattened_as_moving_the_module_to_a_gpu_does() -> None:
    """``RNNBase._apply`` calls ``flatten_parameters``: one buffer holds every weight, the separate copies are freed
    (in the snapshots: 4 x 16 MiB and 4 x 16 KiB, then one 67,174,400-byte buffer)."""
    real = _snapshot_requests("lstm-fp32-adamw-b8-at8")
    assert real[1:12] == [16777216, 16777216, 16384, 16384, 16777216, 16777216, 16384, 16384, 67174400, 20480, 20]
    lstm = nn.LSTM(8, 16, num_layers=2)
    fake = FakeTensorMode()
    with fake:
        swap_tensors_in(lstm, lambda t, is_param: nn.Parameter(fake.from_tensor(t)) if is_param else t)
        flats: list[torch.Tensor] = []
        assert cudnn_rnn.flatten_rnn_weights(lstm, flats.append) == 1
    (flat,) = flats
    assert flat.numel() == sum(p.numel() for p in lstm.parameters())
    assert {p.untyped_storage()._cdata for p in lstm.parameters()} == {flat.untyped_storage()._cdata}
    assert all(w is p for w, p in zip(lstm._flat_weights, lstm.parameters(), strict=True))


def test_lstms_run_cudnns_stand_in_on_fake_cuda_tensors_too() -> None:
    """On a machine with CUDA the trace runs on fake CUDA tensors under the real ``torch.autocast``; the mode stands
    in for ``torch.lstm`` there (checked here on fake CPU tensors, without autocast)."""
    lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
    fake = FakeTensorMode()
    with fake:
        swap_tensors_in(lstm, lambda t, is_param: nn.Parameter(fake.from_tensor(t)) if is_param else t)
        mode = cudnn_rnn.CudnnRNNs()
        with mode:
            out, (h, c) = lstm(torch.randn(4, 5, 8))
        out.sum().backward()
    assert mode.calls == 1 and out.shape == (4, 5, 16) and h.shape == c.shape == (2, 4, 16)
    assert out.stride() == (16, 4 * 16, 1)  # batch-first view of sequence-major storage, as cuDNN returns it
    assert all(p.grad is not None and p.grad.shape == p.shape for p in lstm.parameters())


# --- the stand-in against cuDNN on an H100, over a grid of shapes (benchmarks/gpu_cudnn_rnn.py) -------------------

GRID = (
    Path(__file__).resolve().parents[1]
    / "benchmarks"
    / "results"
    / "gpu-truth"
    / "h100-2026-11-27"
    / "cudnn_rnn.json.gz"
)
_MODULES = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN_TANH": nn.RNN}
_MODES = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh"}
MiB = 2**20


def _grid(path: Path = GRID) -> list[dict]:
    with gzip.open(path) as file:
        return json.load(file)["results"]


def _traced_phases(shape: dict) -> tuple[list[list], list[list]]:
    """The benchmark's forward and backward, traced on fake tensors for a CUDA target: ``[[action, bytes], ...]`` of
    each phase, as the allocator history writes them."""
    from memfit.categories import Phase
    from memfit.tracing.cuda_semantics import CudaSemantics
    from memfit.tracing.recorder import StorageRecorder

    dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(shape["precision"])
    fake, recorder, semantics = FakeTensorMode(), StorageRecorder(), CudaSemantics(dtype)
    n, t, width = shape["batch"], shape["steps"], shape["input"]
    with fake, recorder:
        options = {"bidirectional": shape["bidirectional"], "batch_first": shape["batch_first"],
                   "dropout": shape.get("dropout", 0.0)}  # fmt: skip
        rnn = _MODULES[shape["mode"]](width, shape["hidden"], num_layers=shape["layers"], **options)
        cudnn_rnn.flatten_rnn_weights(rnn, recorder.track)
        x = torch.randn((n, t, width) if shape["batch_first"] else (t, n, width), requires_grad=True)
        recorder.mark(1, Phase.FORWARD)
        semantics.autocast_active = dtype is not None
        with semantics:
            out = rnn(x)[0]
        semantics.autocast_active = False
        forward_end = len(recorder.events)
        grad = torch.ones_like(out)
        recorder.mark(1, Phase.BACKWARD)
        out.backward(grad)
        backward_end = len(recorder.events)

    def phase(start: int, end: int) -> list[list]:
        return [["alloc" if e > 0 else "free_requested", recorder.sizes[abs(e)]] for e in recorder.events[start:end]]

    return phase(recorder.marks[0].event_index, forward_end), phase(recorder.marks[1].event_index, backward_end)


def _allocations_and_frees(events: list[list], workspace: int) -> tuple[list[int], list[int]]:
    """The allocations in order and the frees as a multiset, the workspace written as -1."""
    sizes = [[action, -1 if size == workspace else size] for action, size in events if action != "segment_alloc"]
    return [s for a, s in sizes if a == "alloc"], sorted(s for a, s in sizes if a == "free_requested")


def _workspace_is_exact(shape: dict) -> bool:
    """Where the workspace formula holds to the byte: LSTMs of one direction, H >= 1000, 32 <= T <= 128, I <= H."""
    return (
        shape["mode"] == "LSTM" and not shape["bidirectional"] and shape["hidden"] >= 1000
        and 32 <= shape["steps"] <= 128 and shape["input"] <= shape["hidden"]
    )  # fmt: skip


def test_every_rnn_allocates_what_cudnn_allocated_on_an_h100() -> None:
    """All 107 measured shapes (LSTM, GRU and tanh RNN; fp32, fp16 and bf16 autocast; one or two directions, batch-
    or sequence-first, 1 to 4 layers, 1 to 512 steps): the trace's allocations, in order, and its frees are the
    measured ones, phase by phase, the reserve space to the byte. The workspace, from a closed library, is exact
    where its formula holds (``_workspace_is_exact``) and within 50% and 24 MiB elsewhere (the module docstring
    lists where cuDNN takes another size)."""
    results = _grid()
    assert len(results) == 107 and not any("error" in r for r in results)
    exact = 0
    for result in results:
        shape = result["shape"]
        forward, backward = _traced_phases(shape)
        real = [e for e in result["forward"] if e[0] == "alloc"]
        traced = [e for e in forward if e[0] == "alloc"]
        real_workspace, workspace = real[-2][1], traced[-2][1]  # requested right before the reserve space
        assert real[-1] == traced[-1], shape  # the reserve space
        element = 4 if shape["precision"] == "fp32" else 2
        sizes = (shape["batch"], shape["steps"], shape["input"], shape["hidden"], shape["layers"])
        directions = 2 if shape["bidirectional"] else 1
        assert workspace == cudnn_rnn.workspace_bytes(*sizes, directions, element, mode=_MODES[shape["mode"]])
        for measured, ours in ((result["forward"], forward), (result["backward"], backward)):
            assert _allocations_and_frees(ours, workspace) == _allocations_and_frees(measured, real_workspace), shape
        if _workspace_is_exact(shape):
            assert workspace == real_workspace, shape
        else:
            assert abs(workspace - real_workspace) <= min(0.5 * real_workspace, 24 * MiB), shape
        exact += workspace == real_workspace
    assert exact == 28


def test_the_reserve_space_holds_the_gates_of_every_step_layer_and_direction() -> None:
    """The reserve space of every measured shape, read off the grid directly: N T H D e ((k + 1) L - 1) + 256 bytes
    with k = 5 (LSTM), 6 (GRU) and 1 (RNN)."""
    for result in _grid():
        shape = result["shape"]
        reserve = [e[1] for e in result["forward"] if e[0] == "alloc"][-1]
        element = 4 if shape["precision"] == "fp32" else 2
        directions = 2 if shape["bidirectional"] else 1
        assert reserve == cudnn_rnn.reserve_bytes(
            shape["batch"], shape["steps"], shape["hidden"], shape["layers"], directions, element,
            _MODES[shape["mode"]],
        ), shape  # fmt: skip


def test_grus_and_rnns_run_cudnns_stand_in_too() -> None:
    """``torch.gru``, ``rnn_tanh`` and ``rnn_relu`` run the stand-in (on fake CPU tensors here), with their shapes."""
    fake = FakeTensorMode()
    for module in (nn.GRU(8, 16, num_layers=2, batch_first=True), nn.RNN(8, 16, nonlinearity="relu")):
        with fake:
            swap_tensors_in(module, lambda t, is_param: nn.Parameter(fake.from_tensor(t)) if is_param else t)
            mode = cudnn_rnn.CudnnRNNs()
            with mode:
                out, h = module(torch.randn(4, 5, 8))
            out.sum().backward()
        assert (
            mode.calls == 1
            and out.shape == (4, 5, 16)
            and h.shape == (module.num_layers, 4 if module.batch_first else 5, 16)
        )
        assert all(p.grad is not None and p.grad.shape == p.shape for p in module.parameters())


def test_the_workspace_grid_and_dropout_between_layers() -> None:
    """64 more shapes measured on the H100 where the first grid left the workspace unexplained: GRU and tanh RNNs
    varied from their own base, LSTMs outside the formula's exact region, and dropout between layers. Allocations
    in order and frees match on every shape; the reserve space is exact, dropout's mask (one bit per value of each
    layer's output but the last) included; an LSTM's workspace is exact in the formula's region, dropout's extra
    sequence buffer included. Elsewhere the workspace is under by at most 17 MiB and over by at most 31 MiB (an LSTM
    at T = 1024, where cuDNN's sequence term stops growing linearly). cuDNN's dropout state, allocated once per
    process at the first RNN with dropout, is left out: it is the one allocation the trace lacks."""
    results = _grid(GRID.with_name("cudnn_rnn-workspace.json.gz"))
    assert len(results) == 64 and not any("error" in r for r in results)
    dropout_state = 6_488_064  # cudnnDropoutGetStatesSize on this H100 (132 multiprocessors)
    exact = 0
    for result in results:
        shape = result["shape"]
        forward, backward = _traced_phases(shape)
        real_forward = [e for e in result["forward"] if e[1] != dropout_state and e[1] != 8]
        real = [e for e in real_forward if e[0] == "alloc"]
        traced = [e for e in forward if e[0] == "alloc"]
        assert real[-1] == traced[-1], shape  # the reserve space, dropout's mask included
        real_workspace, workspace = real[-2][1], traced[-2][1]
        for measured, ours in ((real_forward, forward), (result["backward"], backward)):
            assert _allocations_and_frees(ours, workspace) == _allocations_and_frees(measured, real_workspace), shape
        if _workspace_is_exact(shape):
            assert workspace == real_workspace, shape
        assert -17 * MiB <= workspace - real_workspace <= 31 * MiB, shape
        exact += workspace == real_workspace
    first_dropout = next(r for r in results if r["shape"].get("dropout"))
    assert [e[1] for e in first_dropout["forward"] if e[0] == "alloc"].count(dropout_state) == 1
    assert sum(bool(r["shape"].get("dropout")) for r in results) == 6 and exact == 7
