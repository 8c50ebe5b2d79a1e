"""bitsandbytes 4-bit and 8-bit models are traced (``memfit.tracing.quantized``), and other quantization
libraries are refused with what to use instead.

The accuracy check runs the real training step on CPU (bitsandbytes has CPU kernels) and compares the
traced CPU-target peak with the peak the CPU allocator reports to ``torch.profiler``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

import transformers
from peft.tuners.lora import dora
from peft.utils import integrations

import memfit
from memfit import Category, InvalidInputError, TraceError
from quantized_models import llama_config, quantized_llama, quiet_bitsandbytes, save_random_llama, step_peaks

# CPU tensors are allocated at their exact size, so a right model is off by a few scalars at most
# (the measured run's loss and optimizer step counters); 1 KiB is far below one dequantized weight
# (the smallest here, v_proj in bf16, is 64 KiB), so a missing temporary cannot pass.
EXACT = 1024
BATCH, SEQUENCE, VOCAB = 4, 64, 256


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    with quiet_bitsandbytes():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved once: ``from_pretrained`` with a quantization config quantizes it on load."""
    return save_random_llama(tmp_path_factory.mktemp("tiny-llama"), llama_config(vocab=VOCAB))


# case -> (quantization, through prepare_model_for_kbit_training, DoRA)
CASES: dict[str, tuple[str, bool, bool]] = {
    "nf4": ("nf4", False, False),
    "fp4-double": ("fp4-double", False, False),
    "nf4-double-kbit": ("nf4-double", True, False),
    "int8": ("int8", False, False),
    # QDoRA: peft dequantizes every 4-bit weight in each forward for DoRA's norm (8-bit DoRA does not step on a CPU:
    # peft moves the weight back to the CPU after dequantizing it, which drops its row scales)
    "nf4-double-kbit-dora": ("nf4-double", True, True),
}


def quantized_lora(checkpoint: Path, case: str) -> nn.Module:
    quantization, kbit, dora = CASES[case]
    return quantized_llama(checkpoint, quantization, kbit=kbit, dora=dora)


def tokens() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def bnb_state(model: nn.Module) -> list[tuple[Any, ...]]:
    """Every parameter object with its dtype, and each bitsandbytes weight's quantization state (objects and values)."""
    out: list[tuple[Any, ...]] = []
    for name, param in model.named_parameters():
        state = param.__dict__.get("quant_state")
        tensors = [] if state is None else [state.absmax, state.code, *([state.state2.absmax] if state.nested else [])]
        out.append((name, param, param.dtype, param.requires_grad, state, [(t, t.clone()) for t in tensors],
                    param.__dict__.get("CB"), param.__dict__.get("SCB")))  # fmt: skip
    for name, module in model.named_modules():
        if hasattr(module, "state") and hasattr(module.state, "CB"):
            out.append((name, module.state, module.state.CB, module.state.SCB))
    return out


def assert_same(before: list[tuple[Any, ...]], after: list[tuple[Any, ...]]) -> None:
    assert len(before) == len(after)
    for old, new in zip(before, after, strict=True):
        for a, b in zip(old, new, strict=True):
            if isinstance(a, list):  # quantization-state tensors: the same objects with the same values
                assert [t for t, _ in a] == [t for t, _ in b]
                assert all(t is u and torch.equal(t, v) for (t, v), (u, _) in zip(a, b, strict=True))
            elif isinstance(a, (torch.dtype, bool, str)):
                assert a == b
            else:
                assert a is b


# transformers 4.57 (the lowest supported) builds 8-bit layers whose real step holds 132,648 B less than the trace
# of the same model (9,070,264 - 1,567,360 traced vs 7,635,552 measured); not understood yet, so it is expected
# to fail there and must pass on transformers 5.
_INT8_ON_TRANSFORMERS_4 = pytest.mark.xfail(
    int(transformers.__version__.split(".")[0]) < 5, reason="8-bit layers differ on transformers 4.x", strict=False
)


@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=_INT8_ON_TRANSFORMERS_4) if case == "int8" else case for case in CASES]
)
def test_quantized_lora_peaks_where_the_cpu_allocator_does(checkpoint: Path, case: str) -> None:
    model = quantized_lora(checkpoint, case)
    before = bnb_state(model)
    estimate = memfit.estimate(model, tokens(), target=memfit.Target("cpu"))
    assert_same(before, bnb_state(model))  # the user's model is untouched: objects, dtypes, quantization state
    assert dora.dequantize_module_weight is integrations.dequantize_module_weight  # peft's own again

    # frozen quantized weights get no gradients and no optimizer state: only the LoRA adapters do
    adapters = [p for p in model.parameters() if p.requires_grad]
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters)
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    assert estimate.gradient_bytes == adapter_bytes
    last_step = [phase for phase in estimate.phases if phase.phase is memfit.Phase.OPTIMIZER][-1]
    assert last_step.breakdown[Category.OPTIMIZER_STATE] >= 2 * adapter_bytes  # AdamW's two moments (+ steps)
    assert last_step.breakdown[Category.OPTIMIZER_STATE] <= 2 * adapter_bytes + 64 * len(adapters)

    # the real step: two AdamW steps of the adapters, measured by the CPU allocator's own counters
    predicted, measured = step_peaks(model, estimate, tokens)
    assert abs(predicted - measured) <= EXACT


def test_quantized_weights_count_their_packed_bytes_and_state(checkpoint: Path) -> None:
    """4-bit: numel/2 bytes packed plus fp32 absmax per block of 64 and the 16-entry code, all parameters."""
    model = quantized_lora(checkpoint, "nf4")
    estimate = memfit.estimate(model, tokens(), target=memfit.Target("cpu"))
    expected = 0
    for param in model.parameters():
        state = param.__dict__.get("quant_state")
        expected += param.numel() * param.element_size()
        if state is not None:
            rows, columns = state.shape
            assert param.numel() * param.element_size() == rows * columns // 2
            assert state.absmax.numel() == rows * columns // 64 and state.absmax.dtype == torch.float32
            expected += state.absmax.numel() * 4 + state.code.numel() * 4
    assert estimate.phases[0].breakdown[Category.PARAMETERS] == expected


def test_the_8bit_kernel_replays_compute_what_bitsandbytes_kernels_do() -> None:
    """The trace replays LLM.int8()'s mixed matmul as a decomposition (its outlier count being value-dependent):
    on real tensors, with the outlier columns bitsandbytes finds, it gives bitsandbytes' own result."""
    import bitsandbytes.functional as F

    from memfit.tracing.quantized import _int8_mixed_scaled_mm, _int8_scaled_mm, _int8_vectorwise_quant

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(16, 64, generator=generator).half()
    inputs[:, [3, 40]] *= 20  # two outlier columns above LLM.int8()'s threshold of 6
    weight = torch.randn(32, 64, generator=generator).half()
    CB, SCB, _ = F.int8_vectorwise_quant(weight)
    ops = torch.ops.bitsandbytes
    CA, SCA, outliers = ops.int8_vectorwise_quant.default(inputs.clone(), 6.0)
    assert outliers.tolist() == [3, 40]
    replayed, replayed_scales, columns = _int8_vectorwise_quant(inputs, 6.0)
    assert (replayed.shape, replayed.dtype, replayed_scales.shape, replayed_scales.dtype) == (
        CA.shape, CA.dtype, SCA.shape, SCA.dtype)  # fmt: skip
    assert columns.dtype == outliers.dtype and columns.ndim == 1
    expected, expected_sub = ops.int8_mixed_scaled_mm.default(inputs, CA, CB, SCA, SCB, outliers)
    output, sub = _int8_mixed_scaled_mm(inputs, CA, CB, SCA, SCB, outliers)
    assert torch.equal(output, expected) and torch.equal(sub, expected_sub)
    assert torch.equal(_int8_scaled_mm(CA, CB, SCA, SCB, dtype=torch.float16), ops.int8_scaled_mm.default(
        CA, CB, SCA, SCB, dtype=torch.float16))  # fmt: skip


# ------------------------------------------------------------------------------------ refused inputs
def _class_from(package: str, name: str, base: type = nn.Linear) -> type:
    return type(name, (base,), {"__module__": package})


@pytest.mark.parametrize(
    ("package", "library"),
    [
        ("auto_gptq.nn_modules.qlinear.qlinear_cuda", "GPTQ"),
        ("awq.modules.linear.gemm", "AWQ"),
        ("torchao.quantization.linear_activation_quantized_tensor", "torchao"),
    ],
)
def test_other_quantization_libraries_are_refused_by_name(package: str, library: str) -> None:
    model = nn.Sequential(_class_from(package, "QuantLinear")(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(InvalidInputError, match=rf"quantized with {library}.*`memfit estimate`") as raised:
        memfit.estimate(model, torch.randn(2, 8), loss_fn=lambda out, _: out.sum(), target=memfit.Target("cpu"))
    assert "sample" not in str(raised.value)


@pytest.mark.parametrize(("method", "library"), [("gptq", "GPTQ"), ("awq", "AWQ"), ("torchao", "torchao")])
def test_a_config_quant_method_is_refused_by_name(method: str, library: str) -> None:
    model = nn.Sequential(nn.Linear(8, 2))
    model.config = type("Config", (), {"quantization_config": {"quant_method": method}})()
    with pytest.raises(InvalidInputError, match=rf"quantized with {library}.*formula tier"):
        memfit.estimate(model, torch.randn(2, 8), loss_fn=lambda out, _: out.sum(), target=memfit.Target("cpu"))


class _ScaledParameter(nn.Parameter):
    """A parameter subclass whose module reads an attribute off it, as quantized weights do."""


class _ScaledLinear(nn.Linear):
    def __init__(self) -> None:
        super().__init__(8, 8)
        self.weight = _ScaledParameter(self.weight.data)
        self.weight.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.weight.scale


def test_a_failure_on_the_models_own_tensors_does_not_blame_the_sample() -> None:
    model = nn.Sequential(_ScaledLinear())
    with pytest.raises(TraceError, match=r"_ScaledParameter.*fake tensors cannot stand in for") as raised:
        memfit.estimate(model, torch.randn(2, 8), loss_fn=lambda out, _: out.sum(), target=memfit.Target("cpu"))
    assert "sample" not in str(raised.value)
    assert type(model[0].weight) is _ScaledParameter and model[0].weight.scale == 2.0
