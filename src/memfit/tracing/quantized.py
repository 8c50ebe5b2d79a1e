"""bitsandbytes-quantized models in the trace, and the quantization libraries the trace refuses.

A bitsandbytes weight is a ``torch.nn.Parameter`` subclass (``Params4bit``, ``Int8Params``) carrying
its quantization state as Python attributes (``quant_state``; ``CB``/``SCB``), and its module reads
them in ``forward``. A fake tensor cannot be wrapped in those subclasses (``_make_subclass`` refuses
a tensor that already has a Python object), so the trace stands in for each with a plain fake
``Parameter`` of the packed storage's shape and dtype that carries fake twins of those attributes;
the module's own ``forward``, bitsandbytes' autograd functions and its registered fake kernels then
run unchanged. Everything is put on the fake parameters and in the modules' ``__dict__`` (which
``preserved_module_state`` restores): the user's parameters, their quantization states and the
modules' ``MatmulLtState`` objects are never written.

What each stand-in models, in bytes:

- ``Params4bit``: the packed weight, ``numel / 2`` bytes in the ``quant_storage`` dtype (its real
  shape and dtype), and its ``QuantState``: ``absmax`` (fp32 per block of ``blocksize``, or uint8
  with double quantization, whose nested ``state2`` holds fp32 absmax per 256 blocks and a 256-entry
  code), the 16-entry code and the nested offset. All count as parameters; none require grad, so
  they get no gradient and no optimizer state.
- ``gemm_4bit``: bitsandbytes' registered fake kernel returns only the output, but every backend
  it has for training (the "default" kernel, used on CUDA and CPU) dequantizes the whole weight to
  the input's dtype first, then calls ``linear`` (nested absmax dequantized to fp32 before that).
  ``dequantized_gemm`` replays that decomposition, so the dequantized weight is a temporary of the
  forward; the backward's dequantization (``MatMul4Bit.backward``) already goes through the fake
  ``dequantize_4bit`` kernel and is recorded as it is.
- ``Int8Params``: the int8 weight (``CB``, the parameter's own storage) and ``SCB`` (fp32 per
  row). ``Linear8bitLt.forward`` moves both into the module's ``MatmulLtState``; the trace gives the
  module a copy of that state holding the fakes, so the real one keeps its tensors.
- peft's DoRA on a bitsandbytes layer dequantizes its weight in every forward with
  ``dequantize_module_weight``, which recognises a bitsandbytes weight by its class; the stand-ins are
  plain fake tensors, so while the trace runs ``peft_dequantizes_stand_ins`` gives peft's modules a
  version that dequantizes them with the same bitsandbytes calls (``dequantize_4bit`` with the weight's
  quantization state; ``int8_vectorwise_dequant`` with the module's row scales).
- LLM.int8()'s matmul (``MatMul8bitLt``: what a GPU runs in training and inference, and a CPU in
  inference) quantizes its input with an outlier threshold (``llm_int8_threshold``, 6.0 by
  default): the columns holding a value above it are found from the *values*, so bitsandbytes' fake
  kernels ask for a data-dependent size, which a fake tensor cannot give. ``int8_kernels`` replays
  the CUDA kernels instead (the input's absolute values and outlier mask as temporaries, the int8
  input and its row scales, the int32 product of ``int8_linear_matmul`` before ``int8_mm_dequant``)
  with ``INT8_OUTLIER_COLUMNS`` outlier columns, whose fp16 slices of the input and dequantized
  slices of the weight are a few KiB whatever the count. bitsandbytes' CPU kernels for the same ops
  go through fp32 copies instead, which a CPU-target trace of an 8-bit forward does not model.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.errors import InvalidInputError
from memfit.tracing.rebinding import rebound

__all__ = [
    "INT8_OUTLIER_COLUMNS",
    "bind_quantized_modules",
    "bitsandbytes_kernels",
    "fake_quantized_parameter",
    "is_quantized_parameter",
    "peft_dequantizes_stand_ins",
    "refuse_unsupported_quantization",
    "unsupported_quantization",
]

MakeFake = Callable[[torch.Tensor], torch.Tensor]

INT8_OUTLIER_COLUMNS = 6
"""Outlier columns the trace gives each 8-bit matmul's input: the LLM.int8() paper finds a 6.7B model's
outliers in 6 hidden dimensions. Only their small slices depend on the count."""

# Libraries whose packed weights and kernels the trace has no model of: by the ``quant_method`` of a
# Hugging Face ``quantization_config`` and by the top-level package of a module's or tensor's class.
_UNSUPPORTED_METHODS = {
    "gptq": "GPTQ",
    "awq": "AWQ",
    "torchao": "torchao",
    "hqq": "HQQ",
    "quanto": "optimum-quanto",
    "aqlm": "AQLM",
    "eetq": "EETQ",
    "exl2": "ExLlamaV2",
    "vptq": "VPTQ",
    "higgs": "HIGGS",
    "spqr": "SpQR",
}
_UNSUPPORTED_PACKAGES = {
    "auto_gptq": "GPTQ",
    "gptqmodel": "GPTQ",
    "awq": "AWQ",
    "torchao": "torchao",
    "hqq": "HQQ",
    "optimum": "optimum-quanto",  # only its ``optimum.quanto`` classes reach here (see ``_library_of``)
    "quanto": "optimum-quanto",
    "aqlm": "AQLM",
    "eetq": "EETQ",
    "exllamav2": "ExLlamaV2",
    "vptq": "VPTQ",
}


def unsupported_quantization(model: nn.Module) -> str | None:
    """The library that quantized ``model`` when the trace cannot model it (``"GPTQ"``, ``"AWQ"``, ...), else ``None``.

    Detected without importing those libraries: the model config's ``quantization_config.quant_method``,
    then the classes of its modules, parameters and buffers.
    """
    library = _library_of_config(model)
    if library is None:
        for module in model.modules():
            library = _library_of(type(module))
            for tensor in [*module._parameters.values(), *module._buffers.values()]:
                if library is None and tensor is not None:
                    library = _library_of(type(tensor))
            if library is not None:
                break
    return library


def refuse_unsupported_quantization(model: nn.Module) -> None:
    """Raise ``InvalidInputError`` naming the library when ``model`` is quantized by one the trace cannot model."""
    library = unsupported_quantization(model)
    if library is not None:
        raise InvalidInputError(
            f"{type(model).__name__} is quantized with {library}, whose packed weights and kernels memfit cannot "
            "trace (it traces bitsandbytes 4-bit and 8-bit models). Use the formula tier instead: `memfit estimate` "
            "on the command line, or memfit.estimate_from_counts()"
        )


def _library_of_config(model: nn.Module) -> str | None:
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod is a str enum
    return _UNSUPPORTED_METHODS.get(str(method).lower()) if method is not None else None


def _library_of(cls: type) -> str | None:
    module = cls.__module__ or ""
    root = module.split(".", 1)[0]
    if root == "optimum" and not module.startswith("optimum.quanto"):
        return None
    return _UNSUPPORTED_PACKAGES.get(root)


# ----------------------------------------------------------------------------------- bitsandbytes
def _bnb_classes() -> tuple[type | None, type | None, type | None, type | None]:
    """``Params4bit``, ``Int8Params``, ``Linear4bit``, ``Linear8bitLt`` if bitsandbytes is loaded (a
    model holding them has imported it; the trace never imports it itself)."""
    modules = sys.modules.get("bitsandbytes.nn.modules")
    if modules is None:
        return None, None, None, None
    return (
        getattr(modules, "Params4bit", None),
        getattr(modules, "Int8Params", None),
        getattr(modules, "Linear4bit", None),
        getattr(modules, "Linear8bitLt", None),
    )


def is_quantized_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a bitsandbytes weight, whose dtype the trace must keep as it is."""
    params4bit, int8params, _, _ = _bnb_classes()
    return any(cls is not None and isinstance(tensor, cls) for cls in (params4bit, int8params))


def fake_quantized_parameter(tensor: torch.Tensor, fake: nn.Parameter, make_state: MakeFake) -> nn.Parameter:
    """Give ``fake`` (the stand-in for bitsandbytes weight ``tensor``) fakes of the state its module reads.

    ``make_state`` turns one real tensor into a tracked fake; a tensor shared by several weights (the
    nested code book) must map to one fake, which the caller's memo ensures.
    """
    params4bit, int8params, _, _ = _bnb_classes()
    if params4bit is not None and isinstance(tensor, params4bit):
        # Linear4bit.forward reads weight.quant_state (fix_4bit_weight_quant_state_from_module) and
        # passes it to matmul_4bit; the other attributes are what peft and bitsandbytes inspect.
        state = tensor.__dict__.get("quant_state")
        fake.quant_state = _fake_quant_state(state, make_state) if state is not None else None
        for name in ("blocksize", "compress_statistics", "quant_type", "quant_storage", "bnb_quantized"):
            if name in tensor.__dict__:
                setattr(fake, name, tensor.__dict__[name])
    elif int8params is not None and isinstance(tensor, int8params):
        # Linear8bitLt.forward reads weight.CB; once quantized, CB is the weight's own storage and SCB
        # its fp32 row scales (both None after init_8bit_state moved them to the module's state).
        fake.CB = fake if tensor.__dict__.get("CB") is not None else None
        scb = tensor.__dict__.get("SCB")
        fake.SCB = make_state(scb) if scb is not None else None
        fake.has_fp16_weights = tensor.__dict__.get("has_fp16_weights", False)
    return fake


def _fake_quant_state(state: Any, make_state: MakeFake) -> Any:
    """A shallow copy of a bitsandbytes ``QuantState`` with every tensor replaced by a fake (``state2`` too)."""
    twin = copy.copy(state)
    for name in ("absmax", "code", "offset"):
        value = getattr(state, name, None)
        if isinstance(value, torch.Tensor):
            setattr(twin, name, make_state(value))
    if getattr(state, "state2", None) is not None:
        twin.state2 = _fake_quant_state(state.state2, make_state)
    return twin


def bind_quantized_modules(model: nn.Module, make_state: MakeFake) -> None:
    """Point each bitsandbytes module at the fakes of its (already swapped) weight, in its ``__dict__`` only.

    Call inside ``preserved_module_state`` after the parameters were swapped.
    """
    _, _, linear4bit, linear8bit = _bnb_classes()
    for module in model.modules():
        if linear4bit is not None and isinstance(module, linear4bit):
            module.__dict__["quant_state"] = getattr(module.weight, "quant_state", None)
            # Linear4bit repacks its weight for AVX512-bf16 CPU inference in eval mode (a value-reading
            # rewrite of weight.data); the trace models the device-generic layout, as on CUDA.
            module.__dict__["support_avx512bf16_for_cpu"] = False
        elif linear8bit is not None and isinstance(module, linear8bit):
            module.__dict__["state"] = _fake_matmul_state(module, make_state)


def _fake_matmul_state(module: nn.Module, make_state: MakeFake) -> Any:
    """A copy of the module's ``MatmulLtState`` holding fakes where the real one holds ``CB``/``SCB``.

    Before its first forward a ``Linear8bitLt`` keeps them on the weight (the fake carries twins, and
    ``init_8bit_state`` moves them into this copy); after it, in the state, with ``CB`` the weight's
    own storage.
    """
    real = module.state
    state = copy.copy(real)
    weight = module.weight
    if getattr(weight, "CB", None) is None and real.CB is not None:
        state.CB = weight
        state.SCB = make_state(real.SCB) if real.SCB is not None else None
    for name in ("CBt", "SBt", "SB", "subB", "idx"):  # transposed copies and outliers a real step left
        if getattr(state, name, None) is not None:
            setattr(state, name, None)
    return state


def has_4bit_modules(model: nn.Module) -> bool:
    _, _, linear4bit, _ = _bnb_classes()
    return linear4bit is not None and any(isinstance(m, linear4bit) for m in model.modules())


def has_8bit_modules(model: nn.Module) -> bool:
    _, _, _, linear8bit = _bnb_classes()
    return linear8bit is not None and any(isinstance(m, linear8bit) for m in model.modules())


class _DequantizedGemm(TorchDispatchMode):
    """Run ``bitsandbytes::gemm_4bit`` as its backends do: dequantize the weight, then ``linear``.

    Sits above the recorder, so the dequantized weight (and, with double quantization, the fp32
    absmax) is logged as a temporary that lives for the call, as it does on the device.
    """

    def __init__(self) -> None:
        super().__init__()
        self._gemm = torch.ops.bitsandbytes.gemm_4bit.default

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is not self._gemm:
            return func(*args, **kwargs)
        return _gemm_4bit_dequantized(*args, **kwargs)


def _gemm_4bit_dequantized(
    A: torch.Tensor,
    B: torch.Tensor,
    shapeB: list[int],
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    bias: torch.Tensor | None = None,
    absmax_8bit: torch.Tensor | None = None,
    absmax_code: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """bitsandbytes' "default" ``gemm_4bit`` kernel (``backends/default/ops.py``), the one CUDA and CPU use."""
    ops = torch.ops.bitsandbytes
    if absmax_8bit is not None:  # nested: per-block scale = code[absmax_8bit[i]] * absmax[i // 256] + offset
        absmax = ops.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, 256, torch.float32) + absmax_offset
    weight = ops.dequantize_4bit.default(B, absmax, blocksize, quant_type, shapeB, A.dtype)
    return torch.nn.functional.linear(A, weight, bias)


class _Int8Kernels(TorchDispatchMode):
    """Run LLM.int8()'s ops as bitsandbytes' CUDA backend does, with ``INT8_OUTLIER_COLUMNS`` outlier columns
    where the real count depends on the input's values (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        ops = torch.ops.bitsandbytes
        self._replays: dict[Any, Callable[..., Any]] = {
            ops.int8_vectorwise_quant.default: _int8_vectorwise_quant,
            ops.int8_mixed_scaled_mm.default: _int8_mixed_scaled_mm,
            ops.int8_scaled_mm.default: _int8_scaled_mm,
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return self._replays.get(func, func)(*args, **(kwargs or {}))


def _int8_vectorwise_quant(
    A: torch.Tensor, threshold: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The CUDA ``int8_vectorwise_quant``: int8 rows and fp32 row scales; above a threshold, the columns that
    hold an outlier, found through an absolute-value copy and a mask of the input (both temporaries)."""
    ops = torch.ops.bitsandbytes
    quantized, row_stats, _ = ops.int8_vectorwise_quant.default(A, 0.0)
    if threshold <= 0.0:
        return quantized, row_stats, None
    outliers = A.abs() >= threshold
    outliers.any(dim=0)  # the columns argwhere reads
    columns = torch.empty(min(INT8_OUTLIER_COLUMNS, A.shape[-1]), dtype=torch.int64, device=A.device)
    return quantized, row_stats, columns


def _int8_mixed_scaled_mm(
    A: torch.Tensor,
    CA: torch.Tensor,
    CB: torch.Tensor,
    SCA: torch.Tensor,
    SCB: torch.Tensor,
    outlier_cols: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' ``int8_mixed_scaled_mm`` (its one kernel, ``backends/default/ops.py``): the int8 product
    plus the outlier columns in the input's precision."""
    ops = torch.ops.bitsandbytes
    sub_b = None
    if outlier_cols is not None and outlier_cols.numel():
        sub_a = A[:, outlier_cols].contiguous()
        sub_b = ops.int8_vectorwise_dequant.default(CB[:, outlier_cols].contiguous(), SCB).to(A.dtype).t()
    else:
        sub_a = torch.empty(0, device=A.device, dtype=A.dtype)
    output = _int8_scaled_mm(CA, CB, SCA, SCB, bias=bias, dtype=A.dtype)
    if sub_b is not None:
        output = output.addmm(sub_a, sub_b)
    return output, sub_a


def _int8_scaled_mm(
    A: torch.Tensor,
    B: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """bitsandbytes' ``int8_scaled_mm``: the int32 product (a temporary), then its dequantization."""
    ops = torch.ops.bitsandbytes
    product = ops.int8_linear_matmul.default(A, B)
    return ops.int8_mm_dequant.default(product, row_stats, col_stats, dtype=dtype or torch.float16, bias=bias)


@contextlib.contextmanager
def peft_dequantizes_stand_ins() -> Iterator[None]:
    """peft's ``dequantize_module_weight``, where its modules bound it (``peft.tuners.lora.dora`` and others), made
    to dequantize the trace's stand-ins for bitsandbytes weights too (see the module docstring); restored after."""
    integrations = sys.modules.get("peft.utils.integrations")
    original = getattr(integrations, "dequantize_module_weight", None)
    if original is None:  # peft not loaded: no peft layer to trace
        yield
        return
    with rebound("dequantize_module_weight", original, _dequantizing_stand_ins(original)):
        yield


def _dequantizing_stand_ins(original: Callable[[nn.Module], torch.Tensor]) -> Callable[[nn.Module], torch.Tensor]:
    _, _, _, linear8bit = _bnb_classes()

    def dequantize_module_weight(module: nn.Module) -> torch.Tensor:
        """peft's ``dequantize_module_weight``, which also dequantizes a stand-in as ``dequantize_bnb_weight`` would
        dequantize the bitsandbytes weight it stands for."""
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or is_quantized_parameter(weight):
            return original(module)
        state = weight.__dict__.get("quant_state")
        if state is not None:  # a Params4bit's stand-in
            import bitsandbytes.functional as F

            return F.dequantize_4bit(weight, state)
        if linear8bit is not None and isinstance(module, linear8bit):  # an Int8Params' stand-in
            scales = module.state.SCB if module.state.SCB is not None else weight.__dict__.get("SCB")
            return torch.ops.bitsandbytes.int8_vectorwise_dequant.default(weight, scales)
        return original(module)

    return dequantize_module_weight


@contextlib.contextmanager
def bitsandbytes_kernels(model: nn.Module) -> Iterator[None]:
    """While the trace runs: ``_DequantizedGemm`` when the model holds 4-bit layers, ``_Int8Kernels`` when it holds
    8-bit ones, and ``peft_dequantizes_stand_ins`` with either (nothing otherwise)."""
    with contextlib.ExitStack() as stack:
        if has_4bit_modules(model):
            stack.enter_context(_DequantizedGemm())
        if has_8bit_modules(model):
            stack.enter_context(_Int8Kernels())
        if has_4bit_modules(model) or has_8bit_modules(model):
            stack.enter_context(peft_dequantizes_stand_ins())
        yield
