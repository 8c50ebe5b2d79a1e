"""Formula tier: a training step's memory from counts alone, with no model to trace.

This is the cheap first answer: given how many parameters a model has, how many activation
elements one sample keeps for the backward pass, the batch size, the precision and the optimizer,
it adds up the bytes each of them needs. It is meant for "will a 7B model fit on this card at all?"
questions, asked before any code or weights exist.

Accounting rules (bytes per parameter; *trainable* = ``round(parameters * trainable_fraction)``):

* **Parameters** (every parameter): fp32 4 B; pure fp16/bf16 (``16-true`` / ``bf16-true``) 2 B;
  mixed (``16-mixed`` / ``bf16-mixed``) 2 B for a trainable parameter's half-precision working copy
  and 4 B for a frozen one: autocast leaves the weights in fp32, and only trainable ones are
  accounted as working copy + master (frozen weights have no master; LoRA's frozen base is fp32).
* **Master weights** (trainable, mixed precision only): 4 B, the fp32 copy the optimizer updates,
  as in the ZeRO paper's accounting (2 + 2 + 12 = 16 B per parameter for mixed-precision Adam).
* **Gradients** (trainable): in the weight dtype, so 4 B for fp32 and 2 B for pure or mixed half.
* **Optimizer state** (trainable), from the one optimizer registry (``memfit.tracing.optimizers``):
  ``none`` and ``sgd`` 0; ``sgd-momentum``, ``adagrad`` and ``rmsprop`` one state and ``adam`` /
  ``adamw`` two states, each in the state dtype (fp32, 4 B, for fp32 and mixed precision; 2 B for
  pure fp16/bf16); ``adafactor`` 4 B, an approximation (its factored second moment is
  O(rows + cols) per matrix, plus the update), the figure Hugging Face's "anatomy of model memory"
  guide uses; ``adam-8bit`` as bitsandbytes allocates it (``OptimizerInfo.tensor_state_bytes``): per
  tensor of 4096 elements or more, two 1-byte states and two fp32 scales per block of 256, plus two
  256-entry fp32 code books once, and for a smaller tensor two fp32 states (8 B, 4x as much). Given
  ``trainable_sizes`` (each trainable tensor's element count, which ``memfit estimate --hf-config``
  passes), this is exact. Without them a count cannot say which tensors are small, so it is read as
  4095 elements in small tensors and the rest in tensors of 4096 or more (``OptimizerInfo.count_state_bytes``):
  exact under 4096, about 24 KiB above a model whose every tensor is large (LoRA adapters of hidden sizes
  from 512 up at rank 8), and never more for a part of the model than for the whole.
* **Activations**: ``activations_per_sample * batch_size`` elements, 4 B each in fp32 and 2 B in
  any half or mixed precision.
* **LoRA and quantization** (``trainable_parameters``, ``quantize``): ``trainable_parameters`` counts
  the adapters exactly (``parameters`` includes them). ``quantize`` (``nf4``/``fp4``: 4 bits, ``int8``:
  8 bits) stores ``quantized_parameters`` frozen weights (default: every frozen one; quantizing a model
  whose every parameter trains is refused, as bitsandbytes cannot train quantized weights) packed, plus
  bitsandbytes' quantization state (4-bit: an fp32 absmax per block of 64, or with double quantization
  a uint8 one and an fp32 one per 256 blocks, and per weight (``quantized_layers``) its code books; int8:
  its per-row scales are not counted, rows being unknown here) as ``quantized_weights_bytes``. The
  other frozen weights take ``frozen_bytes`` each
  (default as above; ``memfit estimate`` passes 2 for a LoRA base under mixed precision, as LoRA scripts
  load it in bf16, and 4 for QLoRA, as ``prepare_model_for_kbit_training`` keeps them in fp32).

Known limitations: no temporaries (the transient buffers of a forward/backward op), no caching
allocator rounding or fragmentation, no CUDA context, no buffers or inputs; activations are
whatever count the user gives, so the estimate is only as good as that number. The traced tiers
account for all of these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from memfit.errors import InvalidInputError
from memfit.precision import Precision
from memfit.tracing.optimizers import OPTIMIZERS as OPTIMIZER_REGISTRY
from memfit.tracing.optimizers import optimizer_info

__all__ = ["OPTIMIZERS", "FormulaEstimate", "estimate_from_counts", "normalize_optimizer"]

_FP32_BYTES = 4
_HALF_BYTES = 2

OPTIMIZERS: tuple[str, ...] = tuple(OPTIMIZER_REGISTRY)
"""Canonical optimizer names :func:`estimate_from_counts` understands (``memfit.tracing.optimizers.OPTIMIZERS``)."""


def normalize_optimizer(name: str | None) -> str:
    """Return the canonical name of optimizer ``name`` (case-insensitive; ``None`` means ``"none"``)."""
    return optimizer_info(name).name


@dataclass(frozen=True)
class FormulaEstimate:
    """Bytes of each part of a training step, as the formula tier counts them, and the inputs used."""

    parameters_bytes: int
    gradients_bytes: int
    master_weights_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    parameters: int
    batch_size: int
    activations_per_sample: int
    precision: Precision
    optimizer: str
    trainable_fraction: float
    quantized_weights_bytes: int = 0
    quantize: str | None = None
    trainable_count: int | None = None  # exact adapter count, when given instead of a fraction

    @property
    def total_bytes(self) -> int:
        """Sum of the components: the predicted peak, as the formula tier keeps them all live at once."""
        return sum(self.components().values())

    @property
    def trainable_parameters(self) -> int:
        """Parameters that get gradients, master weights and optimizer state."""
        if self.trainable_count is not None:
            return self.trainable_count
        return _trainable(self.parameters, self.trainable_fraction)

    def components(self) -> dict[str, int]:
        """The ``*_bytes`` components, in display order."""
        quantized = {"quantized_weights_bytes": self.quantized_weights_bytes} if self.quantize else {}
        return {
            **quantized,
            "parameters_bytes": self.parameters_bytes,
            "gradients_bytes": self.gradients_bytes,
            "master_weights_bytes": self.master_weights_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "activations_bytes": self.activations_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: every component, the total and the inputs as plain values."""
        return {
            **self.components(),
            "total_bytes": self.total_bytes,
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "batch_size": self.batch_size,
            "activations_per_sample": self.activations_per_sample,
            "precision": self.precision.short_name,
            "optimizer": self.optimizer,
            "trainable_fraction": self.trainable_fraction,
            "quantize": self.quantize,
        }


def estimate_from_counts(
    *,
    parameters: int,
    batch_size: int = 1,
    activations_per_sample: int = 0,
    precision: Precision | str = "fp32",
    optimizer: str | None = "adamw",
    trainable_fraction: float = 1.0,
    trainable_parameters: int | None = None,
    quantize: str | None = None,
    quantized_parameters: int | None = None,
    double_quant: bool = True,
    frozen_bytes: int | None = None,
    quantized_layers: int = 1,
    trainable_sizes: Sequence[int] | None = None,
) -> FormulaEstimate:
    """Estimate a training step's memory from counts (see the module docstring for the rules).

    ``activations_per_sample`` is the number of activation *elements* one sample keeps alive for
    the backward pass; it is multiplied by the batch size and the activation element size.
    ``trainable_sizes``, the element count of each trainable tensor (summing to the trainable count),
    makes the state of optimizers that treat small tensors apart (bitsandbytes' 8-bit ones) exact.
    """
    parameters = _whole("parameters", parameters, minimum=0)
    batch_size = _whole("batch_size", batch_size, minimum=1)
    activations_per_sample = _whole("activations_per_sample", activations_per_sample, minimum=0)
    trainable_fraction = _fraction("trainable_fraction", trainable_fraction)
    precision = _precision(precision)
    optimizer = normalize_optimizer(optimizer)

    trainable = _trainable(parameters, trainable_fraction)
    if trainable_parameters is not None:
        trainable = _whole("trainable_parameters", trainable_parameters, minimum=0)
        if trainable > parameters:
            raise InvalidInputError(f"trainable_parameters ({trainable:,}) exceeds parameters ({parameters:,})")
    optimizer_entry = optimizer_info(optimizer)
    if trainable_sizes is None:
        state_bytes = partial(optimizer_entry.count_state_bytes, trainable)
    else:
        sizes = [_whole("trainable_sizes", n, minimum=1) for n in trainable_sizes]
        if sum(sizes) != trainable:
            raise InvalidInputError(
                f"trainable_sizes add up to {sum(sizes):,}, not the {trainable:,} trainable parameters"
            )
        state_bytes = partial(optimizer_entry.optimizer_state_bytes, sizes)
    layers = _whole("quantized_layers", quantized_layers, minimum=1)
    quantized, quantized_bytes = _quantized(
        quantize, quantized_parameters, parameters - trainable, double_quant, layers
    )
    pure_half = precision in (Precision.FP16_TRUE, Precision.BF16_TRUE)
    weight_size = _FP32_BYTES if precision is Precision.FP32 else _HALF_BYTES
    state_size = _HALF_BYTES if pure_half else _FP32_BYTES
    activation_size = _FP32_BYTES if precision is Precision.FP32 else _HALF_BYTES

    frozen_size = _FP32_BYTES if precision.is_mixed else weight_size
    if frozen_bytes is not None:
        frozen_size = _whole("frozen_bytes", frozen_bytes, minimum=1)
    # the share trained, also where the adapters were counted (not the 1.0 a fraction left unset reads)
    share = trainable / parameters if trainable_parameters is not None and parameters else trainable_fraction
    return FormulaEstimate(
        parameters_bytes=trainable * weight_size + (parameters - trainable - quantized) * frozen_size,
        gradients_bytes=trainable * weight_size,
        master_weights_bytes=trainable * _FP32_BYTES if precision.is_mixed else 0,
        optimizer_state_bytes=state_bytes(state_size),
        activations_bytes=activations_per_sample * batch_size * activation_size,
        parameters=parameters,
        batch_size=batch_size,
        activations_per_sample=activations_per_sample,
        precision=precision,
        optimizer=optimizer,
        trainable_fraction=share,
        quantized_weights_bytes=quantized_bytes,
        quantize=quantize,
        trainable_count=trainable if trainable_parameters is not None else None,
    )


_QUANT_BITS = {"nf4": 4, "fp4": 4, "int8": 8}
_BLOCK_4BIT, _NESTED_BLOCK = 64, 256


def _quantized(kind: str | None, count: int | None, frozen: int, double_quant: bool, layers: int) -> tuple[int, int]:
    """``(weights quantized, their bytes with bitsandbytes' quantization state)``; each of ``layers`` quantized
    weights has its own code books (and, with double quantization, offset)."""
    if kind is None:
        if count:
            raise InvalidInputError("quantized_parameters needs quantize= (nf4, fp4 or int8)")
        return 0, 0
    if kind not in _QUANT_BITS:
        raise InvalidInputError(f"quantize must be one of {', '.join(_QUANT_BITS)} or None, got {kind!r}")
    if frozen == 0:  # quantized full fine-tuning: bitsandbytes' weights do not train
        raise InvalidInputError(
            f"quantize={kind!r} packs frozen weights, and every parameter is trainable here; bitsandbytes cannot "
            "train quantized weights: pass trainable_parameters= (the adapters, as in QLoRA) or a trainable_fraction "
            "below 1"
        )
    count = frozen if count is None else _whole("quantized_parameters", count, minimum=0)
    if count > frozen:
        raise InvalidInputError(f"quantized_parameters ({count:,}) exceeds the frozen parameters ({frozen:,})")
    if count == 0:
        return 0, 0
    packed = math.ceil(count * _QUANT_BITS[kind] / 8)
    if _QUANT_BITS[kind] == 8:
        return count, packed
    blocks = math.ceil(count / _BLOCK_4BIT)
    per_layer = (16 + 256 + 1) * 4 if double_quant else 16 * 4  # 4-bit code, nested code, offset
    state = blocks + 4 * math.ceil(blocks / _NESTED_BLOCK) if double_quant else 4 * blocks
    return count, packed + state + layers * per_layer


def _trainable(parameters: int, trainable_fraction: float) -> int:
    # Exact for the common all-trainable case, where float rounding could bite on huge counts.
    if trainable_fraction == 1.0:
        return parameters
    return round(parameters * trainable_fraction)


def _whole(name: str, value: object, *, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; whole floats such as ``7e9`` are accepted, bools are not."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInputError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return value


def _fraction(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InvalidInputError(f"{name} must be a number between 0 and 1 inclusive, got {value!r}")
    return float(value)


def _precision(value: object) -> Precision:
    try:
        return Precision.parse(value)  # type: ignore[arg-type]
    except InvalidInputError:
        names = ", ".join(p.short_name for p in Precision)
        raise InvalidInputError(
            f"precision must be one of {names} (or 32-true, 16-true, bf16-true), got {value!r}"
        ) from None
