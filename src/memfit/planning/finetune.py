"""LoRA, DoRA and QLoRA on a model built on ``meta``: what ``memfit plan --lora-r ... --quantize nf4`` traces.

The model the planner traces must hold the dtypes and layouts the real run will have:

- ``--quantize nf4|fp4|int8`` swaps each ``nn.Linear`` (not the output head, which transformers'
  bitsandbytes integration leaves unquantized) for a bitsandbytes ``Linear4bit`` / ``Linear8bitLt``
  whose weight is a ``Params4bit`` / ``Int8Params`` of the *packed* shape on ``meta``, with a
  ``QuantState`` whose tensors have the shapes bitsandbytes' ``quantize_4bit`` gives them (absmax per
  block of 64, the 16-entry code; with double quantization uint8 absmax, an fp32 absmax per 256 blocks,
  the 256-entry dynamic code and the offset). The layout is written here, shape only: calling
  bitsandbytes' quantizer on ``meta`` would cache a ``meta`` code book in its module-level
  ``name2qmap``, and transformers' quantizer hooks are process-wide, so both would break a later
  real quantization in the same process. ``tests/test_cli_lora.py`` compares every tensor with a real
  quantization.
- then peft's own ``prepare_model_for_kbit_training`` (without its checkpointing: the planner decides
  that) freezes the model and keeps every non-quantized parameter in fp32, as QLoRA scripts and TRL run;
- without quantization, under mixed precision the frozen base is stored in the compute dtype (bf16),
  as LoRA scripts load it (``torch_dtype=torch.bfloat16``); the adapters stay fp32, as peft keeps them;
- ``--lora-r`` applies real peft ``get_peft_model`` with a ``LoraConfig`` (``use_dora`` for ``--dora``); DoRA on
  quantized layers (QDoRA) computes its magnitude from the dequantized weight there, on ``meta``, as peft does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import InvalidInputError
from memfit.precision import Precision
from memfit.presets import ModelSpec
from memfit.tracing.optimizers import optimizer_info
from memfit.tracing.quantized import unsupported_quantization

__all__ = [
    "QUANTIZATIONS",
    "FinetuneReport",
    "FinetuneSpec",
    "ForeignQuantizationError",
    "add_lora",
    "apply_finetune",
    "finetune_breakdown",
    "finetune_report",
    "foreign_quantization",
    "from_config_quantization",
    "quantizable_linears",
    "resolve_optimizer",
]

QUANTIZATIONS = ("nf4", "fp4", "int8")
BLOCKSIZE_4BIT = 64  # Params4bit's default, the one transformers' BitsAndBytesConfig uses
NESTED_BLOCKSIZE = 256  # quantize_4bit's double quantization of absmax
INT8_THRESHOLD = 6.0  # BitsAndBytesConfig's llm_int8_threshold default

# Optimizer names as Hugging Face's ``TrainingArguments.optim`` and fine-tuning guides write them, each
# with the registry names it may be traced as, best first: a paged optimizer keeps its state in CUDA
# unified memory, on the GPU until the driver pages it out under pressure; where the registry has no
# paged entry the same state is counted on the GPU (the figure before any paging).
_OPTIMIZER_ALIASES: dict[str, tuple[str, ...]] = {
    "adamw-torch": ("adamw",),
    "adamw-torch-fused": ("adamw-fused", "adamw"),
    "adamw-hf": ("adamw",),
    "adamw-bnb-8bit": ("adam-8bit",),
    "adamw-8bit": ("adam-8bit",),
    "paged-adamw-8bit": ("paged-adamw-8bit", "adam-8bit"),
    "paged-adam-8bit": ("paged-adamw-8bit", "adam-8bit"),
    "paged-adamw-32bit": ("paged-adamw-32bit", "paged-adamw", "adamw"),
    "paged-adamw": ("paged-adamw", "adamw"),
}


def resolve_optimizer(name: str) -> tuple[str, str | None]:
    """The registry name ``name`` is traced as, and a note when it stands in for a paged optimizer."""
    key = name.strip().lower().replace("_", "-")
    for candidate in _OPTIMIZER_ALIASES.get(key, (key,)):
        try:
            found = optimizer_info(candidate).name
        except InvalidInputError:
            continue
        note = None
        if key.startswith("paged") and not found.startswith("paged"):
            note = f"{name}: paged state counted on the GPU as {found} (before the driver pages any out)"
        return found, note
    optimizer_info(name)  # raises the registry's one-line error with every name it knows
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class FinetuneSpec:
    """What ``memfit plan``'s fine-tuning flags ask for; ``active`` is False when none was given."""

    lora_r: int | None = None
    lora_alpha: float | None = None
    lora_targets: str | None = None  # "all-linear", or comma-separated module names
    lora_dropout: float = 0.0
    dora: bool = False
    quantize: str | None = None
    double_quant: bool = True
    notes: tuple[str, ...] = ()  # what the command line resolved (a paged optimizer's stand-in)

    def __post_init__(self) -> None:
        if self.quantize is not None and self.quantize.lower() not in QUANTIZATIONS:
            raise InvalidInputError(f"--quantize must be one of {', '.join(QUANTIZATIONS)}, got {self.quantize!r}")
        if self.lora_r is not None and self.lora_r < 1:
            raise InvalidInputError(f"--lora-r must be a positive rank such as 16, got {self.lora_r!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise InvalidInputError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout!r}")
        lora_only = {
            "--lora-alpha": self.lora_alpha is not None,
            "--lora-targets": self.lora_targets is not None,
            "--dora": self.dora,
            "--lora-dropout": self.lora_dropout > 0,
        }
        given = [flag for flag, on in lora_only.items() if on]
        if self.lora_r is None and given:
            raise InvalidInputError(f"{', '.join(given)} need --lora-r (the adapter rank, e.g. --lora-r 16)")

    @property
    def lora(self) -> bool:
        return self.lora_r is not None

    @property
    def active(self) -> bool:
        return self.lora or self.quantize is not None

    def describe(self) -> str:
        """A short label for the report: ``QLoRA nf4 r=16`` and the like."""
        parts = []
        if self.quantize:
            parts.append(self.quantize + (" double-quant" if self.double_quant and self.quantize != "int8" else ""))
        if self.lora:
            parts.append(f"{'DoRA' if self.dora else 'LoRA'} r={self.lora_r}")
        return ", ".join(parts)


def from_config_quantization(spec: ModelSpec, finetune: FinetuneSpec) -> FinetuneSpec:
    """``finetune`` with the bitsandbytes quantization a ``config.json``'s ``quantization_config`` names
    (a pre-quantized checkpoint's), when ``--quantize`` did not say; a note says where it came from, or that
    ``--quantize`` stands in for a library memfit cannot trace (GPTQ, AWQ, ...)."""
    config = getattr(getattr(spec.model, "config", None), "quantization_config", None)
    foreign = foreign_quantization(spec.model) if config is not None else None
    if foreign is not None and finetune.quantize is not None:
        note = f"{foreign[0]} (the config's quantization_config) planned as bitsandbytes {finetune.quantize}"
        return dataclasses.replace(finetune, notes=(*finetune.notes, note))
    if finetune.quantize is not None or config is None:
        return finetune
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    if str(get("quant_method", "")).lower().removeprefix("quantizationmethod.") != "bitsandbytes":
        return finetune
    if get("load_in_8bit", False):
        kind, double = "int8", False
    elif get("load_in_4bit", False):
        kind, double = str(get("bnb_4bit_quant_type", "fp4")).lower(), bool(get("bnb_4bit_use_double_quant", False))
    else:
        return finetune
    note = f"quantized as the config's quantization_config says: bitsandbytes {kind}" + (
        " double-quant" if double else ""
    )
    return dataclasses.replace(finetune, quantize=kind, double_quant=double, notes=(*finetune.notes, note))


def apply_finetune(spec: ModelSpec, finetune: FinetuneSpec, precision: Precision, *, inference: bool) -> ModelSpec:
    """``spec`` with the quantized layout and the adapters ``finetune`` asks for (see the module docstring).

    The model is rebuilt in place (it was built on ``meta`` for this plan alone). A config quantized by a
    library memfit cannot trace (GPTQ, AWQ, ...) builds its unquantized architecture on ``meta``: with
    ``--quantize`` that is planned with bitsandbytes standing in, without it the config is refused (and a
    model holding that library's layers always is).
    """
    _refuse_foreign_quantization(spec, stand_in=finetune.quantize is not None)
    if not finetune.active:
        return spec
    if finetune.quantize and not finetune.lora and not inference:
        raise InvalidInputError(
            f"{spec.name} is quantized ({finetune.describe()}: --quantize or its config's quantization_config), "
            "which freezes its weights, so training needs adapters: add --lora-r 16 (QLoRA), or add --inference "
            "to plan serving the quantized model"
        )
    model = spec.model
    compute = precision.compute_dtype if precision is not Precision.FP32 else torch.bfloat16
    if finetune.quantize:
        _quantize_linears(model, finetune.quantize, finetune.double_quant, compute)
        if not inference:
            from peft import prepare_model_for_kbit_training

            prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    elif finetune.lora and precision.is_mixed:
        for parameter in model.parameters():
            if parameter.is_floating_point():
                parameter.data = parameter.data.to(precision.compute_dtype)
    if finetune.lora:
        model = add_lora(model, finetune)
    if inference:  # serving trains nothing, as peft loads adapters for inference (is_trainable=False)
        model.requires_grad_(False)
    return dataclasses.replace(spec, model=model)


class ForeignQuantizationError(InvalidInputError):
    """A model quantized by a library the trace cannot model (GPTQ, AWQ, torchao, HQQ, ...).

    ``library`` names it; ``stand_in`` is the bitsandbytes quantization of the same width (``int8`` for 8-bit
    weights, else ``nf4``) that the plan and the formula tier can count instead.
    """

    def __init__(self, name: str, library: str, stand_in: str) -> None:
        self.library, self.stand_in = library, stand_in
        self.reason = (
            f"{name} is quantized with {library} (its quantization_config), which memfit cannot trace; it traces "
            "bitsandbytes only"
        )
        super().__init__(f"{self.reason}. {self.advice()}")

    def advice(self, estimate: str | None = None) -> str:
        """What to do instead, with ``estimate``, the formula tier's command, where the caller can write it."""
        return (
            f"Add --quantize {self.stand_in} to plan it with bitsandbytes {self.stand_in} standing in, or use the "
            "formula tier" + (f": {estimate}" if estimate else f" (memfit estimate with --quantize {self.stand_in})")
        )


def foreign_quantization(model: nn.Module) -> tuple[str, str] | None:
    """``(library, bitsandbytes stand-in)`` when ``model`` is quantized by a library memfit cannot trace."""
    library = unsupported_quantization(model)
    if library is None:
        return None
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    return library, "int8" if _weight_bits(config) == 8 else "nf4"


def _weight_bits(config: Any) -> int | None:
    """The weight width a quantization_config names (GPTQ's and AWQ's ``bits``, HQQ's ``nbits``, torchao's
    ``int8_weight_only``...), searched through nested settings; ``None`` when it names none."""
    if config is not None and not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    if not isinstance(config, dict):
        return None
    for key in ("bits", "nbits", "w_bit", "weight_bits"):
        if isinstance(config.get(key), int):
            return int(config[key])
    for value in config.values():
        found = _weight_bits(value) if isinstance(value, dict) else None
        if found is None and isinstance(value, str) and any(tag in value.lower() for tag in ("int8", "8bit")):
            found = 8
        if found is not None:
            return found
    return None


def _refuse_foreign_quantization(spec: ModelSpec, *, stand_in: bool) -> None:
    found = foreign_quantization(spec.model)
    if found is None:
        return
    config = spec.model.config
    if stand_in:  # the architecture is built unquantized: drop the config's word, bitsandbytes stands in
        saved, config.quantization_config = config.quantization_config, None
        if unsupported_quantization(spec.model) is None:
            return
        config.quantization_config = saved  # its own layers are in the model: nothing to stand in for
    raise ForeignQuantizationError(spec.name, *found)


# ------------------------------------------------------------------------------------- quantization
def _quantize_linears(model: nn.Module, kind: str, double_quant: bool, compute: torch.dtype) -> None:
    """Swap every ``nn.Linear`` but the output head for a shape-only bitsandbytes layer (see the docstring)."""
    import bitsandbytes as bnb

    for name, linear in quantizable_linears(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bias = linear.bias is not None
        with torch.device("meta"):
            if kind == "int8":
                layer: nn.Module = bnb.nn.Linear8bitLt(
                    linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False, threshold=INT8_THRESHOLD
                )
                layer.weight = _int8_weight(linear.out_features, linear.in_features)
            else:
                layer = bnb.nn.Linear4bit(
                    linear.in_features,
                    linear.out_features,
                    bias=bias,
                    compute_dtype=compute,
                    compress_statistics=double_quant,
                    quant_type=kind,
                )
                layer.weight = _params_4bit(linear.out_features, linear.in_features, kind, double_quant, layer, compute)
        if bias:
            layer.bias = nn.Parameter(torch.empty_like(linear.bias, dtype=compute), requires_grad=False)
        layer.requires_grad_(False)
        setattr(parent, child, layer)
    config = getattr(model, "config", None)
    if config is not None:  # what transformers sets on a bitsandbytes model, and peft reads
        model.is_loaded_in_4bit = kind != "int8"
        model.is_loaded_in_8bit = kind == "int8"


def quantizable_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers bitsandbytes quantizes (all but the output head); refuses a model with none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [
        (name, module) for name, module in model.named_modules() if type(module) is nn.Linear and module is not head
    ]
    if not linears:
        _refuse_no_linears(model)
    return linears


def _refuse_no_linears(model: nn.Module) -> None:
    other = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in ("Conv1D", "Conv1d")})
    names = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"][:3]
    layers = f" ({', '.join(names)}, ... are transformers Conv1D)" if names else ""
    raise InvalidInputError(
        f"--quantize replaces nn.Linear layers with bitsandbytes ones, and {type(model).__name__} has none besides "
        f"its output head{layers}{' but ' + ', '.join(other) if other and not names else ''}. Drop --quantize for "
        "this model, or plan a family built of nn.Linear (Llama, Mistral, Qwen2, Gemma, Phi-3, BERT, T5)"
    )


def packed_4bit_shape(numel: int, storage: torch.dtype = torch.uint8) -> tuple[int, int]:
    """The shape ``quantize_4bit`` packs ``numel`` values into: two per byte, in ``storage`` elements."""
    return ((numel + 1) // 2 // storage.itemsize, 1) if storage.itemsize > 1 else ((numel + 1) // 2, 1)


def _params_4bit(
    rows: int, cols: int, kind: str, double_quant: bool, module: nn.Module, compute: torch.dtype = torch.bfloat16
) -> nn.Parameter:
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

    numel = rows * cols
    blocks = math.ceil(numel / BLOCKSIZE_4BIT)
    meta = torch.device("meta")
    code = torch.empty(16, dtype=torch.float32, device=meta)
    if double_quant:
        nested = QuantState(
            absmax=torch.empty(math.ceil(blocks / NESTED_BLOCKSIZE), dtype=torch.float32, device=meta),
            code=torch.empty(256, dtype=torch.float32, device=meta),  # the dynamic map
            blocksize=NESTED_BLOCKSIZE,
            dtype=torch.float32,
        )
        state = QuantState(
            absmax=torch.empty(blocks, dtype=torch.uint8, device=meta),
            shape=torch.Size((rows, cols)),
            dtype=compute,
            blocksize=BLOCKSIZE_4BIT,
            code=code,
            quant_type=kind,
            offset=torch.empty((), dtype=torch.float32, device=meta),
            state2=nested,
        )
    else:
        state = QuantState(
            absmax=torch.empty(blocks, dtype=torch.float32, device=meta),
            shape=torch.Size((rows, cols)),
            dtype=compute,
            blocksize=BLOCKSIZE_4BIT,
            code=code,
            quant_type=kind,
        )
    data = torch.empty(packed_4bit_shape(numel), dtype=torch.uint8, device=meta)
    weight = Params4bit(
        data,
        requires_grad=False,
        quant_state=state,
        blocksize=BLOCKSIZE_4BIT,
        compress_statistics=double_quant,
        quant_type=kind,
        module=module,
        bnb_quantized=True,
    )
    module.quant_state = state
    return weight


def _int8_weight(rows: int, cols: int) -> nn.Parameter:
    from bitsandbytes.nn import Int8Params

    data = torch.empty(rows, cols, dtype=torch.int8, device="meta")
    scb = torch.empty(rows, dtype=torch.float32, device="meta")
    return Int8Params(data, requires_grad=False, has_fp16_weights=False, CB=data, SCB=scb)


# --------------------------------------------------------------------------------------------- LoRA
def add_lora(model: nn.Module, finetune: FinetuneSpec) -> nn.Module:
    """``model`` with peft's LoRA (or DoRA) adapters as ``finetune`` asks for them (real ``get_peft_model``)."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = "all-linear"
    if finetune.lora_targets is not None and finetune.lora_targets.strip().lower() not in ("all-linear", "all_linear"):
        targets = [t.strip() for t in finetune.lora_targets.split(",") if t.strip()]
        _check_targets(model, targets)
    config = LoraConfig(
        r=finetune.lora_r,
        lora_alpha=finetune.lora_alpha if finetune.lora_alpha is not None else 2 * finetune.lora_r,
        lora_dropout=finetune.lora_dropout,
        target_modules=targets,
        use_dora=finetune.dora,
        task_type=_task_type(model),
    )
    # DoRA dequantizes a Linear4bit's weight into a copy of the layer (``DoraLinearLayer.update_layer``) whose new
    # Params4bit starts as an empty CPU tensor: on a meta model, it must start on meta to take the meta weight.
    on_meta = any(p.is_meta for p in model.parameters())
    try:
        with warnings.catch_warnings(), torch.device("meta") if on_meta else contextlib.nullcontext():
            # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(model, config, low_cpu_mem_usage=True)
    except ValueError as error:  # peft's own word on targets it cannot adapt
        raise InvalidInputError(f"peft could not add LoRA adapters: {' '.join(str(error).split())}") from None


def _check_targets(model: nn.Module, targets: list[str]) -> None:
    paths = [name for name, module in model.named_modules() if _adaptable(module)]
    names = {path.rsplit(".", 1)[-1] for path in paths}
    # peft matches a target by the end of a module's path: "q_proj" or "self_attn.q_proj"
    missing = [t for t in targets if not any(path == t or path.endswith("." + t) for path in paths)]
    if missing:
        raise InvalidInputError(
            f"--lora-targets {','.join(missing)} names no layer of {type(model).__name__}; the layers peft can adapt "
            f"are {', '.join(sorted(names))} (or use --lora-targets all-linear)"
        )


def _adaptable(module: nn.Module) -> bool:
    kinds = ("Linear", "Linear4bit", "Linear8bitLt", "Conv1D", "Embedding", "Conv2d")
    return type(module).__name__ in kinds


def _task_type(model: nn.Module) -> str | None:
    name = type(model).__name__
    if name.endswith("ForCausalLM") or name.endswith("LMHeadModel"):
        return "CAUSAL_LM"
    if name.endswith("ForConditionalGeneration") or name.endswith("ForSeq2SeqLM"):
        return "SEQ_2_SEQ_LM"
    return None


# ---------------------------------------------------------------------------------------- breakdown
@dataclass(frozen=True)
class FinetuneReport:
    """The fine-tuning lines of a plan: the model's weights by role, and what the trace gave the adapters.

    Weights are as the step stores them (a ``*-true`` precision's conversion applied); gradients and
    optimizer state are their largest over the traced step of the first GPU planned (``None``: none was).
    """

    label: str
    parameters: int  # as peft counts them: a 4-bit weight's packed elements count twice
    trainable_parameters: int
    quantized_weights_bytes: int
    frozen_weights_bytes: int
    adapter_weights_bytes: int
    adapter_gradients_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    notes: tuple[str, ...] = ()

    def components(self) -> dict[str, int | None]:
        """The ``*_bytes`` lines in display order."""
        return {
            "quantized_weights_bytes": self.quantized_weights_bytes,
            "frozen_weights_bytes": self.frozen_weights_bytes,
            "adapter_weights_bytes": self.adapter_weights_bytes,
            "adapter_gradients_bytes": self.adapter_gradients_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            **self.components(),
            "notes": list(self.notes),
        }


def finetune_report(
    model: nn.Module, finetune: FinetuneSpec, precision: Precision, rows: Any, *, inference: bool = False
) -> FinetuneReport | None:
    """The report's fine-tuning lines (``None`` when no fine-tuning flag was given); with ``inference`` there are
    no adapter gradients or optimizer state to report (``None``)."""
    if not finetune.active:
        return None
    from memfit.categories import Category

    sizes = finetune_breakdown(model, precision)
    estimate = next((row.estimate for row in rows if row.estimate is not None), None)
    gradients = optimizer = None
    if estimate is not None and not inference:
        gradients = estimate.gradient_bytes
        optimizer = max((p.breakdown.get(Category.OPTIMIZER_STATE, 0) for p in estimate.phases), default=0)
    trainable, total = _counts(model)
    return FinetuneReport(
        finetune.describe(),
        total,
        trainable,
        **sizes,
        adapter_gradients_bytes=gradients,
        optimizer_state_bytes=optimizer,
        notes=finetune.notes,
    )


def _counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, all)`` parameters, peft's own count where the model is a peft model, and counted as peft counts
    them otherwise (each parameter once, however often it is tied; a 4-bit weight's packed elements twice per byte),
    so a quantized model without adapters has as many parameters as its unquantized self."""
    counter = getattr(model, "get_nb_trainable_parameters", None)
    if counter is not None:
        trainable, total = counter()
        return int(trainable), int(total)
    trainable = total = 0
    for parameter in model.parameters():  # each tied parameter once
        count = parameter.numel()
        if type(parameter).__name__ == "Params4bit":
            count *= 2 * parameter.element_size()
        total += count
        trainable += count if parameter.requires_grad else 0
    return trainable, total


def finetune_breakdown(model: nn.Module, precision: Precision = Precision.FP32) -> dict[str, int]:
    """Bytes of the model's own tensors by role: quantized weights (packed + quantization state),
    other frozen weights, adapters (``*-true`` half precision converts the floating ones); a tied weight once."""
    from memfit.tracing.quantized import is_quantized_parameter

    quantized = frozen = adapters = 0
    seen: set[int] = set()
    # peft marks a parameter as an adapter's by its tuner's prefix in the name ("lora_"); a served model's
    # adapters are frozen, but adapters all the same
    prefix = getattr(getattr(model, "base_model", None), "prefix", None) if hasattr(model, "peft_config") else None

    def size(tensor: torch.Tensor, convert: bool = False) -> int:
        if id(tensor) in seen:
            return 0
        seen.add(id(tensor))
        width = tensor.element_size()
        if convert and tensor.is_floating_point() and precision.converts_to_half:
            width = precision.parameter_dtype.itemsize
        return tensor.numel() * width

    for name, parameter in model.named_parameters():
        if is_quantized_parameter(parameter):
            quantized += size(parameter) + sum(size(t) for t in _state_tensors(parameter))
        elif parameter.requires_grad or (isinstance(prefix, str) and prefix in name):
            adapters += size(parameter, convert=True)
        else:
            frozen += size(parameter, convert=True)
    return {"quantized_weights_bytes": quantized, "frozen_weights_bytes": frozen, "adapter_weights_bytes": adapters}


def _state_tensors(parameter: torch.Tensor) -> list[torch.Tensor]:
    state: Any = parameter.__dict__.get("quant_state")
    tensors: list[torch.Tensor] = []
    while state is not None:
        tensors += [t for t in (state.absmax, state.code, state.offset) if isinstance(t, torch.Tensor)]
        state = state.state2
    scb = parameter.__dict__.get("SCB")
    if isinstance(scb, torch.Tensor):
        tensors.append(scb)
    return tensors
