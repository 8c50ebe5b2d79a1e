"""Training precision: how wide parameters, gradients, optimizer state and activations are."""

from __future__ import annotations

from enum import Enum

import torch

from memfit.errors import InvalidInputError

__all__ = ["Precision"]


class Precision(str, Enum):
    """A training precision, named as Lightning names them.

    ``*-mixed`` keeps fp32 weights (the master copy) and runs matmuls under autocast;
    ``*-true`` (also ``fp16`` / ``bf16``) stores the weights themselves in half precision.
    """

    FP32 = "32-true"
    FP16_MIXED = "16-mixed"
    BF16_MIXED = "bf16-mixed"
    FP16_TRUE = "16-true"
    BF16_TRUE = "bf16-true"

    @classmethod
    def parse(cls, value: Precision | str | int | None) -> Precision:
        """Read ``value`` as a precision; ``None`` means fp32."""
        if value is None:
            return cls.FP32
        if isinstance(value, Precision):
            return value
        key = str(value).strip().lower().replace("_", "-")
        try:
            return _ALIASES[key]
        except KeyError:
            names = ", ".join(sorted({"fp32", "fp16", "bf16", "16-mixed", "bf16-mixed", "16-true", "bf16-true"}))
            raise InvalidInputError(f"unknown precision {value!r}; use one of {names}") from None

    @property
    def is_mixed(self) -> bool:
        return self in (Precision.FP16_MIXED, Precision.BF16_MIXED)

    @property
    def converts_to_half(self) -> bool:
        """``*-true`` half precision: floating parameters, buffers and inputs are cast to ``parameter_dtype``,
        as Lightning's and Fabric's ``HalfPrecision`` plugins do (``convert_module``, ``convert_input``)."""
        return self in (Precision.FP16_TRUE, Precision.BF16_TRUE)

    @property
    def parameter_dtype(self) -> torch.dtype:
        """dtype the weights are stored in."""
        return {Precision.FP16_TRUE: torch.float16, Precision.BF16_TRUE: torch.bfloat16}.get(self, torch.float32)

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype most activations are computed in."""
        return {
            Precision.FP16_MIXED: torch.float16,
            Precision.BF16_MIXED: torch.bfloat16,
            Precision.FP16_TRUE: torch.float16,
            Precision.BF16_TRUE: torch.bfloat16,
        }.get(self, torch.float32)

    @property
    def short_name(self) -> str:
        return {
            Precision.FP32: "fp32",
            Precision.FP16_MIXED: "16-mixed",
            Precision.BF16_MIXED: "bf16-mixed",
            Precision.FP16_TRUE: "fp16",
            Precision.BF16_TRUE: "bf16",
        }[self]


_ALIASES: dict[str, Precision] = {
    "32": Precision.FP32,
    "32-true": Precision.FP32,
    "fp32": Precision.FP32,
    "float32": Precision.FP32,
    "float": Precision.FP32,
    "16-mixed": Precision.FP16_MIXED,
    "fp16-mixed": Precision.FP16_MIXED,
    "amp": Precision.FP16_MIXED,
    "bf16-mixed": Precision.BF16_MIXED,
    "16-true": Precision.FP16_TRUE,
    "fp16-true": Precision.FP16_TRUE,
    "fp16": Precision.FP16_TRUE,
    "float16": Precision.FP16_TRUE,
    "half": Precision.FP16_TRUE,
    "16": Precision.FP16_TRUE,
    "bf16-true": Precision.BF16_TRUE,
    "bf16": Precision.BF16_TRUE,
    "bfloat16": Precision.BF16_TRUE,
}
